"""Hashing a DATA_DIR's shards at start, at any corpus size: each shard once, in parallel.

`data.verify=true`: a shard whose sha256 was computed before, and whose (size, mtime_ns,
ctime_ns) are still those it had then, is not hashed again; everything else is. The digests
are cached in `DATA_DIR/.dsslm-verified.json` (or, where DATA_DIR is read-only, in the run's
folder), replaced atomically. The cache is read without being trusted: an entry that is
malformed, names a file of another size or time, holds a digest other than the manifest's, or
read the tokens in another dtype than the manifest's, is a miss, and the shard is hashed. The
ctime cannot be set by a user (touch, utime, a copy
that keeps times all change it), so editing a shard in place and restoring its mtime is a miss
too. What no file time reveals (bits rotting on the disk, a deliberately forged cache) is what
`data.verify=full` is for: it ignores the cache, hashes every shard and rewrites the cache.

The work is split for a multi-rank start: rank 0 reads the cache and decides which shards need
hashing (`plan_hashing`, one plan for every rank); each rank hashes its share (`share_of`,
balanced by bytes) in threads (`hash_shards`); every rank checks all the digests
(`check_digests`: the same verdict everywhere) and rank 0 writes the cache (`update_cache`).
"""
from __future__ import annotations

import hashlib
import json
import os
import re

import numpy as np
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Callable

from dsslm.data.manifest import DTYPES, verify_tokenizer
from dsslm.data.sources import DataError
from dsslm.durable import write_json_atomic

CACHE_FILE = ".dsslm-verified.json"
CACHE_FORMAT = 1
READ_BYTES = 8 << 20      # one read per hash update: large enough that sha256 releases the GIL for it
MAX_THREADS = 8           # per rank: sha256 runs ~1-2 GB/s a core, so 8 saturate most disks
MAX_CACHE_BYTES = 64 << 20
_HEX64 = re.compile(r"[0-9a-f]{64}")


def cache_path(data_dir: Path, fallback_dir: Path) -> Path:
    """Where the verification cache lives: DATA_DIR, or `fallback_dir` where DATA_DIR is read-only."""
    return data_dir / CACHE_FILE if os.access(data_dir, os.W_OK) else fallback_dir / CACHE_FILE


def shard_entries(manifest: dict) -> list[dict]:
    return [e for domain in manifest["domains"].values() for e in domain["train"] + domain["val"]]


def _stat(path: Path) -> list[int]:
    st = path.stat()
    return [st.st_size, st.st_mtime_ns, st.st_ctime_ns]


def read_cache(path: Path) -> dict[str, dict]:
    """The well-formed entries of a cache file: {shard path: {"stat": [size, mtime_ns, ctime_ns],
    "sha256": hex, "max_token": int, "dtype": name}}; anything else in it is dropped, and an
    unreadable file is an empty cache."""
    try:
        if path.stat().st_size > MAX_CACHE_BYTES:
            return {}
        raw = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    shards = raw.get("shards") if isinstance(raw, dict) and raw.get("format") == CACHE_FORMAT else None
    if not isinstance(shards, dict):
        return {}
    return {name: entry for name, entry in shards.items() if _well_formed(entry)}


def _well_formed(entry) -> bool:
    if not isinstance(entry, dict) or not isinstance(entry.get("sha256"), str) or not _HEX64.fullmatch(entry["sha256"]):
        return False
    stat, top = entry.get("stat"), entry.get("max_token")
    if not isinstance(top, int) or isinstance(top, bool) or top < -1:
        return False  # a cache from before the token range was checked: hashed (and ranged) once more
    if entry.get("dtype") not in DTYPES:
        return False  # a cache from before max_token was tied to its dtype: hashed once more
    return (isinstance(stat, list) and len(stat) == 3
            and all(isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in stat))


def plan_hashing(data_dir: Path, manifest: dict, cache: Path, full: bool) -> dict:
    """Which shards need hashing: [[path, bytes], ...] and how many the cache vouches for. Checks
    the tokenizer file against the manifest too (it is small: hashed every time)."""
    verify_tokenizer(data_dir, manifest)
    known = {} if full else read_cache(cache)
    todo, cached, cached_bytes = [], 0, 0
    for entry in shard_entries(manifest):
        stat = _stat(data_dir / entry["path"])
        hit = known.get(entry["path"])
        # max_token was read in the dtype of the manifest that hashed the shard: the same bytes read
        # in another dtype hold other ids (two uint16 ids are one uint32), so that is a miss too.
        if (hit is not None and hit["stat"] == stat and hit["sha256"] == entry["sha256"]
                and hit["dtype"] == manifest["dtype"] and hit["max_token"] < manifest["tokenizer"]["vocab_size"]):
            cached, cached_bytes = cached + 1, cached_bytes + stat[0]
        else:
            todo.append([entry["path"], stat[0]])
    return {"hash": todo, "cached": cached, "cached_bytes": cached_bytes}


def share_of(todo: list, rank: int, world_size: int) -> list[str]:
    """Rank `rank`'s shards: largest first, each to the least-loaded rank (ties: lowest rank)."""
    loads = [0] * world_size
    mine = []
    for path, size in sorted(todo, key=lambda t: (-t[1], t[0])):
        r = loads.index(min(loads))
        loads[r] += size
        if r == rank:
            mine.append(path)
    return mine


def hash_shards(data_dir: Path, paths: list[str], progress: Callable[[int], None],
                 dtype: str = "uint16") -> dict[str, dict]:
    """{path: {"stat", "sha256", "max_token", "dtype"}} for these shards (tokens of `dtype`),
    hashed in threads; `progress(bytes)` is called as they go (from the threads)."""
    if not paths:
        return {}
    threads = min(len(paths), MAX_THREADS, len(os.sched_getaffinity(0)))
    with ThreadPoolExecutor(threads, thread_name_prefix="dsslm-hash") as pool:
        digests = list(pool.map(lambda p: _hash_one(data_dir / p, progress, np.dtype(dtype)), paths))
    return dict(zip(paths, digests))


def _hash_one(path: Path, progress: Callable[[int], None], dtype: np.dtype) -> dict:
    """The shard's sha256 and its largest token id, from one read (the max costs a few percent)."""
    before = _stat(path)
    digest, buffer = hashlib.sha256(), bytearray(READ_BYTES)
    view, top, carry = memoryview(buffer), -1, b""
    with open(path, "rb", buffering=0) as f:
        while n := f.readinto(buffer):
            digest.update(view[:n])
            chunk = carry + bytes(view[:n]) if carry else view[:n]
            whole = len(chunk) - len(chunk) % dtype.itemsize
            if whole:
                top = max(top, int(np.frombuffer(chunk[:whole], dtype=dtype).max()))
            carry = bytes(chunk[whole:])
            progress(n)
    if _stat(path) != before:
        raise DataError(f"shard {path} changed while it was being hashed; is a prepare still writing "
                        f"{path.parent.parent}? Wait for it, then start again")
    return {"stat": before, "sha256": digest.hexdigest(), "max_token": top, "dtype": dtype.name}


def check_digests(data_dir: Path, manifest: dict, found: dict[str, dict]) -> None:
    """DataError naming the first shard whose digest is not the manifest's, or that holds a token
    id beyond the tokenizer's vocabulary (the embedding would be indexed out of range)."""
    vocab = manifest["tokenizer"]["vocab_size"]
    for entry in shard_entries(manifest):
        got = found.get(entry["path"])
        if got is not None and got["sha256"] != entry["sha256"]:
            raise DataError(f"shard {data_dir / entry['path']} does not match its sha256 in manifest.json; "
                            f"rebuild {data_dir} with prepare")
        if got is not None and got.get("max_token", -1) >= vocab:
            raise DataError(f"shard {data_dir / entry['path']} holds token id {got['max_token']}, beyond the "
                            f"tokenizer's vocabulary (vocab_size {vocab}); rebuild {data_dir} with prepare")


def update_cache(cache: Path, manifest: dict, found: dict[str, dict]) -> None:
    """Merge these digests into the cache (entries for shards the manifest no longer names go).
    Raises OSError when it cannot be written; the caller says so and carries on."""
    names = {e["path"] for e in shard_entries(manifest)}
    shards = {k: v for k, v in read_cache(cache).items() if k in names}
    shards.update(found)
    cache.parent.mkdir(parents=True, exist_ok=True)  # the run's folder, for a read-only DATA_DIR
    write_json_atomic(cache, {"format": CACHE_FORMAT, "shards": dict(sorted(shards.items()))})


def node_of(ranks_hosts: list[str], rank: int) -> list[int]:
    """The ranks that share `rank`'s machine (by host name), ascending: one node's copy of DATA_DIR.
    Every node verifies the copy its own ranks read; its first rank plans and keeps the cache."""
    return [r for r, host in enumerate(ranks_hosts) if host == ranks_hosts[rank]]


def digest_problem(data_dir: Path, manifest: dict, found: dict[str, dict], host: str) -> str | None:
    """check_digests' verdict as a line naming the machine (None: every digest agrees), for the
    ranks to exchange: a node's bad copy must stop every rank, not only that node's."""
    try:
        check_digests(data_dir, manifest, found)
    except DataError as exc:
        return f"on {host}: {exc}"
    return None

