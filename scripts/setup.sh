#!/usr/bin/env bash
# Create .venv and install dsslm with its dev extra. Idempotent: a second run with the same
# pyproject.toml takes about a second.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
[ -x .venv/bin/python ] || "$PY" -m venv .venv
stamp=.venv/.dsslm-installed
want=$(sha256sum pyproject.toml | cut -c1-16)
if [ "$(cat "$stamp" 2>/dev/null)" != "$want" ]; then
    .venv/bin/python -m pip install -q --upgrade pip
    # The CPU build first: an unpinned torch would pull a multi-GB CUDA build. On a GPU
    # machine, set DSSLM_TORCH to the torch requirement you want (e.g. "torch==2.13.0").
    .venv/bin/python -m pip install -q "${DSSLM_TORCH:-torch==2.13.0}"
    .venv/bin/python -m pip install -q -e ".[dev]"
    echo "$want" > "$stamp"
fi
