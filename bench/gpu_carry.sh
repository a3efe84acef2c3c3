#!/usr/bin/env bash
# What bench/gpu_device.sh needs on a lent GPU machine and cannot fetch there (no network), into
# the folder .gpu/ of the repository root, which git ignores (.git/info/exclude) and the device
# tool carries when a run names it (carry [".gpu"], 64 MiB at most with the tree):
#   .gpu/whl/    omegaconf's wheel (pure Python; its one need, PyYAML, is on the device), the
#                version this .venv has;
#   .gpu/cache/  the embedded corpus, built here (stdlib-v2, ~20 MB): building it there would need
#                `datasets`, which the device's image lacks.
# The device's package list: /work/.library/device/KINDS.md (nvidia-h200).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-.venv/bin/python}
exclude="$(git rev-parse --git-common-dir)/info/exclude"
grep -qx '/.gpu/' "$exclude" 2>/dev/null || echo '/.gpu/' >> "$exclude"
rm -rf .gpu && mkdir -p .gpu/whl
version=$("$PY" -c "import omegaconf; print(omegaconf.__version__)")
"$PY" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_17_x86_64 --platform any -d .gpu/whl "omegaconf==$version"
DSSLM_CACHE=$PWD/.gpu/cache "$PY" -c "from dsslm.data.corpus import default_data_dir; print(default_data_dir())" > /dev/null
echo "carry .gpu: $(du -sh .gpu | cut -f1) ($(ls .gpu/whl)); then run bench/gpu_device.sh"
