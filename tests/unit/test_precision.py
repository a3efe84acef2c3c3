"""Mixed precision end to end on CPU: bf16 keeps fp32 masters; fp16 skips and counts overflows."""
import json

import pytest
import torch
from safetensors.torch import load_file

from dsslm.train import train
from helpers import events, read_jsonl, tiny_cfg

pytestmark = pytest.mark.slow


def run(run_dir, *extra):
    assert train(tiny_cfg(run_dir, "train.total_steps=30", "ckpt.every=1", "ckpt.keep_last=70", *extra)) == 0
    return [r for r in read_jsonl(run_dir / "metrics.jsonl") if "loss" in r]


def test_bf16_trains_with_fp32_master_weights_and_moments(tmp_path):
    records = run(tmp_path, "train.precision=bf16")
    assert records[-1]["loss"] < records[0]["loss"] - 0.5
    model = load_file(tmp_path / "checkpoints" / "step-00000030" / "model.safetensors")
    optim = load_file(tmp_path / "checkpoints" / "step-00000030" / "optim.safetensors")
    assert {t.dtype for t in model.values()} == {torch.float32}
    assert {t.dtype for k, t in optim.items() if not k.startswith("step/")} == {torch.float32}


def test_fp16_overflow_steps_are_skipped_counted_and_change_nothing(tmp_path):
    # A scale of 2^40 overflows fp16 activation gradients (max 65504): the scaler halves it
    # after each overflow until the gradients fit.
    records = run(tmp_path, "train.precision=fp16", "train.loss_scale_init=1099511627776",
                  "train.total_steps=60")
    skipped = [r["step"] for r in records if r["verdict"] == "skip_step"]
    assert skipped and skipped == list(range(1, len(skipped) + 1))  # the first steps, in a row
    assert all("fp16_overflow" in e["reason"] for e in events(tmp_path, "skip"))
    assert records[0]["reason"] == f"fp16_overflow (loss scale now {2.0 ** 39:g})"  # the scale step 2 runs with
    state = json.loads((tmp_path / "checkpoints" / "step-00000060" / "state.json").read_text())
    assert state["scaler"]["overflows"] == len(skipped)
    assert state["scaler"]["scale"] == 2.0 ** (40 - len(skipped))
    last_skip = tmp_path / "checkpoints" / f"step-{skipped[-1]:08d}"
    first = tmp_path / "checkpoints" / "step-00000001"
    for name in ("model.safetensors", "optim.safetensors"):
        a, b = load_file(first / name), load_file(last_skip / name)
        assert all(torch.equal(a[k], b[k]) for k in a)
    assert records[-1]["loss"] < records[len(skipped)]["loss"] - 0.3  # then it trains


def test_fp16_a_non_finite_loss_is_never_applied_without_a_monitor(tmp_path):
    """An overflow whose loss is NaN too went to the monitor for its verdict; with the monitor
    off that verdict was OK, and the NaN gradients were applied: NaN weights for good."""
    records = run(tmp_path, "train.precision=fp16", "monitor.enabled=false", "faults.nan_steps=[4]",
                  "train.total_steps=8")
    assert [r["verdict"] for r in records] == ["ok"] * 3 + ["skip_step"] + ["ok"] * 4
    assert "fp16_overflow" in records[3]["reason"]
    assert all(r["loss"] == r["loss"] for r in records[4:])  # finite: the weights were kept
    before = load_file(tmp_path / "checkpoints" / "step-00000003" / "model.safetensors")
    after = load_file(tmp_path / "checkpoints" / "step-00000004" / "model.safetensors")
    assert all(torch.equal(before[k], after[k]) for k in before)
