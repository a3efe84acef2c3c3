"""Checkpoint store: host snapshot, one background writer, atomic publish, retention, newest-valid reads.

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
- on_event is only ever called from the training thread: events the writer produces are queued
  and delivered by the next call into the manager, so a non-thread-safe logger is fine.
- Folders that do not verify, or whose contents the caller's `accept` refuses (a state.json
  field out of range, a tensor of the wrong shape), are passed over (one `passed_over` event
  each) and never deleted. dsslm deletes only what it renamed `.deleting-*` itself: a delete
  renames first, so a `step-XXXXXXXX` without MANIFEST is never its own half delete (a lost
  MANIFEST, a foreign folder, an older dsslm's delete); the next start sets it aside as
  `.invalid-*` for a person.
- What is loaded is hashed in full first; retention bookkeeping (which folders count, which
  to delete, what the loop pins) is not: it checks each MANIFEST, the file list and every
  file's size, and remembers every full-hash failure. So the first save after a restart costs
  no hashing on the training thread, however many checkpoints are kept, and a folder whose
  bytes rotted at the same size is caught when something loads it (then passed over, and no
  longer counted). Only an `.replaced` aside is deleted on the word of a full hash.
"""
from __future__ import annotations

import collections
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

from dsslm.durable import fsync_dir
from dsslm.ckpt.format import (ASIDE_SUFFIX, DELETING, DELETING_RE, FORMAT, INVALID, MANIFEST, STATE_FILE,
                               TENSOR_SUFFIX, Checkpoint, CheckpointError, load_checkpoint, load_verified,
                               candidates, parse_name, safetensors_chunks, stat_key, step_name, invalid_reason)
from dsslm.fields import StateError
from dsslm.ckpt.shards import INDEX_FILE, build_index, check_index, dtype_name, rank_file, shard_file
from dsslm.ckpt.snapshot import HostBuffers

__all__ = ["Checkpoint", "CheckpointError", "CheckpointStore", "load_checkpoint", "invalid_reason"]
# A check of a loaded checkpoint's contents: raises CheckpointError or StateError saying why not.
Accept = Callable[[Checkpoint], None]

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
            f.write(chunk)
            if hashing is not None:
                hashing.result()
            size += len(chunk)
        f.flush()
        os.fsync(f.fileno())
    return digest.hexdigest(), size


def aside_stamp() -> str:
    """A unique suffix for a folder set aside (time, then random: two in one second differ)."""
    return f"{time.strftime('%Y%m%dT%H%M%S')}-{secrets.token_hex(2)}"


def _rename(src: Path, dst: Path) -> None:
    """Every rename of a checkpoint folder goes through here, so a test can crash between two."""
    os.rename(src, dst)


# Said once per folder set aside: what it may be, that nothing reads it, and who removes it.
NO_MANIFEST = ("no MANIFEST (it was lost, or the folder is not dsslm's, or a dsslm older than this one was "
               "killed deleting it); set aside as {aside}, which nothing reads or deletes: look at it, then "
               "remove it by hand (docs/checkpoints.md)")


def _remove_tree(folder: Path, removed: Callable[[], None]) -> None:
    """`folder` and everything in it, a link removed and never followed; `removed()` after each."""
    for entry in sorted(folder.iterdir()):
        if entry.is_dir() and not entry.is_symlink():
            _remove_tree(entry, removed)
        else:
            entry.unlink()
            removed()
    folder.rmdir()
    removed()


class CheckpointStore:
    """Saves and finds checkpoints under `run_dir/checkpoints/`. Call it from one training thread."""

    def __init__(self, run_dir, keep_last: int = 3, keep_every: int = 0,
                 on_event: Callable[..., None] | None = None, reuse_host_buffers: bool = True,
                 fence: Callable[[], None] | None = None):
        if keep_last < 1:
            raise ValueError(f"keep_last={keep_last} would delete the checkpoint just saved; set ckpt.keep_last >= 1")
        if keep_every < 0:
            raise ValueError(f"keep_every={keep_every} must be >= 0 (0 keeps no extra checkpoints)")
        self.run_dir = Path(run_dir)
        self.ckpt_dir = self.run_dir / "checkpoints"
        self.keep_last, self.keep_every = keep_last, keep_every
        self._on_event = on_event
        # Raises if this process may no longer write here (the run.dir lock was taken over): checked
        # by the writer right before it publishes or deletes anything.
        self._fence = fence or (lambda: None)
        self._crash_in_save_step, self._crash_after_files = -1, 1
        self._crash_in_delete: tuple[int, int] = (-1, 0)
        self._buffers = HostBuffers(reuse_host_buffers)
        # Guards every rename, delete and read of checkpoint folders (writer vs training thread).
        self._lock = threading.RLock()
        # name -> (stat_key, reason): a reason found by hashing holds until the files change.
        self._verified: dict[str, tuple[tuple, str | None]] = {}
        self._reported: set[str] = set()
        self._refused: set[str] = set()  # verified, but their contents were refused on load
        self._pinned: set[int] = set()
        self._events: collections.deque = collections.deque()
        self._idle = threading.Event()
        self._idle.set()
        self._thread: threading.Thread | None = None
        self._error: tuple[int, BaseException] | None = None
        self._last_path: Path | None = None

    def die_in_save(self, step: int, after_files: int = 1) -> None:
        """Fault drill: the save of `step` hard-exits the process (os._exit(137), as if SIGKILLed)
        once `after_files` files are in its temp folder (MANIFEST counts; 0 dies before the
        first). It fires every time: arming it once per run is the caller's (recovery.faults)."""
        self._crash_in_save_step, self._crash_after_files = step, after_files

    def die_in_delete(self, step: int, after: int) -> None:
        """Fault drill: the delete of checkpoint `step` (retention's, or a replace's aside) hard-exits
        the process once `after` of its changes are made: the rename is the first, then each file
        and folder removed; 0 dies before the rename."""
        self._crash_in_delete = (step, after)

    # Training-thread API.

    def save_async(self, step: int, tensors: dict, state: dict) -> None:
        """Copy everything to host memory now; write it on the background thread."""
        self.wait()  # one save in flight; also raises the previous save's error
        step_name(step)  # an unnameable step fails here, not in the writer
        state = json.loads(json.dumps(state))  # a deep copy; a non-JSON value fails here too
        snapshot = self._buffers.snapshot(tensors)
        if self._thread is not None:
            self._thread.join()  # idle, so it has returned or is returning
        self._start(step, lambda: self._write(step, snapshot, state))

    def _start(self, step: int, write: Callable[[], Path | None]) -> None:
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
        self._start(step, lambda: self._write_shard(*job))

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

    def remove_leftovers(self) -> list[str]:
        """At start, by the run.dir lock's holder (so no save or delete of another process is in
        progress): delete `checkpoints/.tmp-*`, saves that a kill cut short, and return their names;
        finish the deletes and replaces a kill cut short; set aside folders without MANIFEST."""
        removed = []
        if not self.ckpt_dir.is_dir():
            return removed
        for path in sorted(self.ckpt_dir.glob(".tmp-*")):
            if path.is_symlink() or not path.is_dir():
                path.unlink()  # a link is removed, never followed
            else:
                shutil.rmtree(path)
            removed.append(path.name)
        if removed:
            fsync_dir(self.ckpt_dir)
        self.finish_deletes()  # their own events: checkpoint folders, not temp ones
        self.set_aside_unfinished()
        self.settle_replaces()
        return removed

    def settle_replaces(self) -> None:
        """Finish the replaces a kill cut short (`_settle_aside`). For the run.dir lock's holder."""
        with self._lock:
            for step, paths in self._scan().items():
                if any(p.name.endswith(ASIDE_SUFFIX) for p in paths):
                    self._settle_aside(step)

    def finish_deletes(self) -> list[str]:
        """Remove the `step-XXXXXXXX.deleting-<hex>` folders: deletes a kill cut short. Only a delete
        gives a folder that name, after it decided to remove it. For the run.dir lock's holder."""
        finished = []
        with self._lock:
            for name in sorted(os.listdir(self.ckpt_dir)) if self.ckpt_dir.is_dir() else ():
                path = self.ckpt_dir / name
                if not DELETING_RE.fullmatch(name):
                    continue
                if path.is_dir() and not path.is_symlink():
                    _remove_tree(path, lambda: None)
                else:
                    path.unlink()
                finished.append(name)
            if finished:
                fsync_dir(self.ckpt_dir)
                self._emit("deletes_finished", folders=finished, reason="deletes a kill cut short")
        return finished

    def set_aside_unfinished(self) -> list[str]:
        """Rename each `step-XXXXXXXX` folder without MANIFEST to `<name>.invalid-<time>` (one
        `passed_over` event each, naming the new name): not a checkpoint, and not provably dsslm's to
        delete. For the run.dir lock's holder. Returns the new names."""
        moved = []
        with self._lock:
            for _, paths in sorted(self._scan().items()):
                for path in paths:
                    if not path.is_dir() or os.path.lexists(path / MANIFEST):
                        continue
                    aside = path.with_name(f"{path.name}{INVALID}{aside_stamp()}")
                    _rename(path, aside)
                    self._verified.pop(path.name, None)
                    self._reported.add(path.name)
                    moved.append(aside.name)
                    self._emit("passed_over", checkpoint=path.name, reason=NO_MANIFEST.format(aside=aside.name),
                               set_aside=aside.name)
            if moved:
                fsync_dir(self.ckpt_dir)
        return moved

    def not_resumable(self) -> list[str]:
        """What is not resumable here: the folders passed over by this store and still present, and
        those set aside (`.invalid-*`) by any start, by name."""
        with self._lock:
            names = sorted(os.listdir(self.ckpt_dir)) if self.ckpt_dir.is_dir() else []
            return [n for n in names if n in self._reported or (INVALID in n and n.startswith("step-"))]

    def candidates(self, step: int = 10**8) -> list[str]:
        """Folders at or before `step` whose MANIFEST, file list and sizes check (no hashing),
        newest first, `step-XXXXXXXX` before its aside, leaving out the refused ones: what a
        loader verifies in full (split among ranks) before it reads any."""
        self._flush_events()
        out = []
        with self._lock:
            found = self._scan()
            for s in sorted((s for s in found if s <= step), reverse=True):
                for path in found[s]:
                    if path.name in self._refused:
                        continue
                    reason = self._reason(path, hashed=False)
                    if reason is None:
                        out.append(str(path))
                    else:
                        self._pass_over(path.name, reason)
        return out

    def refuse(self, path: str, reason: str) -> None:
        """A loader found `path`'s hashes or contents wrong: pass it over, never count or delete it."""
        with self._lock:
            self._refused.add(Path(path).name)
            self._pass_over(Path(path).name, reason)

    def valid_steps(self) -> list[int]:
        """Steps with a valid folder, ascending: sizes checked, not hashes (cached per folder file stats)."""
        self._flush_events()
        with self._lock:
            return sorted(self._valid_paths())

    def valid_paths(self) -> list[Path]:
        """The valid folders, oldest first (sizes checked, not hashes; cached per folder file stats)."""
        self._flush_events()
        with self._lock:
            valid = self._valid_paths()
            return [valid[s] for s in sorted(valid)]

    def load_latest(self, accept: Accept | None = None) -> Checkpoint | None:
        return self.latest_before(10**8, accept)

    def latest_before(self, step: int, accept: Accept | None = None) -> Checkpoint | None:
        """Newest valid checkpoint with ckpt.step <= step, re-hashed in full before it is loaded.

        `accept(ckpt)` checks what the hashes cannot (anyone who can write the folder can also
        rewrite its MANIFEST): a folder it refuses is passed over like a hash mismatch, and the
        next older one is tried."""
        self._flush_events()
        with self._lock:
            found = self._scan()
            for candidate in sorted((s for s in found if s <= step), reverse=True):
                path = self._resolve(found[candidate], hashed=True)
                if path is None:
                    continue
                try:
                    ckpt = load_verified(path)
                    if accept is not None:
                        accept(ckpt)
                    return ckpt
                except (CheckpointError, StateError) as exc:  # malformed; a refused resume propagates
                    self._refused.add(path.name)
                    self._pass_over(path.name, str(exc))
        return None

    def fence(self) -> None:
        """LockLost if another trainer took run.dir over: for every write into it, not only ours."""
        self._fence()

    def leave_after(self, step: int) -> list[str]:
        """A rewind to `step`: the checkpoints after it belong to the trajectory the run left. Each
        is renamed `left-step-XXXXXXXX-<time>-<hex>` (a name no reader, resume or retention looks
        at), not deleted: kept for a person, and no resume after a preemption mid-replay can pick
        a newer step of the left trajectory over the replay's own checkpoint. The save in flight
        finishes first (it may be one of them). Fenced like a save: a trainer that lost run.dir's
        lock must not set aside the new holder's checkpoints. Returns the new names."""
        self.wait()
        moved = []
        self._fence()
        with self._lock:
            for s, paths in sorted(self._scan().items()):
                for path in paths if s > step else ():
                    target = path.with_name(f"left-{path.name}-{aside_stamp()}")
                    _rename(path, target)
                    self._verified.pop(path.name, None)
                    self._refused.discard(path.name)
                    moved.append(target.name)
            if moved:
                fsync_dir(self.ckpt_dir)
                self._emit("left_trajectory", rewound_to=step, checkpoints=moved)
        self._flush_events()
        return moved

    def pin(self, steps: Iterable[int]) -> None:
        """Set the steps retention must keep besides its policy (pending rewind targets, the WSD
        decay start). Replaces the previous set, so a target the run has moved past is let go."""
        with self._lock:
            self._pinned = {int(s) for s in steps}

    def apply_retention(self) -> list[int]:
        """Keep the newest keep_last valid, multiples of keep_every, pinned; delete the rest."""
        with self._lock:
            valid = self._valid_paths()
            steps = sorted(valid)
            keep = set(steps[-self.keep_last:]) | self._pinned
            if self.keep_every > 0:
                keep |= {s for s in steps if s % self.keep_every == 0}
            deleted = [s for s in steps if s not in keep]
            for s in deleted:
                self._delete(valid[s])
                self._emit("retention_delete", checkpoint=valid[s].name)
        return deleted

    def _delete(self, folder: Path) -> None:
        """Rename `folder` to `<name>.deleting-<hex>`, then remove it. The rename is atomic: a kill at
        any moment leaves the whole checkpoint or a folder no reader takes for one, which the next
        start finishes (finish_deletes); never a `step-XXXXXXXX` without MANIFEST. A symbolic link
        is refused, never followed: what it points to may be another run's checkpoint."""
        if folder.is_symlink():
            raise CheckpointError(f"{folder} is a symbolic link; not deleting through it")
        step, done = parse_name(folder.name)[0], [0]

        def changed() -> None:
            done[0] += 1
            self._maybe_die_deleting(step, done[0])

        self._maybe_die_deleting(step, 0)
        doomed = folder.with_name(f"{folder.name}{DELETING}{secrets.token_hex(4)}")
        _rename(folder, doomed)
        changed()
        self._verified.pop(folder.name, None)
        fsync_dir(self.ckpt_dir)
        _remove_tree(doomed, changed)
        fsync_dir(self.ckpt_dir)

    def _maybe_die_deleting(self, step: int, done: int) -> None:
        if self._crash_in_delete == (step, done):
            os._exit(137)  # what a SIGKILL mid-delete leaves behind

    # Writer thread.

    def _work(self, step: int, write: Callable[[], Path | None]) -> None:
        try:
            self._last_path = write()
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

    def _publish(self, tmp: Path, step: int) -> Path:
        """Rename the finished temp folder to step-XXXXXXXX, replacing what is there safely.

        Re-saving a step (after a rewind) that has a valid folder takes two renames: old ->
        `step-XXXXXXXX.replaced`, new -> `step-XXXXXXXX`; then the aside is deleted (`_delete`).
        Between the renames only the aside exists, and readers accept a valid aside as its step
        when the plain name is absent or invalid, so the step is findable at every moment;
        `_settle_aside` (next save of the step, or the next start) finishes a replace
        that died half way. Linux renameat2(RENAME_EXCHANGE) would swap atomically, but os does
        not expose it and not every filesystem has it; two renames plus a reader rule work on all.
        An existing invalid folder (hashes, or contents refused on load) is renamed to
        `.invalid-<time>` for a person to look at.
        """
        final = self.ckpt_dir / step_name(step)
        self._settle_aside(step)
        if final.exists() or final.is_symlink():
            # Full hash: deciding what to delete deserves more than the cache. A link is never valid.
            reason = "a symbolic link" if final.is_symlink() else invalid_reason(final)
            if reason is None and final.name not in self._refused:
                _rename(final, final.with_name(final.name + ASIDE_SUFFIX))
            else:
                _rename(final, final.with_name(f"{final.name}{INVALID}{aside_stamp()}"))
            fsync_dir(self.ckpt_dir)
        _rename(tmp, final)
        fsync_dir(self.ckpt_dir)
        self._verified[final.name] = (stat_key(final), None)  # every byte was hashed as written
        self._refused.discard(final.name)
        self._settle_aside(step)
        return final

    def _settle_aside(self, step: int) -> None:
        """Finish a replace of `step` that a crash interrupted (see _publish)."""
        final = self.ckpt_dir / step_name(step)
        aside = final.with_name(final.name + ASIDE_SUFFIX)
        if not aside.exists() or aside.is_symlink():  # a link is passed over by readers, never deleted
            return
        if self._reason(final, hashed=True) is None:  # a delete deserves a full hash
            self._delete(aside)  # the new copy made it in; the aside was going to be deleted
        elif not final.exists() and self._reason(aside, hashed=True) is None:
            _rename(aside, final)  # died between the renames: the old copy is still the step
            fsync_dir(self.ckpt_dir)
            self._verified.pop(aside.name, None)

    # Reading (callers hold self._lock).

    def _scan(self) -> dict[int, list[Path]]:
        """step -> candidate folders, `step-XXXXXXXX` before its aside. Skips `.tmp-*` silently."""
        return candidates(self.ckpt_dir, self._pass_over)

    def _valid_paths(self) -> dict[int, Path]:
        """step -> its valid folder; a folder whose contents were refused counts as neither valid
        (retention must not keep it instead of a good one) nor deletable."""
        found = self._scan()
        valid = {step: self._resolve(paths, hashed=False) for step, paths in found.items()}
        return {step: path for step, path in valid.items() if path is not None and path.name not in self._refused}

    def _resolve(self, paths: list[Path], hashed: bool) -> Path | None:
        """The first valid candidate; reports the invalid ones it passes over."""
        for path in paths:
            reason = self._reason(path, hashed)
            if reason is None:
                return path
            self._pass_over(path.name, reason)
        return None

    def _reason(self, folder: Path, hashed: bool) -> str | None:
        """Why `folder` is not a valid checkpoint (None: it is). `hashed`: every file hashed now
        (what a loader returns); else sizes only, or what an earlier check of the same file
        stats found (a hash failure holds until the files change)."""
        if folder.is_symlink():
            return "is a symbolic link; a checkpoint folder must be a real folder"
        key = stat_key(folder)
        cached = self._verified.get(folder.name)
        if key is not None and not hashed and cached is not None and cached[0] == key:
            return cached[1]
        reason = invalid_reason(folder, hash_files=hashed) if folder.exists() else "missing"
        if key is not None:
            self._verified[folder.name] = (key, reason)
        return reason

    def _pass_over(self, name: str, reason: str) -> None:
        if name not in self._reported:
            self._reported.add(name)
            self._emit("passed_over", checkpoint=name, reason=reason)

    def _emit(self, event: str, **fields) -> None:
        if self._on_event is None:
            return
        self._events.append((event, fields))
        self._flush_events()

    def _flush_events(self) -> None:
        if threading.current_thread() is self._thread:
            return  # the writer never calls on_event; the training thread delivers its events
        while self._events and self._on_event is not None:
            try:
                event, fields = self._events.popleft()
            except IndexError:
                return  # another caller drained it between the check and the pop
            self._on_event(event, **fields)
