"""Tokenizers: a byte-level one that needs no training, a ByteLevel BPE trained with HF `tokenizers`,
and any `tokenizer.json` a user brings (`prepare --tokenizer PATH`, e.g. a Hugging Face model's).

All share one small API: `encode(str) -> list[int]`, `encode_batch(list[str]) -> list[np.ndarray]`,
`decode(ids) -> str`, `vocab_size`, `eos_id`, `kind` ("byte", "bpe" or "file") and `sha256` (what
the manifest pins, so a DATA_DIR can never be read with a tokenizer other than the one that wrote
it). `token_byte_lengths(tok)` is how many bytes of text each id stands for: what bits per byte
divides by.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Iterable, Iterator

import numpy as np

from dsslm.durable import file_sha256

EOS_TOKEN = "<|endoftext|>"
TOKENIZER_FILE = "tokenizer.json"
# Document-end tokens of common tokenizers, tried in this order when a tokenizer.json comes
# without a tokenizer_config.json naming its eos_token.
EOS_CANDIDATES = (EOS_TOKEN, "<|end_of_text|>", "</s>", "<eos>", "<|eos|>")
# Bumping this string changes every byte DATA_DIR's manifest hash: do it only if byte ids change.
BYTE_TOKENIZER_ID = "dsslm-byte-tokenizer-v1: ids 0..255 are utf-8 bytes, 256 is EOS"


class ByteTokenizer:
    """ids 0..255 are the utf-8 bytes of the text, 256 is EOS."""

    kind = "byte"
    vocab_size = 257
    eos_id = 256
    sha256 = hashlib.sha256(BYTE_TOKENIZER_ID.encode()).hexdigest()

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def encode_batch(self, texts: list[str]) -> list[np.ndarray]:
        return [np.frombuffer(t.encode("utf-8"), dtype=np.uint8).astype(np.uint16) for t in texts]

    def decode(self, ids: Iterable[int]) -> str:
        # EOS is dropped, as HF decoders drop special tokens; a sampled byte soup may be
        # invalid utf-8, so decoding replaces rather than raises.
        data = bytes(int(i) for i in ids if 0 <= int(i) < 256)
        return data.decode("utf-8", errors="replace")


class BPETokenizer:
    """A HF `tokenizers.Tokenizer` saved as DATA_DIR/tokenizer.json: the ByteLevel BPE `prepare`
    trains (kind "bpe"), or one a user brought (kind "file", with its own EOS token)."""

    def __init__(self, tokenizer, sha256: str, kind: str = "bpe", eos_token: str = EOS_TOKEN):
        self._tok = tokenizer
        # A literal "<|endoftext|>" inside a document is text, not a document boundary.
        self._tok.encode_special_tokens = True
        self.kind, self.sha256, self.eos_token = kind, sha256, eos_token
        self.vocab_size = tokenizer.get_vocab_size()
        eos_id = tokenizer.token_to_id(eos_token)
        if eos_id is None:
            raise ValueError(f"tokenizer has no {eos_token} token; re-run `python -m dsslm.data prepare`")
        self.eos_id = eos_id

    @classmethod
    def from_file(cls, path: str | Path, kind: str = "bpe", eos_token: str = EOS_TOKEN) -> "BPETokenizer":
        from tokenizers import Tokenizer

        path = Path(path)
        return cls(Tokenizer.from_file(str(path)), file_sha256(path), kind, eos_token)

    @property
    def backend(self):
        """The `tokenizers.Tokenizer` itself (for writing it out, e.g. into a Hugging Face folder)."""
        return self._tok

    def encode(self, text: str) -> list[int]:
        return self._tok.encode(text, add_special_tokens=False).ids

    def encode_batch(self, texts: list[str]) -> list[np.ndarray]:
        # Runs on all cores inside the Rust library; the _fast variant (tokenizers >= 0.20)
        # skips character offsets and is ~2x faster.
        encode = getattr(self._tok, "encode_batch_fast", self._tok.encode_batch)
        encodings = encode(texts, add_special_tokens=False)
        return [np.asarray(e.ids, dtype=np.uint32) for e in encodings]

    def decode(self, ids: Iterable[int]) -> str:
        return self._tok.decode([int(i) for i in ids])

    def byte_lengths(self) -> np.ndarray | None:
        """Bytes per id for a byte-level tokenizer (ByteLevel decoder: every character of a token
        string is one byte); None for any other kind (sentencepiece's "▁" and byte fallback)."""
        spec = json.loads(self._tok.to_str())
        if (spec.get("decoder") or {}).get("type") != "ByteLevel":
            return None
        byte_chars = set(byte_level_chars())
        added = {t["id"]: t for t in spec.get("added_tokens", [])}
        lengths = np.zeros(self.vocab_size, dtype=np.int64)
        for token, i in self._tok.get_vocab(with_added_tokens=True).items():
            if i >= self.vocab_size:
                return None
            if i in added:  # a special token (EOS) is no text; another added token is its own text
                lengths[i] = 0 if added[i].get("special") else len(token.encode("utf-8"))
            elif all(c in byte_chars for c in token):
                lengths[i] = len(token)
            else:
                return None
        return lengths


def byte_level_chars() -> list[str]:
    """The character ByteLevel (GPT-2) uses for each byte 0..255: printable Latin-1 bytes stand
    for themselves, the other 68 for the code points from 256 up, in byte order."""
    printable = {*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)}
    chars, extra = [], 256
    for b in range(256):
        if b in printable:
            chars.append(chr(b))
        else:
            chars.append(chr(extra))
            extra += 1
    return chars


def token_byte_lengths(tok) -> np.ndarray | None:
    """How many bytes of text each id decodes to (EOS: 0), or None where the tokenizer cannot say."""
    if tok.kind == "byte":
        return np.array([1] * 256 + [0], dtype=np.int64)
    return tok.byte_lengths()


def find_tokenizer_file(path: str | Path) -> Path:
    """`--tokenizer PATH`: a tokenizer.json, or a folder holding one."""
    path = Path(path)
    found = path / TOKENIZER_FILE if path.is_dir() else path
    if not found.is_file():
        raise ValueError(f"--tokenizer {path}: no {TOKENIZER_FILE} there; use byte, bpe, a tokenizer.json "
                         "or a folder holding one")
    return found


def eos_token_of(path: Path, tokenizer) -> str:
    """The token that ends a document: tokenizer_config.json's eos_token beside the file, else the
    first of EOS_CANDIDATES the tokenizer has."""
    config = path.parent / "tokenizer_config.json"
    if config.is_file():
        try:
            eos = json.loads(config.read_text()).get("eos_token")
        except (OSError, ValueError, AttributeError) as e:
            raise ValueError(f"{config} is unreadable ({e}); fix it or pass the tokenizer.json alone") from None
        eos = eos.get("content") if isinstance(eos, dict) else eos
        if isinstance(eos, str) and tokenizer.token_to_id(eos) is not None:
            return eos
    for candidate in EOS_CANDIDATES:
        if tokenizer.token_to_id(candidate) is not None:
            return candidate
    raise ValueError(f"--tokenizer {path}: cannot tell which token ends a document (none of "
                     f"{', '.join(EOS_CANDIDATES)}); put a tokenizer_config.json naming eos_token beside it")


def train_bpe(texts: Iterator[str], vocab_size: int, path: str | Path) -> BPETokenizer:
    """Train a ByteLevel BPE on a stream of texts and save it to `path` (atomically)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[EOS_TOKEN],
        # all 256 byte symbols up front: any input encodes, whatever the training text held
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer=trainer)
    path = Path(path)
    tmp = path.with_name(path.name + ".tmp")
    tok.save(str(tmp))
    tmp.replace(path)
    return BPETokenizer.from_file(path)


def load_tokenizer(data_dir: str | Path, manifest: dict) -> ByteTokenizer | BPETokenizer:
    """The tokenizer a DATA_DIR was prepared with; raises ValueError if it is not the one pinned."""
    spec = manifest["tokenizer"]
    if spec["kind"] == "byte":
        tok = ByteTokenizer()
    elif spec["kind"] in ("bpe", "file"):
        path = Path(data_dir) / TOKENIZER_FILE
        if not path.is_file():
            raise ValueError(f"{path} is missing; re-run `python -m dsslm.data prepare` into {data_dir}")
        eos = spec.get("eos_token", EOS_TOKEN)
        if not isinstance(eos, str):
            raise ValueError(f"{data_dir}/manifest.json: tokenizer.eos_token is not a string; rebuild it with prepare")
        # The hash first: a file that is not the one pinned is refused without being parsed (a
        # truncated tokenizer.json was a traceback from the Rust parser, exit 1, not one line).
        if file_sha256(path) != spec["sha256"]:
            raise ValueError(f"the tokenizer in {data_dir} does not match its manifest.json (sha256); "
                             "re-run `python -m dsslm.data prepare` into a fresh DATA_DIR")
        try:
            tok = BPETokenizer.from_file(path, spec["kind"], eos)
        except ValueError:
            raise
        except Exception as exc:  # noqa: BLE001 - the tokenizers library raises its own Exception types
            raise ValueError(f"{path} is not a tokenizer the tokenizers library can read ({exc}); re-run "
                             f"`python -m dsslm.data prepare` into a fresh DATA_DIR") from None
    else:
        raise ValueError(f"unknown tokenizer kind {spec['kind']!r} in {data_dir}/manifest.json")
    # eos_id too: the document mask and the skip list's document bounds split on it.
    if tok.sha256 != spec["sha256"] or tok.vocab_size != spec["vocab_size"] or tok.eos_id != spec["eos_id"]:
        raise ValueError(
            f"the tokenizer in {data_dir} does not match its manifest.json (sha256, vocab_size or eos_id); "
            "re-run `python -m dsslm.data prepare` into a fresh DATA_DIR"
        )
    return tok
