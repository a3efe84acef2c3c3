"""Spike triage end to end on real text (the stdlib corpus), fp32, one process: each drill's
verdict, what each verdict changes and what it must not, early spikes, budgets, preemption mid-replay.

Every run here is a constant learning rate after warmup (min_lr = peak_lr) and batches of 16
sequences, so by step 50 the loss is steady enough that the drills stand out: a repeated 4-gram
(data) gives a grad norm ~7x the median, a 30x learning-rate burst (state) a loss z above 10, a
gradient fault (transient) a non-finite or 1000x norm.
"""
import collections
import json
import shutil
import signal

import numpy as np
import pytest
import torch
from safetensors.torch import load_file

from dsslm.ckpt.format import read_manifest
from dsslm.ckpt.shards import open_folder
from dsslm.data.corpus import default_data_dir
from dsslm.data.loader import Loader
from dsslm.data.skips import windows_of
from dsslm.recovery import triage as triage_module
from dsslm.train import main, train
from helpers import one_thread  # noqa: F401  (autouse here: every run on one thread)
from helpers import TINY, events, losses_by_step, read_jsonl, tiny_cfg

pytestmark = pytest.mark.slow

RUN = ["model.d_model=64", "optim.peak_lr=3e-3", "optim.min_lr=3e-3", "train.micro_batch_size=16",
       "train.total_steps=64", "ckpt.every=5", "ckpt.keep_last=3", "ckpt.keep_every=15", "monitor.min_history=10",
       "monitor.window=20", "monitor.rewind_margin_steps=2", "observe.every=0"]
B = 16
DATA = "faults.repeat_batches=[[50,53]]"          # steps 51..53 are fed data batches 50..52
STATE = ["faults.lr_burst=[[50,54,30.0]]", "monitor.lr_backoff=0.01"]


def cfg(run_dir, *extra):
    return tiny_cfg(run_dir, *RUN, *extra)


def triages(run_dir, scope=None):
    return [e for e in events(run_dir, "triage") if scope is None or e["scope"] == scope]


def final_state(run_dir, step=64):
    return json.loads((run_dir / "checkpoints" / f"step-{step:08d}" / "state.json").read_text())


def tensors(run_dir, step=64):
    """Every tensor of the step's checkpoint, gathered or sharded, read whole by its key."""
    folder = run_dir / "checkpoints" / f"step-{step:08d}"
    reader = open_folder(folder, read_manifest(folder)["files"]).reader
    return {"checkpoint": {key: reader.read(key) for key in reader.keys()}}


@pytest.fixture(scope="module")
def clean(tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("triage") / "clean"
    torch.set_num_threads(1)
    assert train(cfg(run_dir)) == 0
    assert not events(run_dir, "skip") and not events(run_dir, "rewind") and not triages(run_dir)
    return run_dir


@pytest.fixture(scope="module")
def data_run(tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("triage") / "data"
    torch.set_num_threads(1)
    assert train(cfg(run_dir, DATA)) == 0
    return run_dir


@pytest.mark.parametrize("mode", ["nan", "scale"])
def test_transient_fault_after_a_checkpoint_ends_bitwise_equal_to_a_run_without_it(clean, tmp_path, mode):
    """nan: the norm is non-finite, the spike rewinds and the same-data replay is clean. scale:
    an isolated 1000x norm, re-run in place with the same weights, batch and random state."""
    assert train(cfg(tmp_path, "faults.grad_fault_steps=[52]", f"faults.grad_fault_mode={mode}")) == 0
    decisions = triages(tmp_path)
    assert [(d["verdict"], d["scope"]) for d in decisions] == [("transient", "window" if mode == "nan" else "step")]
    assert decisions[0]["evidence"][0]["steps"][0][0] == 52  # the original pass saw the fault at 52
    assert not events(tmp_path, "skip") and not events(tmp_path, "lr_scale")
    state = final_state(tmp_path)
    assert state["skip_list"] == [] and state["train"]["lr_scale"] == 1.0 and state["train"]["skipped_steps"] == 0
    run_file = tmp_path / "skip_list.json"  # written by a rewind; an in-place re-run has none
    assert not run_file.exists() or json.loads(run_file.read_text())["skip_list"] == []
    assert losses_by_step(tmp_path) == losses_by_step(clean)
    mine, theirs = tensors(tmp_path), tensors(clean)
    for name in mine:  # weights, both moments and Adam's step, to the bit
        assert mine[name].keys() == theirs[name].keys()
        assert all(torch.equal(mine[name][k], theirs[name][k]) for k in mine[name]), name


def test_data_spike_skips_its_data_for_good(data_run, tmp_path):
    decision = triages(data_run, "window")[-1]
    assert decision["verdict"] == "data" and (decision["spike_start"], decision["target"]) == (51, 53)
    # Steps 51 and 52 were re-run in place and reproduced: no same-data replay (it would only
    # show that again), the triage starts without the spike's data.
    phases = [e["triage_phase"] for e in events(data_run, "rewind")]
    assert phases == ["skip_window"]
    start, end = decision["window"]
    assert start == 50 * B and end >= 53 * B  # at least monitor.skip_batches batches
    # The outliers came back in place with the same data and the replay was clean without it:
    # the evidence says so.
    original, skipped = decision["evidence"][0], decision["evidence"][1]
    assert original["reproduced_in_place"] == 51 and [row[3] for row in original["steps"]] == ["skip_step"] * 2 + ["rewind"]
    assert skipped["phase"] == "skip_window" and [row[3] for row in skipped["steps"]] == ["ok"] * 3
    # What is skipped is the data: the chunks of the 48 poisoned sequences (the drill poisons whole
    # batches, so no sequence stands out: every sequence's chunk, no document), nothing else.
    skip = decision["skip"]
    assert final_state(data_run)["skip_list"] == skip and skip and all("shard" in e for e in skip)
    assert json.loads((data_run / "skip_list.json").read_text())["skip_list"] == skip
    run_cfg = cfg(data_run, DATA)
    lo = Loader(run_cfg.data.dir or default_data_dir(), run_cfg.model.seq_len, run_cfg.run.seed)
    poisoned = set(lo.chunk_ids(np.arange(50 * B, 53 * B)).tolist())
    assert set(lo.skipped_chunks(skip).tolist()) == poisoned
    assert final_state(data_run)["train"]["lr_scale"] == 1.0 and not events(data_run, "lr_scale")
    # A resume from a checkpoint older than the spike never reads the window either.
    resumed = tmp_path / "resumed"
    shutil.copytree(data_run, resumed)
    for folder in (resumed / "checkpoints").glob("step-*"):
        if int(folder.name[5:]) > 45:
            shutil.rmtree(folder)
    assert train(cfg(resumed, DATA, "train.total_steps=70")) == 0
    assert events(resumed, "resume")[-1]["step"] <= 45
    fed = [r["data_position"] for r in read_jsonl(resumed / "metrics.jsonl")[len(read_jsonl(data_run / "metrics.jsonl")):]
           if "data_position" in r]
    assert fed and not any(poisoned & set(lo.chunk_ids(lo.step(p, skip, B, 0, 1, 1)[0].indices).tolist()) for p in fed)
    assert len(triages(resumed)) == len(triages(data_run))  # nothing spiked again


def test_a_streak_reproduced_in_place_skips_the_same_data_replay(data_run):
    """The streak's outliers (51, 52) were re-run in place with the same weights, batch and
    random state and came back: a same-data replay from 45 would come back at 51 as surely. The
    triage spends one replay of 8 steps (45 -> 53) instead of two, and the steps recomputed
    (metrics records a replay wrote again) say the same. (Before: same_data then skip_window,
    16 steps.)"""
    decision = triages(data_run, "window")[-1]
    assert (decision["from_step"], decision["target"], decision["replay_steps"]) == (45, 53, 8)
    assert [e["phase"] for e in decision["evidence"]] == ["original", "skip_window"]
    records = [r for r in read_jsonl(data_run / "metrics.jsonl") if "loss" in r]
    assert len(records) - len({r["step"] for r in records}) == 8
    rewinds = events(data_run, "rewind")
    assert len(rewinds) == 1 and rewinds[0]["to_step"] == 45 and rewinds[0]["skip"] == decision["skip"]


def test_state_spike_lowers_lr_scale_and_skips_no_data(tmp_path):
    assert train(cfg(tmp_path, *STATE, "run.val_every=8", "run.val_batches=1")) == 0
    # Replays do not validate: each validated step has one record, though the triage trained the
    # steps from its base to the spike once per phase. (Before: one record per pass.)
    validated = [r["step"] for r in read_jsonl(tmp_path / "metrics.jsonl") if "val_loss" in r]
    assert validated == list(range(8, 65, 8))
    decision = triages(tmp_path, "window")[-1]
    assert decision["verdict"] == "state" and not decision["escalated"]
    # The burst's first outliers came back in place: no same-data replay; without the spike's
    # window it comes back; with the learning rate backed off it does not. No sequence of the
    # burst stands out, so there is no narrow replay of its text: one skip-window replay, of the
    # window by position. (Before: a narrow replay of the whole steps' chunks, then the wide one.)
    assert [e["triage_phase"] for e in events(tmp_path, "rewind")] == ["skip_window", "backoff"]
    # Re-run in place, the burst's first outliers came back with every sequence's loss up (no few
    # sequences carry it): not data, nothing committed at any point. (Before: "data", their
    # whole batches put on the skip list until the state verdict.)
    assert [(d["verdict"], d["skip"]) for d in triages(tmp_path, "step")] == [("unknown", [])] * 2
    state = final_state(tmp_path)
    assert state["train"]["lr_scale"] == pytest.approx(0.01) and state["skip_list"] == []
    assert json.loads((tmp_path / "skip_list.json").read_text())["lr_scale"] == pytest.approx(0.01)
    assert events(tmp_path, "lr_scale")[-1]["new"] == pytest.approx(0.01)
    # As finally trained (a replayed step's last record wins), step s read the stream's batch s - 1:
    # the original data, nothing skipped.
    fed = {r["step"]: r["data_position"] for r in read_jsonl(tmp_path / "metrics.jsonl") if "data_position" in r}
    assert fed == {s: (s - 1) * B for s in range(1, 65)}


def test_a_spike_on_the_first_of_three_bad_batches_is_data_not_state(tmp_path):
    """max_skips=0: the first outlier rewinds at once, so the triage knows step 51's data alone.
    Skipping it hands step 51's slots to the next sequences of the stream, batch 51's, bad too, so
    the narrow skip_window replay comes back; without all of the planned window it does not:
    data, the run goes on. (Before: called state, backed off twice, exited 3.) Named as data:
    what stood out (every sequence, a repeated 4-gram) in step 51 and in the narrow replay's step
    51 (batch 51, which brought the spike back); the window by position: in a corpus the loader
    shuffles, the sequences after a spike are random chunks, not its neighbours (the drill makes
    them bad)."""
    assert train(cfg(tmp_path, DATA, "monitor.max_skips=0")) == 0
    decision = triages(tmp_path, "window")[0]
    assert decision["verdict"] == "data" and decision["spike_start"] == decision["target"] == 51, decision
    assert [e["phase"] for e in decision["evidence"]] == ["original", "same_data", "skip_window", "skip_window"]
    assert [e.get("wide") for e in decision["evidence"][2:]] == [False, True]
    lo = Loader(default_data_dir(), 32, 1337)
    skip = final_state(tmp_path)["skip_list"]
    assert set(lo.skipped_chunks(skip).tolist()) == set(lo.chunk_ids(np.arange(50 * B, 52 * B)).tolist())
    # The planned window (monitor.skip_batches=8 from batch 50), by position: this pass only.
    assert windows_of(skip) == [[50 * B, 58 * B]]
    assert final_state(tmp_path)["train"]["lr_scale"] == 1.0 and not events(tmp_path, "escalation")


@pytest.mark.parametrize("base", ["checkpoint", "memory"])
def test_state_spike_that_survives_the_backoffs_escalates_with_exit_3(tmp_path, capsys, base):
    ring = ["ckpt.every=100", "monitor.rewind_every=5", "monitor.rewind_points=3"] if base == "memory" else []
    rc = main([f"run.dir={tmp_path}", *TINY, *RUN, *ring, "faults.lr_burst=[[50,54,30.0]]", "monitor.max_backoffs=1"])
    assert rc == 3 and "escalated" in capsys.readouterr().err
    # No sequence of the burst stands out: one skip-window replay (the window by position).
    assert [e["triage_phase"] for e in events(tmp_path, "rewind")] == ["skip_window", "backoff"]
    assert triages(tmp_path, "window")[-1]["escalated"] and len(events(tmp_path, "escalation")) == 1
    # No verdict concluded a backoff: the restart a person makes after exit 3 trains at the
    # learning rate from before the triage, not at the backoff the last replay tried.
    run_file = json.loads((tmp_path / "skip_list.json").read_text())
    assert run_file["lr_scale"] == 1.0 and run_file["skip_list"] == []
    assert run_file["rewinds"][-1]["lr_scale_factor"] == 1.0 and triages(tmp_path, "window")[-1]["lr_scale"] == 1.0
    # The restart a person makes (here with the fault gone) starts from the triage's base, step
    # 45, with nothing of the triage in flight: the checkpoints its replays saved held the last
    # backoff replay, and a restart resumed it at the trial learning rate (and escalated again).
    assert main([f"run.dir={tmp_path}", *TINY, *RUN, *ring, "monitor.max_backoffs=1"]) == 0
    assert events(tmp_path, "resume")[-1]["step"] == 45
    after = {r["step"]: r for r in read_jsonl(tmp_path / "metrics.jsonl")[-19:] if "lr" in r}
    assert sorted(after) == list(range(46, 65)) and {r["lr"] for r in after.values()} == {3e-3}
    assert final_state(tmp_path)["triage"]["replay"] is None


def test_over_the_replay_budget_falls_back_before_any_replay_and_says_what_it_knows(tmp_path):
    """Each replay costs 8 steps (checkpoint 45 to step 53): one replay alone fits in 10, the
    whole plan (both skip_window replays and 2 backoffs, 32: the streak's re-runs in place
    stand for the same-data replay) does not. The triage must not
    start a plan it cannot finish, nor call the spike data when no replay showed it: verdict
    unknown, the plain rewind with the window planned from the original pass, recorded as such."""
    assert train(cfg(tmp_path, DATA, "monitor.triage_max_replay_steps=10")) == 0
    decision = triages(tmp_path, "window")[-1]
    assert decision["verdict"] == "unknown" and "replay budget" in decision["fallback"]
    assert decision["replay_steps"] == 0 and decision["from_step"] == 45
    rewinds = events(tmp_path, "rewind")
    assert [e.get("triage_phase") for e in rewinds] == [None] and rewinds[0]["verdict"] == "unknown"
    assert rewinds[0]["window"] == decision["window"] and decision["window"][0] == 50 * B
    # What stood out in the spike steps 51..53 (batches 50..52, every sequence a repeated 4-gram),
    # named as data (chunks), so no later epoch feeds it again; the planned window by position.
    skip, lo = final_state(tmp_path)["skip_list"], Loader(default_data_dir(), 32, 1337)
    assert windows_of(skip) == [[50 * B, decision["window"][1]]] and rewinds[0]["skip"] == skip
    assert set(lo.skipped_chunks(skip).tolist()) == set(lo.chunk_ids(np.arange(50 * B, 53 * B)).tolist())
    record = final_state(tmp_path)["train"]["rewinds"][-1]
    assert record["verdict"] == "unknown" and record["to_step"] == rewinds[0]["to_step"] == 45
    assert final_state(tmp_path)["train"]["lr_scale"] == 1.0


def test_killed_inside_a_spike_streak_reaches_the_uninterrupted_verdicts_to_the_bit(tmp_path):
    """Checkpoints every 4 steps: step 52's is taken with the streak of steps 51, 52 open, and
    the run dies right after it. The resumed run must plan the skip window from step 51's data
    (the feed record travels in the checkpoint), not from the first step it fed itself: the same
    verdict, window, evidence, skip list, lr_scale and losses as the run never interrupted."""
    from dsslm.recovery.faults import DrillAbort
    every = ["ckpt.every=4", "ckpt.keep_every=0"]
    ref, cut = tmp_path / "ref", tmp_path / "cut"
    assert train(cfg(ref, DATA, *every)) == 0
    with pytest.raises(DrillAbort):
        train(cfg(cut, DATA, *every, "faults.crash_at_step=52", "faults.crash_mode=raise"))
    assert final_state(cut, 52)["monitor"]["streak"] == 2
    assert train(cfg(cut, DATA, *every)) == 0
    assert events(cut, "resume")[-1]["step"] == 52
    mine, theirs = triages(cut, "window"), triages(ref, "window")
    assert [d["verdict"] for d in theirs] == ["data"] and theirs[0]["window"][0] == 50 * B
    strip = lambda d: {k: v for k, v in d.items() if k not in ("time", "t")}
    assert [strip(d) for d in mine] == [strip(d) for d in theirs]
    for key in ("skip_list",):
        assert final_state(cut)[key] == final_state(ref)[key]
    assert final_state(cut)["train"]["lr_scale"] == final_state(ref)["train"]["lr_scale"] == 1.0
    assert json.loads((cut / "skip_list.json").read_text()) == json.loads((ref / "skip_list.json").read_text())
    assert losses_by_step(cut) == losses_by_step(ref)


@pytest.mark.parametrize("triage", ["true", "false"])
def test_nan_before_the_first_periodic_checkpoint_rewinds_to_the_start(tmp_path, triage):
    assert train(cfg(tmp_path, "faults.nan_steps=[7]", "ckpt.every=50", "train.total_steps=20",
                     f"monitor.triage={triage}")) == 0
    rewind = events(tmp_path, "rewind")
    assert len(rewind) == 1 and rewind[0]["to_step"] == 0 and rewind[0]["checkpoint"].endswith("step-00000000")
    assert not events(tmp_path, "escalation") and events(tmp_path, "end")[0]["step"] == 20


def test_nan_right_after_a_branch_rewinds_to_the_branch_point(clean, tmp_path):
    parent = clean / "checkpoints" / "step-00000060"
    assert train(cfg(tmp_path, f"run.init_from={parent}", "faults.nan_steps=[62]", "train.total_steps=64")) == 0
    rewind = events(tmp_path, "rewind")
    assert len(rewind) == 1 and rewind[0]["to_step"] == 60
    assert rewind[0]["checkpoint"] == str(tmp_path / "checkpoints" / "step-00000060")
    assert losses_by_step(tmp_path) == {s: v for s, v in losses_by_step(clean).items() if s > 60}


@pytest.mark.parametrize("phase", ["skip_window", "same_data"])
def test_preempted_mid_replay_resumes_the_triage_to_the_bit(clean, data_run, tmp_path, monkeypatch, phase):
    """SIGUSR1 as the first replay starts: the preemption checkpoint carries the replay in
    progress (its phase, its tentative window, its evidence); the requeued run resumes from it
    and finishes the triage. skip_window: the data streak, whose re-runs in place stood for the
    same-data replay. same_data: a non-finite step rewinds at once (never re-run in place), so
    the triage replays the same data first and finds the fault transient.

    Durable checkpoints every 15 steps: none of the original pass lies between the base (45) and
    the spike, so the preemption checkpoint is the newest one. (With one at 50 the resume takes
    that instead: see test_a_resume_mid_replay_passes_over_the_left_trajectory's checkpoints.)"""
    original = triage_module.Triage._replay_from
    drill, ref, verdict = ((DATA, data_run, "data") if phase == "skip_window" else
                           ("faults.grad_fault_steps=[52]", clean, "transient"))
    run = [drill, "ckpt.every=15", "ckpt.keep_every=0"]

    def replay_then_preempt(self, state, ckpt, r, window, lr_scale):
        original(self, state, ckpt, r, window, lr_scale)
        if r.phase == phase:
            signal.raise_signal(signal.SIGUSR1)

    monkeypatch.setattr(triage_module.Triage, "_replay_from", replay_then_preempt)
    assert train(cfg(tmp_path, *run, "faults.grad_fault_mode=nan")) == 0
    preempted = events(tmp_path, "preempt_save")
    assert len(preempted) == 1 and 45 < preempted[0]["step"] < 52
    saved = final_state(tmp_path, preempted[0]["step"])
    assert saved["triage"]["replay"]["phase"] == phase and not triages(tmp_path, "window")
    monkeypatch.setattr(triage_module.Triage, "_replay_from", original)
    assert train(cfg(tmp_path, *run, "faults.grad_fault_mode=nan")) == 0
    assert events(tmp_path, "resume")[-1]["step"] == preempted[0]["step"]
    decision = triages(tmp_path, "window")[-1]
    assert decision["verdict"] == verdict and [e["phase"] for e in decision["evidence"]][1:] == [phase]
    assert [e["triage_phase"] for e in events(tmp_path, "rewind")] == [phase]  # the resume replayed nothing again
    assert losses_by_step(tmp_path) == losses_by_step(ref)
    assert final_state(tmp_path)["skip_list"] == final_state(ref)["skip_list"]


@pytest.mark.parametrize("case", ["preempted_before_a_state_spike", "crashed_after_a_checkpoint"])
def test_a_triage_after_a_restart_replays_from_the_base_the_uninterrupted_run_used(tmp_path, monkeypatch, case):
    """Rewind points live in memory: a job resumed from a preemption's save at 48 (or from the
    checkpoint at 50 after a crash) has none, and its triage replayed from whatever it held (48:
    the backoff's lower learning rate from step 49, where the uninterrupted run's from 46; 0: a
    budget fallback and another skip list). The base is planned from the config (a multiple of
    monitor.rewind_every or ckpt.every), reached from an older checkpoint by replaying the steps
    up to it as they were: the same losses, decisions and skip list to the bit."""
    from dsslm.recovery import faults
    ring = ["monitor.rewind_every=5", "monitor.rewind_points=3"]
    preempted = case == "preempted_before_a_state_spike"
    run = ([*ring, *STATE, "ckpt.every=100"] if preempted else
           [*ring, DATA, "ckpt.every=50", "monitor.triage_max_replay_steps=100", "faults.crash_at_step=50",
            "faults.crash_mode=raise"])
    ref = tmp_path / "uninterrupted"
    assert train(cfg(ref, *[o for o in run if not o.startswith("faults.crash")])) == 0
    if preempted:
        real = faults.Drills.maybe_crash

        def preempt_once(self, step):
            if step == 47 and not (self.run_dir / ".preempted").exists():
                (self.run_dir / ".preempted").touch()
                signal.raise_signal(signal.SIGUSR1)
            return real(self, step)
        monkeypatch.setattr(faults.Drills, "maybe_crash", preempt_once)
    cut = tmp_path / "cut"
    if preempted:
        assert main([f"run.dir={cut}", *TINY, *RUN, *run]) == 0
    else:
        with pytest.raises(faults.DrillAbort):
            main([f"run.dir={cut}", *TINY, *RUN, *run])
    assert main([f"run.dir={cut}", *TINY, *RUN, *run]) == 0
    resumed_at = events(cut, "resume")[-1]["step"]
    assert resumed_at == (48 if preempted else 50)
    decision, want = triages(cut, "window")[-1], triages(ref, "window")[-1]
    assert (decision["verdict"], decision["from_step"]) == (want["verdict"], want["from_step"]) == (
        ("state" if preempted else "data"), 45)
    assert losses_by_step(cut) == losses_by_step(ref)
    assert final_state(cut)["skip_list"] == final_state(ref)["skip_list"]
    assert final_state(cut)["train"]["lr_scale"] == final_state(ref)["train"]["lr_scale"]
    # The first replay reached 45 from step 0 and kept it as a rewind point: the later phases
    # start there, not from step 0 again.
    loaded = [e["from_step"] for e in decision["evidence"][1:]]
    assert loaded[0] == 0 and set(loaded[1:]) <= {45} and (len(loaded) > 1) == preempted


def test_a_resume_mid_replay_passes_over_the_left_trajectorys_checkpoints(tmp_path, monkeypatch):
    """Checkpoints every 5 steps: the original pass saved 50 before the spike over 51..53; the
    triage rewinds to 45 and is preempted at 46. The requeued run must resume the replay from
    the preemption checkpoint, not from the original pass's 50 (which holds no replay: the run
    would train the spike's steps again with the in-place re-runs' skips and never finish the
    triage)."""
    original = triage_module.Triage._replay_from

    def replay_then_preempt(self, state, ckpt, r, window, lr_scale):
        original(self, state, ckpt, r, window, lr_scale)
        signal.raise_signal(signal.SIGUSR1)

    monkeypatch.setattr(triage_module.Triage, "_replay_from", replay_then_preempt)
    assert train(cfg(tmp_path, DATA)) == 0
    preempted = events(tmp_path, "preempt_save")
    monkeypatch.setattr(triage_module.Triage, "_replay_from", original)
    assert train(cfg(tmp_path, DATA)) == 0
    assert events(tmp_path, "resume")[-1]["step"] == preempted[0]["step"] == 46
    assert triages(tmp_path, "window")[-1]["verdict"] == "data"
    # The left trajectory's 50 was set aside by the rewind to 45, kept for a person, not deleted.
    left = events(tmp_path, "left_trajectory")[0]
    assert left["rewound_to"] == 45 and [n[:len("left-step-00000050")] for n in left["checkpoints"]] == ["left-step-00000050"]
    assert (tmp_path / "checkpoints" / left["checkpoints"][0] / "MANIFEST").exists()


def test_a_fault_in_a_replays_run_up_retries_that_replay_and_says_nothing_of_the_spike(clean, tmp_path, monkeypatch):
    """A non-finite gradient at 52 (transient) is replayed from 45 with the same data; that
    replay's step 47 gives a non-finite loss of its own (a second fault, before the spike it
    replays). The replay had not reached the spike, so it showed nothing about it: it was taken
    as the spike coming back, and the skip-window replay's clean pass called a transient fault
    data, skipping text. Now the same-data replay runs again, and the run ends as a run without
    the faults, to the bit."""
    from dsslm.recovery import faults
    real, seen = faults.Drills.loss_multiplier, collections.Counter()

    def nan_in_the_replay(self, step):
        seen[step] += 1
        return float("nan") if step == 47 and seen[step] == 2 else real(self, step)

    monkeypatch.setattr(faults.Drills, "loss_multiplier", nan_in_the_replay)
    assert train(cfg(tmp_path, "faults.grad_fault_steps=[52]", "faults.grad_fault_mode=nan")) == 0
    decision = triages(tmp_path, "window")
    assert len(decision) == 1 and decision[0]["verdict"] == "transient"
    phases = decision[0]["evidence"]
    assert [e["phase"] for e in phases] == ["original", "same_data", "same_data"]
    assert phases[1]["spiked_ahead"] == 47 and phases[1]["steps"][0][:2] == [47, "nan"]
    assert [e["triage_phase"] for e in events(tmp_path, "rewind")] == ["same_data", "same_data"]
    assert losses_by_step(tmp_path) == losses_by_step(clean)
    assert final_state(tmp_path)["skip_list"] == final_state(clean)["skip_list"] == []


def test_a_fallback_ends_the_replay_whose_save_it_loads(tmp_path, monkeypatch):
    """A transient fault at 52, replayed from 45 with the same data; preempted at 46, in that
    replay. The resumed job's step 47 faults too, before the spike it replays, and the budget
    (40) has no room to run that replay again: the triage falls back to the plain rewind, which
    loads the newest checkpoint at or before 49, the preemption's save, holding the same-data
    replay in progress (its weights are the original pass's). The fallback ended the triage; the
    replay loaded with the save must not go on and conclude a second verdict."""
    from dsslm.recovery import faults
    original, real = triage_module.Triage._replay_from, faults.Drills.loss_multiplier
    resumed = []

    def replay_then_preempt(self, state, ckpt, r, window, lr_scale):
        original(self, state, ckpt, r, window, lr_scale)
        signal.raise_signal(signal.SIGUSR1)

    def nan_once_resumed(self, step):
        if resumed and step == 47 and resumed.pop():
            return float("nan")
        return real(self, step)

    run = ["faults.grad_fault_steps=[52]", "faults.grad_fault_mode=nan", "monitor.triage_max_replay_steps=40"]
    monkeypatch.setattr(triage_module.Triage, "_replay_from", replay_then_preempt)
    assert train(cfg(tmp_path, *run)) == 0
    assert [e["step"] for e in events(tmp_path, "preempt_save")] == [46]
    monkeypatch.setattr(triage_module.Triage, "_replay_from", original)
    monkeypatch.setattr(faults.Drills, "loss_multiplier", nan_once_resumed)
    resumed.append(True)
    with pytest.raises(faults.DrillAbort):  # killed at 48, before the next save
        train(cfg(tmp_path, *run, "faults.crash_at_step=48", "faults.crash_mode=raise"))
    assert [e["to_step"] for e in events(tmp_path, "rewind") if e.get("verdict") == "unknown"] == [46]
    # The save the fallback loaded was set aside with the replay in it; the restart resumes
    # from the one before, with the fallback's skip list, and no replay.
    assert not (tmp_path / "checkpoints" / "step-00000046").exists()
    assert train(cfg(tmp_path, *run)) == 0
    assert events(tmp_path, "resume")[-1]["step"] == 45
    (decision,) = triages(tmp_path, "window")
    assert decision["verdict"] == "unknown" and "triage_max_replay_steps=40" in decision["fallback"]
    assert decision["evidence"][-1]["spiked_ahead"] == 47
    assert final_state(tmp_path)["triage"]["replay"] is None


def test_spike_forensics_hold_the_batch_and_the_report_decodes_the_worst_sequences(data_run):
    from dsslm.data import Loader
    from dsslm.data.corpus import default_data_dir
    folder = data_run / "spikes" / "step-00000051"
    batch = load_file(folder / "batch.safetensors")
    spike = json.loads((folder / "spike.json").read_text())
    assert batch["indices"].tolist() == list(range(50 * B, 51 * B)) and batch["inputs"].shape == (B, 32)
    loader = Loader(default_data_dir(), 32, 1337)
    real = loader.read(batch["indices"].numpy())[0]
    gram = loader.read([50 * B])[0][0, :4]  # the drill repeats the window's first sequence's first 4 tokens
    assert torch.equal(batch["inputs"], gram.repeat(B, 8)) and not torch.equal(batch["inputs"], real)
    assert spike["step"] == 51 and spike["verdict"] == "skip_step" and "gnorm" in spike["reason"]
    assert set(spike["grad_norms"]) == {"embeddings", "attention", "mlp", "norms"}
    total = sum(v ** 2 for v in spike["grad_norms"].values()) ** 0.5
    assert total == pytest.approx(spike["gnorm"], rel=1e-4)  # the layer groups partition the norm
    assert len(spike["monitor_window"]["losses"]) == 20 and batch["sequence_loss"].shape == (B,)
    decisions = json.loads((folder / "triage.json").read_text())["decisions"]
    # Step 51's re-run in place reproduced it, and every sequence of the batch is one 4-gram
    # repeated: data, named by its text (before: unknown, its loss concentrated in no few
    # sequences); the streak goes on and its triage says data too.
    assert [(d["scope"], d["verdict"]) for d in decisions] == [("step", "data"), ("window", "data")]
    assert not list((data_run / "spikes").glob(".tmp-*"))
    from dsslm.report import main as report
    from dsslm.recovery.forensics import printable
    assert report([str(data_run)]) == 0
    summary = (data_run / "report" / "summary.md").read_text()
    text = bytes(gram.tolist()).decode("utf-8", errors="replace")
    assert "## Spikes" in summary and "| 53 | rewind" in summary and printable(text * 3, 10**6) in summary


@pytest.mark.parametrize("extra", [["monitor.detector=mad"], ["monitor.detector=zscore"],
                                   ["monitor.detector=max_multiple", "monitor.max_multiple_steps=30"],
                                   ["optim.clip_mode=zclip", "optim.zclip_warmup_steps=10"]],
                         ids=["mad", "zscore", "max_multiple", "zclip"])
def test_detector_and_zclip_state_resume_bitwise(tmp_path, extra):
    """Killed at 23, resumed from 20: the same losses and, at the end, the same detector (and
    ZClip) state as the run that was never interrupted. The window (50) outlasts the run, so a
    state that was not restored would still show in the final one."""
    from dsslm.recovery.faults import DrillAbort
    steps = ["train.total_steps=40", "monitor.window=50", "ckpt.keep_every=10", *extra]
    assert train(cfg(tmp_path / "ref", *steps)) == 0
    cut = tmp_path / "cut"
    with pytest.raises(DrillAbort):
        train(cfg(cut, *steps, "faults.crash_at_step=23", "faults.crash_mode=raise"))
    assert train(cfg(cut, *steps)) == 0
    assert events(cut, "resume")[-1]["step"] == 20
    assert losses_by_step(cut) == losses_by_step(tmp_path / "ref")
    mine, theirs = final_state(cut, 40), final_state(tmp_path / "ref", 40)
    assert mine["monitor"] == theirs["monitor"] and len(mine["monitor"]["losses"]) == 40
    assert mine.get("clip") == theirs.get("clip") and ("clip" in mine) == ("zclip" in extra[0])
    saved = final_state(cut, 20)
    assert saved["monitor"]["baseline_count"] == 20 and (saved.get("clip") or {"mean": 0})["mean"] is not None


THREE = ["faults.grad_fault_steps=[30]", "faults.grad_fault_mode=nan", "faults.grad_fault_rank=1",
         "faults.repeat_batches=[[40,43]]", "faults.lr_burst=[[52,56,30.0]]", "monitor.lr_backoff=0.01",
         "faults.grad_surge=[[20,23,20.0]]"]


@pytest.mark.slow
@pytest.mark.parametrize("engine", [["engine.kind=ddp"], ["engine.kind=zero", "engine.zero_stage=1"]],
                         ids=["ddp", "zero1"])
def test_two_ranks_triage_each_drill_right_and_together(tmp_path, engine):
    """One run, 2 gloo ranks, all three causes and a false alarm's: every gradient x20 over steps
    20..22 with the loss untouched (a model-wide surge: applied, no spike), rank 1's gradients go
    non-finite at step 30 (transient), data batches 40..42 repeat one 4-gram (data: its surge is
    the batch's alone against the held-out probe), the learning rate bursts 30x over steps 52..55
    (state). Rank 0 decides every replay; both ranks follow; the forensics gather both ranks'
    sequences."""
    from helpers import run_train
    proc = run_train(tmp_path, *RUN, *THREE, *engine, "train.micro_batch_size=8", nproc=2, timeout_s=400)
    assert proc.returncode == 0
    decisions = [(d["verdict"], d["spike_start"], d["target"]) for d in triages(tmp_path, "window")]
    assert [d[0] for d in decisions] == ["transient", "data", "state"]
    surges = events(tmp_path, "gnorm_surge")
    assert surges and surges[0]["step"] == 20 and all(e["step"] < 23 for e in surges)
    assert all(e["held_out_gnorm"] * 3 > e["rerun_gnorm"] for e in surges)  # the held-out batch shared it
    assert not [e for e in events(tmp_path, "skip") if e["step"] < 30]
    assert decisions[0][1:] == (30, 30) and decisions[1][1:] == (41, 43) and 52 <= decisions[2][1] <= 57
    window = triages(tmp_path, "window")[1]["window"]
    skip = triages(tmp_path, "window")[1]["skip"]  # the data verdict's entries: the poisoned chunks alone
    assert window[0] == 40 * B and skip and final_state(tmp_path)["skip_list"] == skip  # the transient added nothing
    assert final_state(tmp_path)["train"]["lr_scale"] == pytest.approx(0.01)
    assert events(tmp_path, "end")[0]["step"] == 64 and len(events(tmp_path, "start")) == 1
    batch = load_file(tmp_path / "spikes" / "step-00000041" / "batch.safetensors")
    assert batch["indices"].tolist() == list(range(40 * B, 41 * B))  # both ranks' halves, in order


def test_a_temporary_state_backoff_ramps_back_and_resumes_to_the_bit(tmp_path):
    """monitor.lr_recover_steps=10: the backoff holds from the base through the spike, then the
    learning rate climbs linearly back to the plan over 10 steps; lr_scale itself never moves,
    and a resume in the middle of the ramp follows it exactly (it is a function of the history)."""
    from dsslm.recovery.faults import DrillAbort
    steps = [*STATE, "monitor.lr_recover_steps=10", "ckpt.keep_every=5"]
    ref = tmp_path / "ref"
    assert train(cfg(ref, *steps)) == 0
    decision = triages(ref, "window")[-1]
    target = decision["target"]
    assert decision["verdict"] == "state" and decision["lr_factor"] == pytest.approx(0.01)
    lrs = {r["step"]: r["lr"] for r in read_jsonl(ref / "metrics.jsonl") if "lr" in r}
    assert target == 53 and lrs[target] == pytest.approx(3e-3 * 30 * 0.01)  # the burst's last step, backed off
    assert lrs[target + 5] == pytest.approx(3e-3 * (0.01 + 0.99 * 0.5))
    assert lrs[target + 10] == pytest.approx(3e-3) and final_state(ref)["train"]["lr_scale"] == 1.0
    cut = tmp_path / "cut"
    with pytest.raises(DrillAbort):
        train(cfg(cut, *steps, f"faults.crash_at_step={target + 7}", "faults.crash_mode=raise"))
    assert train(cfg(cut, *steps)) == 0
    assert events(cut, "resume")[-1]["step"] > target
    assert losses_by_step(cut) == losses_by_step(ref)


RING = ["ckpt.every=100", "monitor.rewind_every=5", "monitor.rewind_points=3"]
DURABLE = ["ckpt.every=5", "monitor.rewind_every=0"]


def assert_same_run(mine, theirs):
    assert losses_by_step(mine) == losses_by_step(theirs)
    decide = lambda run: [(d["verdict"], d["window"], d["from_step"]) for d in triages(run, "window")]
    assert decide(mine) == decide(theirs) and decide(mine)
    a, b = tensors(mine), tensors(theirs)
    for name in a:  # weights, both moments and Adam's step, to the bit
        assert a[name].keys() == b[name].keys()
        assert all(torch.equal(a[name][k], b[name][k]) for k in a[name]), name


def test_a_rewind_point_in_memory_is_the_checkpoint_of_its_step_to_the_bit(tmp_path):
    """Durable checkpoints only at 0 and 64, rewind points every 5 steps: the data spike over
    51..53 is triaged from the point at 45 (no checkpoint covers it), and every replay and the
    rest of the run equal those of a run that rewound to a durable checkpoint of step 45."""
    ring, durable = tmp_path / "ring", tmp_path / "durable"
    assert train(cfg(ring, DATA, *RING)) == 0
    assert train(cfg(durable, DATA, *DURABLE)) == 0
    rewinds = events(ring, "rewind")
    assert [e["checkpoint"] for e in rewinds] == ["memory:step-00000045"]  # skip_window (reproduced in place)
    assert sorted(int(p.name[5:]) for p in (ring / "checkpoints").glob("step-*")) == [0, 64]
    assert_same_run(ring, durable)
    memory = events(ring, "memory")[0]["per_rank"][0]
    assert memory["rewind_bytes"] == 3 * memory["rewind_point_bytes"] > 16 * 127_296 * 0.75


@pytest.mark.slow
@pytest.mark.parametrize("engine", [["engine.kind=ddp"], ["engine.kind=zero", "engine.zero_stage=3"]],
                         ids=["ddp", "zero3"])
def test_two_ranks_split_the_rewind_points_and_restore_them_to_the_bit(tmp_path, engine):
    """2 gloo ranks: each keeps about half of every point, and a restore reads each rank's own
    part in the live engine (as a sharded checkpoint's rewind does), while the durable run loads
    whole gathered checkpoints: the same run to the bit, on a replicated and a sharded engine."""
    from helpers import run_train
    two = ["train.micro_batch_size=8", *engine]
    ring, durable = tmp_path / "ring", tmp_path / "durable"
    run_train(ring, *RUN, DATA, *RING, *two, nproc=2, timeout_s=500)
    run_train(durable, *RUN, DATA, *DURABLE, *two, "ckpt.format=gathered", nproc=2, timeout_s=500)
    assert [e["checkpoint"] for e in events(ring, "rewind")] == ["memory:step-00000045"]
    assert_same_run(ring, durable)
    shares = [r["rewind_point_bytes"] for r in events(ring, "memory")[0]["per_rank"]]
    assert len(shares) == 2 and max(shares) < 0.6 * sum(shares)


def test_where_kernels_are_not_bitwise_a_replay_must_exceed_the_measured_spread(tmp_path):
    """faults.replay_noise=0.01: every computation's loss (and so its gradients) 1% up or down,
    alternating, as kernels that are not bitwise deterministic would. The job's first step is
    computed twice and the spread measured (2/101 relative); the data spike is still told apart,
    since its replay comes back far beyond 3x that spread."""
    assert train(cfg(tmp_path, DATA, "faults.replay_noise=0.01")) == 0
    spread = events(tmp_path, "replay_spread")
    assert len(spread) == 1 and spread[0]["step"] == 1
    assert spread[0]["spread"] == pytest.approx(0.02 / 1.01, rel=1e-2)
    assert spread[0]["margin"] == pytest.approx(3 * spread[0]["spread"])
    assert [d["verdict"] for d in triages(tmp_path, "window")] == ["data"]


def test_preempted_mid_replay_from_a_rewind_point_reaches_the_same_verdict(tmp_path, monkeypatch):
    """The state spike is triaged from the rewind point at 45 (durable checkpoints only at 0 and
    64). SIGUSR1 as the skip_window replay starts: the preemption checkpoint carries the replay;
    the requeued job has no rewind points, so its backoff replay starts from the durable step 0
    and replays 1..45 exactly as they were trained: the same verdict, lr_scale and losses. The
    catch-up is not counted against the replay budget (40 here; the plan is 4 x 8 steps):
    counted, it made the requeued job fall back, and the plain rewind loaded the preemption's
    save with the skip-window replay in it, which went on and concluded `data` on a state spike."""
    original = triage_module.Triage._replay_from

    def replay_then_preempt(self, state, ckpt, r, window, lr_scale):
        original(self, state, ckpt, r, window, lr_scale)
        if r.phase == "skip_window":
            signal.raise_signal(signal.SIGUSR1)

    ref, cut = tmp_path / "ref", tmp_path / "cut"
    run = [*STATE, *RING, "monitor.triage_max_replay_steps=40"]
    assert train(cfg(ref, *run)) == 0
    monkeypatch.setattr(triage_module.Triage, "_replay_from", replay_then_preempt)
    assert train(cfg(cut, *run)) == 0
    assert events(cut, "rewind")[-1]["checkpoint"] == "memory:step-00000045"
    assert final_state(cut, events(cut, "preempt_save")[0]["step"])["triage"]["replay"]["phase"] == "skip_window"
    monkeypatch.setattr(triage_module.Triage, "_replay_from", original)
    assert train(cfg(cut, *run)) == 0
    decide = lambda run: [(d["verdict"], d["window"], d["lr_scale"]) for d in triages(run, "window")]
    assert decide(cut) == decide(ref) and decide(ref)[0][0] == "state" and "fallback" not in triages(cut)[-1]
    # The requeued job's next replay (the backoff: no sequence of the burst stands out, so there
    # is one skip-window replay) starts from the durable step 0: it holds no rewind point.
    assert [e["checkpoint"] for e in events(cut, "rewind")][-1].endswith("step-00000000")
    assert final_state(cut)["train"]["lr_scale"] == final_state(ref)["train"]["lr_scale"] == pytest.approx(0.01)
    assert final_state(cut)["skip_list"] == final_state(ref)["skip_list"] == []
    assert losses_by_step(cut) == losses_by_step(ref)


def test_at_the_shipped_checkpoint_spacing_a_spike_gets_the_whole_triage(tmp_path):
    """ckpt.every=1000 (the shipped configs) and the default rewind points: the only durable
    checkpoint before the spike over 161..163 is step 0, whose replays (4 x 163 steps) do not fit
    the default budget of 300; the rewind point at 150 does, so the spike is triaged in full."""
    # The drill repeats the n-gram its window's first sequence reads: pinned to the array order it was
    # measured on (under the feistel order that n-gram's spike came back after two backoffs: state).
    assert train(cfg(tmp_path, "faults.repeat_batches=[[160,163]]", "ckpt.every=1000", "train.total_steps=170",
                     "data.shuffle=array")) == 0
    decision = triages(tmp_path, "window")[-1]
    assert decision["verdict"] == "data" and "fallback" not in decision and decision["from_step"] == 150
    assert [(e["triage_phase"], e["checkpoint"]) for e in events(tmp_path, "rewind")] == \
        [("skip_window", "memory:step-00000150")]  # the streak came back in place: no same-data replay
