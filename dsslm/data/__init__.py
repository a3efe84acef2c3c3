"""Deterministic data: a batch is a pure function of (manifest, seed, position, skip list)."""
from __future__ import annotations

from typing import Any

from dsslm.data.manifest import load_manifest, manifest_hash, tokenizer_hash
from dsslm.data.prepare import prepare
from dsslm.data.sources import DataError

__all__ = ["DataError", "Loader", "load_manifest", "manifest_hash", "prepare", "tokenizer_hash"]


def __getattr__(name: str) -> Any:
    """Loader (and torch with it) on first use: `python -m dsslm.data prepare` never needs it."""
    if name != "Loader":
        raise AttributeError(f"module 'dsslm.data' has no attribute {name!r}")
    from dsslm.data.loader import Loader
    return Loader
