"""Tokenizers: a byte-level one that needs no training, and a ByteLevel BPE trained with HF `tokenizers`.

Both share one small API: `encode(str) -> list[int]`, `encode_batch(list[str]) -> list[np.ndarray]`,
`decode(ids) -> str`, `vocab_size`, `eos_id`, `kind` and `sha256` (what the manifest pins, so a
DATA_DIR can never be read with a tokenizer other than the one that wrote it).
"""

from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Iterable, Iterator

import numpy as np

EOS_TOKEN = "<|endoftext|>"
TOKENIZER_FILE = "tokenizer.json"
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
    """A ByteLevel BPE held in a HF `tokenizers.Tokenizer`, saved as DATA_DIR/tokenizer.json."""

    kind = "bpe"

    def __init__(self, tokenizer, sha256: str):
        self._tok = tokenizer
        # A literal "<|endoftext|>" inside a document is text, not a document boundary.
        self._tok.encode_special_tokens = True
        self.sha256 = sha256
        self.vocab_size = tokenizer.get_vocab_size()
        eos_id = tokenizer.token_to_id(EOS_TOKEN)
        if eos_id is None:
            raise ValueError(f"tokenizer has no {EOS_TOKEN} token; re-run `python -m dsslm.data prepare`")
        self.eos_id = eos_id

    @classmethod
    def from_file(cls, path: str | Path) -> "BPETokenizer":
        from tokenizers import Tokenizer

        path = Path(path)
        return cls(Tokenizer.from_file(str(path)), file_sha256(path))

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


def file_sha256(path: str | Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def load_tokenizer(data_dir: str | Path, manifest: dict) -> ByteTokenizer | BPETokenizer:
    """The tokenizer a DATA_DIR was prepared with; raises ValueError if it is not the one pinned."""
    spec = manifest["tokenizer"]
    if spec["kind"] == "byte":
        tok = ByteTokenizer()
    elif spec["kind"] == "bpe":
        path = Path(data_dir) / TOKENIZER_FILE
        if not path.is_file():
            raise ValueError(f"{path} is missing; re-run `python -m dsslm.data prepare` into {data_dir}")
        tok = BPETokenizer.from_file(path)
    else:
        raise ValueError(f"unknown tokenizer kind {spec['kind']!r} in {data_dir}/manifest.json")
    if tok.sha256 != spec["sha256"] or tok.vocab_size != spec["vocab_size"]:
        raise ValueError(
            f"the tokenizer in {data_dir} does not match its manifest.json; re-run "
            "`python -m dsslm.data prepare` into a fresh DATA_DIR"
        )
    return tok
