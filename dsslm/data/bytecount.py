"""Bytes of text that target tokens stand for: what bits per byte divides by.

    bits per byte = (cross-entropy of the targets, in nats) / ln 2 / (bytes those targets stand for)
                  = loss in bits * tokens / bytes

compares across tokenizers: a byte run and a BPE run on the same text divide by the same bytes.
EOS stands for no byte (it is no text) but its loss counts, as it does in val_loss.

The bytes are counted per target with the tokenizer's byte table, so they are exact for whatever
subset of a split is evaluated. A domain counts as exact when `prepare` recorded shard bytes for
it (it does so only when the table's count equals the UTF-8 size of the text it read), or, for a
manifest written before byte counts existed, when the tokenizer is the byte one or a ByteLevel
BPE: their ids are bytes, or strings of byte characters, by construction.
"""
from __future__ import annotations

from pathlib import Path

import torch

from dsslm.data.sources import DataError
from dsslm.data.tokenizer import load_tokenizer, token_byte_lengths

IGNORE_INDEX = -100  # loss.IGNORE_INDEX: data/ may not import loss


class ByteCounter:
    def __init__(self, data_dir: str | Path, manifest: dict):
        try:
            lengths = token_byte_lengths(load_tokenizer(data_dir, manifest))
        except ValueError as e:
            raise DataError(str(e)) from None
        self.table = None if lengths is None else torch.from_numpy(lengths)
        kind = manifest["tokenizer"]["kind"]
        self.exact = {name: self.table is not None and _domain_exact(domain, kind)
                      for name, domain in manifest["domains"].items()}

    def count(self, domain: str, targets: torch.Tensor) -> int | None:
        """Bytes the real (non-ignored) `targets` stand for; None where they cannot be counted."""
        if not self.exact.get(domain):
            return None
        real = targets[targets != IGNORE_INDEX].cpu()
        return int(self.table[real].sum())


def _domain_exact(domain: dict, kind: str) -> bool:
    entries = domain["train"] + domain["val"]
    if "text_bytes" in domain:  # written with byte counts: every shard has one, or none could be made
        return all("bytes" in e for e in entries)
    return kind in ("byte", "bpe")
