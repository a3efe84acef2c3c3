"""The skip list: half-open [start, end) windows of data-batch indices that are never fed again."""
from __future__ import annotations

from typing import Iterable


def merge_windows(skip_list: Iterable[Iterable[int]]) -> list[list[int]]:
    """Sorted, disjoint windows covering the same indices; touching windows join, empty ones go."""
    merged: list[list[int]] = []
    for start, end in sorted((int(s), int(e)) for s, e in skip_list):
        if not 0 <= start <= end:
            raise ValueError(f"skip window [{start}, {end}) must have 0 <= start <= end; fix skip_list.json")
        if merged and start <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], end)
        elif start < end:
            merged.append([start, end])
    return merged
