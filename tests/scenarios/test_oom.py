"""Out of memory (health/oom.py), drilled on CPU with the exception CUDA raises
(`faults.oom_step`): exit 77 with a record, an event and one line; the next start halves the
micro-batch, keeps the global batch and trains the same data with the losses of a run at that
micro-batch from the start (within rounding: another accumulation order); at one sequence a
micro-batch, exit 7 (a person's). On 2 gloo ranks, one rank running out ends the job with 77
too: the other sees a lost peer, finds the record, and no hang or node is blamed."""
from __future__ import annotations

import json

import pytest

from dsslm.exits import EXIT_OOM_AT_FLOOR, EXIT_OUT_OF_MEMORY
from dsslm.train import main
from helpers import TINY, events, losses_by_step, read_jsonl
from nodes import HOST, launch

pytestmark = pytest.mark.slow

RUN = ["train.total_steps=16", "ckpt.every=5", "optim.warmup_steps=2"]
LOSS_RTOL = 1e-5  # the same math in another accumulation order: fp32 rounding over a few steps


def run(run_dir, *extra) -> int:
    return main([f"run.dir={run_dir}", *TINY, *RUN, *extra])


def test_out_of_memory_exits_77_and_the_requeue_trains_the_same_data_at_half_the_micro_batch(tmp_path, capsys):
    ran_out = tmp_path / "oom"
    assert run(ran_out, "train.micro_batch_size=4", "faults.oom_step=8") == EXIT_OUT_OF_MEMORY
    err = capsys.readouterr().err
    assert "out of memory at step 8 in forward_backward on rank 0 (micro-batch 4, accumulation 1)" in err
    (event,) = events(ran_out, "oom")
    assert event["exit_code"] == EXIT_OUT_OF_MEMORY and event["micro_batch_size"] == 4
    (record,) = [json.loads(p.read_text()) for p in (ran_out / "oom").glob("*/rank-0.json")]
    assert (record["step"], record["phase"], record["micro_batch_size"]) == (8, "forward_backward", 4)
    assert not events(ran_out, "failed")  # its own event, not a crash's
    # The requeue: the same command; from the newest checkpoint (step 5), at 2 x 2.
    assert run(ran_out, "train.micro_batch_size=4", "faults.oom_step=8") == 0
    assert "training at micro-batch 2 x accumulation 2 (was 4 x 1), the global batch of 4 kept" in capsys.readouterr().out
    starts = events(ran_out, "start")
    assert [(s["step"], s["env"]["micro_batch_size"], s["env"]["grad_accum"]) for s in starts] == [(0, 4, 1), (5, 2, 2)]
    # An uninterrupted run at the smaller micro-batch: the same data, step by step, and its losses.
    smaller = tmp_path / "smaller"
    assert run(smaller, "train.micro_batch_size=2", "train.grad_accum=2") == 0
    position = {r["step"]: r["data_position"] for r in read_jsonl(smaller / "metrics.jsonl") if "data_position" in r}
    mine = {r["step"]: r["data_position"] for r in read_jsonl(ran_out / "metrics.jsonl") if "data_position" in r}
    assert mine == position
    theirs, ours = losses_by_step(smaller), losses_by_step(ran_out)
    assert sorted(ours) == sorted(theirs)
    assert [ours[s] for s in sorted(ours)] == pytest.approx([theirs[s] for s in sorted(theirs)], rel=LOSS_RTOL)


def test_out_of_memory_at_one_sequence_a_micro_batch_needs_a_person(tmp_path, capsys):
    assert run(tmp_path, "train.micro_batch_size=1", "faults.oom_step=3") == EXIT_OOM_AT_FLOOR
    assert "one sequence a micro-batch is the floor" in capsys.readouterr().err
    # Started again as it was: refused before anything is built, with the way out.
    assert run(tmp_path, "train.micro_batch_size=1") == EXIT_OOM_AT_FLOOR
    assert "no smaller micro-batch splits the global batch" in capsys.readouterr().err


def test_one_rank_out_of_memory_ends_the_job_77_and_blames_no_node(tmp_path):
    """Rank 1 alone runs out in step 8; rank 0 waits for it in the step's all-reduce, sees a lost
    peer, finds the record, and leaves with 77 too: no hang record, no node named."""
    run_dir = tmp_path / "run"
    job = launch([HOST], run_dir, *RUN, "train.micro_batch_size=2", "faults.oom_step=8", "faults.oom_rank=1",
                 "observe.watchdog.floor_s=2", "observe.watchdog.beat_s=0.25", nproc=2)
    assert job.wait() == {HOST.name: EXIT_OUT_OF_MEMORY}, job.output()
    assert not (run_dir / "hangs").exists() or not [p for p in (run_dir / "hangs").iterdir()
                                                     if not p.name.startswith(".")], job.output()
    assert [e["exit_code"] for e in events(run_dir, "oom")] == [EXIT_OUT_OF_MEMORY]
    job = launch([HOST], run_dir, *RUN, "train.micro_batch_size=2", nproc=2)
    assert job.wait() == {HOST.name: 0}, job.output()
    assert "training at micro-batch 1 x accumulation 2 (was 2 x 1)" in job.output()
