"""File mechanics, in one place: writes that survive a crash or a power cut (fsynced files, fsynced
folders, an atomic replace of a file, an atomic publish of a folder), the mode a file of the run
gets, the hash of a file, and whether the process that owns a file (a lock, a temp folder) is still
running."""
from __future__ import annotations

import hashlib
import json
import os
import time
from pathlib import Path

READ_BLOCK = 1 << 20  # file_sha256 reads in blocks this size, each counted as it goes


class Moved:
    """Bytes this process's checkpoint files have moved, counted as they go (`read` by hashing,
    `written` by the writer thread, `peers`: the other ranks' progress its writer waits on): the
    watchdog's evidence that a slow load or write is working, not stuck (health/door.py). Each
    counter has one writing thread at a time, so a plain add is enough. The drills' rates
    (faults.write_mb_s, faults.load_mb_s) make them as slow as a network filesystem."""

    def __init__(self) -> None:
        self.read = self.written = self.peers = 0
        self.read_rate = self.write_rate = 0.0  # bytes a second; 0: as fast as the disk goes

    def add_read(self, n: int) -> None:
        self.read += n
        if self.read_rate > 0:
            time.sleep(n / self.read_rate)

    def add_written(self, n: int) -> None:
        self.written += n
        if self.write_rate > 0:
            time.sleep(n / self.write_rate)


IO = Moved()


def umask() -> int:
    """The process's umask, read without setting it: os.umask's set-and-restore leaves a window in
    which a file another thread creates gets mode 0666 (Linux >= 4.7 shows it in /proc)."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("Umask:"):
                    return int(line.split()[1], 8)
    except (OSError, ValueError, IndexError):
        pass
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def file_mode() -> int:
    """The mode open() gives a new file, 0666 less the umask: what the run's files must have so a
    lab mate can read them on a shared filesystem. mkstemp and safetensors' save_file make 0600."""
    return 0o666 & ~umask()


def fsync_dir(path: Path) -> None:
    """A rename or unlink is durable only once its directory is fsynced."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_json_atomic(path: Path, obj: dict, indent: int | None = None, replace: bool = True) -> None:
    """Replace `path` with `obj` as JSON: a reader sees the old file or the new one, never half.
    replace=False: FileExistsError where `path` exists (a file someone made meanwhile is kept)."""
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        with open(tmp, "w") as f:
            json.dump(obj, f, indent=indent)
            f.flush()
            os.fsync(f.fileno())
        if replace:
            os.replace(tmp, path)
        else:
            try:
                os.link(tmp, path)  # atomic and never over an existing name, unlike a check then a replace
            except FileExistsError:
                raise
            except OSError:  # a filesystem without hard links (some FUSE, SMB, vfat mounts)
                with open(path, "x") as f:  # still never over an existing name; whole once fsynced
                    json.dump(obj, f, indent=indent)
                    f.flush()
                    os.fsync(f.fileno())
    finally:
        tmp.unlink(missing_ok=True)
    fsync_dir(path.parent)


def fsync_file(path: Path) -> None:
    with open(path, "rb") as f:
        os.fsync(f.fileno())


def publish_folder(tmp: Path, final: Path) -> None:
    """Make the finished folder `tmp` appear at `final` whole or not at all: its files and the folder
    fsynced, one rename (which fails where `final` exists and is not empty: nothing is replaced),
    then the parent fsynced so the rename survives a power cut. The checkpoint store has its own,
    fenced, variant (it checks run.dir's lock between the steps)."""
    for path in tmp.iterdir():
        if path.is_file() and not path.is_symlink():
            fsync_file(path)
    fsync_dir(tmp)
    os.rename(tmp, final)
    fsync_dir(final.parent)


def file_sha256(path: str | Path) -> str:
    """The SHA-256 of a file's bytes, read in blocks (a checkpoint shard need not fit in memory)."""
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(READ_BLOCK):
            digest.update(block)
            IO.add_read(len(block))  # a load's progress, block by block (the watchdog's evidence)
    return digest.hexdigest()


def pid_running(pid: int) -> bool:
    """Whether process `pid` is running on this host (for a lock holder, or a killed prepare's
    temp folder): another user's process counts as running, and so does a number no pid can be."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except (PermissionError, OverflowError):
        return True
    return True
