"""The goodput ledger of a real tiny run: killed, resumed, validated; every part where it belongs."""
from __future__ import annotations

import pytest

from dsslm.observe.goodput import PARTS, TOLERANCE, write_goodput
from dsslm.recovery.faults import DrillAbort
from dsslm.train import train
from helpers import read_jsonl, tiny_cfg

STEPS = ("train.total_steps=24", "ckpt.every=10", "run.val_every=8")


def test_ledger_of_a_killed_and_resumed_run(tmp_path):
    run_dir = tmp_path / "run"
    with pytest.raises(DrillAbort):  # killed after step 16: steps 11-16 are trained again
        train(tiny_cfg(run_dir, *STEPS, "faults.crash_at_step=16", "faults.crash_mode=raise"))
    assert train(tiny_cfg(run_dir, *STEPS)) == 0
    result = write_goodput(run_dir)
    parts, wall = result["parts"], result["wall_s"]
    print(result)
    assert set(parts) == set(PARTS) and sum(parts.values()) == pytest.approx(wall, abs=0.01)
    assert abs(parts["other"]) <= TOLERANCE * wall
    assert result["restarts"] == 1 and result["steps"] == {"executed": 30, "standing": 24}
    for name in ("productive", "recomputed", "checkpoint", "evaluation", "startup", "between_starts"):
        assert parts[name] > 0, name
    assert parts["hang_detection"] == 0
    steps = {r["step"]: r for r in read_jsonl(run_dir / "metrics.jsonl") if "loss" in r}
    assert all(isinstance(r["time"], float) for r in steps.values())
    assert parts["productive"] > parts["recomputed"]


def test_a_rewind_is_recomputed_time_and_the_parts_still_add_up(tmp_path):
    """A poisoned window rewinds the run (the plain policy): the steps it threw away and the replay
    are `recomputed`, and the parts add up to the wall time within the tolerance."""
    run_dir = tmp_path / "run"
    assert train(tiny_cfg(run_dir, "train.total_steps=60", "ckpt.every=5", "monitor.triage=false",
                          "monitor.min_history=15", "monitor.window=30", "optim.peak_lr=3e-3",
                          "faults.poison_batches=[[40,44]]")) == 0
    result = write_goodput(run_dir)
    parts, wall = result["parts"], result["wall_s"]
    assert result["rewinds"] >= 1 and result["steps"]["executed"] > result["steps"]["standing"] == 60
    assert parts["recomputed"] > 0 and sum(parts.values()) == pytest.approx(wall, abs=0.01)
    assert abs(parts["other"]) <= TOLERANCE * wall
