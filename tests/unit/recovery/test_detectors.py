"""The zscore and max_multiple detectors, non-finite steps as outliers, the in-place re-run's
rejudge, and every detector's state through JSON and the checkpoint schema."""
import dataclasses
import json
import math
import random

import pytest

from dsslm.fields import StateError
from dsslm.config import MonitorCfg
from dsslm.recovery.monitor import SpikeMonitor, Verdict

ZSCORE = dict(detector="zscore", window=128, min_history=64, loss_z=6.0)  # OLMo-core's skip-step


def flat_stream(seed, n_steps, noise=0.015, spikes=None):
    """(step, loss, gnorm) of late training: loss ~2.0 with relative noise, lognormal grad norms."""
    rng = random.Random(seed)
    for step in range(n_steps):
        loss = 2.0 * (1 + noise * rng.gauss(0, 1)) * (spikes or {}).get(step, 1.0)
        yield step, loss, 0.5 * math.exp(0.2 * rng.gauss(0, 1))


def verdicts(monitor, stream):
    out = []
    for step, loss, gnorm in stream:
        v = monitor.judge(step, loss, gnorm)
        out.append(v)
        if v is Verdict.REWIND:
            monitor.reset_streak()
    return out


@pytest.mark.parametrize("seed", range(4))
def test_zscore_is_quiet_on_clean_curves_and_skips_a_spike(seed):
    monitor = SpikeMonitor(MonitorCfg(**ZSCORE))
    assert set(verdicts(monitor, flat_stream(seed, 1000))) == {Verdict.OK}
    history = monitor.state_dict()["losses"]
    assert monitor.judge(1000, 2.0 * 1.15, 0.5) is Verdict.SKIP  # +15% on 1.5% noise: z ~ 10
    assert monitor.state_dict()["losses"] == history            # the outlier never enters the window
    # The grad norm is judged the same way, but with a normal loss it is a surge, not a skip.
    assert monitor.judge(1001, 2.0, 0.5 * 8) is Verdict.SURGE
    assert monitor.judge(1001, 2.0 * 1.15, 0.5 * 8) is Verdict.SKIP
    assert monitor.judge(1002, 2.0 * 1.6, 0.5) is Verdict.REWIND  # z ~ 40 > hard_loss_z = 20


def test_zscore_waits_for_min_history_and_is_not_the_mad_score():
    monitor = SpikeMonitor(MonitorCfg(**ZSCORE))
    assert set(verdicts(monitor, flat_stream(0, 63))) == {Verdict.OK}
    assert monitor.judge(63, 50.0, 0.5) is Verdict.OK  # 63 clean steps < min_history = 64: no judgement
    # Heavy tails inflate the std but not the MAD: the same point is an outlier for one only.
    rng = random.Random(1)
    tails = [(s, 2.0 + (0.3 if s % 10 == 0 else 0.01 * rng.gauss(0, 1)), 0.5) for s in range(100)]
    mad, zscore = SpikeMonitor(MonitorCfg(window=100)), SpikeMonitor(MonitorCfg(detector="zscore", window=100))
    verdicts(mad, tails), verdicts(zscore, tails)
    assert mad.judge(100, 2.15, 0.5) is Verdict.SKIP and zscore.judge(100, 2.15, 0.5) is Verdict.OK


def test_max_multiple_catches_only_blowups_after_its_first_steps():
    cfg = MonitorCfg(detector="max_multiple", max_multiple=10.0, max_multiple_steps=100)
    monitor = SpikeMonitor(cfg)
    early = [(s, 10.0 - 0.05 * s, 1.0) for s in range(100)]  # a falling loss; its max is 10.0
    assert set(verdicts(monitor, early)) == {Verdict.OK}
    assert monitor.state_dict()["baseline_max"] == 10.0 and monitor.state_dict()["baseline_count"] == 100
    assert monitor.judge(100, 99.0, 1e6) is Verdict.OK       # 9.9x, and a grad norm it never judges
    assert monitor.judge(101, 100.0, 1.0) is Verdict.SKIP    # 10x the first steps' max
    assert monitor.judge(102, 150.0, 1.0) is Verdict.SKIP
    assert monitor.judge(103, 150.0, 1.0) is Verdict.REWIND  # the third in a row (max_skips = 2)
    assert monitor.state_dict()["baseline_max"] == 10.0      # later losses never move the baseline


def test_nonfinite_skip_makes_nan_an_outlier_not_a_rewind():
    monitor = SpikeMonitor(MonitorCfg(nonfinite="skip", window=30, min_history=20))
    verdicts(monitor, flat_stream(0, 30))
    history = monitor.state_dict()["losses"]
    assert monitor.judge(30, math.nan, 0.5) is Verdict.SKIP
    assert monitor.judge(31, 2.0, math.inf) is Verdict.SKIP
    assert monitor.judge(32, math.nan, 0.5) is Verdict.REWIND  # a run of them still rewinds
    assert monitor.state_dict()["losses"] == history
    assert SpikeMonitor(MonitorCfg()).judge(0, math.nan, 1.0) is Verdict.REWIND  # the default


@pytest.mark.parametrize("detector", ["mad", "zscore"])
def test_rejudge_judges_the_rerun_as_if_the_first_attempt_never_happened(detector):
    cfg = MonitorCfg(detector=detector, window=50, min_history=20)
    monitor = SpikeMonitor(cfg)
    verdicts(monitor, flat_stream(0, 50))
    assert monitor.judge(50, 2.0 * 1.2, 0.5) is Verdict.SKIP
    assert monitor.judge(51, 2.0 * 1.2, 0.5) is Verdict.SKIP          # streak 2: one more rewinds
    assert monitor.rejudge(51, 2.0 * 1.2, 0.5) is Verdict.SKIP        # reproduced: still streak 2, not 3
    assert monitor.state_dict()["streak"] == 2 and monitor.spike_start == 50
    history = monitor.state_dict()["losses"]
    assert monitor.judge(52, 2.0 * 1.2, 0.5) is Verdict.REWIND
    monitor.reset_streak()
    assert monitor.judge(53, 2.0 * 1.2, 0.5) is Verdict.SKIP
    assert monitor.rejudge(53, 2.01, 0.5) is Verdict.OK               # a normal re-run: transient
    assert monitor.state_dict()["streak"] == 0 and monitor.spike_start is None
    assert monitor.state_dict()["losses"] == history[1:] + [2.01]     # the re-run's values, not the outlier's


def spiky(seed=3):
    """Clean steps with spikes the detectors see differently: isolated, a run, a blow-up, a NaN."""
    spikes = {150: 1.2, 200: 1.2, 201: 1.2, 202: 1.2, 260: 12.0, 300: math.nan}
    return list(flat_stream(seed, 400, spikes=spikes))


@pytest.mark.parametrize("detector", ["mad", "zscore", "max_multiple"])
@pytest.mark.parametrize("cut", [120, 199, 201, 255])
def test_every_detector_state_round_trips_through_json(detector, cut):
    cfg = MonitorCfg(detector=detector, window=64, min_history=32, max_multiple_steps=140)
    stream = spiky()
    reference = verdicts(SpikeMonitor(cfg), stream)
    assert Verdict.SKIP in reference and Verdict.REWIND in reference
    first = SpikeMonitor(cfg)
    before = verdicts(first, stream[:cut])
    state = json.loads(json.dumps(first.state_dict()))
    SpikeMonitor(cfg).state_spec.validate(state, "monitor")
    restored = SpikeMonitor(cfg)
    restored.load_state_dict(state)
    assert before + verdicts(restored, stream[cut:]) == reference
    # Forgetting is visible: a monitor without the history judges otherwise (the loss trend, which
    # judges from its 8th clean step, off: at cut 120 it alone sees step 150's spike again).
    assert before + verdicts(SpikeMonitor(dataclasses.replace(cfg, loss_trend=0)), stream[cut:]) != reference


def test_the_schema_refuses_another_detector_and_reads_format_1():
    zscore_state = SpikeMonitor(MonitorCfg(detector="zscore")).state_dict()
    with pytest.raises(StateError, match=r"^monitor\.detector: 'zscore'"):
        SpikeMonitor(MonitorCfg()).state_spec.validate(zscore_state, "monitor")
    old = {"format": 1, "losses": [2.0, 2.1], "gnorms": [0.5, 0.6], "streak": 1, "spike_start": 7}
    monitor = SpikeMonitor(MonitorCfg())
    monitor.state_spec.validate(old, "monitor")
    monitor.load_state_dict(old)
    assert monitor.state_dict() == {"format": 3, "detector": "mad", "losses": [2.0, 2.1], "gnorms": [0.5, 0.6],
                                    "streak": 1, "spike_start": 7, "baseline_max": None, "baseline_count": 0,
                                    "sequences": []}
