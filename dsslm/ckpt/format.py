"""The on-disk checkpoint format: folder naming, safetensors streaming, MANIFEST, verify, load.

`store.py` holds the policy (async writer, atomic publish, retention); this module holds the
mechanics and everything a reader needs, so a tool (export, eval) can verify or load a folder
without a store.

A folder `step-XXXXXXXX/` holds `<group>.safetensors` per tensor group, `state.json`, and
`MANIFEST` = {"format": 1, "step": N, "files": {name: {"sha256": hex, "size": int}}} covering
every other file. MANIFEST is written last, into a temp folder renamed into place; a delete
renames the folder to `step-XXXXXXXX.deleting-<hex>` before it removes anything. So dsslm never
leaves a `step-XXXXXXXX` without MANIFEST: one found is not dsslm's to delete (see store.py).
"""
from __future__ import annotations

import json
import os
import re
import stat
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterator

import torch

from dsslm.durable import file_sha256
from safetensors.torch import load_file

FORMAT = 1
MANIFEST = "MANIFEST"
STATE_FILE = "state.json"
TENSOR_SUFFIX = ".safetensors"
# The old copy of a step while a re-save of that step replaces it. Readers accept it as that step
# when `step-XXXXXXXX` itself is absent or invalid, so a crash between the two renames of a
# replace still leaves the step findable (see CheckpointStore._publish).
ASIDE_SUFFIX = ".replaced"
_NAME_RE = re.compile(r"step-([0-9]{8})(\.replaced)?")  # [0-9], not \d: \d matches any Unicode digit
# A folder a delete is removing (named so before anything in it goes), and one set aside as damaged
# for a person: neither is a checkpoint to any reader, and neither is reported again.
DELETING = ".deleting-"
INVALID = ".invalid-"
DELETING_RE = re.compile(r"step-[0-9]{8}(\.replaced)?\.deleting-[0-9a-f]+")
_SET_ASIDE_RE = re.compile(r"step-[0-9]{8}(\.replaced)?\.(deleting|invalid)-.*", re.DOTALL)
_GROUP_RE = re.compile(r"[A-Za-z0-9_]+")
_FILE_RE = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.-]*")
# Read whole into memory before they are checked, so bounded: a MANIFEST lists a few files, and
# state.json holds ~20 KB of RNG state per rank (64 MiB is ~3,000 ranks). A hostile 64 MiB of
# small JSON numbers parses to ~1 GB of Python objects: the most a bad file can cost rank 0.
MAX_MANIFEST_BYTES = 1 << 20
MAX_STATE_BYTES = 64 << 20
# 64 MiB pieces: large enough that per-call overhead is nil, small enough that hashing one piece
# overlaps writing the next (see store._write_file).
CHUNK_BYTES = 64 << 20

_ST_DTYPES = {
    torch.float64: "F64", torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16",
    torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8",
    torch.uint8: "U8", torch.bool: "BOOL",
    torch.float8_e4m3fn: "F8_E4M3", torch.float8_e5m2: "F8_E5M2",
}


class CheckpointError(RuntimeError):
    """A checkpoint could not be saved, or a folder is not a valid checkpoint."""


@dataclass
class Checkpoint:
    step: int
    path: Path
    tensors: dict[str, dict[str, torch.Tensor]]  # {"model": {...}, "optim": {...}}, on CPU
    state: dict                                   # state.json
    reader: Any = None                            # shards.TensorReader: tensors read on demand (tensors then {})


def step_name(step: int) -> str:
    if not 0 <= step < 10**8:
        raise CheckpointError(f"step {step} does not fit step-XXXXXXXX (0 <= step < 1e8)")
    return f"step-{step:08d}"


def parse_name(name: str) -> tuple[int, bool] | None:
    """(step, is_aside) for `step-XXXXXXXX` or its `.replaced` aside; None for any other name."""
    match = _NAME_RE.fullmatch(name)
    return None if match is None else (int(match.group(1)), match.group(2) is not None)


def inside_checkpoints(out: Path) -> str | None:
    """Why a tool must not write to `out`, or None: inside a checkpoint folder (a file its MANIFEST
    does not list makes it invalid, and the next resume passes it over) or beside checkpoint
    folders (a run's checkpoints/, whose leftovers a running trainer clears)."""
    out = Path(os.path.abspath(out))
    for folder in (out, *out.parents):  # a checkpoint holds a MANIFEST: a name alone (exports/step-N) is none
        if parse_name(folder.name) is not None and _is_checkpoint(folder):
            return f"{out} is inside the checkpoint folder {folder}"
    parent = out.parent
    try:
        beside = parent.is_dir() and any(parse_name(p.name) is not None and _is_checkpoint(p) for p in parent.iterdir())
    except OSError:
        beside = False
    return f"{out} would sit among the checkpoints in {parent}" if beside else None


def _is_checkpoint(folder: Path) -> bool:
    try:
        return (folder / MANIFEST).exists() or folder.parent.name == "checkpoints"
    except OSError:
        return False


def candidates(ckpt_dir: Path, pass_over: Callable[[str, str], None]) -> dict[int, list[Path]]:
    """step -> its candidate folders, `step-XXXXXXXX` before its `.replaced` aside: the order every
    reader tries them in (the newest step first is the caller's `sorted(..., reverse=True)`).
    Temp folders, folders being deleted or set aside and other names are skipped silently; a
    `step-` name that does not parse and a symbolic link (never followed: retention would delete
    what it points to) go to `pass_over`."""
    found: dict[int, list[Path]] = {}
    if not ckpt_dir.is_dir():
        return found
    for name in os.listdir(ckpt_dir):
        if not name.startswith("step-") or _SET_ASIDE_RE.fullmatch(name):
            continue  # temp folders of any process, drill markers, what a person has to look at
        parsed = parse_name(name)
        if parsed is None:
            pass_over(name, f"name {name!r} is not step-XXXXXXXX")
        elif os.path.islink(ckpt_dir / name):
            pass_over(name, "is a symbolic link; a checkpoint folder must be a real folder")
        else:
            found.setdefault(parsed[0], []).append(ckpt_dir / name)
    for paths in found.values():
        paths.sort(key=lambda p: p.name.endswith(ASIDE_SUFFIX))
    return found


def check_group_name(group: str) -> None:
    if not isinstance(group, str) or not _GROUP_RE.fullmatch(group):
        raise ValueError(f"tensor group {group!r} must match [A-Za-z0-9_]+ (it becomes a file name)")


def safetensors_chunks(tensors: dict[str, torch.Tensor], metadata: dict[str, str] | None = None) -> Iterator[memoryview]:
    """Yield the safetensors encoding of contiguous CPU tensors without building it in memory.

    safetensors.torch.save() copies everything into one bytes object while holding the GIL
    (3.6 s for 600 MB here, against 1.2 s to write it); streaming the tensors' own memory lets
    write() and sha256 release the GIL and costs no second copy of the state.
    """
    # Largest element first, as safetensors itself orders them, so every offset stays aligned.
    names = sorted(tensors, key=lambda n: (-tensors[n].element_size(), n))
    header, offset = {}, 0
    for name in names:
        t = tensors[name]
        if t.dtype not in _ST_DTYPES:
            raise TypeError(f"tensor {name!r} has dtype {t.dtype}, which safetensors cannot store")
        nbytes = t.numel() * t.element_size()
        header[name] = {"dtype": _ST_DTYPES[t.dtype], "shape": list(t.shape),
                        "data_offsets": [offset, offset + nbytes]}
        offset += nbytes
    if metadata:
        header["__metadata__"] = {str(k): str(v) for k, v in metadata.items()}
    blob = json.dumps(header, separators=(",", ":")).encode()
    blob += b" " * (-len(blob) % 8)  # the format allows trailing spaces; 8-byte aligned data
    yield memoryview(struct.pack("<Q", len(blob)) + blob)
    for name in names:
        t = tensors[name]
        if t.numel() == 0:
            continue
        raw = memoryview(t.reshape(-1).view(torch.uint8).numpy())
        for start in range(0, len(raw), CHUNK_BYTES):
            yield raw[start:start + CHUNK_BYTES]


def stat_key(folder: Path) -> tuple | None:
    """What changes when any file of the folder changes: the cache key for verification."""
    try:
        with os.scandir(folder) as entries:
            return tuple(sorted((e.name, e.stat().st_size, e.stat().st_mtime_ns) for e in entries))
    except OSError:
        return None


def _check_regular(path: Path, max_bytes: int | None = None) -> int:
    """The size of `path` if it is a regular file (not a link, FIFO or device: reading one of
    those could hang or never end) of at most `max_bytes`; CheckpointError saying why not."""
    st = os.lstat(path)  # FileNotFoundError is the caller's
    if stat.S_ISLNK(st.st_mode):
        raise CheckpointError(f"{path.name} is a symbolic link; a checkpoint holds only regular files")
    if not stat.S_ISREG(st.st_mode):
        raise CheckpointError(f"{path.name} is not a regular file")
    if max_bytes is not None and st.st_size > max_bytes:
        raise CheckpointError(f"{path.name} is {st.st_size} bytes, more than the {max_bytes} a checkpoint's "
                              f"{path.name} can be")
    return st.st_size


def no_duplicates(pairs: list) -> dict:
    """json object_pairs_hook: a key given twice is refused, not silently the last one winning
    (a MANIFEST that lists a file twice could vouch for two different contents)."""
    out: dict = {}
    for key, value in pairs:
        if key in out:
            raise ValueError(f"key {key!r} appears twice")
        out[key] = value
    return out


def read_manifest(folder: Path) -> dict:
    try:
        _check_regular(folder / MANIFEST, MAX_MANIFEST_BYTES)
        manifest = json.loads((folder / MANIFEST).read_text(), object_pairs_hook=no_duplicates)
    except FileNotFoundError:
        raise CheckpointError("no MANIFEST") from None
    except (OSError, ValueError) as exc:
        raise CheckpointError(f"unreadable MANIFEST: {exc}") from None
    files = manifest.get("files") if isinstance(manifest, dict) else None
    if not isinstance(files, dict) or manifest.get("format") != FORMAT:
        raise CheckpointError(f"MANIFEST is not format {FORMAT} with a files table")
    for name, entry in files.items():
        if (not _FILE_RE.fullmatch(name) or name == MANIFEST or not isinstance(entry, dict)
                or not isinstance(entry.get("size"), int) or not isinstance(entry.get("sha256"), str)):
            raise CheckpointError(f"MANIFEST entry {name!r} is malformed")
    return manifest


def _check_files(folder: Path, manifest: dict, hash_files: bool = True) -> None:
    files = manifest["files"]
    present = {p.name for p in folder.iterdir()} - {MANIFEST}
    if STATE_FILE not in files:
        raise CheckpointError(f"MANIFEST does not list {STATE_FILE}")
    extra, missing = sorted(present - files.keys()), sorted(files.keys() - present)
    if extra:
        raise CheckpointError(f"file {extra[0]} is not in MANIFEST")
    if missing:
        raise CheckpointError(f"file {missing[0]} is missing")
    for name, entry in sorted(files.items()):
        path = folder / name
        size = _check_regular(path, MAX_STATE_BYTES if name == STATE_FILE else None)
        if size != entry["size"]:
            raise CheckpointError(f"{name} is {size} bytes, MANIFEST says {entry['size']}")
        if hash_files and file_sha256(path) != entry["sha256"]:
            raise CheckpointError(f"{name} does not match its sha256 in MANIFEST")


def invalid_reason(path, hash_files: bool = True) -> str | None:
    """None if `path` is a valid checkpoint folder, else the reason. Hashes every file, unless
    `hash_files=False`: then only the MANIFEST, the file list and every file's size are checked."""
    folder = Path(path)
    parsed = parse_name(folder.name)
    if parsed is None:
        return f"name {folder.name!r} is not step-XXXXXXXX"
    if not folder.is_dir():
        return "not a folder"
    try:
        manifest = read_manifest(folder)
        if manifest.get("step") != parsed[0]:
            return f"MANIFEST says step {manifest.get('step')}, the folder name says {parsed[0]}"
        _check_files(folder, manifest, hash_files)
    except CheckpointError as exc:
        return str(exc)
    except OSError as exc:
        return f"unreadable: {exc}"
    return None


def load_checkpoint(path) -> Checkpoint:
    """Verify a folder against its MANIFEST and load it; CheckpointError naming the reason if not."""
    folder = Path(path)
    reason = invalid_reason(folder)
    if reason is not None:
        raise CheckpointError(f"{folder} is not a valid checkpoint: {reason}")
    return load_verified(folder)


def load_verified(folder: Path) -> Checkpoint:
    """Load a folder the caller has just verified (so the hashing is not done twice)."""
    try:
        files = read_manifest(folder)["files"]
        tensors = {name[:-len(TENSOR_SUFFIX)]: load_file(folder / name)
                   for name in sorted(files) if name.endswith(TENSOR_SUFFIX)}
        state = json.loads((folder / STATE_FILE).read_text())
    except Exception as exc:  # a file that hashes right but fails to parse was written wrong
        raise CheckpointError(f"{folder} verified but did not load: {exc}") from exc
    return Checkpoint(step=parse_name(folder.name)[0], path=folder, tensors=tensors, state=state)
