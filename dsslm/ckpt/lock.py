"""One trainer per run.dir: the lock rank 0 takes before anything is written there.

    lock = RunLock(run_dir, stale_after_s=600)
    takeover = lock.acquire()   # LockHeld (exit 2, naming the holder); a dict when a dead holder's lock was taken
    ...
    lock.check()                # at every step boundary: LockLost if another trainer took run.dir over
    lock.release()

`run.dir/LOCK` is JSON: the holder's host, boot id, pid namespace, pid and that process's start
time, its start date, SLURM_JOB_ID / SLURM_RESTART_COUNT, TORCHELASTIC_RUN_ID /
TORCHELASTIC_RESTART_COUNT and a random token. It is written whole into a temp file and hard-linked
into place, so it appears complete or not at all (link(2) is atomic and exclusive on NFS too).
The holder refreshes its mtime every HEARTBEAT_S and checks that it still names the holder.

A lock is respected unless one of these shows its holder is gone; then it is taken over and the
caller reports the old holder:
- the same machine (boot id) and pid namespace, and that pid is not running, or is another process
  (its start time differs: the pid was reused);
- the same Slurm job at a later SLURM_RESTART_COUNT (a requeue), or the same torchrun run at a
  later TORCHELASTIC_RESTART_COUNT (a restart of the worker group), and its heartbeat has stopped
  (older than `restart_grace_s()`, two missed beats and a margin; acquire waits that long for a
  fresh one to stop). An id is not proof: `accelerate launch` and torchrun without --rdzv_id give
  every run TORCHELASTIC_RUN_ID=none (never trusted, like an empty one), and a user's --rdzv_id
  may be reused by an unrelated trainer; only a live holder keeps its heartbeat fresh;
- its heartbeat is older than `stale_after_s`, measured against a file just made in run.dir, so
  both times are the file server's clock and clock skew between nodes does not matter.
A takeover renames the stale file aside first (only one contender's rename of it succeeds), so two
trainers that start together on a stale lock never both win.
"""
from __future__ import annotations

import json
import os
import secrets
import socket
import threading
import time
from pathlib import Path
from typing import Any

from dsslm.fields import Fields, Int, Optional, StateError, Str, validate
from dsslm.config import ConfigError
from dsslm.durable import fsync_dir, pid_running

LOCK_FILE = "LOCK"
HEARTBEAT_S = 10.0
RESTART_GRACE_MARGIN_S = 5.0  # a slow beat on a loaded node or filesystem, on top of two missed beats
UNSET_IDS = ("", "none")  # no job id: torchrun without --rdzv_id and accelerate's static rendezvous say "none"
READ_RETRY_S = 30.0  # the longest a read error of LOCK is retried before the lock counts as lost
MAX_LOCK_BYTES = 64 << 10  # a lock is a few hundred bytes; anything bigger was not written by us
LOCK_SPEC = Fields(open=True, host=Str(255), boot_id=Str(64), pid_ns=Str(64), pid=Int(1, 2**31),
                     pid_start=Optional(Int(0)), started=Str(64), slurm_job_id=Str(64), slurm_restart=Int(0),
                     elastic_run_id=Str(255), elastic_restart=Int(0), token=Str(64))


class LockHeld(ConfigError):
    """Another live trainer holds run.dir (exit 2: the message names it)."""


class LockLost(RuntimeError):
    """run.dir/LOCK no longer names this trainer: another one took it over, or it was deleted."""


def _read_text(path: str) -> str:
    try:
        with open(path) as f:
            return f.read(256).strip()
    except OSError:
        return ""


def _pid_start(pid: int) -> int | None:
    """The process's start time in clock ticks since boot (/proc/PID/stat field 22); None if gone
    or unknown."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            stat = f.read()
        return int(stat[stat.rindex(")") + 2:].split()[19])  # fields after "(comm)" start at field 3
    except (OSError, ValueError, IndexError):
        return None


def _pid_ns() -> str:
    try:
        return os.readlink("/proc/self/ns/pid")
    except OSError:
        return ""


def identity() -> dict[str, Any]:
    """What this process writes into LOCK."""
    env = os.environ
    return {"host": socket.gethostname(), "boot_id": _read_text("/proc/sys/kernel/random/boot_id"),
            "pid_ns": _pid_ns(), "pid": os.getpid(), "pid_start": _pid_start(os.getpid()),
            "started": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "slurm_job_id": env.get("SLURM_JOB_ID", ""),
            "slurm_restart": int(env.get("SLURM_RESTART_COUNT") or 0),
            "elastic_run_id": env.get("TORCHELASTIC_RUN_ID", ""),
            "elastic_restart": int(env.get("TORCHELASTIC_RESTART_COUNT") or 0), "token": secrets.token_hex(8)}


def restart_grace_s() -> float:
    """How long a holder's heartbeat must have stopped before a restart rule may call it gone: a
    live holder refreshes LOCK every HEARTBEAT_S."""
    return 2 * HEARTBEAT_S + RESTART_GRACE_MARGIN_S


def restarted(holder: dict, me: dict) -> str | None:
    """The restart rule by which the holder's job came back as this process (a Slurm requeue, a
    torchrun restart), or None. Says nothing about whether the holder stopped: ids can be shared."""
    for job, restart in (("slurm_job_id", "slurm_restart"), ("elastic_run_id", "elastic_restart")):
        if holder[job].lower() not in UNSET_IDS and holder[job] == me[job] and me[restart] > holder[restart]:
            return f"{job} {holder[job]} restarted ({holder[restart]} -> {me[restart]})"
    return None


def gone_reason(holder: dict, me: dict, age_s: float, stale_after_s: float) -> str | None:
    """Why the holder of a lock is certainly gone, or None if it may be alive. Pure."""
    if _here(holder, me):
        pid = holder["pid"]
        start = _pid_start(pid)
        if not pid_running(pid):
            return f"pid {pid} is not running on {holder['host']}"
        if start is not None and holder["pid_start"] is not None and start != holder["pid_start"]:
            return f"pid {pid} on {holder['host']} is another process now (the holder's pid was reused)"
        return None  # alive here: its heartbeat does not matter
    rule = restarted(holder, me)
    if rule is not None and age_s > restart_grace_s():
        return f"{rule} and its heartbeat stopped {age_s:.0f} s ago: its old processes are gone"
    if age_s > stale_after_s:
        return f"its heartbeat is {age_s:.0f} s old (run.lock_stale_s={stale_after_s:g})"
    return None


def _here(holder: dict, me: dict) -> bool:
    """The holder runs on this machine, in this pid namespace: its pid says whether it is alive."""
    same_machine = holder["boot_id"] == me["boot_id"] if me["boot_id"] else holder["host"] == me["host"]
    return same_machine and holder["pid_ns"] == me["pid_ns"]


def _mtime(path: Path) -> float | None:
    try:
        return os.stat(path).st_mtime_ns
    except OSError:
        return None


def describe(holder: dict) -> str:
    slurm = f" (Slurm job {holder['slurm_job_id']})" if holder.get("slurm_job_id") else ""
    return f"pid {holder['pid']} on host {holder['host']}{slurm}, started {holder['started']}"


class RunLock:
    """The lock on one run.dir. Only rank 0 acquires; every rank may hold the object."""

    def __init__(self, run_dir: Path, stale_after_s: float = 600.0):
        self.run_dir = Path(run_dir)
        self.path = self.run_dir / LOCK_FILE
        self.stale_after_s = stale_after_s
        self.me: dict | None = None
        self._created: list[Path] = []   # folders acquire() made, removed again if still empty on release
        self._lost: str | None = None
        self._stop = threading.Event()
        self._heartbeat: threading.Thread | None = None

    # --- taking it ------------------------------------------------------------------------------
    def acquire(self) -> dict | None:
        """Take the lock; None, or {"previous": holder, "reason": why it was gone} after a takeover.
        LockHeld naming the holder when it may be alive; ConfigError when run.dir cannot be a folder."""
        self._make_run_dir()
        try:
            return self._take(identity())
        except BaseException:
            self.release()  # a stop signal just after the link: LOCK goes again, with the folders made
            raise

    def _take(self, me: dict) -> dict | None:
        takeover = None
        for _ in range(5):  # each lap either wins, meets a live holder, or clears a stale lock
            self.me = me  # before the link: whatever interrupts us after it, release() removes LOCK
            if self._link(me):
                self._start_heartbeat()
                return takeover
            self.me = None
            raw, holder, age_s = self._inspect()
            if raw is None:
                continue  # released between our link and our read
            reason = self._gone(holder, me, age_s)
            # Our own job's earlier run, if its heartbeat stops: wait and see. Not a holder alive on
            # this machine (the pid rule said so; waiting would only delay the refusal).
            rule = restarted(holder, me) if reason is None and holder is not None and not _here(holder, me) else None
            if rule is not None:
                settled = self._await_silence(raw)
                if settled is None:
                    continue  # LOCK changed meanwhile: judge it afresh
                holder, age_s = settled
                reason = self._gone(holder, me, age_s)
            if reason is None:
                what = describe(holder) if holder else f"an unreadable {self.path}"
                if rule is not None:
                    what += f" ({rule}, but it refreshed the lock while we watched: another trainer with the same id)"
                raise LockHeld(f"run.dir={self.run_dir} is in use by {what}, lock refreshed {age_s:.0f} s ago; "
                               f"stop that trainer or use another run.dir (a holder that is gone is taken over "
                               f"after run.lock_stale_s={self.stale_after_s:g} s, or delete {self.path})")
            if self._remove_stale(raw):
                takeover = {"previous": holder or {"unreadable": raw[:200].decode(errors="replace")},
                            "reason": reason}
        raise LockHeld(f"run.dir={self.run_dir}: could not take {self.path}, other trainers keep starting on it")

    def _make_run_dir(self) -> None:
        missing = [p for p in (self.run_dir, *self.run_dir.parents) if not p.exists()]
        try:
            self.run_dir.mkdir(parents=True, exist_ok=True)
        except (FileExistsError, NotADirectoryError):
            raise ConfigError(f"run.dir={self.run_dir} is a file (or under one); point run.dir at a folder") from None
        except OSError as exc:
            raise ConfigError(f"run.dir={self.run_dir} cannot be created ({exc.strerror}); "
                              f"point run.dir at a folder you can write") from None
        if not self.run_dir.is_dir():
            raise ConfigError(f"run.dir={self.run_dir} is not a folder; point run.dir at a folder")
        self._created = missing  # deepest first

    def _link(self, me: dict) -> bool:
        """Create LOCK holding `me`, whole, unless it exists."""
        tmp = self.run_dir / f".{LOCK_FILE}.tmp-{me['token']}"
        try:
            with open(tmp, "x") as f:
                json.dump(me, f)
                f.flush()
                os.fsync(f.fileno())
            try:
                os.link(tmp, self.path)
            except FileExistsError:
                return False
            except OSError:  # a filesystem without hard links: exclusive create (a reader may see it empty)
                try:
                    fd = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
                except FileExistsError:
                    return False
                with os.fdopen(fd, "w") as f:
                    json.dump(me, f)
        except OSError as exc:
            raise ConfigError(f"run.dir={self.run_dir}: cannot write {self.path} ({exc.strerror}); "
                              f"point run.dir at a folder you can write") from None
        finally:
            tmp.unlink(missing_ok=True)
        fsync_dir(self.run_dir)
        return True

    def _inspect(self) -> tuple[bytes | None, dict | None, float]:
        """(raw bytes, the holder if well formed, heartbeat age in s) of LOCK; raw None if it is gone."""
        try:
            st = os.lstat(self.path)
            if not os.path.isfile(self.path) or os.path.islink(self.path) or st.st_size > MAX_LOCK_BYTES:
                return b"not a small regular file", None, self._fs_now() - st.st_mtime
            raw = self.path.read_bytes()
        except FileNotFoundError:
            return None, None, 0.0
        try:
            holder = json.loads(raw)
            validate(holder, LOCK_SPEC, LOCK_FILE)
        except (ValueError, StateError):
            holder = None  # written by no dsslm: only its age can say it is abandoned
        return raw, holder, self._fs_now() - st.st_mtime

    def _gone(self, holder: dict | None, me: dict, age_s: float) -> str | None:
        if holder is None:
            return f"it is unreadable and {age_s:.0f} s old" if age_s > self.stale_after_s else None
        return gone_reason(holder, me, age_s, self.stale_after_s)

    def _await_silence(self, raw: bytes) -> tuple[dict | None, float] | None:
        """Watch LOCK until its heartbeat is older than restart_grace_s() (gone) or it beats again
        (alive): (holder, heartbeat age) either way; None when LOCK changed (released, replaced)
        meanwhile. Ends on what LOCK shows, not on a clock started here: a deadline from the start
        of the watch refused a holder whose age was a hair under the grace (file times are coarser
        than the watch), and one that beat once and stopped, as "went on"."""
        grace = restart_grace_s()
        first = None
        for _ in range(int(4 * grace / (HEARTBEAT_S / 10)) + 2):  # bounded: an age that never grows (a clock jump)
            seen, holder, age_s = self._inspect()
            if seen != raw:
                return None
            if age_s > grace:
                return holder, age_s
            beat = _mtime(self.path)
            if first is None:
                first = beat
            elif beat != first:
                return holder, age_s  # it refreshed LOCK: alive
            time.sleep(min(HEARTBEAT_S / 10, max(0.0, grace - age_s) + 0.01))
        return holder, age_s

    def _fs_now(self) -> float:
        """Now, by the clock that stamps files in run.dir (the file server's, on a network filesystem)."""
        probe = self.run_dir / f".{LOCK_FILE}.probe-{secrets.token_hex(4)}"
        try:
            probe.touch()
            return probe.stat().st_mtime
        except OSError:
            return time.time()
        finally:
            probe.unlink(missing_ok=True)

    def _remove_stale(self, raw: bytes) -> bool:
        """Move the stale LOCK aside; True if what we moved was the file we judged (so it is gone)."""
        aside = self.run_dir / f".{LOCK_FILE}.stale-{secrets.token_hex(4)}"
        try:
            os.rename(self.path, aside)  # atomic: of two contenders, one moves it and one finds nothing
        except FileNotFoundError:
            return False
        try:
            if aside.read_bytes() == raw:
                return True
            # Someone replaced the stale lock between our read and our rename: put theirs back. If a
            # third trainer got in meanwhile, the displaced one sees at its next heartbeat that LOCK
            # no longer names it and stops (LockLost).
            try:
                os.link(aside, self.path)
            except OSError:
                pass
            return False
        finally:
            aside.unlink(missing_ok=True)
            fsync_dir(self.run_dir)

    # --- holding it -----------------------------------------------------------------------------
    def _start_heartbeat(self) -> None:
        self._heartbeat = threading.Thread(target=self._beat, name="dsslm-lock-heartbeat", daemon=True)
        self._heartbeat.start()

    def _beat(self) -> None:
        while not self._stop.wait(HEARTBEAT_S):
            reason = self.holds()
            if reason is not None:
                self._lost = reason
                return
            try:
                os.utime(self.path)  # now, by the file server's clock
            except OSError:
                pass  # a transient error on a network filesystem; the next beat retries

    @property
    def read_retry_s(self) -> float:
        """How long a LOCK that cannot be read is taken for a transient fault of a shared filesystem
        (an NFS timeout, a stale handle) and read again: well inside the time after which another
        node could call our heartbeat stale, so we stop before anyone could take run.dir over."""
        return min(READ_RETRY_S, self.stale_after_s / 4)

    def holds(self) -> str | None:
        """None while LOCK names this trainer; else what happened to it. A read error is retried
        until `read_retry_s` has passed, and only then taken as losing the lock."""
        deadline, wait = time.monotonic() + self.read_retry_s, 0.05
        while True:
            try:
                with open(self.path, "rb") as f:  # bounded: LOCK could have been replaced by anything
                    holder = json.loads(f.read(MAX_LOCK_BYTES))
                break
            except FileNotFoundError:
                return f"{self.path} was deleted while this trainer held it"
            except (OSError, ValueError) as exc:
                left = deadline - time.monotonic()
                if left <= 0:
                    return f"{self.path} stayed unreadable for {self.read_retry_s:.0f} s ({exc})"
                time.sleep(min(wait, left))
                wait = min(wait * 2, 2.0)
        if not isinstance(holder, dict) or holder.get("token") != self.me["token"]:
            who = describe(holder) if isinstance(holder, dict) and "pid" in holder else "something else"
            return f"{self.path} now names {who}"
        return None

    def check(self, fresh: bool = False) -> None:
        """LockLost if run.dir was taken over (from the last heartbeat, or read now if `fresh`)."""
        if self.me is None:
            return
        reason = self._lost or (self.holds() if fresh else None)
        if reason is not None:
            self._lost = reason
            raise LockLost(f"{reason}; stopping so that two trainers never write into run.dir={self.run_dir}")

    def release(self) -> None:
        """Delete LOCK if it still names us, and the folders acquire() made if they stayed empty."""
        self._stop.set()
        if self._heartbeat is not None:
            self._heartbeat.join()  # it wakes at once: never touching a LOCK that is no longer ours
        if self.me is not None and self.holds() is None:
            self.path.unlink(missing_ok=True)
            fsync_dir(self.run_dir)
        self.me = None
        self._remove_created()

    def _remove_created(self) -> None:
        for folder in self._created:
            try:
                folder.rmdir()  # only an empty folder: a run that wrote nothing leaves no trace
            except OSError:
                break
        self._created = []

