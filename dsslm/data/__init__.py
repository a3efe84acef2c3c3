"""Deterministic data: a batch is a pure function of (manifest, seed, position, skip list)."""
from dsslm.data.loader import Loader
from dsslm.data.prepare import DataError, load_manifest, manifest_hash, prepare, tokenizer_hash

__all__ = ["DataError", "Loader", "load_manifest", "manifest_hash", "prepare", "tokenizer_hash"]
