"""The per-index epoch orders (`data.permute`): bijections of [0, n) at every n, inverses at 2^40,
mixing measured against a true random permutation, and the streams pinned."""
from __future__ import annotations

import hashlib

import numpy as np
import pytest

from dsslm.data.permute import BlockShuffle, Feistel, order_of, parse_shuffle, round_keys

PRIMES = [2, 3, 5, 7, 11, 13, 251, 257, 509, 1021, 4093, 65521]
SIZES = sorted(set(range(1, 130)) | set(PRIMES) | {2**k for k in range(1, 17)} | {2**k + 1 for k in range(1, 16)})


@pytest.mark.parametrize("n", SIZES)
def test_feistel_is_a_bijection_with_its_inverse_at_every_small_n(n):
    order = Feistel(n, round_keys([n, 3]))
    images = order.at(np.arange(n))
    assert np.array_equal(np.sort(images), np.arange(n))
    assert np.array_equal(order.inverse(images), np.arange(n))


@pytest.mark.parametrize("n,block,window", [(1, 1, 1), (7, 3, 2), (100, 8, 4), (1021, 16, 5), (4096, 64, 8),
                                            (5000, 7, 1000)])
def test_the_block_shuffle_is_a_bijection(n, block, window):
    images = BlockShuffle(n, [1, 2], block, window).at(np.arange(n))
    assert np.array_equal(np.sort(images), np.arange(n))


def test_the_inverse_holds_at_two_to_the_40():
    n = 2**40
    order = Feistel(n, round_keys([7, 0]))
    x = np.random.default_rng(0).integers(0, n, 200_000)
    y = order.at(x)
    assert y.min() >= 0 and y.max() < n
    assert np.array_equal(order.inverse(y), x)
    assert len(np.unique(y)) == len(np.unique(x))  # no two positions share an index


def test_one_flipped_input_bit_flips_each_output_bit_half_the_time():
    """Avalanche: the structure an LCG round leaves (low bits that follow the input's) shows here."""
    bits, n = 20, 2**20
    order = Feistel(n, round_keys([11, 0]))
    x = np.random.default_rng(1).integers(0, n, 20_000)
    base = order.at(x)
    for j in range(bits):
        flipped = order.at(x ^ (1 << j))
        changed = np.unpackbits((base ^ flipped).astype(">u4").view(np.uint8).reshape(-1, 4), axis=1)[:, -bits:]
        per_output_bit = changed.mean(axis=0)
        # 20,000 samples: a fair bit is within 0.5 +- 0.02 with overwhelming probability.
        assert np.abs(per_output_bit - 0.5).max() < 0.03, (j, per_output_bit)


@pytest.mark.parametrize("n", [10_007, 2**17, 2**17 + 3])
def test_displacement_and_neighbours_match_a_true_random_permutation(n):
    """Mean |p(i) - i| / n is 1/3 for a uniform permutation; successive images are uncorrelated, and
    every run of consecutive positions lands evenly over the range (a chi-square per run)."""
    ours = Feistel(n, round_keys([5, 1])).at(np.arange(n))
    true = np.random.default_rng(5).permutation(n)
    for p in (ours, true):
        assert abs(np.abs(p - np.arange(n)).mean() / n - 1 / 3) < 0.01
        assert abs(np.corrcoef(p[:-1], p[1:])[0, 1]) < 0.03
    bins = 16
    chi = [np.sum((np.bincount(p[:4096] * bins // n, minlength=bins) - 4096 / bins) ** 2 / (4096 / bins))
           for p in (ours, true)]
    assert chi[0] < 40 and chi[1] < 40  # 15 degrees of freedom: 40 is p ~ 0.0005


def test_the_streams_are_pinned():
    """A run resumes with the order it saved: these digests change only with a new kind's name."""
    def digest(spec):
        order = order_of(spec, 100_003, [1337, 4])
        return hashlib.sha256(order.at(np.arange(0, 100_003, 7)).astype("<i8").tobytes()).hexdigest()[:16]
    assert [digest(s) for s in ("feistel", "block/64/256", "array")] == PINNED


PINNED = ["94b33c762c633b88", "b7631883d2c482fd", "64454cb2df0e852d"]  # computed with the kinds as they landed


@pytest.mark.parametrize("spec", ["", "feistel/2", "block", "block/0/4", "block/4", "random"])
def test_an_unknown_kind_is_refused(spec):
    with pytest.raises(ValueError):
        parse_shuffle(spec)
