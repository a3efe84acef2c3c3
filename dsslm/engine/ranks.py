"""What ranks share outside the training step: the device and the process group a launcher
describes, and the meeting points that are not collectives (work longer than any collective
timeout: gather_long's worker and wait, the checkpoint writers' Exchange)."""
from __future__ import annotations

import os
import pickle
import threading
import time
from datetime import timedelta
from typing import Any, Callable

import torch
import torch.distributed as dist

from dsslm.config import Config, ConfigError
from dsslm.durable import IO
from dsslm.engine.board import enable_flight_recorder

# The collectives' timeout until the first step (engine.collective_timeout_s; then the watchdog's
# bound, health/watchdog.py). Nothing waits in a collective for longer than a step, a checkpoint
# gather or rank 0 hashing the one checkpoint it loads (a 16 GB folder hashes in ~10-30 s); the
# one wait that grows with the corpus (hashing its shards) goes through `gather_long` instead.
COLLECTIVE_TIMEOUT_S = 1800
# gather_long fails when no rank has reported progress for this long: a rank stuck on I/O, not
# one that is slow (progress arrives every READ_BYTES hashed, many times a second).
STALL_TIMEOUT_S = 600
PROGRESS_EVERY_S = 30


def pick_device(cfg: Config) -> torch.device:
    want = cfg.train.device
    if want == "cuda" and not torch.cuda.is_available():  # torch's own error is an AttributeError deep inside
        raise ConfigError(f"train.device=cuda: no GPU is visible here (torch {torch.__version__}); use "
                          "train.device=auto or cpu, or a torch build with CUDA")
    if want == "cuda" or (want == "auto" and torch.cuda.is_available()):
        local_rank = int(os.environ.get("LOCAL_RANK", 0))
        if local_rank >= torch.cuda.device_count():
            raise ConfigError(f"LOCAL_RANK={local_rank} but {torch.cuda.device_count()} GPU(s) are visible; "
                              "launch at most one rank per GPU (--nproc_per_node)")
        torch.cuda.set_device(local_rank)
        return torch.device("cuda", local_rank)
    return torch.device("cpu")


def init_distributed(device: torch.device, timeout_s: float = COLLECTIVE_TIMEOUT_S) -> None:
    """Join the process group that torchrun / accelerate launch / srun described in the environment.

    Plain `python -m dsslm.train` (no WORLD_SIZE) stays a single process with no group at all.
    """
    if dist.is_initialized() or int(os.environ.get("WORLD_SIZE", "1")) <= 1:
        return
    # nccl only moves CUDA tensors; gloo is the CPU path (the one the tests exercise).
    backend = "nccl" if device.type == "cuda" else "gloo"
    enable_flight_recorder()  # read when the group is made: what a hang's record shows of each rank's collectives
    dist.init_process_group(backend=backend, timeout=timedelta(seconds=timeout_s))


class Exchange:
    """Ranks' writer threads meet here, in the process group's key-value store, never inside a
    collective: a save may take longer than any collective timeout, and the training threads
    go on meanwhile. A rank posts progress (bytes written) as it goes and one value when done;
    `wait_all` fails only when no rank has made progress for `stall_s`."""

    def __init__(self, store: Any, world_size: int):
        self.store, self.world_size = store, world_size
        self.local: dict[int, str] = {}

    def progress(self, units: int) -> None:
        if self.store is not None and units:
            self.store.add("units", units)

    def post(self, rank: int, value: str) -> None:
        if self.store is None:
            self.local[rank] = value
        else:
            self.store.set(f"rank{rank}", value)

    def finish(self) -> None:
        """Rank 0's writer, once the save is published or failed: the other ranks' writers stop waiting."""
        if self.store is not None:
            self.store.set("finished", "1")

    def wait_finished(self, stall_s: float = STALL_TIMEOUT_S, poll_s: float = 0.01) -> None:
        """A rank's writer after posting its files: wait for rank 0 to publish (or fail) the save,
        so every rank's save is in flight until the checkpoint is, and no training thread enters a
        collective while rank 0 still writes (a write may outlast the collectives' timeout). Gives
        up after `stall_s` without progress seen; rank 0's own failure is raised by rank 0."""
        if self.store is None:
            return
        last_seen, last_change = None, time.monotonic()
        while not self.store.check(["finished"]):
            seen = self.store.add("units", 0)
            now = time.monotonic()
            if seen != last_seen:
                last_seen, last_change = seen, now
                IO.peers += 1  # the watchdog sees this rank's wait move with the others' writes
            if now - last_change > stall_s:
                return
            time.sleep(poll_s)
            poll_s = min(0.5, poll_s * 2)

    def wait_all(self, stall_s: float = STALL_TIMEOUT_S, poll_s: float = 0.01) -> list[str]:
        if self.store is None:
            return [self.local[r] for r in range(self.world_size)]
        keys = [f"rank{r}" for r in range(self.world_size)]
        last_seen, last_change = None, time.monotonic()
        while True:
            done = sum(self.store.check([k]) for k in keys)
            seen = (done, self.store.add("units", 0))
            now = time.monotonic()
            if seen != last_seen:
                last_seen, last_change = seen, now
                IO.peers += 1  # rank 0's writer waits on the others' progress: the watchdog sees it move
            if done == self.world_size:
                return [self.store.get(k).decode() for k in keys]
            if now - last_change > stall_s:
                raise RuntimeError(f"checkpoint save: no rank made progress for {stall_s:.0f} s ({done} of "
                                   f"{self.world_size} ranks done); a rank may be stuck writing its files")
            time.sleep(poll_s)
            poll_s = min(0.5, poll_s * 2)


class Worker:
    """`fn(progress)` in a daemon thread (a rank stuck in I/O must not keep the process alive),
    counting the units it reports and keeping its result or exception."""

    def __init__(self, fn: Callable[[Callable[[int], None]], Any]):
        self.units = 0
        self.outcome: tuple[str, Any] = ("raise", RuntimeError("the work did not finish"))
        self._lock = threading.Lock()
        self._fn = fn
        self.thread = threading.Thread(target=self._run, name="dsslm-long-work", daemon=True)
        self.thread.start()

    def _progress(self, units: int) -> None:
        with self._lock:  # called from the work's own threads (hash_shards hashes several files at once)
            self.units += units

    def _run(self) -> None:
        try:
            self.outcome = ("ok", self._fn(self._progress))
        except Exception as exc:  # noqa: BLE001 - re-raised on every rank by gather_long
            self.outcome = ("raise", picklable(exc))


def picklable(exc: BaseException) -> BaseException:
    """`exc` itself if it survives the trip to the other ranks, else a RuntimeError saying what it was."""
    try:
        pickle.loads(pickle.dumps(exc))
        return exc
    except Exception:  # noqa: BLE001 - any failure to round-trip means: send a plain copy
        return RuntimeError(f"{type(exc).__name__}: {exc}")


def wait_for_ranks(store: Any, worker: Worker, world_size: int, is_main: bool, what: str, total_units: int,
                   stall_s: float) -> None:
    """gather_long's wait: publish this rank's progress and, once its work is done, itself to the
    store's counters; return when every rank is done, fail after `stall_s` without progress."""
    published, announced, poll_s = 0, False, 0.01
    last_seen, last_change = (-1, -1), time.monotonic()
    last_print = last_change
    while True:
        worker.thread.join(timeout=poll_s)
        poll_s = min(1.0, poll_s * 2)  # a quick job returns at once; a long one polls once a second
        done_units = worker.units
        if done_units > published:
            store.add("units", done_units - published)
            published = done_units
        if not worker.thread.is_alive() and not announced:
            store.add("ranks_done", 1)
            announced = True
        seen = (store.add("ranks_done", 0), store.add("units", 0))
        now = time.monotonic()
        if seen != last_seen:
            last_seen, last_change = seen, now
        if seen[0] >= world_size:
            return
        if now - last_change > stall_s:
            raise RuntimeError(f"{what}: no rank made progress for {stall_s:.0f} s ({seen[0]} of "
                               f"{world_size} ranks done); a rank may be stuck reading its files")
        if is_main and now - last_print >= PROGRESS_EVERY_S:
            share = f" of {total_units / 1e9:.1f} GB" if total_units else ""
            print(f"dsslm: {what}: {seen[1] / 1e9:.1f}{share}, {seen[0]} of {world_size} ranks done",
                  flush=True)
            last_print = now
