"""Prepare in parts: each run of input files (a unit) tokenized on its own, by any process on any node, into
DATA_DIR/.parts-DOMAIN; one merge then streams the units in input order through the split and the
shard writer (prepare.py), so the DATA_DIR's bytes do not depend on how the units were shared out.

A unit is a run of consecutive input files (`Source`s of `find_sources`, in its order) of at least
UNIT_BYTES, or the rest at the end (`plan_units`: their sizes alone decide it, so every task finds
the same units). `unit-00000.bin` holds exactly the token arrays `iter_token_arrays` yields for
those files alone (EOS after each document: nothing carries over from one file to the next), in
the DATA_DIR's dtype, and `unit-00000.json` says what it was made from (each file's path, size and
mtime, the text field, the tokenizer's sha256, the dtype) and what it holds (tokens, text bytes,
the file's sha256). Both are renamed into place, the sidecar last: a unit is finished when its
sidecar matches what the unit would be made from now and the token file has the size and sha256
the sidecar names, so a killed prepare redoes only the units it had not finished, and a changed
input file (or tokenizer) is redone, never reused.

`--part I/N` makes the units u with u % N == I; `--workers N` makes a task's units in N processes.
"""
from __future__ import annotations

import hashlib
import json
import os
import socket
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

import numpy as np

from dsslm.data.sources import DataError, Source, input_bytes, iter_token_arrays, quiet_datasets
from dsslm.data.tokenizer import TOKENIZER_FILE, BPETokenizer, ByteTokenizer
from dsslm.durable import file_sha256, pid_running, write_json_atomic

UNIT_FORMAT = 1
# Workers are forked from a fresh server process that has imported these once, not spawned (each
# spawn imported datasets and torch again: 2-3 s a worker, longer than a byte prepare of 30 MB), nor
# forked from this process (whose tokenizer may already have run Rust threads: a fork can deadlock).
START_METHOD = "forkserver"
PRELOAD = ["dsslm.data.parts", "datasets", "torch"]
# Small files are packed into units of about this much text: a unit costs ~20 ms (a datasets call,
# three fsyncs) on top of its tokenizing, which per file made the 570-file stdlib corpus 6x slower
# (3 s -> 18 s); 4 MiB is ~0.1 s of byte and ~4 s of BPE tokenizing, and 250 units per GB to share.
UNIT_BYTES = 4 << 20
MERGE_READ_BYTES = 1 << 23  # the merge reads unit files in blocks this size: memory stays flat


class WorkerLost(DataError):
    """A worker process died (killed, out of memory): no fault of the input, so the units finished
    are kept for the next run, as after a kill of the whole prepare."""


@dataclass(frozen=True)
class Part:
    """`--part I/N`: this task makes the units u with u % count == index."""
    index: int
    count: int

    def units(self, n_units: int) -> list[int]:
        return list(range(self.index, n_units, self.count))

    def __str__(self) -> str:
        return f"{self.index}/{self.count}"


def parse_part(text: str) -> Part | str:
    """A Part, or what is wrong with `text` (one line)."""
    index, slash, count = text.partition("/")
    if not (slash and index.strip().isdigit() and count.strip().isdigit()):
        return f"--part {text!r} is not I/N; give this task's index and the task count, e.g. --part 0/4"
    part = Part(int(index), int(count))
    if part.count < 1 or part.index >= part.count:
        return f"--part {text}: the index must be below the count (0 <= I < N), e.g. --part 0/{max(part.count, 1)}"
    return part


def parts_dir(out: Path, domain: str) -> Path:
    return out / f".parts-{domain}"


def unit_files(folder: Path, unit: int) -> tuple[Path, Path]:
    return folder / f"unit-{unit:05d}.bin", folder / f"unit-{unit:05d}.json"


def plan_units(sources: list[Source]) -> list[list[Source]]:
    """The units of `sources`: each closed once it holds UNIT_BYTES of input (a big file: alone)."""
    units: list[list[Source]] = [[]]
    size = 0
    for source in sources:
        units[-1].append(source)
        size += input_bytes([source])
        if size >= UNIT_BYTES:
            units.append([])
            size = 0
    return [u for u in units if u]


def source_stamp(source: Source) -> dict:
    """What says a source is unchanged: its resolved path, kind, size and newest mtime (a folder
    source, a save_to_disk dataset: its files' total size and newest mtime)."""
    path = source.path.resolve()
    if path.is_file():
        st = path.stat()
        size, mtime = st.st_size, st.st_mtime_ns
    else:
        stats = [p.stat() for p in sorted(path.rglob("*")) if p.is_file()]
        size, mtime = sum(s.st_size for s in stats), max((s.st_mtime_ns for s in stats), default=0)
    return {"path": str(path), "kind": source.kind, "size": size, "mtime_ns": mtime}


def unit_spec(unit: list[Source], tokenizer_sha256: str, dtype: str, text_field: str) -> dict:
    """Everything a unit's tokens depend on: a sidecar that differs in any of it is stale."""
    return {"format": UNIT_FORMAT, "sources": [source_stamp(s) for s in unit], "text_field": text_field,
            "tokenizer": tokenizer_sha256, "dtype": dtype}


def finished_unit(folder: Path, unit: int, spec: dict, check_hash: bool = True) -> dict | None:
    """The sidecar of `unit` if it is finished for `spec` (its token file whole: size, and sha256
    unless `check_hash` is off because the reader hashes as it reads), else None."""
    bin_path, side_path = unit_files(folder, unit)
    try:
        side = json.loads(side_path.read_text())
        if not isinstance(side, dict) or any(side.get(k) != v for k, v in spec.items()):
            return None
        if bin_path.stat().st_size != side["tokens"] * np.dtype(spec["dtype"]).itemsize:
            return None
        if check_hash and file_sha256(bin_path) != side["sha256"]:
            return None
    except (OSError, ValueError, KeyError, TypeError):
        return None
    return side


def make_unit(folder: Path, unit: int, sources: list[Source], tok, dtype: str, text_field: str) -> dict:
    """Tokenize one unit's sources into its files; returns the sidecar written."""
    spec = unit_spec(sources, tok.sha256, dtype, text_field)
    bin_path, side_path = unit_files(folder, unit)
    side_path.unlink(missing_ok=True)  # a stale sidecar must never stand beside the new token file
    # host and pid: tasks on several nodes share the folder; a killed task's file waits for the merge
    tmp = folder / f".{bin_path.name}.tmp-{socket.gethostname()}-{os.getpid()}"
    digest, n_tokens, text_bytes = hashlib.sha256(), 0, [0]
    try:
        with open(tmp, "wb", buffering=1 << 20) as f:
            for tokens in iter_token_arrays(sources, tok, text_field, text_bytes):
                data = tokens.astype(dtype, copy=False).tobytes()
                f.write(data)
                digest.update(data)
                n_tokens += len(tokens)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, bin_path)
    finally:
        tmp.unlink(missing_ok=True)
    side = {**spec, "tokens": n_tokens, "text_bytes": text_bytes[0], "sha256": digest.hexdigest()}
    write_json_atomic(side_path, side, indent=1)  # last: the unit counts as finished from here on
    return side


@dataclass
class UnitsDone:
    made: list[int]
    reused: list[int]
    tokens: int = 0


def make_units(folder: Path, which: list[int], units: list[list[Source]], tok, dtype: str, text_field: str,
               workers: int = 1) -> UnitsDone:
    """Make every unit of `which` that is not finished, in `workers` processes (1: in this one)."""
    folder.mkdir(parents=True, exist_ok=True)
    _remove_dead_temp_files(folder)
    done = UnitsDone([], [])
    todo = []
    for u in which:
        side = finished_unit(folder, u, unit_spec(units[u], tok.sha256, dtype, text_field))
        if side is None:
            todo.append(u)
        else:
            done.reused.append(u)
            done.tokens += side["tokens"]
    if workers <= 1 or len(todo) <= 1:
        for u in todo:
            done.tokens += make_unit(folder, u, units[u], tok, dtype, text_field)["tokens"]
            done.made.append(u)
        return done
    import multiprocessing
    from concurrent.futures import ProcessPoolExecutor, as_completed
    from concurrent.futures.process import BrokenProcessPool

    workers = min(workers, len(todo))
    cores = len(os.sched_getaffinity(0))
    ref = (tok.kind, str(folder.parent / TOKENIZER_FILE), getattr(tok, "eos_token", None), tok.sha256)
    ctx = multiprocessing.get_context(START_METHOD)
    if START_METHOD == "forkserver":
        ctx.set_forkserver_preload(PRELOAD)
    # An executor, not a multiprocessing.Pool: a worker that dies (the OOM killer) is an error here,
    # where the Pool waits forever for the unit it had.
    pool = ProcessPoolExecutor(workers, ctx, _start_worker, (max(1, cores // workers), ref))
    try:
        futures = {pool.submit(_work, (folder, u, units[u], dtype, text_field)): u for u in todo}
        for future in as_completed(futures):
            done.tokens += future.result()["tokens"]
            done.made.append(futures[future])
    except BrokenProcessPool:
        raise WorkerLost(f"a prepare worker died (killed, or out of memory?) with {len(todo) - len(done.made)} units "
                        "left; run prepare again: the finished units are reused") from None
    finally:
        # On an error the units not started are dropped; those running finish (each is one unit).
        pool.shutdown(wait=True, cancel_futures=True)
    done.made.sort()
    return done


def _remove_dead_temp_files(folder: Path) -> None:
    """Half-written unit files of this host's processes that died (killed workers and tasks)."""
    host = socket.gethostname()
    for path in folder.glob(".unit-*.bin.tmp-*"):
        owner, _, pid = path.name.partition(".tmp-")[2].rpartition("-")
        if owner == host and pid.isdigit() and not pid_running(int(pid)):
            path.unlink(missing_ok=True)


_WORKER_TOK = None


def _start_worker(threads: int, ref: tuple) -> None:
    # Rust's thread pool (the BPE's encode_batch) sizes itself from this on first use: N workers
    # each taking every core would oversubscribe the machine N times. A value the user set stays.
    os.environ.setdefault("RAYON_NUM_THREADS", str(threads))
    quiet_datasets()
    kind, path, eos_token, sha256 = ref
    global _WORKER_TOK
    # A failure is said by the first unit, not raised here, where it would only break the pool.
    try:
        tok = ByteTokenizer() if kind == "byte" else BPETokenizer.from_file(path, kind, eos_token)
    except Exception as e:  # noqa: BLE001 - the tokenizers library raises plain Exceptions
        tok = DataError(f"{path} is unreadable in a worker ({e}); run prepare again")
    if not isinstance(tok, Exception) and tok.sha256 != sha256:
        tok = DataError(f"{path} changed while prepare ran; run prepare again")
    _WORKER_TOK = tok


def _work(job: tuple) -> dict:
    folder, u, sources, dtype, text_field = job
    if isinstance(_WORKER_TOK, Exception):
        raise _WORKER_TOK
    return make_unit(folder, u, sources, _WORKER_TOK, dtype, text_field)


def merge_records(folder: Path, units: list[list[Source]], tokenizer_sha256: str, dtype: str,
                  text_field: str) -> list[dict]:
    """Every unit's sidecar, in order; DataError naming the units not finished (none read yet)."""
    records = [finished_unit(folder, u, unit_spec(unit, tokenizer_sha256, dtype, text_field), check_hash=False)
               for u, unit in enumerate(units)]
    missing = [u for u, r in enumerate(records) if r is None]
    if missing:
        shown = ", ".join(map(str, missing[:20])) + (f" and {len(missing) - 20} more" if len(missing) > 20 else "")
        raise DataError(f"{len(missing)} of {len(records)} units are not prepared in {folder} (units {shown}: "
                        f"{units[missing[0]][0].path} first); run the --part tasks that make them "
                        "(unit u is made by --part I/N where I = u mod N), then --merge again")
    return records


def unit_tokens(folder: Path, records: list[dict], dtype: str) -> Iterator[np.ndarray]:
    """The units' tokens, in unit order, in blocks; each file hashed as it is read (DataError on a
    mismatch: a unit changed since it was finished)."""
    itemsize = np.dtype(dtype).itemsize
    step = MERGE_READ_BYTES - MERGE_READ_BYTES % itemsize
    for u, record in enumerate(records):
        path, digest = unit_files(folder, u)[0], hashlib.sha256()
        with open(path, "rb") as f:
            while data := f.read(step):
                digest.update(data)
                yield np.frombuffer(data, dtype=dtype)
        if digest.hexdigest() != record["sha256"]:
            raise DataError(f"{path} does not match its sidecar (sha256): it changed after it was made; run "
                            "its --part task again (it makes the unit anew), then --merge")
