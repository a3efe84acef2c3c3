"""Which tokenizer a prepare writes with, made once before any unit is tokenized.

A DATA_DIR with a manifest has its tokenizer: every later domain reuses it. A new one gets it from
the tokenizer step (`prepare --tokenizer-only`, or the first thing a plain prepare does): the byte
tokenizer, a user's tokenizer.json copied in, or a ByteLevel BPE trained on a sample, the first
`--tokenizer-sample` bytes (UTF-8, default 1 GiB) of document text in input order, the last
document cut to fit. An input smaller than the sample trains on all its text, as prepare always did.

The step leaves DATA_DIR/tokenizer.json (BPE or a copy) and DATA_DIR/.tokenizer-recipe.json (what
it was made from and its sha256). `--part` tasks and `--merge` use that tokenizer and never train
one: with --tokenizer bpe and no recipe they refuse, so N tasks never train N tokenizers. A plain
prepare reuses a recipe that matches its arguments and inputs (a killed prepare continues with the
same tokenizer, and so the units it finished), else makes the tokenizer again. The merge writes
the manifest, which pins the tokenizer from then on, and removes the recipe.
"""
from __future__ import annotations

import json
import os
import shutil
import socket
import sys
from pathlib import Path
from typing import Iterator

from dsslm.data.parts import source_stamp
from dsslm.data.sources import DataError, Source, iter_pieces
from dsslm.data.tokenizer import (TOKENIZER_FILE, BPETokenizer, ByteTokenizer, eos_token_of, find_tokenizer_file,
                                  load_tokenizer, train_bpe)
from dsslm.durable import file_sha256, write_json_atomic

DEFAULT_VOCAB_SIZE = 8192
TOKENIZER_SAMPLE_BYTES = 1 << 30
RECIPE_FILE = ".tokenizer-recipe.json"


def sample_texts(sources: list[Source], text_field: str, limit: int) -> Iterator[str]:
    """The documents' text in input order, up to `limit` UTF-8 bytes (the last piece cut to fit)."""
    left = limit
    for piece in iter_pieces(sources, text_field):
        if not piece:
            continue
        size = len(piece.encode("utf-8"))
        if size >= left:
            yield piece if size == left else piece.encode("utf-8")[:left].decode("utf-8", errors="ignore")
            return
        left -= size
        yield piece


def get_tokenizer(out: Path, manifest: dict | None, kind: str | None, vocab_size: int | None,
                  sources: list[Source], text_field: str, undo: list[Path], sample_bytes: int = TOKENIZER_SAMPLE_BYTES,
                  make: bool = True):
    """(tokenizer, the given tokenizer.json's path or None). `make` False (a part, the merge): the
    tokenizer step's, or the byte one, or a copy of a given file; never a BPE trained here."""
    given = None if kind in (None, "byte", "bpe") else _tokenizer_file(kind)
    if manifest is not None:
        return _from_manifest(out, manifest, kind, given, vocab_size), None
    want = "file" if given is not None else kind
    recipe = read_recipe(out)
    if recipe is not None:
        mismatch = _mismatch(recipe, want, given, vocab_size, None if not make else
                             _bpe_request(vocab_size, sample_bytes, text_field, sources))
        if mismatch is None:
            return _open(out, recipe), (Path(recipe["source"]) if recipe["kind"] == "file" else None)
        if not make:
            raise DataError(f"{out}'s tokenizer step made {mismatch}; pass the tokenizer arguments it was given, "
                            f"or run the tokenizer step again")
    elif not make and want == "bpe":
        raise DataError(f"{out} has no trained tokenizer yet: run the tokenizer step first (the same prepare "
                        "command with --tokenizer-only, once), then the --part tasks")
    path = out / TOKENIZER_FILE
    if not make:
        # A part or the merge without a tokenizer step: the byte tokenizer or a copy of the given
        # file (the same bytes whichever task's rename lands last), and no recipe, which tasks on
        # several nodes would race to write.
        if want != "file":
            return ByteTokenizer(), None
        return _copy_tokenizer(given, path, undo), given
    if want == "file":
        tok = _copy_tokenizer(given, path, undo)
        _write_recipe(out, {"kind": "file", "sha256": tok.sha256, "eos_token": tok.eos_token,
                            "source": str(given.resolve())}, undo)
        return tok, given
    if (want or "byte") == "byte":
        if recipe is not None and recipe["kind"] != "byte":
            path.unlink(missing_ok=True)  # the recipe's own (a killed prepare's): a byte DATA_DIR has none
        _write_recipe(out, {"kind": "byte", "sha256": ByteTokenizer.sha256}, undo)
        return ByteTokenizer(), None
    undo += [path, path.with_name(path.name + ".tmp")]
    tok = train_bpe(sample_texts(sources, text_field, sample_bytes), vocab_size or DEFAULT_VOCAB_SIZE, path)
    _write_recipe(out, {"kind": "bpe", "sha256": tok.sha256,
                        **_bpe_request(vocab_size, sample_bytes, text_field, sources)}, undo)
    return tok, None


def _bpe_request(vocab_size, sample_bytes, text_field, sources) -> dict:
    return {"vocab_size": vocab_size or DEFAULT_VOCAB_SIZE, "sample_bytes": sample_bytes, "text_field": text_field,
            "inputs": [source_stamp(s) for s in sources]}


def _mismatch(recipe: dict, want: str | None, given: Path | None, vocab_size: int | None,
              bpe_request: dict | None) -> str | None:
    """None where `recipe` is what was asked for (`want` None: whatever it is), else what it is."""
    have = recipe["kind"]
    what = f"a {have} tokenizer" + (f" of --vocab-size {recipe.get('vocab_size')}" if have == "bpe" else "")
    if want is not None and want != have:
        return what
    if have == "file" and given is not None and file_sha256(given) != recipe["sha256"]:
        return f"a copy of another tokenizer.json ({recipe.get('source')})"
    if have == "bpe" and want == "bpe":
        if bpe_request is not None:  # a plain prepare: the same vocabulary, sample and inputs
            if any(recipe.get(k) != v for k, v in bpe_request.items()):
                return what + " from other inputs or arguments"
        elif vocab_size is not None and vocab_size != recipe.get("vocab_size"):
            return what
    return None


def read_recipe(out: Path) -> dict | None:
    """The tokenizer step's record, where it and the tokenizer.json it names are whole."""
    try:
        recipe = json.loads((out / RECIPE_FILE).read_text())
        if not isinstance(recipe, dict) or recipe.get("kind") not in ("byte", "bpe", "file"):
            return None
        if recipe["kind"] != "byte" and file_sha256(out / TOKENIZER_FILE) != recipe.get("sha256"):
            return None
    except (OSError, ValueError):
        return None
    return recipe


def remove_recipe(out: Path) -> None:
    (out / RECIPE_FILE).unlink(missing_ok=True)


def _write_recipe(out: Path, recipe: dict, undo: list[Path]) -> None:
    undo.append(out / RECIPE_FILE)
    write_json_atomic(out / RECIPE_FILE, recipe, indent=1)


def _open(out: Path, recipe: dict):
    if recipe["kind"] == "byte":
        return ByteTokenizer()
    try:
        return BPETokenizer.from_file(out / TOKENIZER_FILE, recipe["kind"], recipe.get("eos_token") or "<|endoftext|>")
    except ValueError as e:
        raise DataError(str(e)) from None


def _from_manifest(out: Path, manifest: dict, kind: str | None, given: Path | None, vocab_size: int | None):
    have = manifest["tokenizer"]["kind"]
    if vocab_size is not None and vocab_size != manifest["tokenizer"]["vocab_size"]:  # never retrained
        # Said, not refused: the command that made the first domain, repeated for the next,
        # names the size it asked for, and BPE may have stopped short of it.
        print(f"dsslm.data: --vocab-size {vocab_size} is not used: {out}'s tokenizer "
              f"({manifest['tokenizer']['vocab_size']} ids) is reused for every domain", file=sys.stderr)
    if given is not None and (have != "file" or file_sha256(given) != manifest["tokenizer"]["sha256"]):
        raise DataError(f"{out} holds data of another tokenizer than {given}; omit --tokenizer or use a new --out")
    if given is None and kind is not None and kind != have:
        raise DataError(f"{out} holds --tokenizer {have} data; pass --tokenizer {have} (or omit it), "
                        "or use a new --out")
    try:
        return load_tokenizer(out, manifest)  # reused as is, never retrained
    except ValueError as e:
        raise DataError(str(e)) from e


def _tokenizer_file(given: str) -> Path:
    try:
        return find_tokenizer_file(given)
    except ValueError as e:
        raise DataError(str(e)) from None


def _copy_tokenizer(src: Path, dst: Path, undo: list[Path]) -> BPETokenizer:
    """A user's tokenizer.json, copied into DATA_DIR (so the data never depends on where it came
    from) and read back from the copy, whose hash the manifest pins."""
    from tokenizers import Tokenizer

    try:
        eos = eos_token_of(src, Tokenizer.from_file(str(src)))
    except ValueError as e:
        raise DataError(str(e)) from None
    except Exception as e:  # the Rust parser's errors are plain Exceptions
        raise DataError(f"--tokenizer {src}: not a tokenizer.json `tokenizers` can read ({e})") from None
    tmp = dst.with_name(f"{dst.name}.tmp-{socket.gethostname()}-{os.getpid()}")  # tasks may copy it at once
    undo += [dst, tmp]
    shutil.copyfile(src, tmp)
    with open(tmp, "rb") as f:
        os.fsync(f.fileno())
    tmp.replace(dst)
    return BPETokenizer.from_file(dst, "file", eos)
