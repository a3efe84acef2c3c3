"""Positions in sequences: the stream continues at exactly the next unread sequence across a change
of global batch (world size, micro-batch, a branch, a ramp), and skip windows keep their meaning."""
from __future__ import annotations

import json

import pytest

from dsslm.recovery.faults import DrillAbort
from dsslm.train import main, train
from helpers import TINY, copy_run_back_to, events, losses_by_step, read_jsonl, remanifest, run_train, tiny_cfg

pytestmark = pytest.mark.slow


def trained_sequences(run_dir) -> list[int]:
    """Global sequence indices of the final trajectory's steps, from metrics.jsonl: a step re-run
    after a resume replaces its earlier record. With no skip window inside a step, a step of
    `batch_sequences` starting at `data_position` trains that contiguous range."""
    by_step = {}
    for r in read_jsonl(run_dir / "metrics.jsonl"):
        if "data_position" in r:
            by_step[r["step"]] = r
    out = []
    for step in sorted(by_step):
        r = by_step[step]
        out += range(r["data_position"], r["data_position"] + r["batch_sequences"])
    return out


@pytest.mark.slow
def test_global_batch_changes_2_to_1_to_2_ranks_train_every_sequence_once(tmp_path):
    run_dir = tmp_path / "run"
    drift = ["--allow-drift", "global_batch_size"]
    # Phase 1: 2 ranks x 2 sequences (B = 4) for 6 steps: sequences [0, 24).
    run_train(run_dir, "train.micro_batch_size=2", "train.total_steps=6", "ckpt.every=6", nproc=2)
    # A window written before the change, in sequences: it must exclude the same sequences after it.
    (run_dir / "skip_list.json").write_text(json.dumps({"schema": 2, "skip_list": [[30, 33]], "rewinds": [],
                                                        "lr_scale": None}))
    # Phase 2: 1 rank x 3 sequences (B = 3) to step 10.
    assert main([*drift, f"run.dir={run_dir}", *TINY, "train.micro_batch_size=3", "train.total_steps=10",
                 "ckpt.every=10"]) == 0
    # Phase 3: 2 ranks x 1 sequence (B = 2) to step 14.
    run_train(run_dir, *drift, "train.micro_batch_size=1", "train.total_steps=14", "ckpt.every=14", nproc=2)
    assert [e["step"] for e in events(run_dir, "resume")] == [6, 10]
    seen = trained_sequences(run_dir)
    # 24 + 12 + 8 sequences, none twice, none missed, the window's three passed over.
    expected = [g for g in range(0, 24 + 12 + 8 + 3) if not 30 <= g < 33]
    assert seen == expected
    positions = {r["step"]: r["data_position"] for r in read_jsonl(run_dir / "metrics.jsonl") if "data_position" in r}
    assert positions[7] == 24 and positions[11] == 36 + 3  # 24 + 4 steps x 3, plus the 3 skipped


def test_branch_with_twice_the_batch_continues_the_parents_stream(tmp_path):
    parent = tmp_path / "parent"
    assert train(tiny_cfg(parent, "train.total_steps=10", "ckpt.every=10")) == 0  # 10 steps x 4: [0, 40)
    child = tmp_path / "child"
    assert train(tiny_cfg(child, "train.total_steps=14", "ckpt.every=14", "train.micro_batch_size=8",
                          f"run.init_from={parent / 'checkpoints' / 'step-00000010'}")) == 0
    branch = events(child, "branch")[0]
    assert "global_batch_size" in branch["drift"] and "continues" in branch["data"]
    records = [r for r in read_jsonl(child / "metrics.jsonl") if "loss" in r]
    assert [(r["step"], r["data_position"], r["batch_sequences"]) for r in records] == \
        [(11, 40, 8), (12, 48, 8), (13, 56, 8), (14, 64, 8)]  # not 10 * 8 = 80: nothing skipped


def test_branch_onto_other_data_starts_at_its_sequence_0_without_the_parents_windows(tmp_path):
    from dsslm.data.__main__ import main as prepare
    parent = tmp_path / "parent"
    assert train(tiny_cfg(parent, "train.total_steps=10", "ckpt.every=10")) == 0
    ckpt = parent / "checkpoints" / "step-00000010"
    state = json.loads((ckpt / "state.json").read_text())
    assert state["train"]["next_sequence"] == 40
    other = tmp_path / "other"
    (tmp_path / "t.txt").write_text("other text for another corpus, repeated enough to train on. " * 400)
    assert prepare(["prepare", "--input", str(tmp_path / "t.txt"), "--out", str(other)]) == 0
    child = tmp_path / "child"
    assert train(tiny_cfg(child, f"data.dir={other}", "train.total_steps=12", "ckpt.every=12",
                          f"run.init_from={ckpt}")) == 0
    branch = events(child, "branch")[0]
    assert "data" in branch["drift"] and "sequence 0" in branch["data"]
    records = [r for r in read_jsonl(child / "metrics.jsonl") if "loss" in r]
    assert [r["data_position"] for r in records] == [0, 4]


def test_batch_ramp_reaches_the_full_batch_at_the_stated_tokens_and_resumes_mid_ramp_bitwise(tmp_path):
    # seq_len 32, full batch 4 (one rank), ramp from 1 over 640 tokens = the first 20 sequences.
    ramp = ["train.batch_ramp.start=1", "train.batch_ramp.tokens=640", "train.total_steps=14", "ckpt.every=3",
            "ckpt.keep_last=10"]
    ref = tmp_path / "ref"
    assert train(tiny_cfg(ref, *ramp)) == 0
    records = [r for r in read_jsonl(ref / "metrics.jsonl") if "loss" in r]
    for r in records:
        want = 4 if r["data_position"] * 32 >= 640 else max(1, int(1 + 3 * r["data_position"] * 32 / 640))
        assert r["batch_sequences"] == want, r
    assert records[0]["batch_sequences"] == 1 and records[-1]["batch_sequences"] == 4
    assert sum(r["batch_tokens"] for r in records) == records[-1]["tokens"] == 32 * sum(
        r["batch_sequences"] for r in records)
    cut = tmp_path / "cut"
    with pytest.raises(DrillAbort):
        train(tiny_cfg(cut, *ramp, "faults.crash_at_step=8", "faults.crash_mode=raise"))
    assert train(tiny_cfg(cut, *ramp)) == 0
    assert events(cut, "resume")[0]["step"] == 6  # mid-ramp: batch 4 is reached at position 20
    assert losses_by_step(cut) == losses_by_step(ref)
    a = [(r["step"], r["data_position"], r["batch_sequences"]) for r in read_jsonl(cut / "metrics.jsonl") if "loss" in r]
    assert sorted(set(a)) == [(r["step"], r["data_position"], r["batch_sequences"]) for r in records]


def downgrade_to_schema_1(folder, batch: int) -> None:
    """Rewrite a checkpoint as dsslm wrote it before positions were in sequences (schema 1)."""
    state = json.loads((folder / "state.json").read_text())
    train_state = state.pop("train")
    train_state["tokens"] = train_state.pop("tokens_seen")
    assert train_state["next_sequence"] % batch == 0
    next_batch = train_state.pop("next_sequence") // batch
    train_state["skip_list"] = [[a // batch, b // batch] for a, b in train_state["skip_list"]]
    state.update(format=1, run=train_state, loader={"next_data_batch": next_batch}, scaler=None,
                 skip_list=train_state["skip_list"])
    del state["schema"]
    (folder / "state.json").write_text(json.dumps(state))
    remanifest(folder)


def test_an_old_checkpoint_with_batch_unit_windows_resumes_to_the_same_data(tmp_path):
    steps = ["train.total_steps=12", "ckpt.every=6"]
    ref = tmp_path / "ref"
    assert train(tiny_cfg(ref, *steps)) == 0
    old = tmp_path / "old"
    folder = copy_run_back_to(ref, old, 6)
    downgrade_to_schema_1(folder, batch=4)
    (old / "skip_list.json").write_text(json.dumps({"skip_list": [[9, 10]], "rewinds": [], "lr_scale": None}))
    assert train(tiny_cfg(old, *steps)) == 0
    assert events(old, "resume")[0]["step"] == 6
    records = {r["step"]: r for r in read_jsonl(old / "metrics.jsonl") if "loss" in r}
    # Step 7 reads batch 6 = sequences [24, 28); old batch 9 = sequences [36, 40) is never fed.
    assert records[7]["data_position"] == 24 and records[9]["data_position"] == 32
    assert records[10]["data_position"] == 40
    assert json.loads((old / "skip_list.json").read_text())["skip_list"] == [[36, 40]]
    ref_losses = losses_by_step(ref)
    assert all(losses_by_step(old)[s] == ref_losses[s] for s in range(7, 10))  # same data, same weights
