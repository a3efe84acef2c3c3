"""The embedded default corpus: the Python standard library's own source, needing no download.

`default_data_dir()` returns a byte-tokenized DATA_DIR with domain "code" (stdlib .py files
outside test folders, first ~8 MB by sorted path) and, where the interpreter ships its test
suite, domain "tests" (.py files under the stdlib's test/, first ~2 MB). It is built once, through
the same `prepare` the CLI runs, and cached under $DSSLM_CACHE/stdlib-v2 (default
~/.cache/dsslm/stdlib-v2).
"""

from __future__ import annotations

import os
import shutil
import sysconfig
import tempfile
from pathlib import Path

from dsslm.data.manifest import MANIFEST_FILE
from dsslm.data.prepare import DataError, prepare, quiet_datasets

CACHE_NAME = "stdlib-v2"  # bump when the file selection below, or what prepare writes, changes
CODE_BYTES = 8 << 20  # ~8M byte tokens: a few minutes of tiny-model CPU training, ~5 s to prepare
TESTS_BYTES = 2 << 20
# Folders that are not the stdlib's own code: tests go to their own domain, installed packages
# differ between machines.
EXCLUDED_DIRS = {"test", "tests", "idle_test", "site-packages", "dist-packages", "__pycache__"}


def default_data_dir() -> Path:
    """The default corpus's DATA_DIR, built on first use; safe when several processes race."""
    root = Path(os.environ.get("DSSLM_CACHE") or Path.home() / ".cache" / "dsslm")
    final = root / CACHE_NAME
    if (final / MANIFEST_FILE).is_file():
        return final
    root.mkdir(parents=True, exist_ok=True)
    workdir = Path(tempfile.mkdtemp(prefix=f".{CACHE_NAME}.tmp-", dir=root))
    try:
        build_stdlib_corpus(workdir / CACHE_NAME)
        try:
            os.rename(workdir / CACHE_NAME, final)
        except OSError:
            # Another process renamed its copy first (the target is then non-empty): use it.
            if not (final / MANIFEST_FILE).is_file():
                raise DataError(f"{final} exists but holds no {MANIFEST_FILE}; delete it and retry") from None
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    return final


def build_stdlib_corpus(out: Path) -> dict:
    """Prepare the stdlib corpus into `out`; returns its manifest."""
    quiet_datasets()
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    code = capped(sorted(p for p in stdlib.rglob("*.py") if _is_code(p, stdlib)), CODE_BYTES)
    manifest = prepare(code, out, domain="code", tokenizer="byte")
    test_dir = stdlib / "test"
    tests = capped(sorted(test_dir.rglob("*.py")), TESTS_BYTES) if test_dir.is_dir() else []
    if tests:
        manifest = prepare(tests, out, domain="tests", tokenizer="byte")
    return manifest


def _is_code(path: Path, stdlib: Path) -> bool:
    parts = path.relative_to(stdlib).parts
    return not any(part in EXCLUDED_DIRS or part.startswith(".") for part in parts[:-1])


def capped(paths: list[Path], max_bytes: int) -> list[Path]:
    """The leading files of `paths` whose sizes sum to at most `max_bytes` (at least one file)."""
    kept, total = [], 0
    for path in paths:
        size = path.stat().st_size
        if kept and total + size > max_bytes:
            break
        kept.append(path)
        total += size
    return kept
