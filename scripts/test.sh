#!/usr/bin/env bash
# Set up and run the whole test suite (the README's test command; CI runs exactly this).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
# Debian's Slurm packages for the real-Slurm tests (they skip with a reason where apt cannot run).
[ -f .ci/slurm-deps ] && bash .ci/slurm-deps || echo "slurm packages not installed; slurm tests will skip"
export DS_ACCELERATOR=cpu
exec .venv/bin/python -m pytest -q "$@"
