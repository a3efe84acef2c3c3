"""`python -m dsslm.data prepare`: stream text into token shards plus a manifest, and read it back.

DATA_DIR layout and manifest format: docs/design.md. Inputs are read through `datasets` in
streaming mode (text files over 8 MB line by line), so memory is bounded by the reader's chunk
and our buffers (a few tens of MB) whatever the input size. A text file is one document; a JSON/Parquet/
save_to_disk record is one document; EOS follows every document.

Validation split: the token stream is cut into contiguous blocks and block k goes to val when
floor((k+1)*f) > floor(k*f): every 1/f-th block, spread through the stream, deterministically.
A domain is written into a temporary folder and renamed into place; manifest.json is written
last, so a DATA_DIR without it, or a domain missing from it, does not exist for any reader.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import os
import re
import shutil
import sys
import time
from pathlib import Path

import numpy as np

from dsslm.durable import fsync_dir, write_json_atomic
from dsslm.data.sources import DataError, Source, find_sources, input_bytes, iter_pieces, iter_token_arrays
from dsslm.data.tokenizer import TOKENIZER_FILE, ByteTokenizer, file_sha256, load_tokenizer, train_bpe

MANIFEST_FILE = "manifest.json"
FORMAT = 1
SHARD_TOKENS = 1 << 28  # 512 MiB of uint16 per shard file
MAX_BLOCK_TOKENS = 8192
MIN_BLOCK_TOKENS = 64
DEFAULT_VOCAB_SIZE = 8192
DOMAIN_NAME = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.-]*")


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
    if verify and manifest["tokenizer"]["kind"] == "bpe":
        try:
            load_tokenizer(data_dir, manifest)
        except ValueError as e:
            raise DataError(str(e)) from e
    return manifest


def _check_shard(data_dir: Path, entry: dict, itemsize: int, verify: bool) -> None:
    path = data_dir / entry["path"]
    if not path.is_file():
        raise DataError(f"shard {path} is missing; rebuild {data_dir} with prepare")
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


class ShardWriter:
    """Appends tokens to DIR/{split}-00000.bin, -00001.bin, ..., `shard_tokens` per file."""

    def __init__(self, folder: Path, domain: str, split: str, dtype: str, shard_tokens: int):
        self.folder, self.domain, self.split = folder, domain, split
        self.dtype, self.shard_tokens = np.dtype(dtype), shard_tokens
        self.entries: list[dict] = []
        self.tokens = 0
        self._file = None

    def write(self, tokens: np.ndarray) -> None:
        while len(tokens):
            if self._file is None:
                self._name = f"{self.split}-{len(self.entries):05d}.bin"
                self._file = open(self.folder / self._name, "wb", buffering=1 << 20)
                self._digest, self._shard_tokens = hashlib.sha256(), 0
            room = self.shard_tokens - self._shard_tokens
            part, tokens = tokens[:room], tokens[room:]
            data = part.astype(self.dtype).tobytes()
            self._file.write(data)
            self._digest.update(data)
            self._shard_tokens += len(part)
            self.tokens += len(part)
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
        self.entries.append({"path": path, "tokens": self._shard_tokens, "sha256": self._digest.hexdigest()})


class SplitRouter:
    """Cuts the token stream into blocks; block k goes to val when floor((k+1)f) > floor(kf)."""

    def __init__(self, train: ShardWriter, val: ShardWriter, val_fraction: float, block_tokens: int):
        self.train, self.val, self.f, self.block_tokens = train, val, val_fraction, block_tokens
        self._pending: list[np.ndarray] = []
        self._pending_tokens = 0
        self._k = 0
        self._held: np.ndarray | None = None  # the latest train block, kept back for close()

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
            self.val.write(block)
            return
        if self._held is not None:
            self.train.write(self._held)
        self._held = block

    def close(self) -> tuple[list[dict], list[dict]]:
        if self._pending_tokens:
            self._route(np.concatenate(self._pending))
        if self._held is not None:
            # A small input may route no block to val: give it the last train block, unless
            # that would leave train empty.
            val_starved = self.f > 0 and self.val.tokens == 0 and self.train.tokens > 0
            (self.val if val_starved else self.train).write(self._held)
        return self.train.close(), self.val.close()


def _block_tokens(sources: list[Source], kind: str) -> int:
    n_bytes = input_bytes(sources)
    est_tokens = n_bytes if kind == "byte" else n_bytes // 4  # BPE averages ~4 bytes a token
    # About 1000 blocks: f=0.01 then gives ~10 val blocks spread over the stream.
    return int(min(MAX_BLOCK_TOKENS, max(MIN_BLOCK_TOKENS, est_tokens // 1000)))


def prepare(inputs: list[str | Path], out: str | Path, domain: str = "default", tokenizer: str | None = None,
            vocab_size: int | None = None, val_fraction: float = 0.01, text_field: str = "text",
            shard_tokens: int = SHARD_TOKENS) -> dict:
    """Tokenize `inputs` into DATA_DIR `out` as `domain`; returns the new manifest.

    `tokenizer`/`vocab_size` None: those of an existing DATA_DIR, else byte / 8192. On any
    failure everything this call created is removed and an existing manifest is untouched."""
    _check_args(domain, tokenizer, vocab_size, val_fraction)
    out = Path(out)
    sources = find_sources(inputs)
    undo: list[Path] = []  # what this call created, removed if it fails
    if not out.exists():
        out.mkdir(parents=True)
        undo.append(out)
    try:
        manifest = _existing_manifest(out, domain)
        tok = _get_tokenizer(out, manifest, tokenizer, vocab_size, sources, text_field, undo)
        dtype = "uint16" if tok.vocab_size <= 1 << 16 else "uint32"
        entry = _write_domain(out, domain, sources, tok, dtype, val_fraction, text_field, shard_tokens, undo)
        entry["sources"] = [str(Path(p).resolve()) for p in inputs]
        if manifest is None:
            spec = {"kind": tok.kind, "vocab_size": tok.vocab_size, "eos_id": tok.eos_id, "sha256": tok.sha256}
            manifest = {"format": FORMAT, "tokenizer": spec, "dtype": dtype, "domains": {}}
        manifest["domains"] = dict(sorted({**manifest["domains"], domain: entry}.items()))
        write_json_atomic(out / MANIFEST_FILE, manifest, indent=1)
        return manifest
    except BaseException:
        for path in reversed(undo):
            shutil.rmtree(path, ignore_errors=True) if path.is_dir() else path.unlink(missing_ok=True)
        raise


def _check_args(domain: str, tokenizer: str | None, vocab_size: int | None, val_fraction: float) -> None:
    if not DOMAIN_NAME.fullmatch(domain):
        raise DataError(f"--domain {domain!r} is not a folder name; use letters, digits, '_', '-' and '.'")
    if tokenizer not in (None, "byte", "bpe"):
        raise DataError(f"--tokenizer {tokenizer!r} is unknown; use byte or bpe")
    if vocab_size is not None and not 258 <= vocab_size <= 1 << 32:
        raise DataError(f"--vocab-size {vocab_size} is out of range; use 258 (256 bytes + EOS + 1 merge) to 2^32")
    if not 0 <= val_fraction < 1:
        raise DataError(f"--val-fraction {val_fraction} must be in [0, 1); 0.01 holds out 1%")


def _existing_manifest(out: Path, domain: str) -> dict | None:
    manifest = load_manifest(out, verify=False) if (out / MANIFEST_FILE).is_file() else None
    if manifest is not None and domain in manifest["domains"]:
        raise DataError(f"--domain {domain} already exists in {out}; choose another --domain or a new --out")
    if (out / domain).exists():
        raise DataError(f"{out / domain} exists but is no domain of {out}; remove it or choose another --domain")
    return manifest


def _get_tokenizer(out, manifest, kind, vocab_size, sources, text_field, undo):
    if manifest is not None:
        have = manifest["tokenizer"]["kind"]
        if kind is not None and kind != have:
            raise DataError(f"{out} holds --tokenizer {have} data; pass --tokenizer {have} (or omit it), "
                            "or use a new --out")
        try:
            return load_tokenizer(out, manifest)  # reused as is, never retrained
        except ValueError as e:
            raise DataError(str(e)) from e
    if (kind or "byte") == "byte":
        return ByteTokenizer()
    path = out / TOKENIZER_FILE
    undo += [path, path.with_name(path.name + ".tmp")]
    texts = (p for p in iter_pieces(sources, text_field) if p)
    return train_bpe(texts, vocab_size or DEFAULT_VOCAB_SIZE, path)


def _write_domain(out, domain, sources, tok, dtype, val_fraction, text_field, shard_tokens, undo) -> dict:
    tmp = out / f".tmp-{domain}-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)  # a crashed run with our pid
    tmp.mkdir()
    undo.append(tmp)
    train = ShardWriter(tmp, domain, "train", dtype, shard_tokens)
    val = ShardWriter(tmp, domain, "val", dtype, shard_tokens)
    router = SplitRouter(train, val, val_fraction, _block_tokens(sources, tok.kind))
    for tokens in iter_token_arrays(sources, tok, text_field):
        router.write(tokens)
    train_entries, val_entries = router.close()
    if not train_entries:
        inputs = " ".join(str(s.path) for s in sources)
        raise DataError(f"--input {inputs} holds no text; give files with text in them")
    fsync_dir(tmp)
    os.rename(tmp, out / domain)
    undo.append(out / domain)
    fsync_dir(out)
    return {"train": train_entries, "val": val_entries}


class _Parser(argparse.ArgumentParser):
    def error(self, message):  # one line on stderr, not argparse's usage block
        self.exit(2, f"{self.prog}: error: {message}; see --help\n")


def _parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="python -m dsslm.data", description=__doc__.split("\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("prepare", help="tokenize text into DATA_DIR as one domain")
    p.add_argument("--input", nargs="+", required=True,
                   help="text/JSONL/JSON/Parquet files, folders of them, save_to_disk folders")
    p.add_argument("--out", required=True, help="DATA_DIR (created, or extended with a new domain)")
    p.add_argument("--domain", default="default", help="a name per source of text; each gets its own val split")
    p.add_argument("--tokenizer", default=None, help="byte (default for a new DATA_DIR) or bpe")
    p.add_argument("--vocab-size", type=int, default=None,
                   help=f"bpe, new DATA_DIR only (a later domain reuses its tokenizer); default {DEFAULT_VOCAB_SIZE}")
    p.add_argument("--val-fraction", type=float, default=0.01, help="share of token blocks held out (0 allowed)")
    p.add_argument("--text-field", default="text", help="the field holding the text in JSON/Parquet records")
    return parser


def quiet_datasets() -> None:
    import datasets

    datasets.disable_progress_bars()
    # We report a bad file ourselves, in one line; datasets would log it again at ERROR.
    datasets.utils.logging.set_verbosity(datasets.utils.logging.CRITICAL)


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    quiet_datasets()
    started = time.perf_counter()
    try:
        manifest = prepare(args.input, args.out, domain=args.domain, tokenizer=args.tokenizer,
                           vocab_size=args.vocab_size, val_fraction=args.val_fraction, text_field=args.text_field)
    except DataError as e:
        print(f"dsslm.data: error: {' '.join(str(e).split())}", file=sys.stderr)
        return 2
    entry = manifest["domains"][args.domain]
    n_train = sum(s["tokens"] for s in entry["train"])
    n_val = sum(s["tokens"] for s in entry["val"])
    seconds = time.perf_counter() - started
    print(f"prepared domain {args.domain!r} in {args.out}: {n_train} train + {n_val} val tokens "
          f"({manifest['tokenizer']['kind']}, vocab {manifest['tokenizer']['vocab_size']}) in {seconds:.1f}s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
