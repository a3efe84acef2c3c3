"""Deterministic data: a batch is a pure function of (manifest, seed, position, skip list)."""
from dsslm.data.loader import Loader
from dsslm.data.manifest import load_manifest, manifest_hash, tokenizer_hash
from dsslm.data.prepare import prepare
from dsslm.data.sources import DataError

__all__ = ["DataError", "Loader", "load_manifest", "manifest_hash", "prepare", "tokenizer_hash"]
