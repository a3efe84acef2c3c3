"""Writes that survive a crash or a power cut: fsynced files, fsynced folders, atomic replace."""
from __future__ import annotations

import json
import os
from pathlib import Path


def fsync_dir(path: Path) -> None:
    """A rename or unlink is durable only once its directory is fsynced."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_json_atomic(path: Path, obj: dict, indent: int | None = None) -> None:
    """Replace `path` with `obj` as JSON: a reader sees the old file or the new one, never half."""
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        with open(tmp, "w") as f:
            json.dump(obj, f, indent=indent)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)
    fsync_dir(path.parent)
