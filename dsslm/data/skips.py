"""Skip lists that name data: what the loader never feeds again, and how a bad batch is narrowed.

A skip list (state.json `skip_list`, run.dir/skip_list.json) holds two kinds of entry:

    [start, end]                          a window of the data stream: the half-open range of
                                          global sequence indices [start, end) is never fed
                                          (what every version before this one wrote; it keeps
                                          exactly that meaning)
    {"shard": PATH, "tokens": [a, b]}     data: the tokens [a, b) of the train shard PATH (as
                                          manifest.json names it). Every chunk of the shard with
                                          a prediction inside the range (a token and the next
                                          both in [a, b)) is never fed again, in any epoch, at
                                          any world size and global batch: its slot in the stream
                                          goes to the next sequence the stream would feed.
    ... "from_step": S                    (optional) the entry applies to steps S and later: the
                                          run trained on that data before its verdict, so a
                                          catch-up from an older checkpoint (after a restart)
                                          feeds it where the run did (`active_at`). A rewind to
                                          step C moves it to C + 1 (`restamp`): a new pass never
                                          feeds data already known bad. Without it: every step.

A window names positions, so the chunks it covered come back in the next epoch's shuffle; a data
entry names the text itself. The loader maps entries to chunk ids (`Loader.skipped_chunks`), so
the batch stays a pure function of (seed, position, skip list) on every rank.

`offending` narrows a spiking batch to the sequences whose loss stood out (`OUTLIER_Z`);
`concentrated` asks whether those few explain the spike (data) or the whole batch rose (state).
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, Callable, Iterable

import numpy as np

from dsslm.data.stream import merge_windows

# A sequence is offending when its mean loss per token is this many robust standard deviations
# (1.4826 x MAD: the std of a normal sample) from the batch's median, either side: a poisoned
# sequence (random tokens) stands far above, a repeated n-gram can sit far below. A threshold
# this high keeps a clean batch's spread (different documents, domains) from naming anything.
OUTLIER_Z = 6.0
# A document is named up to this many tokens on either side of an offending sequence: a whole
# book (~100-500K tokens), but not a whole shard where a file of one huge document has its only
# EOS at the end. In tokens, not chunks: 64 chunks was 4K tokens at seq_len 64, and the bench's
# scattered 15K-token document kept coming back after its verdict named half of it.
DOCUMENT_TOKENS = 1 << 20
# Narrowing needs a batch to stand for "normal": fewer sequences than this are never narrowed,
# and the robust scale is at least SCALE_FLOOR x the median (a batch that is all noise has a tiny
# MAD, and one of its sequences must not look like the lone outlier).
MIN_SEQUENCES = 8
SCALE_FLOOR = 0.05


def is_window(entry: Any) -> bool:
    return isinstance(entry, (list, tuple))


def windows_of(skip_list: Iterable) -> list[list[int]]:
    """The position windows of a skip list, merged (`merge_windows`)."""
    return merge_windows([e for e in skip_list if is_window(e)])


def entries_of(skip_list: Iterable) -> list[dict]:
    """The data entries of a skip list, merged: sorted by (shard, from_step, start); ranges of one
    shard and one from_step that overlap by at least one token are joined (touching ones are not:
    that would name the chunk whose one prediction crosses from one range into the other)."""
    ranges: dict[tuple[str, int], list[list[int]]] = {}
    for e in skip_list:
        if is_window(e):
            continue
        a, b = int(e["tokens"][0]), int(e["tokens"][1])
        if not 0 <= a <= b:
            raise ValueError(f"skip entry {e!r}: tokens must be [a, b) with 0 <= a <= b; fix skip_list.json")
        if b - a >= 2:  # fewer than two tokens hold no prediction: the entry names nothing
            ranges.setdefault((str(e["shard"]), int(e.get("from_step", 0))), []).append([a, b])
    out: list[dict] = []
    for shard, since in sorted(ranges):
        merged: list[list[int]] = []
        for a, b in sorted(ranges[(shard, since)]):
            if merged and a < merged[-1][1]:
                merged[-1][1] = max(merged[-1][1], b)
            else:
                merged.append([a, b])
        out += [{"shard": shard, "tokens": r, **({"from_step": since} if since else {})} for r in merged]
    return out


def stamp(entries: Iterable, step: int) -> list:
    """`entries` applying from step `step` on (`from_step`); windows (positions) and entries that
    carry a step already are left as they are."""
    return [e if is_window(e) or "from_step" in e else {**e, "from_step": int(step)} for e in entries]


def restamp(skip_list: Iterable, step: int) -> list:
    """A new pass from step `step - 1` (a rewind's restore): entries that would apply only later
    apply from `step`, so known bad data is never fed again, and the run, a resumed run and the
    catch-up of either do the same."""
    return [{**e, "from_step": int(step)} if not is_window(e) and e.get("from_step", 0) > step else e
            for e in skip_list]


_active: tuple = ()  # ((list, its length, step threshold, active list), ...), newest first
_latest: tuple = ()  # (list, its length, its sorted from_steps)


def active_at(skip_list: list, step: int) -> list:
    """The entries of `skip_list` that apply to step `step`: windows, entries without a
    `from_step`, and those from `step` or before. The list itself when all apply (the common
    case, so the loader's merged view stays cached), else one list per threshold crossed."""
    global _active, _latest
    if not (_latest and _latest[0] is skip_list and _latest[1] == len(skip_list)):
        stamps = sorted({e["from_step"] for e in skip_list if not is_window(e) and "from_step" in e})
        _latest = (skip_list, len(skip_list), stamps)  # once per change of the list, not every step
    stamps = _latest[2]
    if not stamps or stamps[-1] <= step:
        return skip_list
    later = [s for s in stamps if s > step]
    if not later:
        return skip_list
    threshold = later[0]  # the active list is the same for every step before the next stamp
    for source, length, mark, active in _active:
        if source is skip_list and length == len(skip_list) and mark == threshold:
            return active
    active = [e for e in skip_list if is_window(e) or e.get("from_step", 0) <= step]
    _active = ((skip_list, len(skip_list), threshold, active), *_active)[:4]
    return active


def merge_skip_list(skip_list: Iterable) -> list:
    """The skip list's canonical form: merged windows first, then merged data entries."""
    skip_list = list(skip_list)
    return windows_of(skip_list) + entries_of(skip_list)


@dataclass(frozen=True)
class SkipView:
    """A skip list merged once: its windows (`windows_of`), its data entries (`entries_of`), both
    together (`merged`, what `merge_skip_list` gives) and `key` (`merged` as compact JSON: a
    hashable, order-free key of what the list skips, for the prefetcher). Read only."""
    windows: list
    entries: list
    merged: list
    key: str


_VIEWS = 4  # the loop's list and the merged lists of the views it made: a few are enough
_views: tuple = ()  # ((list, its length, its view), ...), newest first; replaced whole (threads)


def view_of(skip_list: list) -> SkipView:
    """`skip_list` merged, once per change: merging and keying 50K entries costs ~0.4 s, and the
    loop hands the same list to the prefetcher and the loader every step. A list is known again by
    its identity and length: skip lists are replaced whole when they change (`state.skip_list =
    merge_skip_list(...)`), never edited in place but by growing (which its length shows). The
    view's own `merged` list maps to the same view (merging is idempotent)."""
    global _views
    views = _views
    for source, length, view in views:
        if source is skip_list and length == len(skip_list):
            return view
    windows, entries = windows_of(skip_list), entries_of(skip_list)
    merged = windows + entries
    view = SkipView(windows, entries, merged, json.dumps(merged, separators=(",", ":")))
    # The cache holds each source: its id cannot be reused by another list while it is here.
    _views = ((skip_list, len(skip_list), view), (merged, len(merged), view), *views)[:_VIEWS]
    return view


def chunk_range(a: int, b: int, seq_len: int, n_chunks: int) -> tuple[int, int]:
    """The chunks [lo, hi) of a shard (chunk j = tokens [j*L, j*L + L + 1)) with a prediction
    inside tokens [a, b): both tokens of some pair (t, t+1) in the range."""
    lo = -(-(a + 1) // seq_len) - 1  # the smallest j with j*L + L + 1 >= a + 2
    hi = (b - 2) // seq_len + 1       # one past the largest j with j*L + 2 <= b
    return max(0, lo), max(0, min(n_chunks, hi))


def offending(losses: np.ndarray, z: float = OUTLIER_Z) -> np.ndarray:
    """Which sequences of a spiking batch to blame, from their mean losses per token (a bool mask).

    A non-finite loss is always offending. A finite one is when |loss - median| > z x scale, the
    scale being 1.4826 x MAD of the batch's finite losses but at least SCALE_FLOOR x |median|. A
    batch of fewer than MIN_SEQUENCES is not narrowed. When that blames nothing, or more than a quarter of the batch
    (outliers are few; a median cannot stand for a batch that is largely bad, and would blame its
    good sequences), nothing singles a sequence out and the mask is all False: the caller then
    names the whole batch's chunks, without their documents."""
    x = np.asarray(losses, dtype=np.float64)
    bad = ~np.isfinite(x)
    if bad.all() or len(x) < MIN_SEQUENCES:
        return np.zeros(len(x), dtype=bool)
    finite = x[~bad]
    median = float(np.median(finite))
    scale = max(1.4826 * float(np.median(np.abs(finite - median))), SCALE_FLOOR * abs(median))
    deviation = np.abs(np.where(bad, median, x) - median)
    hit = bad | (deviation > z * scale if scale > 0 else deviation > 0)
    if not hit.any() or hit.sum() > max(1, len(x) // 4):
        return np.zeros(len(x), dtype=bool)
    return hit


def concentrated(losses: np.ndarray, outlier: Callable[[float], bool]) -> bool:
    """Is a spiking batch's excess loss carried by a few of its sequences (data), rather than
    spread over nearly all of them (state: a learning-rate burst or damaged weights raise the
    loss of every sequence)? `losses`: each sequence's mean loss per token; `outlier(loss)`: the
    monitor's own test, would a step of this mean loss be an outlier against its clean history.

    True when `offending` singles out sequences (each OUTLIER_Z robust sigma from the batch
    median, at most a quarter of the batch) AND the rest of the batch, without them, is a
    normal step: `outlier(mean loss of the rest)` is False. The threshold is the monitor's
    because the question is the monitor's: the step was called an outlier against the clean
    history; if the batch minus the named sequences would have passed that same test, those
    sequences explain the spike. A state spike moves the whole distribution (its median moves
    with it), so `offending` rarely names anything, and where it names the few hit hardest the
    rest still fails the test. A batch that is bad everywhere (every sequence the same poisoned
    text) is not concentrated either: nothing in its losses tells it from a state spike, so it
    is left to a replay to attribute. Limitation: a spike flagged by its grad norm alone, whose
    batch happens to hold a sequence far from the median, reads as concentrated."""
    x = np.asarray(losses, dtype=np.float64)
    hit = offending(x)
    if not hit.any():
        return False
    return not outlier(float(np.mean(x[~hit])))  # `offending` names every non-finite loss


def document_bounds(tokens: np.ndarray, start: int, end: int, eos_id: int | None, reach: int) -> tuple[int, int]:
    """The token range [a, b) of the documents holding tokens [start, end) of a shard (`tokens`,
    the shard's memmap): from just after the last EOS before `start` to just after the first EOS
    at or after `end - 1` (a document ends with its EOS, as `prepare` writes it), at most `reach`
    tokens beyond [start, end) on either side."""
    n = len(tokens)
    if eos_id is None:
        return start, end
    lo = max(0, start - reach)
    before = np.flatnonzero(np.asarray(tokens[lo:start]) == eos_id)
    a = lo + int(before[-1]) + 1 if len(before) else lo
    hi = min(n, end + reach)
    after = np.flatnonzero(np.asarray(tokens[end - 1:hi]) == eos_id)
    b = end - 1 + int(after[0]) + 1 if len(after) else hi
    return a, max(b, end)
