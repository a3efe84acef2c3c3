"""Checkpoint store: host snapshot, one background writer, atomic publish; what is on disk
(retention, newest-valid reads, deletes, folders set aside) is its base, `catalogue.py`.

    store = CheckpointStore(run_dir, keep_last=3, keep_every=1000, on_event=log_event)
    ckpt = store.load_latest(accept)              # newest folder that verifies and `accept`s, or None
    ...
    store.check()                                 # each step: a failed background save raises here
    store.save_async(step, {"model": model_sd, "optim": optim_flat}, {"step": step, "skip_list": ...})
    ...
    store.wait()                                  # before exit

Layout and file format live in `format.py`. The rules this module keeps:
- `save_async` returns once every tensor is copied to host memory; the optimizer may then change
  the live tensors. The writer thread streams the copies to `.tmp-step-XXXXXXXX-<pid>-<hex>/`,
  fsyncs each file, writes MANIFEST last, fsyncs the folder and renames it into place.
- At most one save in flight; a writer error is kept and raised (once) as CheckpointError by the
  next `check()`, `wait()` or `save_async()` in the training thread.
"""
from __future__ import annotations

import hashlib
import json
import os
import secrets
import shutil
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Callable, Iterable

from dsslm.ckpt.catalogue import Catalogue, aside_stamp
from dsslm.ckpt.format import (FORMAT, MANIFEST, STATE_FILE, TENSOR_SUFFIX, Checkpoint, CheckpointError,
                               invalid_reason, load_checkpoint, safetensors_chunks, step_name)
from dsslm.ckpt.shards import INDEX_FILE, build_index, check_index, dtype_name, rank_file, shard_file
from dsslm.ckpt.snapshot import HostBuffers
from dsslm.durable import IO, fsync_dir

# aside_stamp: recovery.rewind names its own asides with it.
__all__ = ["Checkpoint", "CheckpointError", "CheckpointStore", "aside_stamp", "load_checkpoint", "invalid_reason"]

# Below this a chunk is hashed inline: handing it to the hashing thread costs more than it saves.
_INLINE_HASH_BYTES = 1 << 20


def _write_file(path: Path, chunks: Iterable) -> tuple[str, int]:
    """Create `path`, write `chunks`, fsync; return (sha256 hex, size).

    The writer's only call that writes data, so a test can make it fail (ENOSPC) or slow.
    """
    digest, size = hashlib.sha256(), 0
    with open(path, "xb") as f, ThreadPoolExecutor(1) as hasher:
        for chunk in chunks:
            # sha256 and write() both release the GIL: hashing a chunk while writing it makes a
            # save cost max(hash, write) instead of their sum.
            hashing = hasher.submit(digest.update, chunk) if len(chunk) >= _INLINE_HASH_BYTES else None
            if hashing is None:
                digest.update(chunk)
            for piece in _pieces(chunk):  # counted as written: the watchdog's evidence of a slow write's progress
                f.write(piece)
                IO.add_written(len(piece))
            if hashing is not None:
                hashing.result()
            size += len(chunk)
        f.flush()
        os.fsync(f.fileno())
    return digest.hexdigest(), size


def _pieces(chunk) -> Iterable:
    """A chunk whole, or in _WRITE_PIECE slices under a drill's write rate (so its progress moves
    as a network filesystem's would, not in one jump per tensor)."""
    view = memoryview(chunk)
    if IO.write_rate <= 0 or len(view) <= _WRITE_PIECE:
        return (view,)
    flat = view.cast("B")
    return (flat[i:i + _WRITE_PIECE] for i in range(0, len(flat), _WRITE_PIECE))


_WRITE_PIECE = 1 << 16


class CheckpointStore(Catalogue):
    """Saves and finds checkpoints under `run_dir/checkpoints/`. Call it from one training thread."""

    def __init__(self, run_dir, keep_last: int = 3, keep_every: int = 0,
                 on_event: Callable[..., None] | None = None, reuse_host_buffers: bool = True,
                 fence: Callable[[], None] | None = None):
        super().__init__(run_dir, keep_last, keep_every, on_event, fence)
        self._crash_in_save_step, self._crash_after_files = -1, 1
        self._buffers = HostBuffers(reuse_host_buffers)
        self._idle = threading.Event()
        self._idle.set()
        self._error: tuple[int, BaseException] | None = None
        self._last_path: Path | None = None
        # The save in flight: (step, its bytes, IO.written when it started), for the watchdog's line.
        self.writing: tuple[int, int, int] | None = None
        self.on_written: Callable[[float], None] = lambda seconds: None  # a whole write's time (the watchdog learns it)

    def die_in_save(self, step: int, after_files: int = 1) -> None:
        """Fault drill: the save of `step` hard-exits the process (os._exit(137), as if SIGKILLed)
        once `after_files` files are in its temp folder (MANIFEST counts; 0 dies before the
        first). It fires every time: arming it once per run is the caller's (recovery.faults)."""
        self._crash_in_save_step, self._crash_after_files = step, after_files

    # Training-thread API.

    def save_async(self, step: int, tensors: dict, state: dict) -> None:
        """Copy everything to host memory now; write it on the background thread."""
        self.wait()  # one save in flight; also raises the previous save's error
        step_name(step)  # an unnameable step fails here, not in the writer
        state = json.loads(json.dumps(state))  # a deep copy; a non-JSON value fails here too
        snapshot = self._buffers.snapshot(tensors)
        if self._thread is not None:
            self._thread.join()  # idle, so it has returned or is returning
        total = sum(t.numel() * t.element_size() for named in snapshot.values() for t in named.values())
        self._start(step, lambda: self._write(step, snapshot, state), total)

    def _start(self, step: int, write: Callable[[], Path | None], total: int) -> None:
        self.writing = (step, total, IO.written)
        self._idle.clear()
        # One thread per save, not a daemon: whatever path the process leaves by, the interpreter
        # waits for a save in flight instead of killing it half written.
        self._thread = threading.Thread(target=self._work, args=(step, write), name="dsslm-ckpt-writer")
        self._thread.start()

    def make_tmp(self, step: int) -> str:
        """Rank 0, before a sharded save: the temp folder every rank writes its files into."""
        step_name(step)
        if not self.ckpt_dir.is_dir():
            self.ckpt_dir.mkdir(parents=True)
            fsync_dir(self.run_dir)
        tmp = self.ckpt_dir / f".tmp-{step_name(step)}-{os.getpid()}-{secrets.token_hex(8)}"
        tmp.mkdir()
        fsync_dir(self.ckpt_dir)
        return tmp.name

    def save_shard_async(self, step: int, tmp_name: str, rank: int, world_size: int, shards: list,
                         own: dict, exchange, state: dict | None) -> None:
        """A sharded save, on every rank: copy this rank's shards (engine.base.Shard) to host memory
        now; the writer thread writes them and `own` (this rank's JSON state) into `tmp_name`,
        fsyncs them and posts their hashes to rank 0 through `exchange` (a failure too: rank 0
        raises it, for every rank). Rank 0 (`state` given) then waits for every rank, writes
        index.json, state.json and MANIFEST last, and publishes with one rename."""
        self.wait()
        own = json.loads(json.dumps(own))
        state = None if state is None else json.loads(json.dumps(state))
        snapshot = self._buffers.snapshot({"shard": {f"{s.key}@{s.start}": s.tensor for s in shards}})["shard"]
        file = shard_file(rank, world_size)
        pieces = [[s.key, list(s.shape), dtype_name(s.tensor.dtype), s.start, s.end, file] for s in shards]
        if self._thread is not None:
            self._thread.join()
        job = (step, tmp_name, rank, world_size, snapshot, pieces, own, exchange, state)
        self._start(step, lambda: self._write_shard(*job), sum(t.numel() * t.element_size() for t in snapshot.values()))

    def save(self, step: int, tensors: dict, state: dict) -> Path:
        """Synchronous save: the same path as save_async, then wait. Returns the published folder."""
        self.save_async(step, tensors, state)
        self.wait()
        return self._last_path

    def check(self) -> None:
        """Deliver queued events; raise a failed background save as CheckpointError (once)."""
        self._flush_events()
        if not self._idle.is_set():
            return  # the writer only sets _error before going idle; reading it now could race
        failure, self._error = self._error, None
        if failure is not None:
            step, exc = failure
            raise CheckpointError(f"saving checkpoint {step_name(step)} failed: {exc!r}; checkpoints "
                                  f"saved before it are untouched") from exc

    def wait(self) -> None:
        """Block until no save is in flight; raise its error if it failed."""
        self._idle.wait()
        self.check()

    def settle(self) -> None:
        """Block until no save is in flight, raising nothing: its failure is raised where every
        rank raises it together (a decide, check_health)."""
        self._idle.wait()

    @property
    def in_flight(self) -> bool:
        """True while a background save is being written."""
        return not self._idle.is_set()

    def close(self) -> None:
        """wait() (raising a failed save's error), then join the writer thread."""
        try:
            self.wait()
        finally:
            if self._thread is not None:
                self._thread.join()

    def leave_after(self, step: int) -> list[str]:
        """Catalogue.leave_after once the save in flight is finished (it may be one of them)."""
        self.wait()
        return super().leave_after(step)

    # Writer thread.

    def _work(self, step: int, write: Callable[[], Path | None]) -> None:
        started = time.monotonic()
        try:
            self._last_path = write()
            self.on_written(time.monotonic() - started)
        except BaseException as exc:  # OSError(ENOSPC) included: kept for the training thread
            self._error = (step, exc)
        finally:
            self._idle.set()

    def _write_shard(self, step: int, tmp_name: str, rank: int, world_size: int, tensors: dict, pieces: list,
                     own: dict, exchange, state: dict | None) -> Path | None:
        start = time.perf_counter()
        tmp = self.ckpt_dir / tmp_name
        try:
            if not tmp.is_dir() or tmp.is_symlink():
                raise CheckpointError(f"{tmp_name} is gone; another process cleared the run's temp folders")
            self._maybe_crash(step, tmp)
            meta = {"save": tmp_name, "rank": rank, "world_size": world_size}
            files = {}
            name = shard_file(rank, world_size)
            files[name] = self._write_one(tmp / name, safetensors_chunks(tensors, meta), step)
            exchange.progress(files[name][1])
            name = rank_file(rank, world_size)
            files[name] = self._write_one(tmp / name, [memoryview(json.dumps(own, sort_keys=True).encode())], step)
            report = {"files": files, "pieces": pieces}
        except Exception as exc:  # noqa: BLE001 - reported to rank 0, which raises it for every rank
            report = {"error": f"{type(exc).__name__}: {exc}"}
        exchange.post(rank, json.dumps(report))
        if state is None:
            exchange.wait_finished()  # in flight until rank 0 published it: the ranks leave their waits together
            return None  # not rank 0: the publish, and any failure, are rank 0's to report
        try:
            reports = [json.loads(v) for v in exchange.wait_all()]
            failed = [(r, rep["error"]) for r, rep in enumerate(reports) if "error" in rep]
            if failed:
                raise CheckpointError(f"rank {failed[0][0]} could not write its shard: {failed[0][1]}")
            files = {n: tuple(v) for rep in reports for n, v in rep["files"].items()}
            index = build_index(world_size, tmp_name, [rep["pieces"] for rep in reports])
            check_index(index, {**files, INDEX_FILE: None, STATE_FILE: None}, world_size)  # an engine's bug, caught now
            files[INDEX_FILE] = self._write_one(tmp / INDEX_FILE, [memoryview(json.dumps(index).encode())], step)
            files = dict(sorted(files.items()))
            path = self._seal(tmp, step, state, files)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)  # every rank has posted: nobody writes there any more
            raise
        finally:
            exchange.finish()
        self._emit("save", checkpoint=path.name, step=step, seconds=round(time.perf_counter() - start, 3),
                   bytes=sum(size for _, size in files.values()), format="sharded", world_size=world_size)
        try:
            self._fence()
            self.apply_retention()
        except OSError as exc:
            raise CheckpointError(f"{path.name} was saved, but retention could not delete: {exc}") from exc
        return path

    def _seal(self, tmp: Path, step: int, state: dict, files: dict) -> Path:
        """Both formats' last writes: state.json, the MANIFEST last (every other file's SHA-256, in
        `files`' order), then, fenced by run.dir's lock, the one rename that publishes the folder."""
        state_bytes = json.dumps(state, indent=1, sort_keys=True).encode()
        files[STATE_FILE] = self._write_one(tmp / STATE_FILE, [memoryview(state_bytes)], step)
        manifest = {"format": FORMAT, "step": step,
                    "files": {n: {"sha256": h, "size": size} for n, (h, size) in files.items()}}
        self._write_one(tmp / MANIFEST, [memoryview(json.dumps(manifest, indent=1).encode())], step)
        fsync_dir(tmp)
        self._fence()
        with self._lock:
            return self._publish(tmp, step)

    def _write(self, step: int, tensors: dict, state: dict) -> Path:
        start = time.perf_counter()
        if not self.ckpt_dir.is_dir():
            self.ckpt_dir.mkdir(parents=True)
            fsync_dir(self.run_dir)  # the new checkpoints/ entry must survive a power cut too
        tmp = self.ckpt_dir / f".tmp-{step_name(step)}-{os.getpid()}-{secrets.token_hex(4)}"
        tmp.mkdir()
        try:
            self._maybe_crash(step, tmp)
            files = {}
            for group, named in tensors.items():
                name = group + TENSOR_SUFFIX
                files[name] = self._write_one(tmp / name, safetensors_chunks(named), step)
            path = self._seal(tmp, step, state, files)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)  # our own temp folder; frees what ENOSPC needs
            raise
        self._emit("save", checkpoint=path.name, step=step, seconds=round(time.perf_counter() - start, 3),
                   bytes=sum(size for _, size in files.values()))
        try:
            self._fence()
            self.apply_retention()
        except OSError as exc:
            raise CheckpointError(f"{path.name} was saved, but retention could not delete: {exc}") from exc
        return path

    def _write_one(self, path: Path, chunks, step: int) -> tuple[str, int]:
        result = _write_file(path, chunks)
        self._maybe_crash(step, path.parent)
        return result

    def _maybe_crash(self, step: int, tmp: Path) -> None:
        if step != self._crash_in_save_step or len(os.listdir(tmp)) < self._crash_after_files:
            return
        os._exit(137)  # no cleanup, no flush: what a SIGKILL mid-save leaves behind
