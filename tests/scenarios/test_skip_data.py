"""Skipping data, not positions, end to end: a data verdict's chunks never come back in the next
epoch, and a skip list of data entries feeds the same batches on 1 and 2 ranks."""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from dsslm.data import prepare
from dsslm.data.loader import Loader
from dsslm.train import train
from helpers import one_thread  # noqa: F401  (autouse here: every run on one thread)
from helpers import events, read_jsonl, run_train, stdlib_sources, tiny_cfg

# As tests/scenarios/test_triage.py: a constant learning rate, batches of 16; a repeated 4-gram
# in data batches 40..42 is a data spike by step 41.
RUN = ["model.d_model=64", "optim.peak_lr=3e-3", "optim.min_lr=3e-3", "train.micro_batch_size=16",
       "ckpt.every=5", "ckpt.keep_last=3", "monitor.min_history=10", "monitor.window=20",
       "monitor.rewind_margin_steps=2", "observe.every=0"]
B = 16


@pytest.fixture(scope="module")
def small_data(tmp_path_factory) -> Path:
    """~30 KB of stdlib source, one document per file: an epoch of about 58 steps of 16 x 32 tokens."""
    root = tmp_path_factory.mktemp("small")
    prepare([stdlib_sources(root / "src")], root / "data", domain="code", val_fraction=0.02)
    return root / "data"


@pytest.mark.slow
@pytest.mark.parametrize("batches", [3, 1])
def test_poisoned_chunks_skipped_in_epoch_1_are_never_fed_in_epoch_2(small_data, tmp_path, batches):
    """3 poisoned batches: a streak, triaged by replay. 1: an isolated outlier whose in-place
    re-run reproduces it. Every sequence of either is one 4-gram repeated, its loss the history's:
    named by its text (`recovery.reach.repeated`), never fed again, in the next epoch either.
    Before, the single batch's verdict was `unknown` (its loss concentrated in no few sequences):
    the step was skipped, nothing named, and the drill's batch came back in the next epoch."""
    lo = Loader(small_data, 32, 1337)
    epoch = lo.n_chunks // B
    assert 45 < epoch < 80
    steps = 2 * epoch + 5
    run_dir = tmp_path / "run"
    assert train(tiny_cfg(run_dir, *RUN, f"data.dir={small_data}", f"train.total_steps={steps}",
                          f"faults.repeat_batches=[[40,{40 + batches}]]")) == 0
    decisions = [e for e in events(run_dir, "triage")]
    if batches == 1:
        assert [(d["scope"], d["target"], d["verdict"]) for d in decisions] == [("step", 41, "data")]
        assert not events(run_dir, "rewind")
    else:
        # The streak's steps re-run in place name their text too; the triage's verdict is data.
        assert [(d["scope"], d["verdict"]) for d in decisions][-1] == ("window", "data")
        assert {d["verdict"] for d in decisions} == {"data"}
    assert max(d["target"] for d in decisions) <= 45
    assert not [e for e in events(run_dir, "skip") + events(run_dir, "rewind") if e["step"] > 45]
    state = json.loads((run_dir / "checkpoints" / f"step-{steps:08d}" / "state.json").read_text())
    skip = state["skip_list"]
    poisoned = set(lo.chunk_ids(np.arange(40 * B, (40 + batches) * B)).tolist())
    assert set(lo.skipped_chunks(skip).tolist()) == poisoned
    # Every step of the second epoch: its chunks, from its position and the skip list.
    later = [r["data_position"] for r in read_jsonl(run_dir / "metrics.jsonl")
             if "data_position" in r and r["data_position"] >= lo.n_chunks]
    assert len(later) > epoch - 5
    for position in later:
        fed, _ = lo.step(position, skip, B, 0, 1, 1)
        assert not poisoned & set(lo.chunk_ids(fed.indices).tolist())
    assert [e["epoch"] for e in events(run_dir, "domain_epoch")][:1] == [1]


def positions_and_losses(run_dir: Path) -> list[tuple]:
    return [(r["data_position"], r["batch_sequences"], r["loss"]) for r in read_jsonl(run_dir / "metrics.jsonl")
            if "loss" in r]


@pytest.mark.slow
def test_a_data_skip_list_feeds_the_same_batches_on_1_and_2_ranks(small_data, tmp_path):
    """skip_list.json with data entries (and an old window) before the first step: both runs feed
    the same sequences, so positions match exactly and losses to float rounding."""
    lo = Loader(small_data, 32, 1337)
    skip = lo.data_entries(np.array([3, 9, 10, 30])) + [[20, 22]]
    common = ["train.total_steps=6", "ckpt.every=3", "train.micro_batch_size=2", "train.grad_accum=2",
              f"data.dir={small_data}", "data.prefetch=true"]
    runs = {}
    for nproc in (1, 2):
        run_dir = tmp_path / f"ranks{nproc}"
        run_dir.mkdir()
        (run_dir / "skip_list.json").write_text(json.dumps({"schema": 2, "skip_list": skip, "rewinds": [],
                                                            "lr_scale": None}))
        # The same global batch of 8 on both: 2 x 2 x 2 ranks, or 2 x 4 on one.
        extra = ["train.grad_accum=4"] if nproc == 1 else []
        run_train(run_dir, *common, *extra, nproc=nproc)
        runs[nproc] = positions_and_losses(run_dir)
    one, two = runs[1], runs[2]
    # Sequences 3, 9, 10 are skipped in the first two steps, then 20, 21 and 30.
    assert [p for p, _, _ in one] == [p for p, _, _ in two] == [0, 11, 19, 29, 38, 46]
    assert np.allclose([loss for *_, loss in one], [loss for *_, loss in two], rtol=1e-5, atol=0)
    state = json.loads((tmp_path / "ranks2" / "checkpoints" / "step-00000006" / "state.json").read_text())
    assert state["skip_list"] == skip[-1:] + skip[:-1]  # canonical: windows first
