"""The data manifest (`DATA_DIR/manifest.json`): read it, check the shards it names, hash it.

Written last by `prepare`, so a DATA_DIR without it is no dataset. Format: docs/design.md.
"""
from __future__ import annotations

import hashlib
import json
import os
import re
import stat
from pathlib import Path

import numpy as np

from dsslm.data.sources import DataError
from dsslm.data.tokenizer import load_tokenizer
from dsslm.durable import file_sha256
from dsslm.fields import shard_path_problem

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
    except (OSError, ValueError, RecursionError) as e:  # RecursionError: nesting json cannot parse
        raise DataError(f"{path} is unreadable ({e}); rebuild {data_dir} with prepare") from e
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
        got = manifest.get("format") if isinstance(manifest, dict) else type(manifest).__name__
        raise DataError(f"{path} has format {got!r}, not {FORMAT}; rebuild it with prepare")
    check_manifest(data_dir, manifest)
    itemsize = np.dtype(manifest["dtype"]).itemsize
    for domain in manifest["domains"].values():
        for entry in domain["train"] + domain["val"]:
            _check_shard(data_dir, entry, itemsize, verify)
    if verify:
        verify_tokenizer(data_dir, manifest)
    return manifest


DTYPES = ("uint16", "uint32")  # what prepare writes: the smallest that holds the vocabulary
_HEX64 = re.compile(r"[0-9a-f]{64}")
_MAX_TOKENS = 2**62


def check_manifest(data_dir: Path, manifest: dict) -> None:
    """Every field a reader relies on, before anything is read or allocated by it: a manifest may
    come from another machine or tool. DataError naming the field. A shard path is spelled as a
    skip entry must spell it (`fields.shard_path_problem`: the loader copies it into skip entries)
    and stays inside DATA_DIR (no link leading out): a manifest cannot make a run read, or hash, a
    file elsewhere. Each names a different file: a skip entry names a shard by its path, so a file
    listed twice (to upweight it, or in two domains) would be skipped under one listing only."""
    where = data_dir / MANIFEST_FILE

    def bad(field: str, value, want: str, fix: str = "") -> DataError:
        return DataError(f"{where}: {field} is {str(value)[:80]!r}, expected {want}; {fix}rebuild {data_dir} "
                         "with prepare")

    tok = manifest.get("tokenizer")
    if not isinstance(tok, dict) or tok.get("kind") not in ("byte", "bpe", "file"):
        raise bad("tokenizer", tok, "an object with kind byte, bpe or file")
    vocab = tok.get("vocab_size")
    if not _is_int(vocab) or not 1 <= vocab <= 2**31:
        raise bad("tokenizer.vocab_size", vocab, "an integer in [1, 2^31]")
    if not _is_int(tok.get("eos_id")) or not 0 <= tok["eos_id"] < vocab:
        raise bad("tokenizer.eos_id", tok.get("eos_id"), f"an integer in [0, {vocab})")
    if not isinstance(tok.get("sha256"), str) or not _HEX64.fullmatch(tok["sha256"]):
        raise bad("tokenizer.sha256", tok.get("sha256"), "64 hex digits")
    dtype = manifest.get("dtype")
    if dtype not in DTYPES:
        raise bad("dtype", dtype, " or ".join(DTYPES))
    if vocab > 1 << (8 * np.dtype(dtype).itemsize):
        raise bad("dtype", dtype, f"one that holds token ids up to {vocab - 1} (tokenizer.vocab_size)")
    domains = manifest.get("domains")
    if not isinstance(domains, dict) or not domains:
        raise bad("domains", domains, "an object with at least one domain")
    root, seen, folders = os.path.realpath(data_dir), {}, {}
    for name, domain in domains.items():
        if not isinstance(domain, dict) or not all(isinstance(domain.get(s), list) for s in ("train", "val")):
            raise bad(f"domains.{name}", domain, "an object with train and val lists")
        for split in ("train", "val"):
            for i, entry in enumerate(domain[split]):
                field = f"domains.{name}.{split}[{i}]"
                if not isinstance(entry, dict):
                    raise bad(field, entry, "an object")
                rel = entry.get("path")
                problem = shard_path_problem(rel)
                if problem is not None:  # the string itself: skip entries copy it (fields.shard_path_problem)
                    raise bad(f"{field}.path", rel, f"a relative shard path such as {name}/train-00000.bin "
                              f"({problem})", _respelled(rel))
                resolved = _resolved(data_dir, rel, folders)  # relative, no '..': shard_path_problem
                if resolved is None or not (resolved == root or resolved.startswith(root + os.sep)):
                    raise bad(f"{field}.path", rel, "a path inside DATA_DIR")
                if resolved in seen:
                    raise bad(f"{field}.path", rel, f"a file no other entry names ({seen[resolved]} names it too)")
                seen[resolved] = field
                if not _is_int(entry.get("tokens")) or not 0 <= entry["tokens"] <= _MAX_TOKENS:
                    raise bad(f"{field}.tokens", entry.get("tokens"), "a token count")
                if split == "train" and entry["tokens"] == 0:
                    # prepare never writes one, and an empty file cannot be mapped: the loader maps a
                    # train shard beside the one a document crosses out of (Loader._document_beyond).
                    raise bad(f"{field}.tokens", 0, "at least 1 in a train shard", "drop the entry or ")
                if not isinstance(entry.get("sha256"), str) or not _HEX64.fullmatch(entry["sha256"]):
                    raise bad(f"{field}.sha256", entry.get("sha256"), "64 hex digits")


def _resolved(data_dir: Path, rel: str, folders: dict[str, str]) -> str | None:
    """The real path of DATA_DIR/rel (links followed), None where the file system refuses the name.
    Each folder is resolved once: a manifest of 10^5 shards in a few folders is 10^5 lstats, where
    resolving each path whole took 7 s of a start (one lstat per component, through pathlib)."""
    head, _, name = rel.rpartition("/")
    try:  # a NUL, a lone surrogate or an over-long name is a bad path, not a crash
        folder = folders.get(head)
        if folder is None:
            folder = folders[head] = os.path.realpath(os.path.join(data_dir, head))
        full = os.path.join(folder, name)
        os.fsencode(full)  # a name no file system can hold (a lone surrogate): ValueError, as resolve() raised
        return os.path.realpath(full) if os.path.islink(full) else full
    except (OSError, ValueError):
        return None


def _respelled(rel) -> str:
    """'write it as X or ' where dropping empty and '.' parts (and reading a backslash as /) makes
    `rel` a shard path, else ''."""
    if not isinstance(rel, str) or rel.startswith(("/", "\\")):
        return ""  # absolute: dropping the root would name another file, under DATA_DIR
    fixed = "/".join(p for p in rel.replace("\\", "/").split("/") if p not in ("", "."))
    return f"write it as {fixed!r} or " if shard_path_problem(fixed) is None else ""


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def verify_tokenizer(data_dir: Path, manifest: dict) -> None:
    """DataError unless the tokenizer in `data_dir` is the one the manifest pins (every kind: a byte
    manifest's sha256 and eos_id are checked as well)."""
    try:
        load_tokenizer(data_dir, manifest)
    except ValueError as e:
        raise DataError(str(e)) from e


def verify_split(data_dir: str | Path, manifest: dict, split: str) -> None:
    """Hash one split's shards (every domain's): a tool that reads only the val shards checks only
    those, instead of every train shard of a large corpus."""
    itemsize = np.dtype(manifest["dtype"]).itemsize
    vocab = manifest["tokenizer"]["vocab_size"]
    for domain in manifest["domains"].values():
        for entry in domain[split]:
            _check_shard(Path(data_dir), entry, itemsize, verify=True)
            if entry["tokens"]:  # a hash that matches says nothing of ids a manifest's writer put there
                top = int(np.memmap(Path(data_dir) / entry["path"], dtype=manifest["dtype"], mode="r").max())
                if top >= vocab:
                    raise DataError(f"shard {Path(data_dir) / entry['path']} holds token id {top}, beyond the "
                                    f"tokenizer's vocabulary (vocab_size {vocab}); rebuild {data_dir} with prepare")


def _check_shard(data_dir: Path, entry: dict, itemsize: int, verify: bool) -> None:
    path = os.path.join(data_dir, entry["path"])  # not pathlib: a start checks 10^5 of them
    try:
        info = os.stat(path)  # one stat a shard: a start reads 10^5 of them
        size = info.st_size if stat.S_ISREG(info.st_mode) else None
    except (OSError, ValueError):  # a name the file system refuses (a component over 255 bytes)
        size = None
    if size is None:
        raise DataError(f"shard {path} is missing; rebuild {data_dir} with prepare")
    count = entry.get("bytes", 0)
    if isinstance(count, bool) or not isinstance(count, int) or count < 0:
        raise DataError(f"shard {path}: manifest.json's bytes {count!r} is not a count; rebuild {data_dir} with prepare")
    if size != entry["tokens"] * itemsize:
        raise DataError(f"shard {path} has {size} bytes but manifest.json says {entry['tokens']} tokens "
                        f"({entry['tokens'] * itemsize} bytes); rebuild {data_dir} with prepare")
    if verify and file_sha256(Path(path)) != entry["sha256"]:
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
