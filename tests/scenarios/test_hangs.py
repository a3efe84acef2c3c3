"""The hang drills on one node, 2 gloo ranks under torchrun (`python -m dsslm.engine.agent`, which
exits with the ranks' own code): a rank stopped (SIGSTOP, faults.hang_*) inside a step, or inside a
checkpoint save, ends every process of the job with exit 75 and a record in run.dir/hangs/ that
names it, and the resumed run continues from the newest checkpoint to the bit; with the watchdog
not judging, the collectives' bound still ends it the same way; and runs that are slow where they
may be (a long save, a compiled first step, evaluation) never trip it under tight limits.

The limits here are seconds (floor 2 s, beats of 0.25 s), so each drill takes seconds; the
default ones (floor 60 s) are timed by bench/bench_hang.py."""
from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from dsslm.exits import EXIT_REQUEUE
from helpers import hook_env, losses_by_step, read_jsonl, run_train
from nodes import HOST, launch

pytestmark = pytest.mark.slow

TOTAL = 24
RUN = [f"train.total_steps={TOTAL}", "ckpt.every=5", "train.micro_batch_size=2"]
# Tight limits, so a drill takes seconds. ceiling_s bounds a first save or evaluation.
QUICK = ["observe.watchdog.floor_s=2", "observe.watchdog.beat_s=0.25", "observe.watchdog.ceiling_s=20",
         "observe.watchdog.first_s=120"]


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> dict[int, float]:
    run_dir = tmp_path_factory.mktemp("hang-ref") / "run"
    run_train(run_dir, *RUN, nproc=2)
    return losses_by_step(run_dir)


def the_record(run_dir: Path) -> dict:
    (folder,) = [p for p in (run_dir / "hangs").iterdir() if not p.name.startswith(".")]
    return json.loads((folder / "hang.json").read_text())


def gone(pids: list[int]) -> bool:
    return not any(Path(f"/proc/{pid}").exists() for pid in pids)


def drill(run_dir: Path, *overrides: str) -> tuple[dict, str]:
    """A 2-rank job that must end 75 with a record; returns the record and the launcher's log."""
    job = launch([HOST], run_dir, *RUN, *QUICK, *overrides, nproc=2)
    codes = job.wait()
    assert codes == {HOST.name: EXIT_REQUEUE}, job.output()
    record = the_record(run_dir)
    pids = [s["pid"] for s in record["first"] + record["waiting"]]
    assert gone(pids), (pids, job.output())  # every process of the job: the stopped one too (the reaper)
    return record, job.output()


def test_a_rank_stopped_in_a_step_is_named_and_the_job_resumes_to_the_bit(tmp_path, reference):
    run_dir = tmp_path / "run"
    record, log = drill(run_dir, "faults.hang_step=12", "faults.hang_rank=1")
    assert record["cause"] == "stopped_beating" and record["exit_code"] == EXIT_REQUEUE, record
    assert [(s["rank"], s["host"]) for s in record["first"]] == [(1, HOST.name)], record
    assert (record["step"], record["phase"]) == (12, "forward_backward"), record  # where rank 0 waits for it
    (waiting,) = record["waiting"]
    assert waiting["rank"] == 0 and waiting["dumped"] and waiting["collective"].startswith("gloo:"), record
    assert "hang at step 12 in forward_backward" in log and "exit 75 (requeue)" in log, log
    hang_events = [e for e in read_jsonl(run_dir / "events.jsonl") if e["event"] == "hang"]
    assert [(e["step"], e["exit_code"]) for e in hang_events] == [(12, EXIT_REQUEUE)]
    assert not (run_dir / "LOCK").exists()  # rank 0 left it: a requeue on any node takes run.dir at once
    # The newest checkpoint the job finished: step 10's, unless rank 1 was stopped before its async
    # writer had finished its shard of it (seen once under load: step 10 stayed a temp folder).
    newest = max(p.name for p in (run_dir / "checkpoints").glob("step-*") if p.name[5:].isdigit())
    assert newest in ("step-00000005", "step-00000010"), newest

    job = launch([HOST], run_dir, *RUN, *QUICK, nproc=2)  # the requeue
    assert job.wait() == {HOST.name: 0}, job.output()
    assert "the job before this one ended in a hang at step 12 in forward_backward" in job.output(), job.output()
    resumes = [e for e in read_jsonl(run_dir / "events.jsonl") if e["event"] == "resume"]
    assert len(resumes) == 1 and newest in json.dumps(resumes[0]), (newest, resumes)
    assert losses_by_step(run_dir) == reference


def test_a_rank_stopped_in_a_checkpoint_save_is_named(tmp_path):
    run_dir = tmp_path / "run"
    record, _ = drill(run_dir, "faults.hang_step=10", "faults.hang_rank=1", "faults.hang_phase=checkpoint")
    assert [s["rank"] for s in record["first"]] == [1] and record["cause"] == "stopped_beating", record
    assert record["first"][0]["step"] <= 10 and (record["step"], record["phase"]) == (10, "checkpoint"), record


def test_a_hang_the_watchdog_does_not_judge_ends_at_the_collectives_bound(tmp_path):
    """observe.watchdog.enabled=false: nothing calls the stopped rank, but after the first step the
    collectives' timeout is the bound derived from the measured phase times (here every phase's
    limit is the 1 s floor: 2 s), so rank 0's collective times out, diagnosed the same way."""
    run_dir = tmp_path / "run"
    record, log = drill(run_dir, "faults.hang_step=8", "faults.hang_rank=1", "observe.watchdog.enabled=false",
                        "observe.watchdog.floor_s=1", "observe.watchdog.ceiling_s=3", "ckpt.async_save=false")
    assert record["cause"] == "collective_timeout" and record["exit_code"] == EXIT_REQUEUE, record
    assert [s["rank"] for s in record["first"]] == [1], record
    assert "timed out" in record["why"].lower() and "hang at step 8" in log, (record, log)


SLOW = """
    import time
    from dsslm import loss
    from dsslm.ckpt import store
    # Patched where dsslm.train imports them from: under torchrun it runs as __main__.
    real_write, real_accumulate, real_validation, calls = store._write_file, loss.accumulate, loss.validation_sums, []
    def slow_write(path, chunks):
        if path.name.endswith(".safetensors"):
            time.sleep(3)  # 1.5 x the floor: each rank's tensors, in every save
        return real_write(path, chunks)
    def slow_first_step(*args, **kwargs):
        calls.append(1)
        if len(calls) == 1:
            time.sleep(8)  # 4 x the floor, as compiling every block makes the first step
        return real_accumulate(*args, **kwargs)
    def slow_validation(*args, **kwargs):
        time.sleep(3)  # each domain's validation pass
        return real_validation(*args, **kwargs)
    store._write_file, loss.accumulate, loss.validation_sums = slow_write, slow_first_step, slow_validation
"""


def test_slow_saves_a_slow_first_step_and_evaluation_never_trip_the_watchdog(tmp_path):
    """Under a 2 s floor: saves of 3 s, written synchronously (the whole save is a phase of the
    step loop), a first step of 8 s (compilation; a compiled run at the default limits is
    tests/scenarios/test_compile.py's), and validation never timed before: all longer than the
    floor, where the run may be slow; it ends 0 and no hang is recorded."""
    run_dir = tmp_path / "run"
    env = hook_env(tmp_path / "hook", SLOW)
    job = launch([HOST], run_dir, *RUN, *QUICK, "ckpt.async_save=false", "run.val_every=8",
                 "train.total_steps=16", "ckpt.every=8", nproc=2, env=env)
    assert job.wait() == {HOST.name: 0}, job.output()
    assert not (run_dir / "hangs").exists() and "hang at" not in job.output()
    learned = json.loads((run_dir / "watchdog.json").read_text())["longest"]
    # timed, and saved with the run: a synchronous save's write is its own phase, apart from the snapshot
    assert learned["checkpoint_write"] >= 3 and learned["evaluation"] >= 3, learned


def test_writes_and_evaluations_past_every_limit_wait_while_they_work_and_the_run_ends_0(tmp_path):
    """Production durations at tight limits (floor 2 s, ceiling 4 s), 2 ranks: every checkpoint
    shard written at 0.05 MB/s (about 6 s each, waited for by the next save and at the run's end:
    before, that wait was the snapshot's phase, its limit the floor, exit 75 at every start), and
    validation batches of 0.7 s (a pass past the ceiling). Each outlives its limit while its work
    advances: no hang, one line each saying so, exit 0."""
    run_dir = tmp_path / "run"
    job = launch([HOST], run_dir, *RUN, "observe.watchdog.floor_s=2", "observe.watchdog.beat_s=0.25",
                 "observe.watchdog.ceiling_s=4", "observe.watchdog.first_s=120", "faults.write_mb_s=0.05",
                 "faults.eval_batch_s=0.7", "run.val_every=8", "run.val_batches=4", "train.total_steps=16",
                 "ckpt.every=5", nproc=2)
    assert job.wait() == {HOST.name: 0}, job.output()
    log = job.output()
    assert not (run_dir / "hangs").exists() and "hang at" not in log, log
    assert "still writing" in log and "still scoring" in log, log
    learned = json.loads((run_dir / "watchdog.json").read_text())["longest"]
    assert learned["checkpoint_write"] > 4 > learned["checkpoint"], learned  # the write apart from the snapshot


def test_a_silent_rank_is_named_while_the_watchdog_waits_and_ctrl_c_calls_the_hang_at_once(tmp_path):
    """A rank stopped with a floor of 30 s: the wait is named at a quarter of it; Ctrl-C 0.5 s later
    (a person at the terminal) writes the record, marked interrupted, ends every process (the
    stopped one too) and releases the lock well before the floor, exit 130. It was 60 s of
    silence, and a Ctrl-C in it lost the diagnosis and left ranks and a LOCK behind."""
    import signal
    import time

    from nodes import wait_for
    run_dir = tmp_path / "run"
    job = launch([HOST], run_dir, *RUN, "observe.watchdog.floor_s=30", "observe.watchdog.beat_s=0.25",
                 "observe.watchdog.ceiling_s=60", "observe.watchdog.first_s=120", "faults.hang_step=8",
                 "faults.hang_rank=1", nproc=2)
    wait_for(lambda: "silent for" in job.output(), 60, "the silent rank's line", job)
    assert "rank 1 (" in job.output() and "calling a hang at 30 s" in job.output(), job.output()
    time.sleep(0.5)
    pressed = time.monotonic()
    os.killpg(job.procs[HOST.name].pid, signal.SIGINT)  # the terminal's Ctrl-C: every process of the group
    assert job.wait(timeout_s=60) == {HOST.name: 130}, job.output()
    assert job.ended[HOST.name] - pressed < 20, job.output()  # not the floor's 30 s
    record = the_record(run_dir)
    assert record["interrupted"] == "Ctrl-C" and record["exit_code"] == 130 and record["cause"] == "stopped_beating"
    assert [s["rank"] for s in record["first"]] == [1] and record["time_utc"].endswith("Z")
    assert gone([s["pid"] for s in record["first"] + record["waiting"]]), job.output()
    assert not (run_dir / "LOCK").exists()
    assert "Ctrl-C while the others waited: diagnosed at once, exit 130" in job.output()
