"""What recovery decides from, as state: the run file's history merge, the checkpoint part
"triage" (the replay, the feed record, the original pass's rows), and a replay's reading of a
scaler overflow."""
import collections
import json
import shutil

import numpy as np
import pytest

from dsslm.ckpt.train_state import TrainState
from dsslm.config import Config
from dsslm.fields import StateError
from dsslm.recovery.monitor import Verdict
from dsslm.recovery.rewind import merge_history, merge_recovery
from dsslm.data.skips import merge_skip_list, windows_of
from dsslm.recovery.triage import Replay, ReplayProgress, Triage


def test_repeated_rewinds_of_one_spike_are_two_decisions_after_a_resume():
    first = {"step": 51, "window": [800, 928], "to_step": 45, "lr_scale_factor": 1.0}
    again = {"step": 51, "window": [800, 1056], "to_step": 45, "lr_scale_factor": 0.7}
    state = TrainState(rewinds=[first])  # the checkpoint saw the first rewind only
    merge_recovery(state, {"skip_list": [[800, 1056]], "rewinds": [first, again], "lr_scale": 0.7})
    assert state.rewinds == [first, again]
    # The same decision twice (a plain rewind of a spike that came back identically) stays twice.
    state = TrainState(rewinds=[first])
    merge_recovery(state, {"skip_list": [], "rewinds": [first, first], "lr_scale": None})
    assert state.rewinds == [first, first]
    assert merge_history([first, again], [first]) == [first, again]


def test_the_triage_part_carries_the_feed_record_and_the_original_rows():
    fed, recent = collections.OrderedDict(), collections.deque(maxlen=8)
    progress = ReplayProgress()
    progress.bind(fed, recent)
    fed[51], fed[52] = (800, 816), (816, 832)
    recent.extend([[51, 3.1, 9.0, "skip_step"], [52, 3.2, 9.5, "skip_step"]])
    progress.replay = Replay(phase="same_data", spike_start=51, target=53, base_step=45, window=[800, 928],
                             skip_list=[], lr_scale=1.0, fed_end=848)
    saved = json.loads(json.dumps(progress.state_dict()))
    progress.state_spec.validate(saved, "state.triage")
    other_fed, other_recent = collections.OrderedDict({9: (1, 2)}), collections.deque(maxlen=8)
    restored = ReplayProgress()
    restored.bind(other_fed, other_recent)
    restored.load_state_dict(saved)
    assert other_fed == fed and list(other_recent) == list(recent) and restored.replay == progress.replay
    # A checkpoint written before the fields existed still loads (with nothing recorded).
    old = {"format": 1, "replay": None}
    restored.state_spec.validate(old, "state.triage")
    restored.load_state_dict(old)
    assert not other_fed and not other_recent
    with pytest.raises(StateError, match=r"state.triage.fed\[0\]"):
        restored.state_spec.validate({**saved, "fed": [[51, 800]]}, "state.triage")
    # A replay saved before fed_end existed loads with None (its wide phase names the whole window
    # as data, as it did); one whose fed_end is outside its window is refused.
    legacy = {**saved, "replay": {k: v for k, v in saved["replay"].items() if k != "fed_end"}}
    restored.state_spec.validate(legacy, "state.triage")
    restored.load_state_dict(legacy)
    assert restored.replay.fed_end is None
    with pytest.raises(StateError, match=r"state.triage.replay.fed_end: 999 is outside the window \[800, 928\]"):
        restored.state_spec.validate({**saved, "replay": {**saved["replay"], "fed_end": 999}}, "state.triage")


def test_the_triage_part_carries_the_open_streaks_sequence_losses_and_its_skip_list_before_reruns():
    """A resume in the middle of a spike streak names the same offending data, and replays the
    streak on the same data, as the uninterrupted run: both come from the checkpoint."""
    fed, recent, sequences = collections.OrderedDict(), collections.deque(maxlen=8), collections.OrderedDict()
    progress = ReplayProgress()
    progress.bind(fed, recent, sequences)
    fed[51], fed[52] = (800, 816), (816, 832)
    sequences[40] = (np.arange(4, dtype=np.int64), np.ones(4))  # a streak long closed: not carried
    sequences[51] = (np.arange(800, 816, dtype=np.int64), np.linspace(2.0, 9.123456789012345, 16))
    sequences[52] = (np.arange(816, 832, dtype=np.int64), np.array([float("nan"), float("inf")] + [2.5] * 14))
    skips = [{"shard": "web/train-00000.bin", "tokens": [0, 512]}]
    progress.streak = (51, skips)
    saved = json.loads(json.dumps(progress.state_dict(), allow_nan=False))
    progress.state_spec.validate(saved, "state.triage")
    other = collections.OrderedDict({9: (np.zeros(1, dtype=np.int64), np.zeros(1))})
    restored = ReplayProgress()
    restored.bind(collections.OrderedDict(), collections.deque(maxlen=8), other)
    restored.load_state_dict(saved)
    assert list(other) == [51, 52] and restored.streak == (51, skips)
    for step in (51, 52):
        assert other[step][0].dtype == np.int64 and np.array_equal(other[step][0], sequences[step][0])
        # To the bit, NaN and inf included: the offending sequences are picked from these.
        assert other[step][1].tobytes() == sequences[step][1].tobytes()
    # A checkpoint written before the fields existed loads with neither.
    restored.load_state_dict({"format": 1, "replay": None})
    assert not other and restored.streak is None
    for bad, where in [({"sequences": [[51, [800, 801], [2.0]]]}, r"sequences\[0\]: 2 sequence indices but 1"),
                       ({"sequences": [[51, [-1], [2.0]]]}, r"sequences\[0\]\[1\]\[0\]"),
                       ({"sequences": [[51, [800], ["x"]]]}, r"sequences\[0\]\[2\]\[0\]"),
                       ({"sequences": [[0, [800], [2.0]]]}, r"sequences\[0\]\[0\]"),
                       ({"sequences": [[51, [800]]]}, r"sequences\[0\]"),
                       ({"streak": {"start": 51, "skip_list": "all"}}, r"streak.skip_list"),
                       ({"streak": {"start": 51}}, r"streak.skip_list: missing"),
                       ({"streak": [51, []]}, r"streak: \[51, \[\]\] is not an object")]:
        with pytest.raises(StateError, match=r"state.triage." + where):
            restored.state_spec.validate({**saved, **bad}, "state.triage")


class _Rewinder:
    loader = None  # no data: a skip-window replay is always runnable (Triage._cannot_run)

    def __init__(self):
        self._fed = collections.OrderedDict()

    def write_run_file(self, state):
        from dsslm.recovery.rewind import write_recovery
        write_recovery(self.run_dir, state)

    def check_skip_list(self, skip_list, step):
        pass  # no loader here; tests/unit/recovery has its own test of the check


def test_a_scaler_overflow_in_a_replay_is_not_the_spike_coming_back():
    progress = ReplayProgress()
    triage = Triage(Config(), None, _Rewinder(), None, None, progress, lambda *a, **k: None)
    progress.replay = Replay(phase="same_data", spike_start=51, target=53, base_step=45, window=[800, 928],
                             skip_list=[], lr_scale=1.0, evidence=[{"phase": "same_data", "steps": []}])
    state = TrainState()
    verdict, _ = triage.review(state, 51, Verdict.SKIP, "fp16_overflow (loss scale now 32768)", 3.0, float("inf"),
                               spike=False)
    assert verdict is Verdict.SKIP and triage.replay is not None
    verdict, reason = triage.review(state, 52, Verdict.SKIP, "loss z=9", 9.0, 3.0)
    assert verdict is Verdict.REWIND and "came back" in reason


class _Engine:
    device = __import__("torch").device("cpu")

    def decide(self, fn):
        return fn()


def test_a_replayed_step_within_the_measured_spread_does_not_show_the_spike_again():
    from dsslm.recovery.monitor import SpikeMonitor
    cfg = Config()
    cfg.monitor.min_history, cfg.monitor.window = 10, 20
    monitor = SpikeMonitor(cfg.monitor)
    for step in range(1, 21):
        assert monitor.judge(step, 2.0 + 0.01 * (-1) ** step, 1.0) is Verdict.OK
    emitted = []
    progress = ReplayProgress()
    triage = Triage(cfg, _Engine(), _Rewinder(), monitor, None, progress, lambda e, **f: emitted.append((e, f)))
    # Two computations of one step 1% above and below: a spread of 2/101, a margin of 3x it.
    triage.note_spread(1, (2.0 * 1.01, 1.01), (2.0 * 0.99, 0.99))
    assert emitted[0][0] == "replay_spread" and emitted[0][1]["spread"] == pytest.approx(0.02 / 1.01)
    assert triage.noise == pytest.approx(0.06 / 1.01)
    progress.replay = Replay(phase="same_data", spike_start=51, target=53, base_step=45, window=[800, 928],
                             skip_list=[], lr_scale=1.0, evidence=[{"phase": "same_data", "steps": []}])
    state = TrainState()
    # 5% above the median: an outlier to the monitor (z ~ 6.7), but within 3x the spread of it.
    assert monitor.judge(51, 2.1, 1.0) is Verdict.SKIP
    verdict, _ = triage.review(state, 51, Verdict.SKIP, monitor.last_reason, 2.1, 1.0)
    assert verdict is Verdict.OK and monitor.spike_start is None
    assert progress.replay.evidence[-1]["steps"][-1][3] == "within_noise"
    # 50% above: far beyond the noise, the spike came back.
    assert monitor.judge(52, 3.0, 1.0) is Verdict.REWIND
    verdict, reason = triage.review(state, 52, Verdict.REWIND, monitor.last_reason, 3.0, 1.0)
    assert verdict is Verdict.REWIND and "came back" in reason
    # Without a measured spread (CPU: bitwise replays) the first outlier already came back.
    triage.noise = 0.0
    assert monitor.judge(52, 2.1, 1.0) is Verdict.SKIP
    assert triage.review(state, 52, Verdict.SKIP, "", 2.1, 1.0)[0] is Verdict.REWIND


@pytest.mark.parametrize("replayed, verdict", [([], "unknown"), (["same_data"], "unknown"),
                                               (["same_data", "skip_window"], "state")])
def test_a_fallback_records_what_the_replays_showed_and_commits_the_planned_window(replayed, verdict):
    """Every phase replayed so far came back (that is why the triage went on): only a skip-window
    replay coming back says something (not the data); the window handed over is the one planned
    from the original pass, with the skip list and lr_scale from before the triage."""
    calls, emitted = [], []

    class Rewinder(_Rewinder):
        def rewind(self, state, target, spike_start, fallback=None):
            calls.append((target, spike_start, fallback))

        class checkpointer:
            def leave_after(step):
                calls.append(("leave_after", step))

    class Ckpt:
        state = {"step": 45}

    progress = ReplayProgress()
    triage = Triage(Config(), _Engine(), Rewinder(), None, None, progress, lambda e, **f: emitted.append((e, f)))
    evidence = [{"phase": "original", "steps": []}] + [{"phase": p, "steps": []} for p in replayed]
    entry = {"shard": "web/train-00000.bin", "tokens": [1000, 1033]}
    r = Replay(phase="backoff", spike_start=51, target=53, base_step=45, window=[800, 928], skip_list=[[0, 16]],
               lr_scale=0.5, backoffs=1, evidence=evidence, entries=[entry], fed_end=848)
    triage._fall_back(TrainState(), r, Ckpt())
    assert triage.replay is None
    (name, fields), = emitted
    assert name == "triage" and fields["verdict"] == verdict and fields["window"] == [800, 928]
    assert "replay budget" in fields["fallback"] and "[800, 928]" in fields["fallback"]
    # The named documents go too, unless a replay without the window's data came back (state).
    named = [entry] if verdict == "unknown" else []
    assert ("documents" in fields["fallback"]) == bool(named)
    # A skip-window (or backoff) replay's saves after its base hold its trajectory: set aside first.
    aside = [("leave_after", 45)] if replayed[-1:] == ["skip_window"] else []
    assert calls == aside + [(53, 51, {"window": [800, 928], "fed_end": 800, "skip_list": [[0, 16]],
                                       "lr_scale": 0.5, "verdict": verdict, "entries": named})]


def _rewinder_to_45(tmp_path, emitted: list, cfg: Config | None = None, loader=None):
    """A real Rewinder (planning, skip entries, skip_list.json) whose spike began at step 51 and
    whose restore loads a stand-in checkpoint of step 45, recording the events in `emitted`."""
    import types

    from dsslm.recovery.rewind import Rewinder

    class Monitor:
        spike_start, last_reason = 51, "loss z=9"

    class Ckpt:
        state, path = {"step": 45}, "memory:step-00000045"

    class Probe(Rewinder):
        def checkpoint_before(self, spike_step, to_step, spike_start):
            return Ckpt()

        def restore(self, state, ckpt, skip_list, lr_scale, record, new_pass=None):
            state.step, state.skip_list, state.rewinds = 45, merge_skip_list(skip_list), [record]

    checkpointer = types.SimpleNamespace(store=types.SimpleNamespace(fence=lambda: None))
    return Probe(cfg or Config(), _Engine(), checkpointer, Monitor(), 16, tmp_path,
                 lambda e, **f: emitted.append((e, f)), loader=loader)

def test_a_fallback_rewind_skips_the_window_and_the_spikes_named_documents(tmp_path):
    """The over-budget fallback skips the planned window's data and the documents of the
    sequences that stood out in the spike's batches: a document whose other chunks lie outside
    the window (fed later in the epoch, or in the next) is not fed again. (Before: the window
    alone, so the rest of the document spiked again later.)"""
    from dsslm.recovery.rewind import read_recovery
    entry = {"shard": "web/train-00000.bin", "tokens": [9000, 9400]}
    emitted = []
    rewinder = _rewinder_to_45(tmp_path, emitted)
    for step in (51, 52, 53):
        rewinder.note(step, 800 + 16 * (step - 51), 816 + 16 * (step - 51))
    state = TrainState(step=53, skip_list=[[0, 16], entry])  # what a replay had tried: not kept
    rewinder.rewind(state, 53, 51, fallback={"window": [800, 864], "skip_list": [[0, 16]], "lr_scale": 1.0,
                                             "verdict": "unknown", "entries": [entry]})
    # The documents apply from the step after the checkpoint it goes back to (45): the steps before
    # it trained on them, and a catch-up after a restart must feed them there too.
    stamped = {**entry, "from_step": 46}
    assert state.skip_list == [[0, 16], [800, 864], stamped] == read_recovery(tmp_path, 16)["skip_list"]
    (name, fields), = [(e, f) for e, f in emitted if e == "rewind"]
    assert fields["skip"] == [[800, 864], stamped] and fields["verdict"] == "unknown"


def test_a_plain_rewind_names_the_spike_steps_data_and_skips_its_widening_by_position(tmp_path):
    """The window is widened past the spike to monitor.skip_batches batches. The loader shuffles
    chunks over the whole corpus, so those positions hold random text: named as data they were
    taken out of every later epoch (one rewind at skip_batches=200 named every chunk of a 1,027-chunk
    corpus). Now only what the spike steps read is named as data; the widening is a window of
    positions, skipped this pass and no other."""
    from dsslm.config import load
    from dsslm.data.corpus import default_data_dir
    from dsslm.data.loader import Loader
    from dsslm.recovery.rewind import read_recovery
    emitted = []
    loader = Loader(default_data_dir(), 32, 1337)
    rewinder = _rewinder_to_45(tmp_path, emitted, load(None, ["monitor.skip_batches=8"]), loader)
    for step in (51, 52):
        rewinder.note(step, 800 + 16 * (step - 51), 816 + 16 * (step - 51))
    state = TrainState(step=52, skip_list=[])
    rewinder.rewind(state, 52, 51)
    spike_chunks = set(loader.chunk_ids(np.arange(800, 832)).tolist())
    assert windows_of(state.skip_list) == [[832, 800 + 8 * 16]]
    assert set(loader.skipped_chunks(state.skip_list).tolist()) == spike_chunks
    assert read_recovery(tmp_path, 16)["skip_list"] == state.skip_list
    (fields,) = [f for e, f in emitted if e == "rewind"]
    assert fields["window"] == [800, 928] and fields["skip"] == state.skip_list


class _Forensics:
    """The spike step's per-sequence losses, and the entries `data_entries` would name for it."""

    def __init__(self, losses):
        self.sequences = collections.OrderedDict({51: (np.arange(800, 816), np.asarray(losses, dtype=np.float64),
                                                        np.zeros(16, dtype=bool))})
        self.suspects = collections.OrderedDict()
        self.recorded = []

    def data_entries(self, steps, monitor):
        assert list(steps) == [51]
        return [{"shard": "web/train-00000.bin", "tokens": [1000, 1033]}]

    def record_decision(self, steps, decision):
        self.recorded.append(decision)


def _reproduced_outlier(step: int, concentrated: bool = True):
    """A monitor that judged steps 1..step-1 clean (2.0 +- 0.1, robust scale ~0.1) and `step` an
    outlier, reproduced by its re-run in place: (cfg, monitor, the step's 16 per-sequence losses).
    Concentrated: two sequences carry it (the batch's mean 3.0; without the two, 2.0, a normal
    step); else every sequence rose by the same mean."""
    from dsslm.recovery.monitor import SpikeMonitor
    cfg = Config()
    cfg.monitor.min_history, cfg.monitor.window = 10, 20
    monitor = SpikeMonitor(cfg.monitor)
    rng = np.random.default_rng(0)
    for clean in range(1, step):
        assert monitor.judge(clean, 2.0 + 0.1 * float(rng.standard_normal()), 1.0) is Verdict.OK
    losses = 2.0 + 0.05 * rng.standard_normal(16)
    if concentrated:
        losses[[3, 11]] += 8.0
    else:
        losses += 1.0
    assert monitor.judge(step, float(losses.mean()), 1.0) is Verdict.SKIP
    assert monitor.rejudge(step, float(losses.mean()), 1.0) is Verdict.SKIP
    return cfg, monitor, losses


@pytest.mark.parametrize("shape, verdict", [("few", "data"), ("everywhere", "unknown")])
def test_an_outlier_reproduced_in_place_is_data_only_where_a_few_sequences_carry_it(tmp_path, shape, verdict):
    """A reproduced outlier whose excess sits in two sequences of sixteen is data: their entries
    join the skip list and skip_list.json. One where every sequence rose (an LR burst) is not
    committed as data: `unknown`, the skip list untouched. Both mark the streak reproduced in
    place (the triage that may follow skips its same-data replay). (Before: data either way.)"""
    cfg, monitor, losses = _reproduced_outlier(51, concentrated=shape == "few")
    rewinder = _Rewinder()
    rewinder.run_dir, rewinder.fed_of = tmp_path, lambda step: (800, 816)
    emitted, forensics = [], _Forensics(losses)
    triage = Triage(cfg, _Engine(), rewinder, monitor, forensics, ReplayProgress(), lambda e, **f: emitted.append((e, f)))
    state = TrainState(skip_list=[[0, 16]])
    triage.note_rerun(state, 51, (float(losses.mean()), 1.0, "loss z=9"), (float(losses.mean()), 1.0), Verdict.SKIP)
    (name, decision), = emitted
    assert name == "triage" and decision["verdict"] == verdict and decision["scope"] == "step"
    # From the step after the outlier's: it and the steps before it fed that data.
    committed = [{"shard": "web/train-00000.bin", "tokens": [1000, 1033], "from_step": 52}] if verdict == "data" else []
    assert decision["skip"] == committed and state.skip_list == [[0, 16]] + committed
    assert (tmp_path / "skip_list.json").exists() == (verdict == "data")
    assert triage.progress.streak == (51, [[0, 16]]) and [d["verdict"] for d in forensics.recorded] == [verdict]


def test_an_outlier_reproduced_in_place_during_a_replay_commits_nothing(tmp_path):
    """A backoff replay of the spike at steps [51, 53] from step 45 trains steps 46-50 at a lower
    learning rate: an outlier there, carried by two sequences and reproduced in place, is found
    in a tentative pass. Committing it wrote skip_list.json, while the next phase's restore put
    back the base's list: a resume then skipped data the uninterrupted run fed. Now the pass
    commits nothing and marks no streak; the event says `deferred`. (Before: committed.)"""
    cfg, monitor, losses = _reproduced_outlier(48)
    rewinder = _Rewinder()
    rewinder.run_dir, rewinder.fed_of = tmp_path, lambda step: (768, 784)

    class Forensics(_Forensics):
        def __init__(self, losses):
            super().__init__(losses)
            self.sequences = collections.OrderedDict({48: (np.arange(768, 784), np.asarray(losses),
                                                            np.zeros(16, dtype=bool))})

        def data_entries(self, steps, monitor):
            return [{"shard": "web/train-00000.bin", "tokens": [900, 933]}]

    emitted, forensics, progress = [], Forensics(losses), ReplayProgress()
    progress.replay = Replay(phase="backoff", spike_start=51, target=53, base_step=45, window=[800, 848],
                             skip_list=[[0, 16]], lr_scale=1.0, backoffs=1)
    triage = Triage(cfg, _Engine(), rewinder, monitor, forensics, progress, lambda e, **f: emitted.append((e, f)))
    assert triage.may_rerun(48) and not triage.may_rerun(51)
    state = TrainState(step=47, skip_list=[[0, 16]])
    triage.note_rerun(state, 48, (float(losses.mean()), 1.0, "loss z=9"), (float(losses.mean()), 1.0), Verdict.SKIP)
    (name, decision), = emitted
    assert name == "triage" and decision["verdict"] == "data" and decision["skip"] == []
    assert "backoff replay" in decision["deferred"]
    assert state.skip_list == [[0, 16]] and not (tmp_path / "skip_list.json").exists()
    assert progress.streak is None


def test_data_a_streaks_rerun_committed_is_not_merged_into_a_resume_of_its_triage_replay(tmp_path):
    """Step 51, re-run in place, is carried by two sequences: data, committed to the skip list and
    skip_list.json. The streak goes on to rewind: its triage replays without that data, then (if
    the spike comes back without it) with it at a lower learning rate, and its verdict decides.
    The replay in progress names it (`withdrawn`, in the checkpoint part), so a resume of a
    backoff replay, which merges the run file into the checkpoint's list, feeds what the
    uninterrupted replay feeds; the run file keeps it, so a restart from a checkpoint before the
    streak (a crash that saved nothing of the triage) still never feeds it. (Before: a resume of
    the backoff replay skipped data the uninterrupted run trained on.)"""
    from dsslm.recovery.rewind import RewindPlan, read_recovery
    cfg, monitor, losses = _reproduced_outlier(51)
    entry = {"shard": "web/train-00000.bin", "tokens": [1000, 1033]}
    restored = []

    class Ckpt:
        state = {"step": 45}
        path = "memory:step-00000045"

    class Rewinder(_Rewinder):
        run_dir = tmp_path
        fed_of = staticmethod(lambda step: (800 + 16 * (step - 51), 816 + 16 * (step - 51)))

        def plan(self, state, spike_start, target):
            return RewindPlan(to_step=48, window=[800, 848], lr_scale_factor=1.0, escalate=False)

        def checkpoint_before(self, target, to_step, spike_start):
            return Ckpt()

        def restore(self, state, ckpt, skip_list, lr_scale, record, new_pass=None):
            # The base (step 45) holds the list from before the streak; the replay's skips join it.
            state.step, state.skip_list = 45, merge_skip_list([[0, 16]] + skip_list)
            restored.append(list(state.skip_list))

    class Forensics(_Forensics):
        def data_entries(self, steps, monitor):
            return [entry]

    emitted = []
    progress = ReplayProgress()
    triage = Triage(cfg, _Engine(), Rewinder(), monitor, Forensics(losses), progress,
                    lambda e, **f: emitted.append((e, f)))
    state = TrainState(step=51, skip_list=[[0, 16]])
    triage.note_rerun(state, 51, (float(losses.mean()), 1.0, "loss z=9"), (float(losses.mean()), 1.0), Verdict.SKIP)
    committed = {**entry, "from_step": 52}
    assert state.skip_list == [[0, 16], committed] == read_recovery(tmp_path, 16)["skip_list"]
    for step in (52, 53):  # the streak goes on (its next outliers' re-runs are not data)
        monitor.judge(step, float(losses.mean()), 1.0)
    state.step = 53
    triage._start(state, 53)
    # The base's list restored; the skip_window phase leaves the streak's data out from the base
    # on (before_step), here at once.
    assert triage.replay.phase == "skip_window" and restored == [[[0, 16]]]
    replayed = {**entry, "from_step": triage.replay.base_step + 1}  # the replay's: from its planned base on
    assert state.skip_list == [[0, 16], replayed]
    assert read_recovery(tmp_path, 16)["skip_list"] == [[0, 16], committed]  # the file keeps it
    assert [f["skip"] for e, f in emitted if e == "skip_withheld"] == [[committed]]
    # The checkpoint part carries what the replay withholds.
    saved = json.loads(json.dumps(progress.state_dict()))
    progress.state_spec.validate(saved, "state.triage")
    again = ReplayProgress()
    again.load_state_dict(saved)
    assert again.replay.withdrawn == [committed]
    # A checkpoint saved during the backoff replay holds the base's list; its resume merges the
    # run file without the withheld data: the same data as the uninterrupted replay.
    resumed = TrainState(skip_list=[[0, 16]])
    merge_recovery(resumed, read_recovery(tmp_path, 16), again.replay.withdrawn)
    assert resumed.skip_list == [[0, 16]]
    # A restart from before the streak, with no replay in progress, skips it.
    restarted = TrainState(skip_list=[[0, 16]])
    merge_recovery(restarted, read_recovery(tmp_path, 16))
    assert restarted.skip_list == [[0, 16], committed]


def test_a_spike_folder_that_cannot_be_written_is_an_event_not_a_crash(tmp_path, monkeypatch):
    """safetensors reports an I/O error (a full disk) as SafetensorError, not OSError: rank 0,
    the only writer, raised out of the step while the other ranks went on into the verdict's
    collectives. Now any failed write is a `forensics_failed` event, as the module promises."""
    from safetensors import SafetensorError

    import dsslm.recovery.forensics as forensics_module
    from helpers import capture_a_spike

    def full_disk(*args, **kwargs):
        raise SafetensorError("Error while serializing: I/O error: No space left on device (os error 28)")

    monkeypatch.setattr(forensics_module, "save_file", full_disk)
    emitted = capture_a_spike(tmp_path)
    assert [e for e, _ in emitted] == ["forensics_failed"] and "No space left" in emitted[0][1]["reason"]
    assert not list((tmp_path / "spikes").glob(".tmp-*"))  # the half-made folder is gone


# --- a skip list too long to read back is never committed -------------------------------------------
def test_the_skip_list_readers_take_exactly_the_cap_the_writer_checks(tmp_path):
    """One constant for the readers (state.json's train part, skip_list.json) and the writer's
    check: a list of MAX_SKIP_ENTRIES reads back, one more entry is refused by both."""
    from dsslm.fields import MAX_SKIP_ENTRIES, validate
    from dsslm.recovery.rewind import read_recovery, skip_cap_problem, write_recovery
    full = [[2 * i, 2 * i + 1] for i in range(MAX_SKIP_ENTRIES)]
    assert skip_cap_problem(full, tmp_path) is None
    write_recovery(tmp_path, TrainState(skip_list=full))
    assert len(read_recovery(tmp_path, 16)["skip_list"]) == MAX_SKIP_ENTRIES
    validate(TrainState(skip_list=full).state_dict(), TrainState.state_spec, "state.train")
    over = full + [[2 * MAX_SKIP_ENTRIES, 2 * MAX_SKIP_ENTRIES + 1]]
    assert f"{MAX_SKIP_ENTRIES + 1} entries, more than the {MAX_SKIP_ENTRIES}" in skip_cap_problem(over, tmp_path)
    with pytest.raises(StateError, match="at most"):
        validate(TrainState(skip_list=over).state_dict(), TrainState.state_spec, "state.train")


def test_a_skip_list_past_the_cap_escalates_before_skip_list_json_is_written(tmp_path):
    """A run whose skip list grew past what a resume reads back wrote a skip_list.json (and
    checkpoints) its own resume refused, and the list was rebuilt without it: the bad data fed
    again. (Before: written.) Now Escalation (exit 3), one line, the old file left as it was."""
    import torch

    from dsslm.ckpt.store import CheckpointStore
    from dsslm.fields import MAX_SKIP_ENTRIES
    from dsslm.recovery.rewind import Escalation, Rewinder, read_recovery, recovery_path
    store = CheckpointStore(tmp_path, keep_last=5)
    store.save(4, {"model": {"w": torch.ones(4)}}, {"step": 4})
    checkpointer = type("Checkpointer", (), {"store": store})()  # what write_run_file uses of one
    emitted = []
    rewinder = Rewinder(Config(), _Engine(), checkpointer, None, 16, tmp_path, lambda e, **f: emitted.append((e, f)))
    rewinder.write_run_file(TrainState(skip_list=[[0, 16]]))
    before = recovery_path(tmp_path).read_bytes()
    state = TrainState(step=9, skip_list=[[2 * i, 2 * i + 1] for i in range(MAX_SKIP_ENTRIES + 1)])
    with pytest.raises(Escalation, match=rf"the skip list would hold {MAX_SKIP_ENTRIES + 1} entries, more than the "
                                         rf"{MAX_SKIP_ENTRIES} .* take the bad text out of the corpus") as raised:
        rewinder.write_run_file(state)
    assert "\n" not in str(raised.value)
    assert recovery_path(tmp_path).read_bytes() == before and read_recovery(tmp_path, 16)["skip_list"] == [[0, 16]]
    assert [e for e, _ in emitted] == ["escalation"] and emitted[0][1]["step"] == 9


def test_a_skip_list_naming_every_chunk_escalates_and_one_emptying_a_domain_is_said(tmp_path):
    """A rewind's window is widened by position, so on a small corpus its data can be every chunk
    training draws from. That was a DataError at the next step's read (exit 2) after skip_list.json
    had the list: every resume exited 2 until a person edited the file. Now Escalation (exit 3)
    before anything is written, naming what to change."""
    import torch

    from dsslm.ckpt.store import CheckpointStore
    from dsslm.data.corpus import default_data_dir
    from dsslm.data.loader import Loader
    from dsslm.recovery.rewind import Escalation, Rewinder, read_recovery, recovery_path
    store = CheckpointStore(tmp_path, keep_last=5)
    store.save(4, {"model": {"w": torch.ones(4)}}, {"step": 4})
    checkpointer = type("Checkpointer", (), {"store": store})()
    loader = Loader(default_data_dir(), 32, 1337)
    emitted = []
    rewinder = Rewinder(Config(), _Engine(), checkpointer, None, 16, tmp_path,
                        lambda e, **f: emitted.append((e, f)), loader=loader)
    rewinder.write_run_file(TrainState(skip_list=[[0, 16]]))
    before = recovery_path(tmp_path).read_bytes()
    everything = [{"shard": path, "tokens": [0, tokens]} for path, tokens in loader._train]
    with pytest.raises(Escalation, match=r"names every chunk .* take the bad text out of the corpus or add data") as raised:
        rewinder.write_run_file(TrainState(step=9, skip_list=everything))
    assert "\n" not in str(raised.value)
    assert recovery_path(tmp_path).read_bytes() == before and read_recovery(tmp_path, 16)["skip_list"] == [[0, 16]]
    assert [e for e, _ in emitted] == ["escalation"]
    # One domain's data, all of it: the run goes on with the other, and says so once.
    rewinder.write_run_file(TrainState(step=9, skip_list=everything[1:]))
    rewinder.write_run_file(TrainState(step=10, skip_list=everything[1:]))
    assert [(e, f.get("domain")) for e, f in emitted[1:] if e != "skip_share"] == [("domain_emptied", loader.domains[1])]
    # The share named is said once too (the domain emptied on purpose is no reason to ask a person).
    assert [f["shares"] for e, f in emitted if e == "skip_share"] == [{loader.domains[1]: 1.0}]
    assert read_recovery(tmp_path, 16)["skip_list"] == everything[1:]


def test_a_resume_whose_merged_skip_list_passes_the_cap_escalates_instead_of_saving(tmp_path):
    """The checkpoint and skip_list.json each within the cap, their union past it: the next save
    escalates (exit 3) instead of writing a checkpoint the next resume would refuse. (Before: it
    was written, and the resume after it passed it over.)"""
    from helpers import remanifest, tiny_cfg

    from dsslm.fields import MAX_SKIP_ENTRIES
    from dsslm.recovery.rewind import Escalation, write_recovery
    from dsslm.train import train
    cfg = ("train.total_steps=4", "optim.warmup_steps=0", "ckpt.every=2", "monitor.enabled=false",
           "ckpt.async_save=false", "ckpt.keep_last=10")
    assert train(tiny_cfg(tmp_path, *cfg)) == 0
    shutil.rmtree(tmp_path / "checkpoints" / "step-00000004")  # resumes from step 2, saves at step 4
    folder = tmp_path / "checkpoints" / "step-00000002"
    state = json.loads((folder / "state.json").read_text())
    far = 10**9  # windows the short run never reaches
    state["skip_list"] = state["train"]["skip_list"] = [[far - 10, far - 5]]
    (folder / "state.json").write_text(json.dumps(state))
    remanifest(folder)
    write_recovery(tmp_path, TrainState(skip_list=[[far + 2 * i, far + 2 * i + 1] for i in range(MAX_SKIP_ENTRIES)]))
    with pytest.raises(Escalation, match=f"{MAX_SKIP_ENTRIES + 1} entries"):
        train(tiny_cfg(tmp_path, *cfg))
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir() if p.name.startswith("step-")) == [
        "step-00000002"]


@pytest.mark.parametrize("why", ["every chunk", "more than the 100000"])
def test_a_skip_window_replay_that_cannot_run_is_not_run(why):
    """A skip-window replay leaves out the data its spike's standing-out sequences read (their
    documents, where those stand out). On a small corpus that can be every chunk there is: a
    DataError at the replay's first read (exit 2), on every resume of it. At a large batch it can
    be more entries than a checkpoint may hold: the replay's checkpoints would be refused on
    resume. Such a phase is not run, narrow or wide (the wide one adds the window by position to
    the same entries): the triage goes on to the backoff, and the evidence says why."""
    from dsslm.data.sources import NothingLeft
    from dsslm.fields import MAX_SKIP_ENTRIES
    calls, emitted = [], []
    named = ([{"shard": "web/train-00000.bin", "tokens": [0, 9000]}] if why == "every chunk" else
             [{"shard": "web/train-00000.bin", "tokens": [100 * i, 100 * i + 33]}
              for i in range(20, MAX_SKIP_ENTRIES + 21)])

    class Loader:
        def skipped_chunks(self, skip_list):
            if why == "every chunk" and named[0] in skip_list:
                raise NothingLeft("the skip list names every chunk of DATA that training draws from")

    class Ckpt:
        state, path = {"step": 45}, "memory:step-00000045"

    class Rewinder(_Rewinder):
        loader = Loader()

        def checkpoint_before(self, target, base, spike_start):
            return Ckpt()

        def restore(self, state, ckpt, skip_list, lr_scale, record, new_pass=None):
            calls.append(("restore", ckpt.state["step"], skip_list))
            state.step = ckpt.state["step"]

    progress = ReplayProgress()
    triage = Triage(Config(), _Engine(), Rewinder(), None, None, progress, lambda e, **f: emitted.append((e, f)))
    r = Replay(phase="same_data", spike_start=51, target=53, base_step=45, window=[800, 928], skip_list=[],
               lr_scale=1.0, evidence=[{"phase": "original", "steps": []}, {"phase": "same_data", "steps": []}],
               entries=named, replay_steps=8)
    progress.replay = r
    triage._next_phase(TrainState(step=53), 53)
    assert r.phase == "backoff" and r.backoffs == 1 and r.wide
    narrow, wide = r.evidence[2:4]
    for phase in (narrow, wide):
        assert phase["phase"] == "skip_window" and why in phase["not_run"] and not phase["steps"]
    assert not narrow["wide"] and wide["wide"] and [800, 928] in r.entries
    assert r.evidence[4]["phase"] == "backoff" and [c[0] for c in calls] == ["restore"]
    assert [e for e, _ in emitted] == ["triage_phase_not_run", "triage_phase_not_run", "rewind"]


def test_a_skip_list_naming_more_than_its_share_of_a_domain_asks_a_person(tmp_path):
    """Clean text named by the hundred thousand tokens went on silently (30.2% of a corpus in a long
    run). Past monitor.max_skip_share of a domain, the commit is an escalation naming the share."""
    import torch

    from dsslm.ckpt.store import CheckpointStore
    from dsslm.config import load
    from dsslm.data.corpus import default_data_dir
    from dsslm.data.loader import Loader
    from dsslm.recovery.rewind import Escalation, Rewinder, read_recovery
    store = CheckpointStore(tmp_path, keep_last=5)
    store.save(4, {"model": {"w": torch.ones(4)}}, {"step": 4})
    checkpointer = type("Checkpointer", (), {"store": store})()
    loader = Loader(default_data_dir(), 32, 1337)
    emitted = []
    rewinder = Rewinder(load(None, ["monitor.max_skip_share=0.01"]), _Engine(), checkpointer, None, 16, tmp_path,
                        lambda e, **f: emitted.append((e, f)), loader=loader)
    path, tokens = loader._train[0]  # the first domain's first shard
    few = [{"shard": path, "tokens": [0, 33 * 3]}]  # 3 chunks: well under 1%
    rewinder.write_run_file(TrainState(step=5, skip_list=few))
    share = emitted[-1][1]["shares"][loader.domains[0]]
    assert emitted[-1][0] == "skip_share" and 0 < share < 0.01
    much = [{"shard": path, "tokens": [0, tokens // 50]}]  # 2% of it
    with pytest.raises(Escalation, match=r"would name \d+\.\d% of domain .* past monitor.max_skip_share=0.01"):
        rewinder.write_run_file(TrainState(step=9, skip_list=much))
    assert read_recovery(tmp_path, 16)["skip_list"] == few  # nothing more was written


@pytest.mark.parametrize("entries, verdict", [
    ([], "batch"), ([[803, 804], [800, 928]], "batch"),
    ([{"shard": "web/train-00000.bin", "tokens": [1000, 1033]}, [800, 928]], "data")])
def test_a_clean_skip_window_replay_is_data_only_where_it_left_out_text(tmp_path, entries, verdict):
    """The skip-window replay reaches the target clean. Where it left out text that stood out
    (a data entry), the verdict is data and commits it; where it left out positions only (nothing
    in the spike stood out, or a lone sequence of ordinary text), it is `batch`: the window is
    skipped this pass and no text is named for good. (Before: data, naming every sequence of the
    spike steps: an optimizer-state instability on clean text put its batches on the skip list.)"""
    rewinder = _Rewinder()
    rewinder.run_dir = tmp_path
    emitted, forensics = [], _Forensics(np.full(16, 2.0))
    progress = ReplayProgress()
    triage = Triage(Config(), _Engine(), rewinder, None, forensics, progress, lambda e, **f: emitted.append((e, f)))
    progress.replay = Replay(phase="skip_window", spike_start=51, target=53, base_step=45, window=[800, 928],
                             skip_list=[], lr_scale=1.0, entries=entries, wide=True,
                             evidence=[{"phase": "original", "steps": []}, {"phase": "skip_window", "steps": []}])
    triage.review(TrainState(step=53), 53, Verdict.OK, "", 2.0, 1.0)
    (name, decision), = [(e, f) for e, f in emitted if e == "triage"]
    assert decision["verdict"] == verdict and decision["window"] == [800, 928]
    named = [e for e in decision["skip"] if isinstance(e, dict)]
    assert bool(named) == (verdict == "data") and all(e["from_step"] == 46 for e in named)
