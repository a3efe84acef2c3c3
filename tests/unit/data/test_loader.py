"""The loader and the stream: sequences are a pure function of (manifest, seed, index); positions,
rank-local shares, skips, the batch ramp, val."""
from __future__ import annotations

import hashlib
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch

from dsslm.data import load_manifest, prepare
from dsslm.data.loader import Loader
from dsslm.data.stream import batch_size_at, merge_windows, nth, split_micro_batches, step_slice, take

from helpers import ROOT
SEQ_LEN, BATCH = 16, 8


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory) -> Path:
    """Two byte domains, ~40k and ~20k tokens, several train shards each."""
    root = tmp_path_factory.mktemp("loader")
    rng = np.random.default_rng(0)
    for name, n_lines in (("prose", 700), ("code", 350)):
        lines = (" ".join(map(str, rng.integers(0, 10**6, 8))) + "\n" for _ in range(n_lines))
        (root / f"{name}.txt").write_text("".join(lines))
        prepare([root / f"{name}.txt"], root / "d", domain=name, val_fraction=0.05, shard_tokens=7_000)
    return root / "d"


def loader(data_dir: Path, seed: int = 0) -> Loader:
    return Loader(data_dir, SEQ_LEN, seed)


def batch_at(lo: Loader, data_batch: int, batch: int = BATCH) -> tuple[torch.Tensor, torch.Tensor]:
    """The sequences [data_batch * batch, (data_batch + 1) * batch) of the stream."""
    return lo.read(np.arange(data_batch * batch, (data_batch + 1) * batch))


def one_rank(lo: Loader, position: int, skip_list: list, batch: int = BATCH):
    return lo.step(position, skip_list, batch, 0, 1, 1)[1][0]


def digest(batch: tuple[torch.Tensor, torch.Tensor]) -> str:
    return hashlib.sha256(batch[0].numpy().tobytes() + batch[1].numpy().tobytes()).hexdigest()


def test_batch_shape_and_shifted_targets(data_dir):
    inputs, targets = batch_at(loader(data_dir), 0)
    assert inputs.shape == targets.shape == (BATCH, SEQ_LEN)
    assert inputs.dtype == targets.dtype == torch.int64
    assert torch.equal(inputs[:, 1:], targets[:, :-1])


def test_chunks_stay_inside_one_shard(data_dir):
    manifest = load_manifest(data_dir)
    shards = [np.fromfile(data_dir / e["path"], dtype=np.uint16).tobytes()
              for d in manifest["domains"].values() for e in d["train"]]
    assert len(shards) > 4
    lo = loader(data_dir)
    for data_batch in range(lo.n_chunks // BATCH):
        inputs, targets = batch_at(lo, data_batch)
        for row in torch.cat([inputs, targets[:, -1:]], dim=1).numpy().astype(np.uint16):
            assert any(row.tobytes() in shard for shard in shards)


def test_an_epoch_visits_every_chunk_once(data_dir):
    lo = loader(data_dir)
    rows = torch.cat([batch_at(lo, b)[0] for b in range(lo.n_chunks // BATCH)])
    assert len({tuple(r.tolist()) for r in rows}) == len(rows)
    assert lo.n_chunks == sum((e["tokens"] - 1) // SEQ_LEN for d in lo.manifest["domains"].values() for e in d["train"])


@pytest.mark.slow
def test_same_batch_in_a_fresh_process(data_dir):
    skip = [[3 * BATCH, 5 * BATCH]]
    script = ("import hashlib, sys; from dsslm.data.loader import Loader; "
              f"x, y = Loader(sys.argv[1], {SEQ_LEN}, 1234).step({37 * BATCH}, {skip}, {BATCH}, 0, 1, 1)[1][0]; "
              "print(hashlib.sha256(x.numpy().tobytes() + y.numpy().tobytes()).hexdigest())")
    proc = subprocess.run([sys.executable, "-c", script, str(data_dir)], cwd=ROOT, capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == digest(one_rank(loader(data_dir, seed=1234), 37 * BATCH, skip))


@pytest.mark.parametrize("world_size,grad_accum", [(2, 1), (2, 2), (4, 2)])
@pytest.mark.parametrize("skip_list", [[], [[83, 86], [90, 91]]])
def test_rank_shares_partition_the_global_batch(data_dir, world_size, grad_accum, skip_list):
    """Each rank computes and reads only its own sequences; together they are the one-rank step, bitwise."""
    lo = loader(data_dir)
    whole = lo.step(80, skip_list, 16, 0, 1, 1)
    pieces = []
    for rank in range(world_size):
        part, micro = lo.step(80, skip_list, 16, rank, world_size, grad_accum)
        assert (part.first, part.end, part.batch_size) == (whole[0].first, whole[0].end, 16)
        pieces += micro
    assert len(pieces) == world_size * grad_accum
    assert all(p[0].shape == (16 // world_size // grad_accum, SEQ_LEN) for p in pieces)
    assert torch.equal(torch.cat([p[0] for p in pieces]), whole[1][0][0])
    assert torch.equal(torch.cat([p[1] for p in pieces]), whole[1][0][1])


def test_rank_local_arithmetic_at_1024_ranks_reads_only_each_ranks_share(data_dir):
    """W = 1024 without 1024 processes: every rank's indices are its contiguous share of the
    step's sequences, the shares partition the step, and a rank reads only its own chunks."""
    world_size, batch, skip_list = 1024, 2048, [[10_000, 10_500], [11_000, 11_001]]
    whole = take(9_000, batch, merge_windows(skip_list))
    shares = [step_slice(9_000, skip_list, batch, rank, world_size) for rank in range(world_size)]
    assert np.array_equal(np.concatenate([s.indices for s in shares]), whole)
    assert all(len(s.indices) == batch // world_size for s in shares)
    assert {(s.first, s.end) for s in shares} == {(9_000, int(whole[-1]) + 1)}
    lo = loader(data_dir)
    for rank in (0, 5, 1023):
        lo.chunks_read = 0
        part, micro = lo.step(9_000, skip_list, batch, rank, world_size, 1)
        assert lo.chunks_read == batch // world_size == micro[0][0].shape[0]
        assert torch.equal(micro[0][0], lo.read(shares[rank].indices)[0])


def test_indivisible_batch_names_the_keys_to_change(data_dir):
    with pytest.raises(ValueError, match="train.grad_accum"):
        split_micro_batches(4, 3)
    with pytest.raises(ValueError, match="train.micro_batch_size"):
        step_slice(0, [], BATCH, 0, 3)


def test_skip_windows_are_passed_over_by_position(data_dir):
    windows = merge_windows([[3, 5]])
    assert [nth(0, k, windows) for k in range(6)] == [0, 1, 2, 5, 6, 7]
    assert take(1, 5, merge_windows([[4, 6], [0, 1], [5, 8]])).tolist() == [1, 2, 3, 8, 9]
    assert nth(10, 0, []) == 10 and nth(4, 0, windows) == 5
    steps = [step_slice(p, [[3 * BATCH, 5 * BATCH]], BATCH, 0, 1) for p in (0, BATCH, 2 * BATCH, 3 * BATCH)]
    assert [(s.first, s.end) for s in steps] == [(0, BATCH), (BATCH, 2 * BATCH), (2 * BATCH, 3 * BATCH),
                                                 (5 * BATCH, 6 * BATCH)]
    assert merge_windows([[5, 8], [0, 2], [2, 3], [7, 7]]) == [[0, 3], [5, 8]]
    with pytest.raises(ValueError, match="skip"):
        merge_windows([[4, 2]])


def test_skipped_sequences_are_never_served(data_dir):
    lo = loader(data_dir)
    skip_list = [[3, 5], [10, 20], [15, 25], [40, 41], [57, 130]]
    skipped = set(range(3, 5)) | set(range(10, 25)) | {40} | set(range(57, 130))
    position, served = 0, []
    for _ in range(30):
        part, _ = lo.step(position, skip_list, BATCH, 0, 1, 1)
        served += part.indices.tolist()
        position = part.end
    assert not skipped & set(served) and len(served) == len(set(served)) == 30 * BATCH
    assert served == sorted(served) and served[:5] == [0, 1, 2, 5, 6]


def test_far_position_needs_no_fast_forward(data_dir):
    lo = loader(data_dir)
    started = time.perf_counter()
    batch = one_rank(lo, 100_000 * BATCH, [[3, 5]])
    assert time.perf_counter() - started < 1.0
    assert digest(batch) == digest(batch_at(loader(data_dir), 100_000))


def test_seeds_give_different_batches(data_dir):
    assert digest(batch_at(loader(data_dir, seed=0), 0)) != digest(batch_at(loader(data_dir, seed=1), 0))
    assert digest(batch_at(loader(data_dir), 0)) != digest(batch_at(loader(data_dir), 1))


def test_batch_ramp_is_linear_in_tokens_and_reaches_the_full_batch():
    seq_len, full, granule, start, tokens = 64, 256, 8, 32, 64_000
    sizes = [batch_size_at(p, full, granule, start, tokens, seq_len) for p in range(0, 2000, 50)]
    assert sizes[0] == 32 and all(b % granule == 0 for b in sizes) and sizes == sorted(sizes)
    assert batch_size_at(tokens // seq_len, full, granule, start, tokens, seq_len) == full  # at the stated tokens
    assert batch_size_at(tokens // seq_len - 8, full, granule, start, tokens, seq_len) < full
    assert batch_size_at(500, full, granule, start, tokens, seq_len) == 8 * ((32 + 224 * 0.5) // 8)
    assert batch_size_at(0, full, granule, 0, 0, seq_len) == full  # no ramp
    assert batch_size_at(0, full, granule, 3, tokens, seq_len) == granule  # never below one granule


def test_val_batches_are_fixed_and_seed_independent(data_dir):
    a, b = loader(data_dir, seed=0), loader(data_dir, seed=99)
    assert a.domains == ["code", "prose"]
    for domain in a.domains:
        va, vb = a.val_batches(domain, 3, 4), b.val_batches(domain, 3, 4)
        assert len(va) == 3 and all(x[0].shape == (4, SEQ_LEN) for x in va)
        assert [digest(x) for x in va] == [digest(x) for x in vb]
        first = a.manifest["domains"][domain]["val"][0]
        tokens = np.fromfile(data_dir / first["path"], dtype=np.uint16)[: SEQ_LEN + 1].astype(np.int64)
        assert va[0][0][0].tolist() == tokens[:-1].tolist() and va[0][1][0].tolist() == tokens[1:].tolist()
    few = a.val_batches("code", 10_000, 64)  # more than the split holds: a short last batch
    assert 0 < len(few) < 10_000 and few[-1][0].shape[0] <= 64
    with pytest.raises(ValueError, match="code, prose"):
        a.val_batches("nope", 1, 1)


@pytest.mark.parametrize("accum, world", [(1, 1), (8, 1), (8, 2), (2, 4)])
def test_the_held_out_batch_is_the_same_sequences_at_any_split(data_dir, accum, world):
    """The spike probe's held-out batch: the first domain's first 16 validation chunks, rank r's
    share in `accum` micro-batches as a training step lays them out; together the ranks hold every
    row once, and every rank counts every rank's real targets (the step's token weighting)."""
    lo = loader(data_dir)
    (want_x, want_y), = lo.val_batches("code", 1, 16)
    shares = [lo.held_out_share(16, accum, rank, world) for rank in range(world)]
    assert {real for _, real in shares} == {int((want_y != -100).sum())}
    assert all(len(batches) == accum and all(len(x) == 16 // (accum * world) for x, _ in batches)
               for batches, _ in shares)
    got_x = torch.cat([x for batches, _ in shares for x, _ in batches])
    got_y = torch.cat([y for batches, _ in shares for _, y in batches])
    assert torch.equal(got_x, want_x) and torch.equal(got_y, want_y)


def test_a_held_out_split_smaller_than_the_batch_is_padded_with_rows_that_count_nothing(data_dir):
    lo = loader(data_dir)
    held = sum(len(x) for x, _ in lo.val_batches("code", 10_000, 64))
    batches, real = lo.held_out_share(held + 6, 1, 1, 2)  # one rank's half of held + 6 rows
    (x, y), = batches
    full = torch.cat([t for _, t in lo.val_batches("code", 10_000, 64)])
    assert real == int((full != -100).sum()) and len(x) == (held + 6) // 2


def test_seq_len_longer_than_every_shard_is_an_error(data_dir):
    with pytest.raises(ValueError, match="model.seq_len"):
        Loader(data_dir, 100_000, 0)


def test_open_shard_maps_are_bounded_and_reads_are_unchanged(data_dir, monkeypatch):
    """Each map holds a file descriptor and a shuffled epoch reads every shard: at most
    MAX_OPEN_SHARDS stay open, the least recently read closed first, and a batch read through
    reopened maps is the same batch. (Before: every shard stayed open; 1,024 shards met the
    usual soft limit of open files.)"""
    import dsslm.data.loader as loader_module
    reference = [digest(batch_at(loader(data_dir), b)) for b in range(6)]
    monkeypatch.setattr(loader_module, "MAX_OPEN_SHARDS", 2)
    lo = loader(data_dir)
    assert len(lo._train) > 4
    assert [digest(batch_at(lo, b)) for b in range(6)] == reference
    assert len(lo._maps) == 2


def test_an_empty_val_shard_is_passed_over(data_dir, tmp_path):
    """A manifest from another tool may list a val shard of 0 tokens (prepare never writes one):
    nothing to read, and an empty file cannot be mapped. (Before: ValueError at the first
    validation.)"""
    import json
    import shutil
    copy = tmp_path / "d"
    shutil.copytree(data_dir, copy)
    manifest = json.loads((copy / "manifest.json").read_text())
    (copy / "prose" / "val-empty.bin").write_bytes(b"")
    manifest["domains"]["prose"]["val"].insert(0, {"path": "prose/val-empty.bin", "tokens": 0, "bytes": 0,
                                                   "sha256": hashlib.sha256(b"").hexdigest()})
    (copy / "manifest.json").write_text(json.dumps(manifest))
    want = Loader(data_dir, SEQ_LEN, 0).val_batches("prose", 2, 4)
    got = Loader(copy, SEQ_LEN, 0).val_batches("prose", 2, 4)
    assert len(got) == len(want) == 2 and all(torch.equal(a[0], b[0]) for a, b in zip(got, want))
