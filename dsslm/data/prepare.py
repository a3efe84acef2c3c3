"""`prepare`: stream text into token shards plus a manifest (the CLI is `python -m dsslm.data`).

DATA_DIR layout and manifest format: docs/design.md. Inputs are read through `datasets` in
streaming mode (text files over 8 MB line by line), so memory is bounded by the reader's chunk
and our buffers (a few tens of MB) whatever the input size. A text file is one document; a JSON/Parquet/
save_to_disk record is one document; EOS follows every document.

Every shard entry records the `bytes` of text its tokens stand for (what bits per byte divides
by), counted with the tokenizer's byte table and written only when the whole domain's count
equals the UTF-8 size of the text it read: a tokenizer that cannot count exactly records none.

Validation split: the token stream is cut into contiguous blocks and block k goes to val when
floor((k+1)*f) > floor(k*f): every 1/f-th block, spread through the stream, deterministically.
A domain is written into a temporary folder and renamed into place; manifest.json is written
last, so a DATA_DIR without it, or a domain missing from it, does not exist for any reader.

In parts (parts.py, vocab.py): the tokenizer is made once; each run of input files (a unit) is
tokenized on its own into DATA_DIR/.parts-DOMAIN (by this process, `workers` processes, or `--part
I/N` tasks on any number of nodes); the merge streams those units in input order through one split
and one shard writer. The split and the shards depend only on the token stream and the inputs'
total size, so the DATA_DIR is the same bytes whatever the worker or task count.
"""

from __future__ import annotations

import hashlib
import math
import os
import re
import shutil
import socket
import sys
from pathlib import Path

import numpy as np

from dsslm.config import join_problems
from dsslm.durable import pid_running, publish_folder, write_json_atomic
from dsslm.data.sources import DataError, Source, find_sources, input_bytes, quiet_datasets  # noqa: F401 (theirs)
from dsslm.data.manifest import FORMAT, MANIFEST_FILE, load_manifest
from dsslm.data.parts import Part, WorkerLost, make_units, merge_records, parts_dir, plan_units, unit_tokens
from dsslm.data.tokenizer import TOKENIZER_FILE, token_byte_lengths
from dsslm.data.vocab import (DEFAULT_VOCAB_SIZE, RECIPE_FILE, TOKENIZER_SAMPLE_BYTES,  # noqa: F401
                              get_tokenizer, remove_recipe)

SHARD_TOKENS = 1 << 28  # 512 MiB of uint16 per shard file
MAX_BLOCK_TOKENS = 8192
MIN_BLOCK_TOKENS = 64
DOMAIN_NAME = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.-]*")


class ShardWriter:
    """Appends tokens to DIR/{split}-00000.bin, -00001.bin, ..., `shard_tokens` per file."""

    def __init__(self, folder: Path, domain: str, split: str, dtype: str, shard_tokens: int,
                 byte_lengths: np.ndarray | None = None):
        self.folder, self.domain, self.split = folder, domain, split
        self.dtype, self.shard_tokens = np.dtype(dtype), shard_tokens
        self.byte_lengths = byte_lengths  # bytes of text per token id, None = not countable
        self.entries: list[dict] = []
        self.tokens = self.bytes = 0
        self._file = None

    def write(self, tokens: np.ndarray) -> None:
        while len(tokens):
            if self._file is None:
                self._name = f"{self.split}-{len(self.entries):05d}.bin"
                self._file = open(self.folder / self._name, "wb", buffering=1 << 20)
                self._digest, self._shard_tokens, self._shard_bytes = hashlib.sha256(), 0, 0
            room = self.shard_tokens - self._shard_tokens
            part, tokens = tokens[:room], tokens[room:]
            data = part.astype(self.dtype).tobytes()
            self._file.write(data)
            self._digest.update(data)
            self._shard_tokens += len(part)
            self.tokens += len(part)
            if self.byte_lengths is not None:
                self._shard_bytes += int(self.byte_lengths[part].sum())
            if self._shard_tokens == self.shard_tokens:
                self._close_shard()

    def close(self) -> list[dict]:
        if self._file is not None:
            self._close_shard()
        return self.entries

    def _close_shard(self) -> None:
        self._file.flush()
        os.fsync(self._file.fileno())
        self._file.close()
        self._file = None
        path = f"{self.domain}/{self._name}"
        self.bytes += self._shard_bytes
        self.entries.append({"path": path, "tokens": self._shard_tokens, "bytes": self._shard_bytes,
                             "sha256": self._digest.hexdigest()})


class SplitRouter:
    """Cuts the token stream into blocks; block k goes to val when floor((k+1)f) > floor(kf).

    Blocks are cut at token offsets, not at documents: where a split's next block does not follow
    its last one in the stream, the document its last block cut off is ended with an EOS first
    (`eos_id`), so the split reads `doc EOS doc EOS ...` and no EOS-delimited span holds text of
    two documents (the document mask, and a skip entry's document bounds, split on EOS)."""

    def __init__(self, train: ShardWriter, val: ShardWriter, val_fraction: float, block_tokens: int,
                 eos_id: int | None = None):
        self.train, self.val, self.f, self.block_tokens = train, val, val_fraction, block_tokens
        self.eos_id = eos_id
        self._pending: list[np.ndarray] = []
        self._pending_tokens = 0
        self._k = 0
        self._held: tuple[int, np.ndarray] | None = None  # the latest train block (k, tokens), kept for close()
        self._last: dict[int, tuple[int, int]] = {}  # id(writer) -> (k, last token) of its last block

    def write(self, tokens: np.ndarray) -> None:
        self._pending.append(tokens)
        self._pending_tokens += len(tokens)
        if self._pending_tokens < self.block_tokens:
            return
        stream = np.concatenate(self._pending)
        n_full = len(stream) // self.block_tokens
        for i in range(n_full):
            self._route(stream[i * self.block_tokens : (i + 1) * self.block_tokens])
        rest = stream[n_full * self.block_tokens :].copy()
        self._pending, self._pending_tokens = [rest], len(rest)

    def _route(self, block: np.ndarray) -> None:
        k = self._k
        self._k += 1
        if math.floor((k + 1) * self.f) > math.floor(k * self.f):
            self._emit(self.val, k, block)
            return
        if self._held is not None:
            self._emit(self.train, *self._held)
        self._held = (k, block)

    def _emit(self, writer: ShardWriter, k: int, block: np.ndarray) -> None:
        last = self._last.get(id(writer))
        if self.eos_id is not None and last is not None and last[0] != k - 1 and last[1] != self.eos_id:
            writer.write(np.asarray([self.eos_id], dtype=block.dtype))
        writer.write(block)
        if len(block):
            self._last[id(writer)] = (k, int(block[-1]))

    def close(self) -> tuple[list[dict], list[dict]]:
        if self._pending_tokens:
            self._route(np.concatenate(self._pending))
        if self._held is not None:
            # A small input may route no block to val: give it the last train block, unless
            # that would leave train empty.
            val_starved = self.f > 0 and self.val.tokens == 0 and self.train.tokens > 0
            self._emit(self.val if val_starved else self.train, *self._held)
        return self.train.close(), self.val.close()


def _block_tokens(sources: list[Source], kind: str) -> int:
    n_bytes = input_bytes(sources)
    est_tokens = n_bytes if kind == "byte" else n_bytes // 4  # BPE averages ~4 bytes a token
    # About 1000 blocks: f=0.01 then gives ~10 val blocks spread over the stream.
    return int(min(MAX_BLOCK_TOKENS, max(MIN_BLOCK_TOKENS, est_tokens // 1000)))


def prepare(inputs: list[str | Path], out: str | Path, domain: str = "default", tokenizer: str | None = None,
            vocab_size: int | None = None, val_fraction: float = 0.01, text_field: str = "text",
            shard_tokens: int = SHARD_TOKENS, workers: int = 1,
            tokenizer_sample: int = TOKENIZER_SAMPLE_BYTES) -> dict:
    """Tokenize `inputs` into DATA_DIR `out` as `domain`, in `workers` processes; returns the new
    manifest. Every step in this call: the tokenizer, the units (those a killed prepare finished
    are reused), the merge.

    `tokenizer`/`vocab_size` None: those of an existing DATA_DIR (its manifest's, or its tokenizer
    step's: vocab.py), else byte / 8192. On an error everything this call created is removed and an
    existing manifest is untouched; interrupted (Ctrl-C) or a worker killed, it keeps the tokenizer
    and the finished units for the next call."""
    _check_args(domain, tokenizer, vocab_size, val_fraction, workers, tokenizer_sample)
    out = _out_folder(out)
    sources = find_sources(inputs)
    undo: list[Path] = []  # what this call created, removed if it fails
    if not out.exists():
        out.mkdir(parents=True)
        undo.append(out)
    folder = parts_dir(out, domain)
    try:
        manifest = _existing_manifest(out, domain)
        tok, given = get_tokenizer(out, manifest, tokenizer, vocab_size, sources, text_field, undo, tokenizer_sample)
        remove_leftovers(out, manifest)  # once `out` is accepted: a folder refused is left as it was
        dtype = _dtype(tok)
        if not folder.exists():
            undo.append(folder)
        units = plan_units(sources)
        done = make_units(folder, list(range(len(units))), units, tok, dtype, text_field, workers)
        if done.reused:
            print(f"dsslm.data: reused {len(done.reused)} of {len(units)} units finished before in {folder}",
                  file=sys.stderr)
        return _merge(out, domain, inputs, sources, tok, given, dtype, manifest, val_fraction, text_field,
                      shard_tokens, undo)
    except BaseException as e:
        # Bad input: nothing of this call's stays. Interrupted, or a worker killed: the tokenizer
        # and the finished units stay, for the next run to reuse.
        resumable = not isinstance(e, Exception) or isinstance(e, WorkerLost)
        _undo(undo, keep={folder, out / TOKENIZER_FILE, out / RECIPE_FILE} if resumable else set())
        raise


def prepare_tokenizer(inputs: list[str | Path], out: str | Path, domain: str = "default",
                      tokenizer: str | None = None, vocab_size: int | None = None, text_field: str = "text",
                      tokenizer_sample: int = TOKENIZER_SAMPLE_BYTES):
    """The tokenizer step alone (`--tokenizer-only`): the tokenizer the --part tasks will use."""
    _check_args(domain, tokenizer, vocab_size, 0.0, 1, tokenizer_sample)
    out = _out_folder(out)
    sources = find_sources(inputs)
    undo: list[Path] = []
    if not out.exists():
        out.mkdir(parents=True)
        undo.append(out)
    try:
        manifest = _existing_manifest(out, domain)
        return get_tokenizer(out, manifest, tokenizer, vocab_size, sources, text_field, undo, tokenizer_sample)[0]
    except BaseException:
        _undo(undo)
        raise


def prepare_part(inputs: list[str | Path], out: str | Path, part: Part, domain: str = "default",
                 tokenizer: str | None = None, vocab_size: int | None = None, text_field: str = "text",
                 workers: int = 1):
    """One task's units (`--part I/N`), nothing else: never a trained tokenizer, never the manifest.
    Tasks share `out`, so a failure removes only the unit it was writing."""
    _check_args(domain, tokenizer, vocab_size, 0.0, workers, 1)
    out = _out_folder(out)
    sources = find_sources(inputs)
    manifest = _existing_manifest(out, domain) if out.is_dir() else None
    created = not out.exists()
    out.mkdir(parents=True, exist_ok=True)  # another task may make it at the same moment
    try:
        tok, _ = get_tokenizer(out, manifest, tokenizer, vocab_size, sources, text_field, [], make=False)
    except BaseException:
        if created and not any(out.iterdir()):
            out.rmdir()  # refused: no empty folder left behind for the next run to wonder about
        raise
    units = plan_units(sources)
    which = part.units(len(units))
    return make_units(parts_dir(out, domain), which, units, tok, _dtype(tok), text_field, workers), len(units)


def merge(inputs: list[str | Path], out: str | Path, domain: str = "default", tokenizer: str | None = None,
          vocab_size: int | None = None, val_fraction: float = 0.01, text_field: str = "text",
          shard_tokens: int = SHARD_TOKENS) -> dict:
    """The last step (`--merge`): the units every --part task made, into the domain and the
    manifest. Refused, with nothing written, while any unit is not finished."""
    _check_args(domain, tokenizer, vocab_size, val_fraction, 1, 1)
    out = _out_folder(out)
    if not out.is_dir():
        raise DataError(f"--out {out} does not exist: --merge reads the units the --part tasks make there; "
                        "run them first")
    sources = find_sources(inputs)
    undo: list[Path] = []
    try:
        manifest = _existing_manifest(out, domain)
        tok, given = get_tokenizer(out, manifest, tokenizer, vocab_size, sources, text_field, undo, make=False)
        dtype = _dtype(tok)
        records = merge_records(parts_dir(out, domain), plan_units(sources), tok.sha256, dtype, text_field)
        remove_leftovers(out, manifest)
        return _merge(out, domain, inputs, sources, tok, given, dtype, manifest, val_fraction, text_field,
                      shard_tokens, undo, records)
    except BaseException:
        _undo(undo)
        raise


def _merge(out, domain, inputs, sources, tok, given, dtype, manifest, val_fraction, text_field, shard_tokens,
           undo, records=None) -> dict:
    folder = parts_dir(out, domain)
    records = records or merge_records(folder, plan_units(sources), tok.sha256, dtype, text_field)
    entry = _write_domain(out, domain, sources, tok, dtype, val_fraction, shard_tokens, folder, records, undo)
    entry["sources"] = [str(Path(p).resolve()) for p in inputs]
    if manifest is None:
        spec = {"kind": tok.kind, "vocab_size": tok.vocab_size, "eos_id": tok.eos_id, "sha256": tok.sha256}
        manifest = {"format": FORMAT, "tokenizer": spec, "dtype": dtype, "domains": {}}
        if tok.kind == "file":
            # Outside the tokenizer spec, which manifest_hash covers: the same file
            # brought from another path is the same tokenizer.
            spec["eos_token"] = tok.eos_token
            manifest["tokenizer_source"] = str(Path(given).resolve())
    manifest["domains"] = dict(sorted({**manifest["domains"], domain: entry}.items()))
    write_json_atomic(out / MANIFEST_FILE, manifest, indent=1)
    # The manifest is written: what follows only tidies up, and must not undo the domain.
    shutil.rmtree(folder, ignore_errors=True)
    try:
        remove_recipe(out)
    except OSError:
        pass
    return manifest


def _out_folder(out: str | Path) -> Path:
    out = Path(out)
    if out.exists() and not out.is_dir():
        raise DataError(f"--out {out} is a file, not a folder; name a new folder or an existing DATA_DIR")
    return out


def _dtype(tok) -> str:
    return "uint16" if tok.vocab_size <= 1 << 16 else "uint32"


def _undo(undo: list[Path], keep: set[Path] = frozenset()) -> None:
    """Remove what a failed call created, newest first, except `keep` and the folders holding it."""
    kept = {k for k in keep if k.exists()}
    for path in reversed(undo):
        if path in kept or any(path in k.parents for k in kept):
            continue
        shutil.rmtree(path, ignore_errors=True) if path.is_dir() else path.unlink(missing_ok=True)


def _check_args(domain: str, tokenizer: str | None, vocab_size: int | None, val_fraction: float, workers: int,
                tokenizer_sample: int) -> None:
    problems = arg_problems(domain, tokenizer, vocab_size, val_fraction) + step_problems(workers, tokenizer_sample)
    if problems:
        raise DataError(join_problems(problems))


def arg_problems(domain: str, tokenizer: str | None, vocab_size: int | None, val_fraction: float,
                 inputs: list[str] = ()) -> list[str]:
    """What is wrong with prepare's arguments, each on its own: none needs a file read or a library."""
    problems = [] if DOMAIN_NAME.fullmatch(domain) else [
        f"--domain {domain!r} is not a folder name; use letters, digits, '_', '-' and '.'"]
    if tokenizer not in (None, "byte", "bpe") and not Path(tokenizer).exists():
        problems.append(f"--tokenizer {tokenizer!r} is unknown; use byte, bpe, or the path of a tokenizer.json "
                        "(or of a folder holding one)")
    elif vocab_size is not None and tokenizer not in (None, "bpe"):
        problems.append(f"--vocab-size is for --tokenizer bpe; {tokenizer} has its own vocabulary, drop --vocab-size")
    if vocab_size is not None and not 258 <= vocab_size <= 1 << 32:
        problems.append(f"--vocab-size {vocab_size} is out of range; use 258 (256 bytes + EOS + 1 merge) to 2^32")
    if not 0 <= val_fraction < 1:
        problems.append(f"--val-fraction {val_fraction} must be in [0, 1); 0.01 holds out 1%")
    problems += [f"--input {path} does not exist; fix the path" for path in inputs if not Path(path).exists()]
    return problems


def _existing_manifest(out: Path, domain: str) -> dict | None:
    path = out / MANIFEST_FILE
    if os.path.lexists(path) and not path.is_file():  # a folder, a broken link, a FIFO: never replaced
        raise DataError(f"{path} is not a file (a folder, a broken link or a pipe); fix or remove it, or use a new --out")
    manifest = load_manifest(out, verify=False) if path.is_file() else None
    if manifest is not None and domain in manifest["domains"]:
        raise DataError(f"--domain {domain} already exists in {out}; choose another --domain or a new --out")
    if (out / domain).exists():
        raise DataError(f"{out / domain} exists but is no domain of {out}; remove it or choose another --domain")
    return manifest

def step_problems(workers: int, tokenizer_sample: int) -> list[str]:
    """What is wrong with the arguments that say how prepare runs (not what it makes)."""
    problems = []
    if workers < 1:
        problems.append(f"--workers {workers} must be at least 1 (1: tokenize in this process)")
    if tokenizer_sample < 1:
        problems.append(f"--tokenizer-sample {tokenizer_sample} must be at least 1 byte (default {TOKENIZER_SAMPLE_BYTES})")
    return problems


OWNER_FILE = ".owner"
_LEFTOVER = re.compile(r"\.tmp-.+-(\d+)")


def remove_leftovers(out: Path, manifest: dict | None = None) -> None:
    """The temp folders of prepares killed mid-write (`.tmp-DOMAIN-PID`, PID no longer running):
    each can be a corpus-sized partial shard, and nothing else ever removed them. A folder of
    a live process, or of another host (its owner file says), is left alone. And the units of a
    domain the manifest already has (`.parts-DOMAIN`: a merge killed after its manifest)."""
    for domain in (manifest or {}).get("domains", {}):
        if parts_dir(out, domain).is_dir():
            shutil.rmtree(parts_dir(out, domain), ignore_errors=True)
            print(f"dsslm.data: removed {parts_dir(out, domain)}, the units of a finished domain", file=sys.stderr)
    host = socket.gethostname()
    for path in sorted(out.glob(".tmp-*")):
        m = _LEFTOVER.fullmatch(path.name)
        if not m or not path.is_dir() or path.is_symlink():
            continue
        try:
            owner = (path / OWNER_FILE).read_text().strip()
        except OSError:
            owner = host  # written before the owner file: this host's, as prepares ran then
        if owner != host or pid_running(int(m.group(1))):
            continue
        shutil.rmtree(path, ignore_errors=True)
        print(f"dsslm.data: removed {path}, left by a prepare that was killed", file=sys.stderr)


def _write_domain(out, domain, sources, tok, dtype, val_fraction, shard_tokens, folder, records, undo) -> dict:
    tmp = out / f".tmp-{domain}-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)  # a crashed run with our pid
    tmp.mkdir()
    undo.append(tmp)
    (tmp / OWNER_FILE).write_text(socket.gethostname())  # remove_leftovers: whose pid the name holds
    byte_lengths = token_byte_lengths(tok)
    train = ShardWriter(tmp, domain, "train", dtype, shard_tokens, byte_lengths)
    val = ShardWriter(tmp, domain, "val", dtype, shard_tokens, byte_lengths)
    # The block size comes from the inputs' total size alone, never from how the units were made.
    router = SplitRouter(train, val, val_fraction, _block_tokens(sources, tok.kind), tok.eos_id)
    for tokens in unit_tokens(folder, records, dtype):
        router.write(tokens)
    train_entries, val_entries = router.close()
    if not train_entries:
        inputs = " ".join(str(s.path) for s in sources)
        raise DataError(f"--input {inputs} holds no text; give files with text in them")
    text_bytes = sum(r["text_bytes"] for r in records)
    if byte_lengths is None or train.bytes + val.bytes != text_bytes:
        for entry in train_entries + val_entries:  # not countable exactly: record no byte count
            del entry["bytes"]
    (tmp / OWNER_FILE).unlink()  # the domain's folder holds its shards and nothing else
    publish_folder(tmp, out / domain)
    undo.append(out / domain)
    return {"train": train_entries, "val": val_entries, "text_bytes": text_bytes}
