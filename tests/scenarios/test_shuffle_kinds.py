"""The epoch order a run trained with is the one it resumes with: a checkpoint saved before orders
were recorded resumes with numpy's materialised permutation (`array`), bit for bit; a resume asked
to change the order is refused, and a new run reads the per-index Feistel order."""
from __future__ import annotations

import json

import pytest

from dsslm.train import main, train
from helpers import TINY, copy_run_back_to, events, losses_by_step, remanifest, tiny_cfg

pytestmark = pytest.mark.slow


def state_of(run_dir, step: int) -> dict:
    return json.loads((run_dir / "checkpoints" / f"step-{step:08d}" / "state.json").read_text())


@pytest.fixture(scope="module")
def straight(tmp_path_factory):
    """8 steps read in the array order, checkpoints at 4 and 8."""
    run_dir = tmp_path_factory.mktemp("shuffle") / "array"
    assert train(tiny_cfg(run_dir, "train.total_steps=8", "ckpt.every=4", "data.shuffle=array")) == 0
    return run_dir


def test_a_checkpoint_from_before_orders_were_recorded_resumes_in_the_array_order_bit_for_bit(straight, tmp_path):
    old = copy_run_back_to(straight, tmp_path / "old", 4)
    state = json.loads((old / "state.json").read_text())
    assert state["train"].pop("shuffle") == "array"  # as dsslm wrote it before the field existed
    (old / "state.json").write_text(json.dumps(state))
    remanifest(old)
    run_dir = tmp_path / "old"
    assert train(tiny_cfg(run_dir, "train.total_steps=8", "ckpt.every=4")) == 0  # data.shuffle=auto
    resumed, reference = losses_by_step(run_dir), losses_by_step(straight)
    assert [resumed[s] for s in range(5, 9)] == [reference[s] for s in range(5, 9)]
    assert state_of(run_dir, 8)["train"]["shuffle"] == "array"  # recorded from here on


def test_a_resume_that_would_change_the_order_is_refused_in_one_line(straight, tmp_path, capsys):
    run_dir = tmp_path / "again"
    copy_run_back_to(straight, run_dir, 4)
    before = (run_dir / "events.jsonl").read_text()
    assert main([f"run.dir={run_dir}", *TINY, "train.total_steps=8", "data.shuffle=feistel"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "data.shuffle=array order, now feistel" in err[0] and "--allow-drift data.shuffle" in err[0]
    assert (run_dir / "events.jsonl").read_text() == before and not (run_dir / "checkpoints" / "step-00000008").exists()
    # With the user's leave it continues, recording the new order.
    assert main(["--allow-drift", "data.shuffle", f"run.dir={run_dir}", *TINY, "train.total_steps=8",
                 "ckpt.every=4", "data.shuffle=feistel"]) == 0
    assert state_of(run_dir, 8)["train"]["shuffle"] == "feistel"


def test_a_new_run_reads_the_feistel_order_and_keeps_it_on_resume(straight, tmp_path):
    whole = tmp_path / "whole"
    assert train(tiny_cfg(whole, "train.total_steps=8", "ckpt.every=4")) == 0
    assert state_of(whole, 4)["train"]["shuffle"] == "feistel"
    assert losses_by_step(whole)[1] != losses_by_step(straight)[1]  # another order: other first sequences
    run_dir = tmp_path / "resumed"
    copy_run_back_to(whole, run_dir, 4)
    assert train(tiny_cfg(run_dir, "train.total_steps=8", "ckpt.every=4")) == 0
    assert events(run_dir, "resume")[-1]["step"] == 4
    # The resume kept the order: the same stream, the same losses, as the run straight through.
    assert losses_by_step(run_dir) == losses_by_step(whole)
    assert state_of(run_dir, 8)["train"]["shuffle"] == "feistel"
