"""Positions in the data stream: which global sequences a step trains on, as pure arithmetic.

The run's data is one stream of global sequence indices g = 0, 1, 2, ... (the loader maps each g
to a chunk of the corpus). A skip list is a set of half-open [start, end) windows of g that are
never fed. A run's position is the next g to consider: a step of B sequences trains the first B
indices at or after the position that lie outside every window, and moves the position past the
last of them. Nothing here depends on the step count or on how big earlier batches were, so a
global batch may change (another world size, a branch, a batch ramp) and the stream still
continues at exactly the next unread sequence, and a skip window keeps naming the same sequences.

The windows here are the skip list's position windows; its data entries (`data.skips`) take
chunks out of the stream, which needs the loader's map from index to chunk (`Loader.stream`).

Rank r of W takes the contiguous share [r*B/W, (r+1)*B/W) of the step's B sequences and computes
only its own indices: `nth` walks the windows once, whatever the world size.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Iterable

import numpy as np


def merge_windows(skip_list: Iterable[Iterable[int]]) -> list[list[int]]:
    """The skip list's canonical form: sorted, disjoint half-open [start, end) windows of global
    sequence indices covering the same indices; touching windows join, empty ones go."""
    merged: list[list[int]] = []
    for start, end in sorted((int(s), int(e)) for s, e in skip_list):
        if not 0 <= start <= end:
            raise ValueError(f"skip window [{start}, {end}) must have 0 <= start <= end; fix skip_list.json")
        if merged and start <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], end)
        elif start < end:
            merged.append([start, end])
    return merged


def nth(start: int, n: int, windows: list[list[int]]) -> int:
    """The n-th (0-based) index at or after `start` outside every window (`windows` merged)."""
    pos, remaining = start, n
    for lo, hi in windows:
        if hi <= pos:
            continue
        if lo > pos:
            gap = lo - pos
            if remaining < gap:
                return pos + remaining
            remaining -= gap
        pos = hi
    return pos + remaining


def take(start: int, count: int, windows: list[list[int]]) -> np.ndarray:
    """The first `count` indices at or after `start` outside every window, ascending (int64)."""
    out = np.empty(count, dtype=np.int64)
    pos, filled = start, 0
    for lo, hi in windows:
        if filled == count:
            break
        if hi <= pos:
            continue
        if lo > pos:
            n = min(lo - pos, count - filled)
            out[filled:filled + n] = np.arange(pos, pos + n, dtype=np.int64)
            filled += n
        pos = max(pos, hi)
    out[filled:] = np.arange(pos, pos + count - filled, dtype=np.int64)
    return out


@dataclass(frozen=True)
class StepSlice:
    """What one step trains on, as seen by one rank."""
    first: int            # the step's first global sequence (metrics.jsonl's data_position)
    end: int              # the position after the step: its last sequence + 1
    batch_size: int       # the step's global batch, in sequences
    indices: np.ndarray   # this rank's sequences, in micro-batch order
    domain_tokens: dict = field(default_factory=dict)  # the whole step's target tokens per domain (the loader's)


def step_slice(position: int, skip_list: list, batch_size: int, rank: int, world_size: int) -> StepSlice:
    """The step starting at `position`: the whole step's bounds, and rank `rank`'s share."""
    return slice_of_merged(position, merge_windows(skip_list), batch_size, rank, world_size)


def slice_of_merged(position: int, windows: list[list[int]], batch_size: int, rank: int,
                    world_size: int) -> StepSlice:
    """`step_slice` of windows already merged (`merge_windows`): the loader merges a skip list
    once per change, not once per step."""
    if batch_size % world_size:
        raise ValueError(f"a global batch of {batch_size} sequences does not split over {world_size} ranks; "
                         "the global batch must be train.micro_batch_size * train.grad_accum * world_size")
    per_rank = batch_size // world_size
    first = nth(position, 0, windows)
    end = nth(position, batch_size - 1, windows) + 1
    mine = take(nth(position, rank * per_rank, windows), per_rank, windows)
    return StepSlice(first=first, end=end, batch_size=batch_size, indices=mine)


def batch_size_at(position: int, full: int, granule: int, ramp_start: int, ramp_tokens: int, seq_len: int) -> int:
    """The global batch (sequences) of the step starting at `position`, under a linear batch ramp.

    From `ramp_start` sequences to `full` over the first `ramp_tokens` tokens of the stream
    (position * seq_len), as GPT-3 and Megatron's --rampup-batch-size do; rounded down to a
    multiple of `granule` (world_size * grad_accum, so every rank gets whole micro-batches) and
    never below one granule. A pure function of the position: a resume mid-ramp continues it.
    `ramp_tokens` 0 (or ramp_start >= full) means no ramp.
    """
    if ramp_tokens <= 0 or ramp_start >= full:
        return full
    fraction = min(1.0, position * seq_len / ramp_tokens)
    target = ramp_start + (full - ramp_start) * fraction
    return max(granule, min(full, granule * math.floor(target / granule)))


def split_micro_batches(count: int, grad_accum: int) -> list[slice]:
    """`count` rows of one rank in `grad_accum` contiguous micro-batches of equal size."""
    if count % grad_accum:
        raise ValueError(f"{count} sequences per rank do not split into train.grad_accum={grad_accum} "
                         "micro-batches; make train.micro_batch_size * train.grad_accum the per-rank batch")
    size = count // grad_accum
    return [slice(i * size, (i + 1) * size) for i in range(grad_accum)]
