"""The loader: batches are a pure function of (manifest, seed, data batch); ranks, skips, val."""
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
from dsslm.data.loader import Loader, merge_windows, split_batch

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


def loader(data_dir: Path, seed: int = 0, batch: int = BATCH) -> Loader:
    return Loader(data_dir, SEQ_LEN, seed, batch)


def digest(batch: tuple[torch.Tensor, torch.Tensor]) -> str:
    return hashlib.sha256(batch[0].numpy().tobytes() + batch[1].numpy().tobytes()).hexdigest()


def test_batch_shape_and_shifted_targets(data_dir):
    inputs, targets = loader(data_dir).global_batch(0)
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
        inputs, targets = lo.global_batch(data_batch)
        for row in torch.cat([inputs, targets[:, -1:]], dim=1).numpy().astype(np.uint16):
            assert any(row.tobytes() in shard for shard in shards)


def test_an_epoch_visits_every_chunk_once(data_dir):
    lo = loader(data_dir)
    rows = torch.cat([lo.global_batch(b)[0] for b in range(lo.n_chunks // BATCH)])
    assert len({tuple(r.tolist()) for r in rows}) == len(rows)
    assert lo.n_chunks == sum((e["tokens"] - 1) // SEQ_LEN for d in lo.manifest["domains"].values() for e in d["train"])


def test_same_batch_in_a_fresh_process(data_dir):
    script = ("import hashlib, sys; from dsslm.data.loader import Loader; "
              f"x, y = Loader(sys.argv[1], {SEQ_LEN}, 1234, {BATCH}).micro_batches(37, [[3, 5]], 0, 1, 1)[0]; "
              "print(hashlib.sha256(x.numpy().tobytes() + y.numpy().tobytes()).hexdigest())")
    proc = subprocess.run([sys.executable, "-c", script, str(data_dir)], cwd=ROOT, capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == digest(loader(data_dir, seed=1234).micro_batches(37, [[3, 5]], 0, 1, 1)[0])


@pytest.mark.parametrize("world_size,grad_accum", [(2, 1), (2, 2), (4, 2)])
def test_rank_slices_partition_the_global_batch(data_dir, world_size, grad_accum):
    lo = loader(data_dir, batch=16)
    whole = lo.micro_batches(5, [], 0, 1, 1)[0]
    pieces = [mb for rank in range(world_size) for mb in lo.micro_batches(5, [], rank, world_size, grad_accum)]
    assert len(pieces) == world_size * grad_accum
    assert all(p[0].shape == (16 // world_size // grad_accum, SEQ_LEN) for p in pieces)
    assert torch.equal(torch.cat([p[0] for p in pieces]), whole[0])
    assert torch.equal(torch.cat([p[1] for p in pieces]), whole[1])


def test_indivisible_batch_names_the_keys_to_change(data_dir):
    batch = loader(data_dir).global_batch(0)
    with pytest.raises(ValueError, match="train.grad_accum"):
        split_batch(batch, 0, 2, 3)
    with pytest.raises(ValueError, match="train.micro_batch_size"):
        split_batch(batch, 0, 3, 1)


def test_skip_window_maps_steps_past_it(data_dir):
    lo = loader(data_dir)
    assert [lo.data_batch_index(s, [[3, 5]]) for s in range(6)] == [0, 1, 2, 5, 6, 7]
    assert [lo.data_batch_index(s, [[4, 6], [0, 1], [5, 8]]) for s in range(5)] == [1, 2, 3, 8, 9]
    assert lo.data_batch_index(10, []) == 10
    assert merge_windows([[5, 8], [0, 2], [2, 3], [7, 7]]) == [[0, 3], [5, 8]]
    with pytest.raises(ValueError, match="skip"):
        merge_windows([[4, 2]])


def test_skipped_batches_are_never_served(data_dir):
    lo = loader(data_dir)
    skip_list = [[3, 5], [10, 20], [15, 25], [40, 41]]
    skipped = {digest(lo.global_batch(b)) for s, e in skip_list for b in range(s, e)}
    served = [lo.micro_batches(step, skip_list, 0, 1, 1)[0] for step in range(60)]
    assert not skipped & {digest(b) for b in served}
    assert digest(served[3]) == digest(lo.global_batch(5))


def test_far_step_needs_no_fast_forward(data_dir):
    lo = loader(data_dir)
    started = time.perf_counter()
    batch = lo.micro_batches(100_000, [[3, 5]], 0, 1, 1)[0]
    assert time.perf_counter() - started < 1.0
    assert digest(batch) == digest(loader(data_dir).global_batch(100_002))


def test_seeds_give_different_batches(data_dir):
    assert digest(loader(data_dir, seed=0).global_batch(0)) != digest(loader(data_dir, seed=1).global_batch(0))
    assert digest(loader(data_dir).global_batch(0)) != digest(loader(data_dir).global_batch(1))


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


def test_seq_len_longer_than_every_shard_is_an_error(data_dir):
    with pytest.raises(ValueError, match="model.seq_len"):
        Loader(data_dir, 100_000, 0, 4)
