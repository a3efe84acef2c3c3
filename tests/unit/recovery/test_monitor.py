"""SpikeMonitor verdicts on synthetic loss curves, state roundtrips, and the rewind policy."""
import json
import math
import random

import pytest

from dsslm.config import MonitorCfg
from dsslm.data.loader import merge_windows
from dsslm.recovery.monitor import SpikeMonitor, Verdict
from dsslm.recovery.rewind import RewindPlan, plan_rewind, rewind_record


def clean_curve(seed, n_steps=3000, noise=0.015, gnorm_sigma=0.25, warmup_steps=0):
    """(step, loss, gnorm) of a healthy run: exponential decay from ~10.8 (ln 50k vocab) to 2.0
    with relative Gaussian noise, and lognormal grad-norm noise. With warmup the loss stays flat
    for a while and the grad norm climbs 7.5x over warmup before slowly decaying."""
    rng = random.Random(seed)
    for step in range(n_steps):
        if warmup_steps:
            mean = 2.0 + 8.8 * math.exp(-max(0, step - warmup_steps // 4) / 350)
            if step < warmup_steps:
                gnorm = 0.2 + 1.3 * step / warmup_steps
            else:
                gnorm = 0.3 + 1.2 * math.exp(-(step - warmup_steps) / 1500)
        else:
            mean = 2.0 + 8.8 * math.exp(-step / 400)
            gnorm = 0.4 + 1.6 * math.exp(-step / 300)
        loss = mean * (1 + noise * rng.gauss(0, 1))
        yield step, loss, gnorm * math.exp(gnorm_sigma * rng.gauss(0, 1))


def feed(monitor, stream):
    return [monitor.judge(step, loss, gnorm) for step, loss, gnorm in stream]


def warmed_monitor(n_steps=200, cfg=None, seed=0):
    """A monitor that has seen `n_steps` clean steps of the late, flat part of a curve."""
    monitor = SpikeMonitor(cfg or MonitorCfg())
    stream = list(clean_curve(seed, n_steps=2000 + n_steps))[2000:]
    assert set(feed(monitor, ((i, loss, g) for i, (_, loss, g) in enumerate(stream)))) == {Verdict.OK}
    return monitor


@pytest.mark.parametrize("warmup_steps", [0, 300])
@pytest.mark.parametrize("noise", [0.01, 0.02])
def test_clean_curves_have_no_outliers(noise, warmup_steps):
    # Measured over 50 seeds x 3000 steps per setting: at most 1 outlier in 150k steps.
    for seed in range(5):
        stream = clean_curve(seed, noise=noise, warmup_steps=warmup_steps)
        verdicts = feed(SpikeMonitor(MonitorCfg()), stream)
        outliers = [(step, v) for step, v in enumerate(verdicts) if v is not Verdict.OK]
        assert outliers == [], seed


def test_a_sudden_drop_in_loss_is_progress_not_a_spike():
    monitor = warmed_monitor()
    rng = random.Random(1)
    # The loss falls 15% in one step (a phase change): z is about -10, far below -loss_z.
    verdicts = [monitor.judge(200 + i, 1.7 * (1 + 0.015 * rng.gauss(0, 1)), 0.4) for i in range(100)]
    assert set(verdicts) == {Verdict.OK}


def test_noise_free_curves_do_not_divide_by_a_zero_mad():
    monitor = SpikeMonitor(MonitorCfg())
    assert set(feed(monitor, ((s, 3.0, 1.0) for s in range(100)))) == {Verdict.OK}
    assert monitor.judge(100, 3.0 * 1.005, 1.0) is Verdict.OK   # 0.5% wobble: under the floor
    assert monitor.judge(101, 3.0 * 1.03, 1.0) is Verdict.SKIP  # 3%: z = 0.09 / 0.007 = 12.9
    falling = SpikeMonitor(MonitorCfg())
    assert set(feed(falling, ((s, 2.0 + 3.0 * math.exp(-s / 50), 1.0) for s in range(1000)))) == {Verdict.OK}


def test_isolated_spike_is_skipped_at_once_and_kept_out_of_the_history():
    monitor = warmed_monitor()
    losses_before = monitor.state_dict()["losses"]
    median = sorted(losses_before)[len(losses_before) // 2]
    assert 6 < monitor.loss_z(median * 1.15) < 20
    assert monitor.judge(200, median * 1.15, 0.4) is Verdict.SKIP  # detection delay: 0 steps
    assert monitor.spike_start == 200
    assert monitor.state_dict()["losses"] == losses_before
    assert monitor.judge(201, median, 0.4) is Verdict.OK
    assert monitor.spike_start is None
    assert max(monitor.state_dict()["losses"]) < median * 1.15


def test_a_grad_norm_outlier_with_a_normal_loss_is_a_surge_and_the_loss_decides_a_skip():
    monitor = warmed_monitor()
    before = monitor.state_dict()
    assert monitor.judge(200, 2.0, 0.4 * 6) is Verdict.SURGE
    assert monitor.state_dict() == before      # nothing recorded until the loop applies it
    assert monitor.judge(200, 2.6, 0.4 * 6) is Verdict.SKIP  # the loss is an outlier too: a spike
    assert monitor.judge(201, 2.0, 0.4 * 3) is Verdict.OK


def test_an_accepted_surge_enters_the_history_so_the_trend_follows_a_rise():
    """The grad norm's reference follows its last `gnorm_trend` steps: a norm that has risen for a
    few applied steps is judged against where it is now, and the rise ends its surges."""
    monitor = warmed_monitor()
    verdicts = []
    for i in range(12):  # the norm steps up 8x and stays there, the loss flat
        verdict = monitor.judge(200 + i, 2.0, 0.4 * 8)
        verdicts.append(verdict)
        if verdict is Verdict.SURGE:
            monitor.accept(2.0, 0.4 * 8)
    assert verdicts[0] is Verdict.SURGE and verdicts[-1] is Verdict.OK
    assert verdicts.count(Verdict.SURGE) <= 3  # the trend's median crosses within gnorm_trend // 2 + 1 steps
    plain = warmed_monitor(cfg=MonitorCfg(gnorm_trend=0))
    assert plain.judge(200, 2.0, 0.4 * 8) is Verdict.SURGE


@pytest.mark.parametrize("max_skips", [0, 2, 4])
def test_sustained_spike_rewinds_after_max_skips(max_skips):
    monitor = warmed_monitor(cfg=MonitorCfg(max_skips=max_skips))
    verdicts = [monitor.judge(200 + i, 2.3, 0.4) for i in range(max_skips + 1)]
    assert verdicts == [Verdict.SKIP] * max_skips + [Verdict.REWIND]  # detection delay: max_skips
    assert monitor.spike_start == 200


def test_a_clean_step_resets_the_consecutive_count():
    monitor = warmed_monitor()
    verdicts = []
    for i in range(0, 30, 3):  # two spikes, one clean step, repeated
        verdicts += [monitor.judge(200 + i, 2.3, 0.4), monitor.judge(201 + i, 2.3, 0.4),
                     monitor.judge(202 + i, 2.0, 0.4)]
    assert Verdict.REWIND not in verdicts
    assert verdicts.count(Verdict.SKIP) == 20


@pytest.mark.parametrize("loss, gnorm", [(math.nan, 0.4), (math.inf, 0.4), (2.0, math.inf), (2.0, math.nan)])
def test_non_finite_rewinds_immediately(loss, gnorm):
    monitor = warmed_monitor()
    history = monitor.state_dict()["losses"]
    assert monitor.judge(200, loss, gnorm) is Verdict.REWIND
    assert monitor.spike_start == 200
    assert monitor.state_dict()["losses"] == history


def test_nan_rewinds_even_before_min_history():
    monitor = SpikeMonitor(MonitorCfg())
    assert monitor.judge(0, 10.8, 1.0) is Verdict.OK
    assert monitor.judge(1, math.nan, 1.0) is Verdict.REWIND
    assert monitor.state_dict()["losses"] == [10.8]


def test_hard_threshold_rewinds_immediately_and_keeps_the_streak_start():
    monitor = warmed_monitor()
    assert monitor.loss_z(2.0 + 25 * 0.03) > 20   # noise is 1.5% of 2.0 = 0.03 nats
    assert monitor.judge(200, 2.0 + 25 * 0.03, 0.4) is Verdict.REWIND
    assert monitor.spike_start == 200
    monitor.reset_streak()
    assert monitor.spike_start is None
    assert monitor.judge(300, 2.3, 0.4) is Verdict.SKIP      # a skip, then a hard spike
    assert monitor.judge(301, 50.0, 0.4) is Verdict.REWIND
    assert monitor.spike_start == 300


def test_no_judgement_before_min_history_but_the_trend_s():
    monitor = SpikeMonitor(MonitorCfg(min_history=20, loss_trend=0))
    assert set(feed(monitor, ((s, 3.0 if s % 2 else 30.0, 1.0) for s in range(20)))) == {Verdict.OK}
    assert len(monitor.state_dict()["losses"]) == 20


def descent(steps: int, seed: int = 0) -> list[float]:
    """An initial descent: from 5.5 nats towards 2.5, fast, with 2% batch-to-batch noise."""
    rng = random.Random(seed)
    return [(2.5 + 3.0 * math.exp(-s / 15)) * (1 + 0.02 * rng.gauss(0, 1)) for s in range(steps)]


@pytest.mark.parametrize("at", [10, 31, 60])
def test_a_batch_of_garbage_in_the_initial_descent_is_an_outlier(at):
    """The loss reference lags a fast descent (the window's median sits far above the loss, its MAD
    is the descent's): random tokens at step 31 (5.95 nats against a current 3.0) passed under a
    threshold of 11.2 nats. Against the recent level in units of the step-to-step noise they
    stand out, from the first steps on; the same descent without them is never an outlier."""
    curve = descent(120)
    clean = SpikeMonitor(MonitorCfg())
    assert set(feed(clean, ((s + 1, loss, 1.0) for s, loss in enumerate(curve)))) == {Verdict.OK}
    monitor = SpikeMonitor(MonitorCfg())
    feed(monitor, ((s + 1, loss, 1.0) for s, loss in enumerate(curve[:at])))
    assert monitor.judge(at + 1, 5.95, 2.3) is Verdict.SKIP
    assert "over its recent level" in monitor.last_reason
    old = SpikeMonitor(MonitorCfg(loss_trend=0))  # the window's median alone: blind before step 60
    feed(old, ((s + 1, loss, 1.0) for s, loss in enumerate(curve[:at])))
    assert (old.judge(at + 1, 5.95, 2.3) is Verdict.OK) == (at < 60)


def spiky_stream(seed=3, n_steps=1500):
    """A late-training stream with isolated spikes, short runs, sustained runs, NaNs."""
    # Noise is 1.5% of the loss: x1.15 is z ~ 10 (skip), x1.5 is z ~ 33 (hard rewind).
    spikes = {300: 1.15, 301: 1.15, 500: 1.5, 700: 1.15, 701: 1.2, 702: 1.15, 703: 1.15,
              900: math.nan, 1100: 1.2, 1250: 5.0, 1400: 1.15, 1401: 1.15}
    for i, (_, loss, gnorm) in enumerate(list(clean_curve(seed, n_steps=2000 + n_steps))[2000:]):
        yield i, loss * spikes.get(i, 1.0), gnorm * (8.0 if i == 1000 else 1.0)


def judge(monitor, stream):
    """Verdicts and spike starts, acting on a REWIND as the loop does (reset_streak)."""
    out = []
    for step, loss, gnorm in stream:
        verdict = monitor.judge(step, loss, gnorm)
        out.append((verdict, monitor.spike_start))
        if verdict is Verdict.REWIND:
            monitor.reset_streak()
        if verdict is Verdict.SURGE:  # the loop applies a surge
            monitor.accept(loss, gnorm)
    return out


@pytest.mark.parametrize("cut", [290, 300, 301, 690, 701, 702, 990, 1240])
def test_state_roundtrip_judges_like_the_uninterrupted_monitor(cut):
    stream = list(spiky_stream())
    reference = judge(SpikeMonitor(MonitorCfg()), stream)
    assert {v for v, _ in reference} == {Verdict.OK, Verdict.SKIP, Verdict.REWIND, Verdict.SURGE}
    first = SpikeMonitor(MonitorCfg())
    before = judge(first, stream[:cut])
    restored = SpikeMonitor(MonitorCfg())
    restored.load_state_dict(json.loads(json.dumps(first.state_dict())))
    assert before + judge(restored, stream[cut:]) == reference
    # A monitor that starts afresh at the cut misses what the restored one sees.
    assert before + judge(SpikeMonitor(MonitorCfg()), stream[cut:]) != reference


def test_the_streak_travels_in_the_state():
    monitor = warmed_monitor()
    assert [monitor.judge(200 + i, 2.3, 0.4) for i in range(2)] == [Verdict.SKIP] * 2
    state = json.loads(json.dumps(monitor.state_dict()))
    restored, streakless = SpikeMonitor(MonitorCfg()), SpikeMonitor(MonitorCfg())
    restored.load_state_dict(state)
    streakless.load_state_dict({**state, "streak": 0, "spike_start": None})
    assert restored.judge(202, 2.3, 0.4) is Verdict.REWIND and restored.spike_start == 200
    assert streakless.judge(202, 2.3, 0.4) is Verdict.SKIP and streakless.spike_start == 202


def test_load_state_dict_refuses_another_format():
    with pytest.raises(ValueError, match="format"):
        SpikeMonitor(MonitorCfg()).load_state_dict({"format": 99})


def batch_of(skip_list):
    """For plan_rewind with a batch of one sequence: step s is fed [b, b + 1), b = batch(s)."""
    batch = data_batch_of(skip_list)
    return lambda step: (batch(step), batch(step) + 1)


def data_batch_of(skip_list):
    """The loader's mapping, for step counts: step s is fed the (s-1)-th data batch outside every
    [start, end) window."""
    def data_batch_of_step(step):
        batch = step - 1
        for start, end in merge_windows(skip_list):
            if batch < start:
                break
            batch += end - start
        return batch
    return data_batch_of_step


def test_plan_rewind_without_skip_windows():
    plan = plan_rewind(201, 203, batch_of([]), [], MonitorCfg(skip_batches=1), 1)
    assert plan == RewindPlan(to_step=195, window=[200, 203], lr_scale_factor=1.0, escalate=False, fed_end=203)
    with pytest.raises(ValueError):
        plan_rewind(0, 0, batch_of([]), [], MonitorCfg(), 1)  # step counts start at 1


def test_plan_rewind_covers_batches_across_an_existing_skip_window():
    skip, cfg = [[100, 110]], MonitorCfg(skip_batches=1)
    assert plan_rewind(96, 98, batch_of(skip), [], cfg, 1).window == [95, 98]
    # Steps 99..102 are fed batches 98, 99, 110, 111: the window covers all four.
    assert plan_rewind(99, 102, batch_of(skip), [], cfg, 1).window == [98, 112]
    assert plan_rewind(101, 101, batch_of(skip), [], cfg, 1).window == [110, 111]
    assert merge_windows(skip + [[98, 112]]) == [[98, 112]]


def test_plan_rewind_to_step_keeps_the_margin():
    # A spike at step 201 refused the update after checkpoint 200; 20 clean steps before it is 180.
    assert plan_rewind(201, 203, batch_of([]), [], MonitorCfg(rewind_margin_steps=20), 1).to_step == 180
    assert plan_rewind(4, 4, batch_of([]), [], MonitorCfg(rewind_margin_steps=5), 1).to_step == 0


def test_second_spike_in_the_same_region_backs_off_the_lr():
    cfg = MonitorCfg(region_steps=50, lr_backoff=0.7, skip_batches=1)
    first = plan_rewind(201, 203, batch_of([]), [], cfg, 1)
    history = [rewind_record(201, first)]
    assert json.loads(json.dumps(history)) == history
    skip = [first.window]
    # Same steps replayed after the rewind: the data moved on, the spike did not.
    again = plan_rewind(202, 204, batch_of(skip), history, cfg, 1)
    assert again.lr_scale_factor == 0.7 and again.window == [204, 207]
    assert plan_rewind(250, 250, batch_of(skip), history, cfg, 1).lr_scale_factor == 0.7
    assert plan_rewind(251, 251, batch_of(skip), history, cfg, 1).lr_scale_factor == 1.0
    assert plan_rewind(601, 603, batch_of(skip), history, cfg, 1).lr_scale_factor == 1.0
    # Far in steps but touching the old data window: the same region of data.
    far_history = [{"step": 1001, "window": [200, 203], "to_step": 995}]
    assert plan_rewind(198, 200, batch_of([]), far_history, cfg, 1).lr_scale_factor == 0.7
    assert plan_rewind(191, 196, batch_of([]), far_history, cfg, 1).lr_scale_factor == 1.0


def test_escalate_after_max_rewinds_in_one_region_not_over_the_run():
    cfg = MonitorCfg(max_rewinds=4, region_steps=50)
    # Four rewinds long ago, each in its own region: a long run recovering from unrelated spikes.
    far = [{"step": 1000 * i, "window": [1000 * i, 1000 * i + 3], "to_step": 1000 * i - 5} for i in range(1, 5)]
    assert plan_rewind(7001, 7003, batch_of([]), far, cfg, 1).escalate is False
    # Four within region_steps of this spike: it keeps coming back.
    near = [{"step": 6960 + 10 * i, "window": [100 * i, 100 * i + 3], "to_step": 6950} for i in range(4)]
    assert plan_rewind(7001, 7003, batch_of([]), near[:3], cfg, 1).escalate is False
    assert plan_rewind(7001, 7003, batch_of([]), near, cfg, 1).escalate is True
    assert plan_rewind(7001, 7003, batch_of([]), far + near[:3], cfg, 1).escalate is False


def test_merge_windows():
    assert merge_windows([]) == []
    assert merge_windows([[5, 8], (0, 3), [3, 4], [7, 10], [12, 12], [20, 25], [21, 22]]) == \
        [[0, 4], [5, 10], [20, 25]]


def test_verdicts_are_json_strings():
    assert json.dumps([Verdict.OK, Verdict.SKIP]) == '["ok", "skip_step"]'
    assert Verdict("rewind") is Verdict.REWIND
    # Escalation is an exception with exit code 3, not a verdict a step can get.
    # A surge never leaves the loop's decide: a step's record says ok.
    assert {v.value for v in Verdict} == {"ok", "skip_step", "rewind", "gnorm_surge"}


def test_rewind_window_has_a_minimum_that_doubles_in_the_same_region():
    cfg = MonitorCfg(skip_batches=8, region_steps=50)
    first = plan_rewind(301, 301, batch_of([]), [], cfg, 1)
    assert first.window == [300, 308]  # one bad batch seen, eight skipped
    assert first.fed_end == 301  # the batch the spike step read: as data; the other seven by position
    history = [rewind_record(301, first)]
    again = plan_rewind(301, 301, batch_of([first.window]), history, cfg, 1)
    assert again.window == [308, 324] and again.lr_scale_factor == cfg.lr_backoff
    # In sequences with a batch of 4: eight batches are 32 sequences.
    wide = plan_rewind(301, 301, lambda step: (1200, 1204), [], cfg, 4)
    assert (wide.window, wide.fed_end) == ([1200, 1232], 1204)
    far = plan_rewind(901, 903, batch_of([first.window]), history, cfg, 1)
    assert far.window == [908, 916]  # another region: back to the minimum


def test_a_transient_in_the_region_neither_doubles_the_window_nor_backs_off_but_counts():
    cfg = MonitorCfg(skip_batches=8, region_steps=50, max_rewinds=2)
    transient = {"step": 290, "window": [290, 290], "to_step": 280, "lr_scale_factor": 1.0, "verdict": "transient"}
    plan = plan_rewind(301, 301, batch_of([]), [transient], cfg, 1)
    assert plan.window == [300, 308] and plan.lr_scale_factor == 1.0 and not plan.escalate
    assert plan_rewind(301, 301, batch_of([]), [transient, transient], cfg, 1).escalate


@pytest.mark.parametrize("detector", ["mad", "zscore"])
def test_loss_outlier_is_the_monitors_own_test_of_a_loss_and_changes_nothing(detector):
    """`loss_outlier` (what data.skips.concentrated asks of a batch without its offending
    sequences) agrees with `judge` on the loss and leaves the monitor as it was."""
    monitor = warmed_monitor(cfg=MonitorCfg(detector=detector))
    before = monitor.state_dict()
    median = sorted(before["losses"])[len(before["losses"]) // 2]
    assert not monitor.loss_outlier(median) and monitor.loss_outlier(median + 1.0)
    assert monitor.loss_outlier(float("nan")) and monitor.state_dict() == before
    gnorm = sorted(before["gnorms"])[len(before["gnorms"]) // 2]
    assert monitor.judge(1_000_000, median + 1.0, gnorm) is not Verdict.OK  # as judge says
    assert not SpikeMonitor(MonitorCfg()).loss_outlier(100.0)  # no history yet: nothing is judged


def _monitor_with_sequence_history(per_step=4, steps=100, seed=0):
    """A mad monitor that judged `steps` clean steps of `per_step` sequences at 2.0 +- 0.05 nats."""
    cfg = MonitorCfg(min_history=10, window=50)
    monitor = SpikeMonitor(cfg)
    rng = random.Random(seed)
    for step in range(1, steps + 1):
        sequences = [2.0 + 0.05 * rng.gauss(0, 1) for _ in range(per_step)]
        assert monitor.judge(step, sum(sequences) / per_step, 1.0, sequences) is Verdict.OK
    return monitor


@pytest.mark.parametrize("batch", [1, 2, 4, 7])
def test_blame_names_the_bad_sequence_and_not_its_neighbours_at_any_batch_size(batch):
    """Against the run's history of sequence losses a step of 1-7 sequences names its bad one
    alone (the batch test, `data.skips.offending`, narrows nothing under 8 sequences: a data
    verdict then named every sequence of the step)."""
    monitor = _monitor_with_sequence_history()
    losses = [2.0 + 0.01 * i for i in range(batch)]
    bad = batch // 2
    losses[bad] = 6.0  # an 1,800-token garbage document's chunk: far above every clean sequence
    hit = monitor.blame(losses)
    if batch == 1:
        assert not hit.any()  # one sequence: nothing is left to stand for a normal step; a replay tells
    else:
        assert hit.tolist() == [i == bad for i in range(batch)]
    from dsslm.data.skips import offending
    assert not offending(losses).any()  # what the batch test alone would have said


def test_blame_is_the_minimal_explanation_and_none_when_the_whole_step_rose():
    monitor = _monitor_with_sequence_history(per_step=8)
    rose = [2.8 + 0.01 * i for i in range(8)]  # a learning-rate burst: every sequence up
    assert not monitor.blame(rose).any()
    two = [2.0] * 6 + [7.0, 2.4]  # one far off, one a little high but within REFERENCE_Z
    assert monitor.blame(two).tolist() == [False] * 6 + [True, False]
    assert monitor.blame([2.0] * 7 + [float("nan")]).tolist() == [False] * 7 + [True]
    # A step whose loss is no outlier (flagged by its grad norm alone) names nothing, though one
    # of its sequences stands out against the history. (Before: that sequence's document.)
    assert not monitor.blame([1.9] * 7 + [2.6]).any()
    state = monitor.state_dict()
    assert len(state["sequences"]) == 800
    again = SpikeMonitor(monitor.cfg)
    monitor.state_spec.validate(state, "monitor")
    again.load_state_dict(state)
    assert again.blame(two).tolist() == monitor.blame(two).tolist()


def test_outliers_and_surges_leave_the_sequence_history_alone():
    monitor = _monitor_with_sequence_history()
    before = monitor.state_dict()["sequences"]
    assert monitor.judge(500, 2.2, 1.0, [2.2] * 4) is Verdict.SKIP
    assert monitor.judge(501, 2.0, 20.0, [1.9] * 4) is Verdict.SURGE
    assert monitor.state_dict()["sequences"] == before
    monitor.accept(2.0, 20.0, [1.9] * 4)
    assert monitor.state_dict()["sequences"] == before + [1.9] * 4  # 400 + 4 < monitor.sequence_window


def test_a_rise_over_the_recent_level_with_a_surging_grad_norm_is_a_surge_not_an_outlier():
    """The plateau's exit: the norm jumps 10-50x and the loss wobbles over its recent level (the
    clean bench's two false alarms of the trend test, one of them an LR cut). With the norm
    surging it is a surge, for the held-out probe to tell the batch's from the model's."""
    curve = descent(40)
    monitor = SpikeMonitor(MonitorCfg())
    feed(monitor, ((s + 1, loss, 1.0) for s, loss in enumerate(curve)))
    assert monitor.judge(41, 5.95, 11.0) is Verdict.SURGE
    monitor = SpikeMonitor(MonitorCfg())
    feed(monitor, ((s + 1, loss, 1.0) for s, loss in enumerate(curve[:12])))
    assert monitor.judge(13, 5.95, 11.0) is Verdict.OK  # before min_history a surge is not judged
