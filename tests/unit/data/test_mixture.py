"""Mixture weights: each global sequence's domain drawn by weight, a pure function of (seed,
weights, index): exact shares per block, independent of the world size, each domain its own
permutation and epochs; without a mix, today's stream bit for bit."""
from __future__ import annotations

import hashlib
import time

import numpy as np
import pytest
import torch

from dsslm.data import DataError, prepare
from dsslm.data.loader import Loader
from dsslm.data.mixture import BLOCK, Mixture, weight_units

SEQ_LEN = 16
MIX = {"big": 0.2, "mid": 0.3, "tiny": 0.5}


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory):
    """Three byte domains of ~3,700, ~1,200 and ~190 chunks of 17 tokens."""
    root = tmp_path_factory.mktemp("mixture")
    rng = np.random.default_rng(7)
    for name, n_lines in (("big", 1200), ("mid", 400), ("tiny", 60)):
        lines = (" ".join(map(str, rng.integers(0, 10**6, 8))) + "\n" for _ in range(n_lines))
        (root / f"{name}.txt").write_text("".join(lines))
        prepare([root / f"{name}.txt"], root / "d", domain=name, val_fraction=0.05, shard_tokens=11_000)
    return root / "d"


def domains_of(lo: Loader, start: int, count: int) -> np.ndarray:
    return lo._domain_index(np.arange(start, start + count, dtype=np.int64))


@pytest.mark.parametrize("start", [0, 12_345, 10**9 + 7])
def test_shares_over_10000_sequences_are_within_2_points_of_the_weights(data_dir, start):
    lo = Loader(data_dir, SEQ_LEN, seed=5, mix=MIX)
    shares = np.bincount(domains_of(lo, start, 10_000), minlength=3) / 10_000
    assert np.abs(shares - [MIX[d] for d in lo.domains]).max() < 0.02, shares


def test_every_block_boundary_holds_the_exact_apportionment():
    units = weight_units({"a": 1.0, "b": 2.0, "c": 1e-3}, ["a", "b", "c"])
    mix = Mixture(units, seed=0)
    for b in (1, 7, 40, 10**6, 10**9):
        g = mix.block_start(b)
        counts = mix.count_before(g)
        assert counts.tolist() == [BLOCK * u * b // sum(units) for u in units]
        assert g - BLOCK * b in range(-2, 1)  # within the number of domains of K * b
    # A weight too small for one sequence per block still gets its share over many blocks.
    assert mix.count_before(mix.block_start(40_000))[2] == BLOCK * units[2] * 40_000 // sum(units) > 0


def test_each_domain_numbers_its_sequences_without_gaps_or_repeats():
    mix = Mixture([3, 1, 6], seed=11)
    domains, numbers = mix.locate(np.arange(5_000, dtype=np.int64))
    for d in range(3):
        assert np.array_equal(numbers[domains == d], np.arange((domains == d).sum()))
    for g in (0, 1, 255, 256, 257, 1234, 4999):
        assert mix.count_before(g).tolist() == np.bincount(domains[:g], minlength=3).tolist()
    shuffled = np.random.default_rng(0).permutation(5_000)  # any order, any blocks: the same answer
    d2, n2 = mix.locate(shuffled)
    assert np.array_equal(d2, domains[shuffled]) and np.array_equal(n2, numbers[shuffled])


@pytest.mark.parametrize("world_size,grad_accum", [(2, 1), (4, 2)])
def test_rank_shares_are_the_one_rank_step_bitwise(data_dir, world_size, grad_accum):
    lo = Loader(data_dir, SEQ_LEN, seed=5, mix=MIX)
    skip = [[130, 150]]
    whole_fed, whole = lo.step(100, skip, 64, 0, 1, 1)
    parts = [lo.step(100, skip, 64, r, world_size, grad_accum) for r in range(world_size)]
    assert all(p[0].domain_tokens == whole_fed.domain_tokens for p in parts)
    assert sum(whole_fed.domain_tokens.values()) == 64 * SEQ_LEN
    assert torch.equal(torch.cat([x for _, micro in parts for x, _ in micro]), whole[0][0])


def test_a_domain_shuffles_its_own_chunks_and_counts_its_epochs(data_dir):
    lo = Loader(data_dir, SEQ_LEN, seed=5, mix=MIX)
    tiny = lo.domains.index("tiny")
    n_tiny = int(lo.domain_chunks[tiny])
    first, last = int(lo._domain_first[tiny]), int(lo._domain_first[tiny + 1])
    g = np.arange(0, 3 * n_tiny, dtype=np.int64)  # tiny has half the weight: about 1.5 passes
    domains, numbers = lo.mixture.locate(g)
    chunks = lo._chunk_ids(g)
    mine = chunks[domains == tiny]
    assert ((mine >= first) & (mine < last)).all()
    assert sorted(mine[:n_tiny].tolist()) == list(range(first, last))  # epoch 0: every chunk once
    again = mine[n_tiny:]
    assert len(again) > 50 and not np.array_equal(again, mine[: len(again)])  # epoch 1 is reshuffled
    crossing = int(g[domains == tiny][n_tiny])  # the first sequence of tiny's second pass
    assert lo.epochs_before(crossing)["tiny"] == 0 and lo.epochs_before(crossing + 1)["tiny"] == 1
    assert lo.epochs_before(crossing + 1)["big"] == 0
    rows = lo.read(g[domains == tiny][:50])[0]  # the rows are tiny's text
    tiny_tokens = np.concatenate([np.fromfile(data_dir / e["path"], dtype=np.uint16)
                                  for e in lo.manifest["domains"]["tiny"]["train"]]).tobytes()
    assert all(r.numpy().astype(np.uint16).tobytes() in tiny_tokens for r in rows)


def test_far_positions_cost_what_near_ones_cost(data_dir):
    lo = Loader(data_dir, SEQ_LEN, seed=5, mix=MIX)
    started = time.perf_counter()
    fed, _ = lo.step(10**12, [[10**12 + 5, 10**12 + 9]], 64, 3, 4, 2)
    lo.epochs_before(10**12)
    assert time.perf_counter() - started < 1.0 and fed.end == 10**12 + 68


@pytest.mark.parametrize("mix", [None, MIX])
def test_tokens_before_a_position_are_the_sum_of_the_steps_tokens(data_dir, mix):
    lo = Loader(data_dir, SEQ_LEN, seed=5, mix=mix)
    skip = [[10, 30], [77, 78], [5_000, 5_100]]
    total, position = dict.fromkeys(lo.domains, 0), 0
    for _ in range(90):  # past one whole epoch of the corpus without a mix
        fed, _ = lo.step(position, skip, 64, 0, 1, 1)
        total = {d: total[d] + fed.domain_tokens[d] for d in total}
        position = fed.end
    assert lo.domain_tokens_before(position, skip) == total


def test_without_a_mix_the_stream_is_the_one_before_mixtures_bit_for_bit(data_dir):
    """Digests of steps read by the loader as it was before data.mix existed (same data, seed 5),
    under the epoch order dsslm had then (data.shuffle's `array` kind, which old runs resume with)."""
    digests = []
    for lo in (Loader(data_dir, SEQ_LEN, seed=5, shuffle="array"),
               Loader(data_dir, SEQ_LEN, seed=5, mix={}, shuffle="array")):
        for position in (0, 4_000, 10**9):
            _, micro = lo.step(position, [[30, 40]], 32, 1, 2, 2)
            digests.append(hashlib.sha256(b"".join(x.numpy().tobytes() + y.numpy().tobytes()
                                                   for x, y in micro)).hexdigest()[:16])
    assert digests == GOLDEN * 2


# Computed with the loader of main at f7c4994 (before data.mix), on this fixture as prepare writes it
# since 323b8f9 (a document cut off by a val block ends with an EOS; before it: 52ead348381b677e,
# 4bf7aa53ed6d555d, e3bddd8e796c2dad, which today's loader gives on the old prepare's data too).
GOLDEN = ["0bd33bba46356b5d", "66da99b234c2eb1d", "3bd3e81d70a2fe7d"]


def test_a_mix_naming_a_domain_the_data_lacks_names_the_domains_it_has(data_dir):
    with pytest.raises(DataError, match=r"data.mix names domain 'web'.*big, mid, tiny"):
        Loader(data_dir, SEQ_LEN, seed=5, mix={"big": 1.0, "web": 1.0})


def test_without_a_mix_every_domain_repeats_when_the_corpus_does(data_dir):
    lo = Loader(data_dir, SEQ_LEN, seed=5)
    assert lo.epochs_before(lo.n_chunks) == {"big": 0, "mid": 0, "tiny": 0}  # the last sequence of pass 0
    assert lo.epochs_before(lo.n_chunks + 1) == {"big": 1, "mid": 1, "tiny": 1}
