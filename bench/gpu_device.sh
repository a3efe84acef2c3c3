#!/usr/bin/env bash
# bench/gpu_check.sh on a lent GPU machine, as it is: no network, no .venv (the repository travels
# without it), a python3 with a CUDA torch and most of what dsslm needs, but not omegaconf, nor the
# `datasets` that building the embedded corpus reads text through. Both travel in the ignored
# folder .gpu/, which bench/gpu_carry.sh fills here, on a machine with pip's network:
#
#   bash bench/gpu_carry.sh        # here, once: .gpu/whl (omegaconf's wheel) and .gpu/cache (the corpus)
#   # then, through the device tool, with carry [".gpu"] and OUT set by the tool:
#   bash bench/gpu_device.sh
#
# It installs the wheels into /tmp/site (PYTHONPATH), points DSSLM_CACHE at the carried corpus,
# and runs gpu_check.sh with python3 under a timeout that leaves the call room to return.
set -uo pipefail
cd "$(dirname "$0")/.."
if [ -d .gpu/whl ] && ls .gpu/whl/*.whl > /dev/null 2>&1; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
        .gpu/whl/*.whl || { echo "gpu_device: the carried wheels did not install" >&2; exit 2; }
    export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
fi
[ -d .gpu/cache ] && export DSSLM_CACHE=$PWD/.gpu/cache
export PYTHON=${PYTHON:-python3} PYTHONUNBUFFERED=1
exec timeout -k 10 "${CHECK_TIMEOUT_S:-500}" bash bench/gpu_check.sh
