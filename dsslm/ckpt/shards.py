"""Sharded checkpoints: every rank writes and reads only its own part; one index, one MANIFEST.

A sharded folder `step-XXXXXXXX/` holds, besides `state.json` and `MANIFEST`:

- `shard-RRRRR-of-WWWWW.safetensors`, one per rank of the saving job: flat (1-D) pieces named
  `KEY@START`, each elements [START, END) of the row-major flattening of the tensor KEY
  (`model/NAME`, `optim/STATE/NAME`, `optim/step/NAME`: see engine.base.Shard). Its safetensors
  metadata names the save (`save`, the temp folder's random token), the rank and the world size.
- `rank-RRRRR-of-WWWWW.json`: that rank's own state (its random streams), so state.json stays
  the same size at any world size.
- `index.json` = {"format": 1, "world_size": W, "save": TOKEN, "tensors": {KEY: {"shape": [...],
  "dtype": "F32" | "F64", "pieces": [[FILE, NAME, START, END], ...]}}}: which elements of which
  tensor each file holds. The pieces of a tensor, sorted by START, cover [0, numel) exactly.

A gathered folder (`model.safetensors`, `optim.safetensors`, rank 0's writing) is read through
the same `TensorReader`: its index is made from the two files' headers, one piece per tensor.
Readers read byte ranges (`safe_open(...).get_slice`), never a whole file they do not need.
"""
from __future__ import annotations

import json
import math
import re
from pathlib import Path
from typing import Any, Callable

import numpy as np
import torch
from safetensors import safe_open

from dsslm.ckpt.format import (MAX_STATE_BYTES, STATE_FILE, TENSOR_SUFFIX, Checkpoint, CheckpointError, no_duplicates,
                               parse_name)
from dsslm.durable import file_sha256

INDEX_FILE = "index.json"
INDEX_FORMAT = 1
MAX_INDEX_BYTES = 256 << 20  # ~1 KB a piece: 256 MiB is ~250k pieces (e.g. 300 tensors x 800 ranks)
_SHARD_RE = re.compile(r"shard-([0-9]{5})-of-([0-9]{5})\.safetensors")
_RANK_RE = re.compile(r"rank-([0-9]{5})-of-([0-9]{5})\.json")
_KEY_RE = re.compile(r"(model|optim/[A-Za-z0-9_]+)/[A-Za-z0-9_.]+")
DTYPES = {"F32": torch.float32, "F64": torch.float64}
_ELEMENT = {"F32": 4, "F64": 8}


def shard_file(rank: int, world_size: int) -> str:
    return f"shard-{rank:05d}-of-{world_size:05d}{TENSOR_SUFFIX}"


def rank_file(rank: int, world_size: int) -> str:
    return f"rank-{rank:05d}-of-{world_size:05d}.json"


def is_sharded(files: dict) -> bool:
    return INDEX_FILE in files


def dtype_name(dtype: torch.dtype) -> str:
    for name, dt in DTYPES.items():
        if dt == dtype:
            return name
    raise TypeError(f"a checkpoint tensor is {dtype}; only float32 and float64 are stored")


def read_json(path: Path, max_bytes: int) -> Any:
    size = path.stat().st_size
    if size > max_bytes:
        raise CheckpointError(f"{path.name} is {size} bytes, more than the {max_bytes} it can be")
    try:
        return json.loads(path.read_text(), object_pairs_hook=no_duplicates)
    except ValueError as exc:
        raise CheckpointError(f"{path.name}: {exc}") from None


# --- the index ---------------------------------------------------------------------------------

def build_index(world_size: int, save: str, reports: list[list]) -> dict:
    """The index from every rank's pieces: [[KEY, SHAPE, DTYPE, START, END, FILE], ...] per rank."""
    tensors: dict[str, dict] = {}
    for pieces in reports:
        for key, shape, dtype, start, end, file in pieces:
            entry = tensors.setdefault(key, {"shape": list(shape), "dtype": dtype, "pieces": []})
            if entry["shape"] != list(shape) or entry["dtype"] != dtype:
                raise CheckpointError(f"ranks disagree on the shape or dtype of {key}")
            entry["pieces"].append([file, f"{key}@{start}", start, end])
    for entry in tensors.values():
        entry["pieces"].sort(key=lambda p: p[2])
    return {"format": INDEX_FORMAT, "world_size": world_size, "save": save,
            "tensors": dict(sorted(tensors.items()))}


def check_index(index: Any, files: dict, world_size: int) -> dict:
    """Refuse an index that could make a reader read outside a tensor, read a tensor twice or
    not at all, or mix shards of another save or world size; returns it. `files` is the
    MANIFEST's table, `world_size` the one state.json says saved the folder."""
    if not isinstance(index, dict) or index.get("format") != INDEX_FORMAT:
        raise CheckpointError(f"{INDEX_FILE} is not format {INDEX_FORMAT}")
    w, save, tensors = index.get("world_size"), index.get("save"), index.get("tensors")
    # A written index always names its save: "" marks a gathered folder's in-memory index, whose
    # header checks check_headers skips, so on disk it would let a piece point at any tensor.
    if (not isinstance(w, int) or not 1 <= w <= 1 << 20 or not isinstance(save, str) or not save
            or not isinstance(tensors, dict)):
        raise CheckpointError(f"{INDEX_FILE}: world_size, save or tensors malformed")
    if w != world_size:
        raise CheckpointError(f"{INDEX_FILE} says {w} ranks wrote it, state.json says {world_size}")
    shards = {n for n in files if _SHARD_RE.fullmatch(n)}
    ranks = {n for n in files if _RANK_RE.fullmatch(n)}
    want_shards = {shard_file(r, w) for r in range(w)}
    want_ranks = {rank_file(r, w) for r in range(w)}
    if shards != want_shards or ranks != want_ranks:
        odd = sorted((shards ^ want_shards) | (ranks ^ want_ranks))
        raise CheckpointError(f"the folder's shard files do not match {w} ranks (e.g. {odd[0]})")
    others = set(files) - shards - ranks - {INDEX_FILE, STATE_FILE}
    if others:
        raise CheckpointError(f"{sorted(others)[0]} is not part of a sharded checkpoint")
    for key, entry in tensors.items():
        if not isinstance(key, str) or not _KEY_RE.fullmatch(key) or not isinstance(entry, dict):
            raise CheckpointError(f"{INDEX_FILE}: tensor {key!r} malformed")
        shape, dtype, pieces = entry.get("shape"), entry.get("dtype"), entry.get("pieces")
        if (not isinstance(shape, list) or not all(isinstance(d, int) and 0 < d < 1 << 40 for d in shape)
                or dtype not in DTYPES or not isinstance(pieces, list)):
            raise CheckpointError(f"{INDEX_FILE}: {key}: shape, dtype or pieces malformed")
        numel, at = math.prod(shape), 0
        for piece in pieces:
            if (not isinstance(piece, list) or len(piece) != 4 or piece[0] not in want_shards
                    or not isinstance(piece[1], str) or not all(isinstance(x, int) for x in piece[2:])):
                raise CheckpointError(f"{INDEX_FILE}: {key}: piece {piece!r} malformed")
            _, _, start, end = piece
            if not 0 <= start < end <= numel:
                raise CheckpointError(f"{INDEX_FILE}: {key}: piece [{start}, {end}) is outside the tensor's "
                                      f"{numel} elements")
            if start != at:
                what = "overlap" if start < at else "leave a gap"
                raise CheckpointError(f"{INDEX_FILE}: {key}: pieces {what} at element {min(start, at)}")
            at = end
        if at != numel:
            raise CheckpointError(f"{INDEX_FILE}: {key}: pieces cover {at} of {numel} elements")
    return index


def check_headers(index: dict, headers: dict[str, dict]) -> None:
    """Every piece against the header of the file that holds it (read while hashing): present,
    of the index's dtype and length, and written by the same save at the same rank and world size."""
    if not index["save"]:
        return  # a gathered folder: its index was made from these headers
    w = index["world_size"]
    for r in range(w):
        name = shard_file(r, w)
        meta = headers.get(name, {}).get("__metadata__") or {}
        if meta.get("save") != index["save"] or meta.get("rank") != str(r) or meta.get("world_size") != str(w):
            raise CheckpointError(f"{name} was written by another save (its metadata: {meta}); shard files "
                                  f"cannot be mixed between checkpoints")
    for entry in index["tensors"].values():
        for file, name, start, end in entry["pieces"]:
            header = headers[file].get(name)
            if header is None or header != [entry["dtype"], [end - start]]:
                raise CheckpointError(f"{file}: piece {name} is {header}, the index says "
                                      f"{[entry['dtype'], [end - start]]}")


def gathered_index(folder: Path) -> dict:
    """The index of a gathered folder, from its files' headers: one piece per tensor."""
    tensors = {}
    for group, prefix in (("model", "model/"), ("optim", "optim/")):
        path = folder / f"{group}{TENSOR_SUFFIX}"
        with safe_open(path, "pt") as f:
            for name in f.keys():
                sl = f.get_slice(name)
                shape, dtype = list(sl.get_shape()), sl.get_dtype()
                if dtype not in DTYPES:
                    raise CheckpointError(f"{path.name}: {name} is {dtype}, not float32 or float64")
                if math.prod(shape) == 0:
                    raise CheckpointError(f"{path.name}: {name} is empty")
                tensors[prefix + name] = {"shape": shape, "dtype": dtype,
                                          "pieces": [[path.name, name, 0, math.prod(shape)]]}
    return {"format": INDEX_FORMAT, "world_size": 1, "save": "", "tensors": tensors}


class TensorReader:
    """Reads spans of a checkpoint's tensors (engine.base.StateReader), opening each file once and
    reading only the byte ranges asked for. `bytes_read` counts them (benchmarks report it)."""

    def __init__(self, folder: Path, index: dict):
        self.folder, self.index = folder, index
        self.bytes_read = 0
        self._files: dict[str, Any] = {}

    def keys(self) -> list[str]:
        return list(self.index["tensors"])

    def shape(self, key: str) -> tuple[int, ...]:
        return tuple(self.index["tensors"][key]["shape"])

    def dtype(self, key: str) -> torch.dtype:
        return DTYPES[self.index["tensors"][key]["dtype"]]

    def read(self, key: str, start: int = 0, end: int | None = None) -> torch.Tensor:
        entry = self.index["tensors"].get(key)
        if entry is None:
            raise CheckpointError(f"the checkpoint has no tensor {key}")
        numel = math.prod(entry["shape"])
        end = numel if end is None else end
        if not 0 <= start <= end <= numel:
            raise CheckpointError(f"{key}: elements [{start}, {end}) asked of {numel}")
        parts = []
        for file, name, p_start, p_end in entry["pieces"]:
            a, b = max(start, p_start), min(end, p_end)
            if a < b:
                parts.append(self._slice(file, name, a - p_start, b - p_start))
        out = torch.cat(parts) if parts else torch.empty(0, dtype=DTYPES[entry["dtype"]])
        self.bytes_read += out.numel() * out.element_size()
        return out

    def _slice(self, file: str, name: str, a: int, b: int) -> torch.Tensor:
        """Elements [a, b) of the flattening of tensor `name` in `file`: whole rows are read."""
        handle = self._files.get(file)
        if handle is None:
            handle = self._files[file] = safe_open(self.folder / file, "pt")
        sl = handle.get_slice(name)
        shape = sl.get_shape()
        row = math.prod(shape[1:]) if len(shape) > 1 else 1
        first, last = a // row, -(-b // row)
        rows = sl[first:last] if shape else handle.get_tensor(name).reshape(1)
        return rows.reshape(-1)[a - first * row:b - first * row]

    def close(self) -> None:
        self._files.clear()


# --- verification, split among ranks ------------------------------------------------------------

def split_files(files: dict[str, dict], world_size: int) -> list[list[str]]:
    """Every file to one rank, largest first to the least loaded: each rank hashes ~1/W of the bytes."""
    shares: list[list[str]] = [[] for _ in range(world_size)]
    loads = [0] * world_size
    for name in sorted(files, key=lambda n: (-files[n]["size"], n)):
        r = loads.index(min(loads))
        shares[r].append(name)
        loads[r] += files[name]["size"]
    return shares


def verify_share(folder: Path, files: dict[str, dict], names: list[str],
                 progress: Callable[[int], None] = lambda units: None,
                 check_rank_file: Callable[[Any, str], None] | None = None) -> dict:
    """Hash this rank's share of a folder's files, read each one's tensors for non-finite values
    (and negative second moments), keep each safetensors header for the index check. Returns
    {"bad": reason or None, "headers": {file: {name: [dtype, shape]}, "__metadata__": {...}}}."""
    headers: dict[str, dict] = {}
    for name in names:
        path = folder / name
        try:
            if file_sha256(path) != files[name]["sha256"]:
                return {"bad": f"{name} does not match its sha256 in MANIFEST", "headers": {}}
            if name.endswith(TENSOR_SUFFIX):
                headers[name] = _scan(path)
            elif _RANK_RE.fullmatch(name) and check_rank_file is not None:
                check_rank_file(read_json(path, MAX_STATE_BYTES), name)
        except (CheckpointError, ValueError) as exc:  # StateError is a ValueError
            return {"bad": str(exc), "headers": {}}
        except Exception as exc:  # noqa: BLE001 - a file that hashes right but does not parse
            return {"bad": f"{name} verified but did not load: {exc}", "headers": {}}
        progress(files[name]["size"])
    return {"bad": None, "headers": headers}


def _scan(path: Path) -> dict:
    """A safetensors file's header, and a check of its values, one tensor in memory at a time."""
    out: dict[str, Any] = {}
    group = {f"model{TENSOR_SUFFIX}": "model/", f"optim{TENSOR_SUFFIX}": "optim/"}.get(path.name, "")
    with safe_open(path, "pt") as f:
        out["__metadata__"] = f.metadata() or {}
        for name in f.keys():
            t = f.get_tensor(name)
            out[name] = [f.get_slice(name).get_dtype(), list(t.shape)]
            # "model/NAME" -> "model NAME", "optim/exp_avg/NAME@START" -> "optim exp_avg NAME"
            label = " ".join((group + name).split("@")[0].split("/", 2))
            if t.is_floating_point():
                # numpy, one thread: torch's OpenMP kernels stall 30-40x here when other processes
                # hold the cores (measured: 13 s against 0.3 s for 250 MB on a busy 2-core box)
                values = t.numpy()
                finite = np.isfinite(values)
                if not finite.all():
                    raise CheckpointError(f"{label}: {int(finite.size - finite.sum())} non-finite value(s) "
                                          f"(in {path.name})")
                if label.startswith("optim exp_avg_sq ") and bool((values < 0).any()):
                    raise CheckpointError(f"{label}: negative values (a second moment is >= 0; in {path.name})")
    return out


def open_index(folder: Path, files: dict, world_size: int) -> dict:
    """The folder's index, checked against its MANIFEST (sharded), or one made from a gathered
    folder's headers."""
    if is_sharded(files):
        return check_index(read_json(folder / INDEX_FILE, MAX_INDEX_BYTES), files, world_size)
    want = {f"model{TENSOR_SUFFIX}", f"optim{TENSOR_SUFFIX}", STATE_FILE}
    if set(files) != want:
        raise CheckpointError(f"tensor files are {sorted(set(files) - {STATE_FILE})}, expected model and optim "
                              f"(or a sharded checkpoint's {INDEX_FILE})")
    return gathered_index(folder)


def open_folder(folder: Path, files: dict) -> Checkpoint:
    """A verified folder (sharded or gathered) as a Checkpoint whose tensors are read on demand
    through `reader`; its index checked against `files` (the MANIFEST's table)."""
    try:
        state = read_json(folder / STATE_FILE, MAX_STATE_BYTES)
        world = state.get("world_size") if isinstance(state, dict) else None
        if is_sharded(files) and not isinstance(world, int):
            raise CheckpointError("state.world_size: missing; a sharded checkpoint needs it")
        index = open_index(folder, files, world)
    except CheckpointError:
        raise
    except Exception as exc:  # noqa: BLE001 - hashes right but does not parse: written wrong
        raise CheckpointError(f"verified but did not load: {exc}") from None
    return Checkpoint(step=parse_name(folder.name)[0], path=folder, tensors={}, state=state,
                      reader=TensorReader(folder, index))


def read_rank_file(folder: Path, rank: int, world_size: int) -> Any:
    return read_json(folder / rank_file(rank, world_size), MAX_STATE_BYTES)
