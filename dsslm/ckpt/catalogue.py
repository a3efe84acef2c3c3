"""The catalogue of what is on disk under `run_dir/checkpoints/`: which folders are checkpoints,
which verify, and every change to them but a save's own writes (publish, replace, retention,
deletes, folders set aside, the start's housekeeping). `store.CheckpointStore`, the writer, is one.

The rules it keeps:
- Folders that do not verify, or whose contents the caller's `accept` refuses (a state.json
  field out of range, a tensor of the wrong shape), are passed over (one `passed_over` event
  each) and never deleted. dsslm deletes only what it renamed `.deleting-*` itself: a delete
  renames first, so a `step-XXXXXXXX` without MANIFEST is never its own half delete (a lost
  MANIFEST, a foreign folder, an older dsslm's delete); the next start sets it aside as
  `.invalid-*` for a person. Of the temp names, a start deletes only those its saves make
  (`.tmp-step-XXXXXXXX-<pid>-<hex>`, OWN_TMP_RE) and sets any other `.tmp-*` aside the same way.
- What is loaded is hashed in full first; retention bookkeeping (which folders count, which
  to delete, what the loop pins) is not: it checks each MANIFEST, the file list and every
  file's size, and remembers every full-hash failure. So the first save after a restart costs
  no hashing on the training thread, however many checkpoints are kept, and a folder whose
  bytes rotted at the same size is caught when something loads it (then passed over, and no
  longer counted). Only an `.replaced` aside is deleted on the word of a full hash.
- on_event is only ever called from the training thread: events the writer produces are queued
  and delivered by the next call into the store, so a non-thread-safe logger is fine.
"""
from __future__ import annotations

import collections
import os
import re
import secrets
import shutil
import threading
import time
from pathlib import Path
from typing import Callable, Iterable

from dsslm.ckpt.format import (ASIDE_SUFFIX, DELETING, DELETING_RE, INVALID, MANIFEST, Checkpoint, CheckpointError,
                               candidates, invalid_reason, load_verified, parse_name, stat_key, step_name)
from dsslm.durable import fsync_dir
from dsslm.fields import StateError

# A check of a loaded checkpoint's contents: raises CheckpointError or StateError saying why not.
Accept = Callable[[Checkpoint], None]


def aside_stamp() -> str:
    """A unique suffix for a folder set aside (time, then random: two in one second differ)."""
    return f"{time.strftime('%Y%m%dT%H%M%S')}-{secrets.token_hex(2)}"


def _rename(src: Path, dst: Path) -> None:
    """Every rename of a checkpoint folder goes through here, so a test can crash between two."""
    os.rename(src, dst)


# The temp folders of dsslm's own saves, the only `.tmp-*` names a start may delete: store.py's
# `_write` (4 random bytes) and `make_tmp` (8). Another tool's `.tmp-*` in checkpoints/ may be its
# work in progress or a person's copy; it is set aside instead (FOREIGN_TMP).
OWN_TMP_RE = re.compile(r"\.tmp-step-[0-9]{8}-[0-9]+-(?:[0-9a-f]{8}|[0-9a-f]{16})")
FOREIGN_TMP = ("a temp name that no dsslm save makes (not .tmp-step-XXXXXXXX-<pid>-<hex>), so not dsslm's to "
               "delete; set aside as {aside}, which nothing reads or deletes: look at it, then remove it by hand "
               "(docs/checkpoints.md)")

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


class Catalogue:
    """The checkpoints under `run_dir/checkpoints/`. Call it from one training thread."""

    def __init__(self, run_dir, keep_last: int = 3, keep_every: int = 0,
                 on_event: Callable[..., None] | None = None, fence: Callable[[], None] | None = None):
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
        self._crash_in_delete: tuple[int, int] = (-1, 0)
        # Guards every rename, delete and read of checkpoint folders (writer vs training thread).
        self._lock = threading.RLock()
        # name -> (stat_key, reason): a reason found by hashing holds until the files change.
        self._verified: dict[str, tuple[tuple, str | None]] = {}
        self._reported: set[str] = set()
        self._refused: set[str] = set()  # verified, but their contents were refused on load
        self._pinned: set[int] = set()
        self._events: collections.deque = collections.deque()
        self._thread: threading.Thread | None = None  # the writer's (store.py); it never calls on_event

    def die_in_delete(self, step: int, after: int) -> None:
        """Fault drill: the delete of checkpoint `step` (retention's, or a replace's aside) hard-exits
        the process once `after` of its changes are made: the rename is the first, then each file
        and folder removed; 0 dies before the rename."""
        self._crash_in_delete = (step, after)

    # At start, by the run.dir lock's holder.

    def remove_leftovers(self) -> list[str]:
        """At start, by the run.dir lock's holder (so no save or delete of another process is in
        progress): delete dsslm's own `checkpoints/.tmp-step-*` temp folders, saves that a kill cut
        short, and return their names; set aside any other `.tmp-*` (`set_aside_foreign_tmp`);
        finish the deletes and replaces a kill cut short; set aside folders without MANIFEST."""
        removed = []
        if not self.ckpt_dir.is_dir():
            return removed
        for path in sorted(self.ckpt_dir.glob(".tmp-*")):
            if not OWN_TMP_RE.fullmatch(path.name):
                continue
            if path.is_symlink() or not path.is_dir():
                path.unlink()  # a link is removed, never followed
            else:
                shutil.rmtree(path)
            removed.append(path.name)
        if removed:
            fsync_dir(self.ckpt_dir)
        self.set_aside_foreign_tmp()
        self.finish_deletes()  # their own events: checkpoint folders, not temp ones
        self.set_aside_unfinished()
        self.settle_replaces()
        return removed

    def set_aside_foreign_tmp(self) -> list[str]:
        """Rename each `.tmp-*` entry whose name no dsslm save makes (a folder, file or link, never
        followed) to `<name>.invalid-<time>` (one `passed_over` event each), as a folder without
        MANIFEST is set aside; one set aside before is left as it is. For the run.dir lock's holder.
        Returns the new names."""
        moved = []
        with self._lock:
            for name in sorted(os.listdir(self.ckpt_dir)) if self.ckpt_dir.is_dir() else ():
                if not name.startswith(".tmp-") or OWN_TMP_RE.fullmatch(name) or INVALID in name:
                    continue
                path = self.ckpt_dir / name
                base = os.fsdecode(os.fsencode(name)[:200])  # the suffix must not push it past NAME_MAX
                aside = path.with_name(f"{base}{INVALID}{aside_stamp()}")
                _rename(path, aside)
                moved.append(aside.name)
                self._emit("passed_over", checkpoint=name, reason=FOREIGN_TMP.format(aside=aside.name),
                           set_aside=aside.name)
            if moved:
                fsync_dir(self.ckpt_dir)
        return moved

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

    # Reading.

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

    # Changes: every rename and delete of a checkpoint folder.

    def leave_after(self, step: int) -> list[str]:
        """A rewind to `step`: the checkpoints after it belong to the trajectory the run left. Each
        is renamed `left-step-XXXXXXXX-<time>-<hex>` (a name no reader, resume or retention looks
        at), not deleted: kept for a person, and no resume after a preemption mid-replay can pick
        a newer step of the left trajectory over the replay's own checkpoint. Fenced like a save: a trainer that lost run.dir's
        lock must not set aside the new holder's checkpoints. Returns the new names."""
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
