"""The data manifest (`DATA_DIR/manifest.json`): read it, check the shards it names, hash it.

Written last by `prepare`, so a DATA_DIR without it is no dataset. Format: docs/design.md.
"""
from __future__ import annotations

import hashlib
import json
from pathlib import Path

import numpy as np

from dsslm.data.sources import DataError
from dsslm.data.tokenizer import load_tokenizer
from dsslm.durable import file_sha256

MANIFEST_FILE = "manifest.json"
FORMAT = 1


def load_manifest(data_dir: str | Path, verify: bool = True) -> dict:
    """The manifest of `data_dir`, after checking every shard's size (and sha256 if `verify`)."""
    data_dir = Path(data_dir)
    path = data_dir / MANIFEST_FILE
    if not path.is_file():
        raise DataError(f"{data_dir} has no {MANIFEST_FILE}; build it with "
                        f"`python -m dsslm.data prepare --input PATH --out {data_dir}`")
    try:
        manifest = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise DataError(f"{path} is unreadable ({e}); rebuild {data_dir} with prepare") from e
    if manifest.get("format") != FORMAT:
        raise DataError(f"{path} has format {manifest.get('format')!r}, not {FORMAT}; rebuild it with prepare")
    itemsize = np.dtype(manifest["dtype"]).itemsize
    for domain in manifest["domains"].values():
        for entry in domain["train"] + domain["val"]:
            _check_shard(data_dir, entry, itemsize, verify)
    if verify:
        verify_tokenizer(data_dir, manifest)
    return manifest


def verify_tokenizer(data_dir: Path, manifest: dict) -> None:
    """DataError unless the tokenizer file in `data_dir` is the one the manifest pins."""
    if manifest["tokenizer"]["kind"] == "bpe":
        try:
            load_tokenizer(data_dir, manifest)
        except ValueError as e:
            raise DataError(str(e)) from e


def verify_split(data_dir: str | Path, manifest: dict, split: str) -> None:
    """Hash one split's shards (every domain's): a tool that reads only the val shards checks only
    those, instead of every train shard of a large corpus."""
    itemsize = np.dtype(manifest["dtype"]).itemsize
    for domain in manifest["domains"].values():
        for entry in domain[split]:
            _check_shard(Path(data_dir), entry, itemsize, verify=True)


def _check_shard(data_dir: Path, entry: dict, itemsize: int, verify: bool) -> None:
    path = data_dir / entry["path"]
    if not path.is_file():
        raise DataError(f"shard {path} is missing; rebuild {data_dir} with prepare")
    count = entry.get("bytes", 0)
    if isinstance(count, bool) or not isinstance(count, int) or count < 0:
        raise DataError(f"shard {path}: manifest.json's bytes {count!r} is not a count; rebuild {data_dir} with prepare")
    size = path.stat().st_size
    if size != entry["tokens"] * itemsize:
        raise DataError(f"shard {path} has {size} bytes but manifest.json says {entry['tokens']} tokens "
                        f"({entry['tokens'] * itemsize} bytes); rebuild {data_dir} with prepare")
    if verify and file_sha256(path) != entry["sha256"]:
        raise DataError(f"shard {path} does not match its sha256 in manifest.json; rebuild {data_dir} with prepare")


def manifest_hash(manifest: dict) -> str:
    """sha256 of what decides the token stream: tokenizer, dtype and every shard's hash.

    `sources` (absolute input paths) are left out: the same corpus prepared on another
    machine, or copied elsewhere, hashes the same."""
    domains = {name: {"train": d["train"], "val": d["val"]} for name, d in manifest["domains"].items()}
    core = {"tokenizer": manifest["tokenizer"], "dtype": manifest["dtype"], "domains": domains}
    return hashlib.sha256(json.dumps(core, sort_keys=True, separators=(",", ":")).encode()).hexdigest()


def tokenizer_hash(manifest: dict) -> str:
    return manifest["tokenizer"]["sha256"]
