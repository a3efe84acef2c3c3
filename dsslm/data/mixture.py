"""Mixture weights (`data.mix: {domain: weight}`): the domain of every global sequence, by arithmetic.

The stream of global sequences is cut into blocks of about K = 256. With q_d = K * w_d / sum(w),
the first b blocks hold exactly A_d(b) = floor(q_d * b) sequences of domain d, so block b holds
A_d(b+1) - A_d(b) of them: every domain's share is exact to one sequence at every block boundary,
and a weight too small for one sequence per block still gets its share over many blocks. Block b
starts at P(b) = sum_d A_d(b), which lies in (K*b - D, K*b] for D drawn domains, so the block of a
sequence is one of two candidates: O(D) work, at position 10**9 as at 0. Inside a block the
order of the slots is a permutation seeded by (seed, b), so domains interleave within a micro-batch.

Sequence g in block b, slot s, drawn from domain d, is domain d's sequence number
j = A_d(b) + (how many earlier slots of block b are d's): each domain has its own stream of
sequence numbers, and the loader maps number j to chunk perm_{d,e}[j mod n_d] of that domain's
n_d chunks, e = j // n_d, with a permutation seeded by (seed, d, e): each domain shuffles its own
chunks and repeats on its own schedule (domain d is in its epoch e).

Weights are rounded to parts per million of their total (integers from then on), so the stream is
the same on every machine. Everything is a pure function of (seed, weights, g): independent of
the world size, and a resume needs only the position.
"""
from __future__ import annotations

import collections
import hashlib
import threading

import numpy as np

BLOCK = 256               # K: sequences per block (the shares are exact at every multiple)
WEIGHT_UNITS = 10**6      # weights are kept as integer parts per million of their total
MAX_DOMAINS = BLOCK       # more drawn domains than K could leave a block empty
_BLOCK_SALT = 0x6D6978    # "mix": keeps the block permutations apart from the loader's epoch ones
_CACHED_BLOCKS = 512      # 512 x 256 slots: far more than one step of a large global batch


def weight_units(weights: dict[str, float], domains: list[str]) -> list[int]:
    """Each of `domains`' weight in integer parts per million of the total (0 where not named)."""
    total = sum(weights.values())
    return [round(weights.get(d, 0.0) / total * WEIGHT_UNITS) for d in domains]


def domain_key(name: str) -> int:
    """A domain's seed component: from its name, so adding a domain elsewhere changes nothing."""
    return int.from_bytes(hashlib.sha256(name.encode()).digest()[:8], "little")


class Mixture:
    """Which domain each global sequence is drawn from, and its number in that domain's stream."""

    def __init__(self, units: list[int], seed: int, stage: int = 0):
        if sum(units) <= 0 or min(units) < 0:
            raise ValueError(f"mixture weights {units} must be >= 0 with a positive total")
        if sum(u > 0 for u in units) > MAX_DOMAINS:
            raise ValueError(f"at most {MAX_DOMAINS} domains can have a positive weight")
        self.units, self.total, self.seed = list(units), sum(units), seed
        # Stage 0's blocks are seeded as dsslm seeded a mixture before stages: its streams are unchanged.
        self._stage_entropy = [stage] if stage else []
        self.n_domains = len(units)
        self._blocks: collections.OrderedDict[int, tuple] = collections.OrderedDict()
        self._lock = threading.Lock()  # the prefetch thread and the training thread share the cache

    def before_block(self, b: int) -> list[int]:
        """A_d(b): sequences of each domain in blocks [0, b). Exact integers (Python ints)."""
        return [BLOCK * u * b // self.total for u in self.units]

    def block_start(self, b: int) -> int:
        return sum(self.before_block(b))

    def block_of(self, g: int) -> int:
        b = g // BLOCK  # P(b) <= K*b <= g, and P(b + 2) > K*(b + 2) - D > g
        return b + 1 if g >= self.block_start(b + 1) else b

    def locate(self, indices: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(domain index, that domain's sequence number) of each global sequence index."""
        g = np.asarray(indices, dtype=np.int64)
        blocks = g // BLOCK
        for b in np.unique(blocks):
            mask = blocks == b
            blocks[mask & (g >= self.block_start(int(b) + 1))] += 1
        domains, numbers = np.empty_like(g), np.empty_like(g)
        for b in np.unique(blocks):
            mask = blocks == b
            start, labels, ranks, base = self._block(int(b))
            slots = g[mask] - start
            domains[mask] = labels[slots]
            numbers[mask] = base[labels[slots]] + ranks[slots]
        return domains, numbers

    def count_before(self, g: int) -> np.ndarray:
        """How many sequences of each domain the stream holds before global index `g` (int64)."""
        start, labels, _, base = self._block(self.block_of(g))
        return base + np.bincount(labels[: g - start], minlength=self.n_domains)

    def _block(self, b: int) -> tuple[int, np.ndarray, np.ndarray, np.ndarray]:
        """Block b: its first index, each slot's domain, each slot's rank among its domain's slots
        in the block, and A_d(b)."""
        with self._lock:
            if b in self._blocks:
                self._blocks.move_to_end(b)
                return self._blocks[b]
        before, after = self.before_block(b), self.before_block(b + 1)
        counts = np.array([a - c for a, c in zip(after, before)], dtype=np.int64)
        rng = np.random.Generator(np.random.PCG64(np.random.SeedSequence([self.seed, b, _BLOCK_SALT, *self._stage_entropy])))
        labels = rng.permutation(np.repeat(np.arange(self.n_domains), counts))
        order = np.argsort(labels, kind="stable")  # slots grouped by domain, in slot order
        ranks = np.empty_like(labels)
        ranks[order] = np.arange(len(labels)) - np.repeat(np.cumsum(counts) - counts, counts)
        table = (sum(before), labels, ranks, np.array(before, dtype=np.int64))
        with self._lock:
            self._blocks[b] = table
            while len(self._blocks) > _CACHED_BLOCKS:
                self._blocks.popitem(last=False)
        return table


class StagedMixture:
    """A mixture whose weights change at planned global sequences (`data.mix` as a list of stages).

    Stage k holds the global sequences [S_k, S_k+1) and draws them as a `Mixture` of its own
    weights over its own indices g - S_k (blocks seeded by (seed, block, k)): its shares are exact
    at every block boundary counted from S_k, and it starts and ends exactly at its sequences. A
    domain's sequence numbers run on across stages (stage k adds its count to what the earlier
    stages drew), so a domain never restarts its permutation when its weight changes. A pure
    function of (seed, stages, g): the same at any world size and across resumes, and a planned
    change needs no --allow-drift (the plan is the config)."""

    def __init__(self, stages: list[tuple[int, list[int]]], seed: int):
        if not stages or stages[0][0] != 0 or any(a[0] >= b[0] for a, b in zip(stages, stages[1:])):
            raise ValueError(f"mixture stages {[s for s, _ in stages]} must start at 0 and increase")
        self.starts = np.array([start for start, _ in stages], dtype=np.int64)
        self.stages = [Mixture(units, seed, stage=k) for k, (_, units) in enumerate(stages)]
        self.n_domains = self.stages[0].n_domains
        # A domain is drawn where any stage gives it a weight (Loader: which domains a skip list may empty).
        self.units = [max(column) for column in zip(*(m.units for m in self.stages))]
        self._base = [np.zeros(self.n_domains, dtype=np.int64)]  # each stage's domains' first numbers
        for k in range(1, len(self.stages)):
            drew = self.stages[k - 1].count_before(int(self.starts[k] - self.starts[k - 1]))
            self._base.append(self._base[-1] + drew)

    def stage_of(self, g: np.ndarray | int) -> np.ndarray:
        return np.searchsorted(self.starts, g, side="right") - 1

    def locate(self, indices: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        g = np.asarray(indices, dtype=np.int64)
        stages = self.stage_of(g)
        domains, numbers = np.empty_like(g), np.empty_like(g)
        for k in np.unique(stages):
            mask = stages == k
            d, n = self.stages[k].locate(g[mask] - self.starts[k])
            domains[mask], numbers[mask] = d, n + self._base[k][d]
        return domains, numbers

    def count_before(self, g: int) -> np.ndarray:
        k = int(self.stage_of(g))
        return self._base[k] + self.stages[k].count_before(int(g - self.starts[k]))
