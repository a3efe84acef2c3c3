"""Reading `prepare`'s inputs: find the files, stream their documents, encode them.

Plain text, JSON/JSONL (a text field), Parquet, folders of those, and `save_to_disk` folders, all
read through `datasets` in streaming mode so that memory stays bounded by one chunk.
"""
from __future__ import annotations

import collections
import functools
import os
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterable, Iterator

import numpy as np

READ_CHUNK_BYTES = 1 << 20  # the text reader's chunk: bounds memory on a single huge file
WHOLE_FILE_BYTES = 8 << 20  # text files up to this size are read whole, as one row
ENCODE_BATCH_CHARS = 1 << 21  # text handed to the tokenizer at once
JSON_SUFFIXES = {".json", ".jsonl", ".ndjson"}
COMPRESSION_SUFFIXES = {".gz", ".bz2", ".xz", ".zst"}


class DataError(ValueError):
    """Bad input, or a DATA_DIR that does not verify; the message says what to fix."""


class NothingLeft(DataError):
    """A skip list names every chunk training draws from: nothing is left to train on."""


@dataclass(frozen=True)
class Source:
    path: Path
    kind: str  # "text" | "json" | "parquet" | "saved" (a save_to_disk folder)


def find_sources(inputs: list[str | Path]) -> list[Source]:
    """Every input file in a deterministic order: as given, folders walked recursively by name."""
    sources: list[Source] = []
    for given in inputs:
        path = Path(given)
        _check_readable(path)
        if path.is_file() and _kind_of(path) == "text" and _looks_binary(path):
            raise DataError(f"--input {path} is a binary file (a NUL byte in its first 8 KiB), not text; "
                            "give text, JSONL, Parquet or a save_to_disk folder")
        sources += _walk(path) if path.is_dir() else [Source(path, _kind_of(path))]
    if not sources:
        raise DataError(f"--input {' '.join(map(str, inputs))} holds no files; "
                        "point it at text, JSONL, Parquet or a save_to_disk folder")
    return sources


def _check_readable(path: Path) -> None:
    if not path.exists():
        raise DataError(f"--input {path} does not exist; fix the path")
    if not os.access(path, os.R_OK):
        raise DataError(f"--input {path} is not readable; fix its permissions")


def _walk(folder: Path) -> list[Source]:
    if (folder / "state.json").is_file() or (folder / "dataset_dict.json").is_file():
        return [Source(folder, "saved")]
    found: list[Source] = []
    for entry in sorted(folder.iterdir(), key=lambda p: p.name):
        if entry.name.startswith(".") or entry.name == "__pycache__":
            continue
        _check_readable(entry)
        if entry.is_dir():
            found += _walk(entry)
        elif entry.is_file() and not (_kind_of(entry) == "text" and _looks_binary(entry)):
            found.append(Source(entry, _kind_of(entry)))
    return found


def _kind_of(path: Path) -> str:
    suffixes = [s.lower() for s in path.suffixes]
    if suffixes and suffixes[-1] in COMPRESSION_SUFFIXES:
        suffixes.pop()  # datasets decompresses on the fly
    last = suffixes[-1] if suffixes else ""
    return "json" if last in JSON_SUFFIXES else "parquet" if last == ".parquet" else "text"


def _looks_binary(path: Path) -> bool:
    # Inside folders, skip images, archives and compiled files: a NUL byte never occurs in text.
    if path.suffix.lower() in COMPRESSION_SUFFIXES:
        return False
    with open(path, "rb") as f:
        return b"\0" in f.read(8192)


def quiet_datasets() -> None:
    import datasets

    datasets.disable_progress_bars()
    # We report a bad file ourselves, in one line; datasets would log it again at ERROR.
    datasets.utils.logging.set_verbosity(datasets.utils.logging.CRITICAL)


def _datasets():
    """The `datasets` module, told not to count downloads: each load_dataset call otherwise pings
    the Hub's download counter for its packaged reader ("text", "json"), 0.15-3 s a call where the
    network is down, for local files that need no network. prepare opens each input file on its
    own (parts.py): 100 small files took 15 s that way, 0.2 s without the ping."""
    import datasets

    datasets.config.HF_UPDATE_DOWNLOAD_COUNTS = False
    return datasets


def input_bytes(sources: list[Source]) -> int:
    total = 0
    for s in sources:
        files = [s.path] if s.path.is_file() else [p for p in s.path.rglob("*") if p.is_file()]
        total += sum(p.stat().st_size for p in files)
    return total


def iter_pieces(sources: list[Source], text_field: str) -> Iterator[str | None]:
    """The text of `sources` in order, in pieces; None marks the end of a document (where EOS goes)."""
    for kind, group in _group(sources):
        try:
            if kind == "text":
                yield from _document_pieces(group)
            elif kind == "big_text":
                yield from _line_pieces(group[0].path)
            else:
                yield from _record_pieces(kind, group, text_field)
        except DataError:
            raise
        except Exception as e:  # datasets/pyarrow raise many types for one malformed file
            raise DataError(f"cannot read {_names(group)} ({type(e).__name__}: {e}); fix or remove that file") from e


def _group(sources: list[Source]) -> list[tuple[str, list[Source]]]:
    # One `datasets` call per run of same-kind files: each call costs a few ms (and 0.2-3 s where
    # the network is down, unless _datasets() turned the Hub's download counter off).
    groups: list[tuple[str, list[Source]]] = []
    for source in sources:
        kind = source.kind
        if kind == "text" and source.path.stat().st_size > WHOLE_FILE_BYTES:
            kind = "big_text"
        if groups and kind == groups[-1][0] and kind in ("text", "json", "parquet"):
            groups[-1][1].append(source)
        else:
            groups.append((kind, [source]))
    return groups


def _names(group: list[Source]) -> str:
    return str(group[0].path) + (f" (or one of {len(group) - 1} more inputs)" if len(group) > 1 else "")


def _document_pieces(group: list[Source]) -> Iterator[str | None]:
    datasets = _datasets()
    ds = datasets.load_dataset("text", data_files=[str(s.path) for s in group], split="train", streaming=True,
                               sample_by="document", encoding_errors="replace")
    for table in ds.with_format("arrow").iter(batch_size=1):
        text = table.column("text")[0].as_py()
        if text:  # an empty file is no document, so it gets no EOS
            yield text
            yield None


def _line_pieces(path: Path) -> Iterator[str | None]:
    # A big file is read in 1 MB chunks of whole lines, so one huge file cannot exhaust memory.
    datasets = _datasets()
    ds = datasets.load_dataset("text", data_files=[str(path)], split="train", streaming=True, keep_linebreaks=True,
                               chunksize=READ_CHUNK_BYTES, encoding_errors="replace")
    has_text = False
    for table in ds.with_format("arrow").iter(batch_size=4096):
        piece = "".join(table.column("text").to_pylist())
        if piece:
            has_text = True
            yield piece
    if has_text:
        yield None


def _record_pieces(kind: str, group: list[Source], text_field: str) -> Iterator[str | None]:
    for ds in _open_records(kind, group):
        for table in ds.with_format("arrow").iter(batch_size=1024):
            if text_field not in table.column_names:
                raise DataError(f"{_names(group)} has no field {text_field!r} (it has "
                                f"{', '.join(table.column_names)}); pass --text-field NAME")
            for text in table.column(text_field).to_pylist():
                if text is None or text == "":
                    continue
                if not isinstance(text, str):
                    raise DataError(f"field {text_field!r} of {_names(group)} holds {type(text).__name__}, "
                                    "not text; pass --text-field NAME")
                yield text
                yield None


def _json_takes_mixed_types() -> bool:
    """datasets' JSON builder has on_mixed_types from 5.x; 4.x (still supported) has no such field."""
    import dataclasses

    from datasets.packaged_modules.json.json import JsonConfig
    return "on_mixed_types" in {f.name for f in dataclasses.fields(JsonConfig)}


def _open_records(kind: str, group: list[Source]) -> list:
    datasets = _datasets()

    if kind == "saved":
        ds = datasets.load_from_disk(str(group[0].path))
        # A DatasetDict contributes every split, by name: our own val split is cut later.
        return [ds[k] for k in sorted(ds)] if isinstance(ds, datasets.DatasetDict) else [ds]
    # JSON: a field of mixed types (a string here, an object there) is an error, not every value
    # re-serialised as JSON text (datasets' default, on_mixed_types="use_json"): that quoted each
    # document's text in the shards.
    extra = {"on_mixed_types": None} if kind == "json" and _json_takes_mixed_types() else {}
    return [datasets.load_dataset(kind, data_files=[str(s.path) for s in group], split="train", streaming=True,
                                  **extra)]


def iter_token_arrays(sources: list[Source], tok, text_field: str,
                      text_bytes: list[int] | None = None) -> Iterator[np.ndarray]:
    """Token ids of every document in input order, EOS after each, in arrays of bounded size.
    `text_bytes[0]`, if given, grows by the UTF-8 size of the text read (what the tokens stand for).

    Batches are encoded in threads, several at a time, and handed back in input order: the
    tokenizer's batch encoding fans each call out over every core (and releases the GIL), so
    reading the next batch and writing the last overlap with it, and a batch's long last
    document no longer leaves the other cores idle. The batches themselves are cut as before,
    so the shards are the same bytes whatever the number of threads.
    """
    return _in_order(functools.partial(_encode, tok), _piece_batches(sources, text_field, text_bytes),
                     encode_in_flight(tok))


def _piece_batches(sources: list[Source], text_field: str,
                   text_bytes: list[int] | None) -> Iterator[list[str | None]]:
    pieces: list[str | None] = []
    chars = 0
    for piece in iter_pieces(sources, text_field):
        pieces.append(piece)
        chars += len(piece) if piece else 0
        if text_bytes is not None and piece:
            text_bytes[0] += len(piece.encode("utf-8"))
        if chars >= ENCODE_BATCH_CHARS or len(pieces) >= 8192:
            yield pieces
            pieces, chars = [], 0
    if pieces:
        yield pieces


def encode_in_flight(tok) -> int:
    """Batches encoded at once: two keep the cores busy through a batch's tail on a small machine;
    a batch holds ~2 MB of text in a few to thousands of documents, so wide machines take more.
    The byte tokenizer is a copy under the GIL (~1 GB/s): threads would only contend for it
    (prepare measured 55 MB/s inline, 45 MB/s with two in flight), so it encodes inline. A prepare
    worker (parts.py) has RAYON_NUM_THREADS, its share of the cores: the cores its batches can use."""
    if tok.kind == "byte":
        return 1
    threads = os.environ.get("RAYON_NUM_THREADS", "")
    cores = int(threads) if threads.isdigit() and int(threads) > 0 else len(os.sched_getaffinity(0))
    return min(16, 2 + cores // 4)


def _in_order(fn: Callable, items: Iterable, in_flight: int) -> Iterator:
    """fn(item) for every item, up to `in_flight` computed at once in threads, yielded in item
    order. `in_flight` 1 computes inline."""
    if in_flight <= 1:
        yield from map(fn, items)
        return
    with ThreadPoolExecutor(in_flight, thread_name_prefix="dsslm-encode") as pool:
        pending: collections.deque = collections.deque()
        for item in items:
            pending.append(pool.submit(fn, item))
            if len(pending) >= in_flight:
                yield pending.popleft().result()
        while pending:
            yield pending.popleft().result()


def _encode(tok, pieces: list[str | None]) -> np.ndarray:
    encoded = iter(tok.encode_batch([p for p in pieces if p is not None]))
    eos = np.array([tok.eos_id], dtype=np.uint32)
    return np.concatenate([eos if p is None else next(encoded) for p in pieces]).astype(np.uint32, copy=False)
