"""Background reads of the next step's micro-batches, overlapping the reads with compute.

    feed = Prefetcher(loader, rank, world_size, grad_accum, batch_size_at, pin_memory=True)
    fed, micro_batches = feed.step(position, skip_list)   # every step
    feed.close()                                          # once, at the end

A step's batch is a pure function of (position, skip list, batch size) (`data.stream`), and the
next step's position is this step's `fed.end` whatever its verdict: a skipped step still consumes
its data. So right after handing over a step, the prefetcher reads the step that would start at
`fed.end` in one background thread, under the key (position, skip list, batch size). The next
call takes it when its own key is the same; on any other key (a rewind restored an older position
and grew the skip list; a ramp or a resume changed the batch size) the read in flight is dropped
and the step is read synchronously. A hit and a miss return the same tensors, bit for bit: both
are `loader.step` of the same arguments.

On CUDA the host tensors are pinned, so the loop's `.to(device, non_blocking=True)` is a real
asynchronous copy; PyTorch's pinned-memory allocator keeps a block alive until its copy is done.
"""
from __future__ import annotations

import time
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Callable

from dsslm.data.loader import Batch, Loader
from dsslm.data.skips import SkipView, view_of
from dsslm.data.stream import StepSlice

Key = tuple[int, str, int]  # (position, the skip list's canonical JSON, batch size)


class Prefetcher:
    """One step read ahead for one rank; `enabled=False` reads every step synchronously."""

    def __init__(self, loader: Loader, rank: int, world_size: int, grad_accum: int,
                 batch_size_at: Callable[[int], int], pin_memory: bool = False, enabled: bool = True):
        self.loader, self.rank, self.world_size, self.grad_accum = loader, rank, world_size, grad_accum
        self.batch_size_at, self.pin_memory = batch_size_at, pin_memory
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="dsslm-prefetch") if enabled else None
        self._pending: tuple[Key, Future] | None = None
        self.hits = self.misses = 0
        self.wait_s = 0.0  # the last step's time spent waiting for its batch (metrics.jsonl's data_wait_s)

    def step(self, position: int, skip_list: list) -> tuple[StepSlice, list[Batch]]:
        """The step starting at `position`: this rank's share, as `Loader.step` gives it."""
        started = time.perf_counter()
        # Merged and keyed once per change of the list (skips.view_of): the same list every step
        # costs nothing here, and its key is the same string object, compared by identity first.
        view = view_of(skip_list)
        key = self._key(position, view)
        pending, self._pending = self._pending, None
        if pending is not None and pending[0] == key:
            self.hits += 1
            fed, batches = pending[1].result()  # a read that failed raises here, as a synchronous one would
        else:
            self.misses += int(self._pool is not None)
            fed, batches = self._read(key, view)
        self.wait_s = time.perf_counter() - started
        if self._pool is not None:
            ahead = self._key(fed.end, view)
            self._pending = (ahead, self._pool.submit(self._read, ahead, view))
        return fed, batches

    def close(self) -> None:
        """Drop the read in flight and stop the thread (waits for a read already running)."""
        self._pending = None
        if self._pool is not None:
            self._pool.shutdown(wait=True, cancel_futures=True)

    def _key(self, position: int, view: SkipView) -> Key:
        # The view is a copy: the loop may grow its skip list in place after this step was scheduled.
        return position, view.key, self.batch_size_at(position)

    def _read(self, key: Key, view: SkipView) -> tuple[StepSlice, list[Batch]]:
        position, _, batch_size = key
        fed, batches = self.loader.step(position, view.merged, batch_size, self.rank, self.world_size,
                                        self.grad_accum)
        if self.pin_memory:
            batches = [(inputs.pin_memory(), targets.pin_memory()) for inputs, targets in batches]
        return fed, batches
