#!/usr/bin/env bash
# Set up and run the whole test suite (the README's test command; CI runs exactly this).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
# Debian's Slurm packages for the real-Slurm tests (they skip with a reason where apt cannot run).
[ -f .ci/slurm-deps ] && bash .ci/slurm-deps || echo "slurm packages not installed; slurm tests will skip"
# The linter first ([tool.ruff] in pyproject.toml), in seconds: a finding fails the run before the
# tests' twenty minutes, with ruff's own exit code.
.venv/bin/ruff check --quiet dsslm tests bench || {
    rc=$?; echo "ruff check failed (exit $rc): fix the findings above; tests not run"; exit "$rc"; }
export DS_ACCELERATOR=cpu
# pytest runs as a child, not exec'd, so the suite's duration prints after it; its exit code stays
# this script's (and so .ci/run's).
start=$(date +%s)
rc=0
# Two workers, each test file whole in one (its module fixtures, the reference runs several tests
# compare against, are built once; test_slurm's cluster is one). Measured on a 2-core machine with
# nothing else running: 1,329 s serial, 839 s with 2 workers. DSSLM_TEST_WORKERS=0 runs in this process.
.venv/bin/python -m pytest -q -n "${DSSLM_TEST_WORKERS:-2}" --dist loadfile "$@" || rc=$?
echo "suite took $(( $(date +%s) - start )) s (pytest exit code $rc)"
exit "$rc"
