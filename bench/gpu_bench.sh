#!/usr/bin/env bash
# Tokens/s, MFU and peak GPU memory per engine on an H200 node (bf16), for configs/125m.yaml
# and configs/350m.yaml. Installs nothing: run it from the repository root with a CUDA torch
# (PYTHON, else the project's .venv, else python3; on a machine with network access,
# DSSLM_TORCH="torch==2.13.0" bash scripts/setup.sh makes the .venv; on a lent device without it,
# bench/gpu_device.sh installs the carried wheels).
#
#   bash bench/gpu_bench.sh                 # every GPU on the machine, 30 steps per run
#   STEPS=50 NGPU=1 ENGINES="ddp fsdp" CONFIGS=125m bash bench/gpu_bench.sh
#   COMPILE=false AC=full bash bench/gpu_bench.sh    # eager, every block's activations recomputed
#   DEVICE=cpu NGPU=2 CONFIGS=tiny EXTRA="model.d_model=64" bash bench/gpu_bench.sh   # smoke test, no GPU
#
# Every run: bf16, train.compile=$COMPILE (default true on CUDA, false on CPU),
# train.activation_checkpointing=$AC (default none), optim.impl=auto (fused AdamW), TF32 on for
# what stays fp32, vocabulary padded to a multiple of 64.
#
# Data: the embedded stdlib corpus (data.dir="", byte tokens, nothing to download) with the
# model's vocabulary forced to 32768, so the lm_head matmul costs what it costs on real BPE data.
# MFU = (6 N + 12 L d T) * tokens/s per GPU / 989e12  (H200 dense bf16 peak; N = parameters,
# L layers, d width, T sequence length: the second term is attention's QK^T and AV, PaLM's form;
# bench/gpu_summary.py). No checkpoint is saved (ckpt.at_end=false): 350m's would be ~4 GB a run.
# Results: a table on stdout and $OUT/gpu_bench.csv (or bench/gpu_bench.csv when OUT is unset);
# each run's metrics/events stay under $OUT/runs/.
set -uo pipefail
cd "$(dirname "$0")/.."
if [ -n "${PYTHON:-}" ]; then PY=$PYTHON; elif [ -x .venv/bin/python ]; then PY=.venv/bin/python; else PY=python3; fi
STEPS=${STEPS:-30}
WARMUP=${WARMUP:-5}                      # steps left out of the medians (compile, allocator warm-up)
NGPU=${NGPU:-$(nvidia-smi -L 2>/dev/null | wc -l)}
DEVICE=${DEVICE:-cuda}
EXTRA=${EXTRA:-}                         # more dotted overrides for every run
ENGINES=${ENGINES:-"ddp zero1 zero2 zero3 fsdp"}
if [ "$DEVICE" = cuda ]; then COMPILE=${COMPILE:-true}; else COMPILE=${COMPILE:-false}; fi
AC=${AC:-none}
CONFIGS=${CONFIGS:-"125m 350m"}
PEAK_FLOPS=${PEAK_FLOPS:-989e12}
VOCAB=${VOCAB:-32768}
OUTDIR=${OUT:-bench}
mkdir -p "$OUTDIR/runs"
CSV="$OUTDIR/gpu_bench.csv"
[ "$NGPU" -ge 1 ] || { echo "gpu_bench: no GPU found (nvidia-smi -L); set NGPU" >&2; exit 2; }
echo "config,engine,gpus,params,tokens_per_s_per_gpu,step_time_s,mfu,peak_mem_gib,torch_peak_gib,status" > "$CSV"

engine_overrides() {
    case "$1" in
        ddp) echo "engine.kind=ddp" ;;
        zero1|zero2|zero3) echo "engine.kind=zero engine.zero_stage=${1#zero}" ;;
        fsdp) echo "engine.kind=fsdp" ;;
        *) echo "gpu_bench: unknown engine $1" >&2; return 1 ;;
    esac
}

# Peak memory.used over all GPUs, sampled every 200 ms while a run lasts (includes the CUDA
# context and allocator cache: what the job really takes from the card).
watch_memory() {
    local file=$1; : > "$file"
    while true; do
        nvidia-smi --query-gpu=memory.used --format=csv,noheader,nounits >> "$file" 2>/dev/null
        sleep 0.2
    done
}

summarise() {  # run_dir config engine gpus peak_mib status
    "$PY" bench/gpu_summary.py "$@"
}

for config in $CONFIGS; do
    for engine in $ENGINES; do
        run_dir="$OUTDIR/runs/$config-$engine"
        rm -rf "$run_dir"
        mem_file="$OUTDIR/runs/$config-$engine.mem"
        watch_memory "$mem_file" & watcher=$!
        # shellcheck disable=SC2046
        "$PY" -m torch.distributed.run --standalone --nproc_per_node "$NGPU" -m dsslm.train \
            --config "configs/$config.yaml" run.dir="$run_dir" "data.dir=''" model.vocab_size="$VOCAB" \
            train.precision=bf16 train.device="$DEVICE" train.total_steps="$STEPS" optim.warmup_steps=2 \
            optim.schedule=cosine run.val_every=0 run.tensorboard=false monitor.enabled=false \
            ckpt.every=1000000 ckpt.at_end=false observe.every=10 train.compile="$COMPILE" train.activation_checkpointing="$AC" \
            $(engine_overrides "$engine") $EXTRA > "$run_dir.log" 2>&1
        rc=$?
        kill "$watcher" 2>/dev/null; wait "$watcher" 2>/dev/null
        peak_mib=$(sort -n "$mem_file" | tail -1); peak_mib=${peak_mib:-0}
        status=ok; [ $rc -eq 0 ] || status="exit$rc(see $run_dir.log)"
        summarise "$run_dir" "$config" "$engine" "$NGPU" "$peak_mib" "$status" "$WARMUP" "$PEAK_FLOPS" >> "$CSV"
        tail -1 "$CSV"
    done
done
echo
column -s, -t < "$CSV" 2>/dev/null || cat "$CSV"
echo "results: $CSV"
