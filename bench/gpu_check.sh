#!/usr/bin/env bash
# The GPU check: one script, one table, under 8 minutes on one H200. Run it from the repository
# root with the project's venv set up; it installs nothing.
#
#   bash bench/gpu_check.sh                          # one GPU: tests/scenarios/test_gpu.py, then the runs
#   DEVICE=cpu bash bench/gpu_check.sh               # smoke test without a GPU (tiny sizes; in the suite)
#   ROWS="125m:ddp:muon:true 350m:fsdp:adamw:false" bash bench/gpu_check.sh
#
# 1. tests/scenarios/test_gpu.py (fused AdamW chosen, a bf16 compiled run resumed to the bit, ...).
# 2. Tokens/s per GPU, MFU and peak memory for each row CONFIG:ENGINE:OPTIM:DOCUMENT_MASK, by
#    bench/gpu_bench.sh (bf16, compiled on CUDA, the embedded corpus with the vocabulary forced to
#    32768; MFU against the H200's dense bf16 peak). The rows cover each axis the 2026 recipe adds
#    (Muon, the document mask) on both engines and both sizes without the full product, which
#    would not fit the budget: the adamw/false rows are the baselines the others are read against.
# Each run is cut at RUN_TIMEOUT_S; rows that would start past BUDGET_S are reported, not run.
# The global batch is GLOBAL_BATCH sequences (default 4 micro-batches a GPU), not the configs'
# 256: a step in seconds, not tens of seconds, so steady-state figures come within the budget.
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-.venv/bin/python}
DEVICE=${DEVICE:-cuda}
OUTDIR=${OUT:-bench/gpu_check}
mkdir -p "$OUTDIR"
started=$(date +%s)
if [ "$DEVICE" = cuda ]; then
    NGPU=${NGPU:-1}; STEPS=${STEPS:-25}; WARMUP=${WARMUP:-8}; MBS=${MBS:-8}; VOCAB=${VOCAB:-32768}
    BUDGET_S=${BUDGET_S:-420}; RUN_TIMEOUT_S=${RUN_TIMEOUT_S:-120}; SIZE=""
    ROWS=${ROWS:-"125m:ddp:adamw:false 125m:ddp:muon:false 125m:ddp:adamw:true 125m:fsdp:adamw:false
                  125m:fsdp:muon:true 350m:ddp:adamw:false 350m:fsdp:adamw:false 350m:fsdp:muon:true"}
else  # the smoke test: the same path through every piece, on a CPU, in about a minute
    NGPU=${NGPU:-1}; STEPS=${STEPS:-4}; WARMUP=${WARMUP:-1}; MBS=${MBS:-2}; VOCAB=${VOCAB:-512}
    BUDGET_S=${BUDGET_S:-600}; RUN_TIMEOUT_S=${RUN_TIMEOUT_S:-300}
    SIZE="model.d_model=32 model.n_layers=2 model.n_heads=2 model.seq_len=32"
    ROWS=${ROWS:-"tiny:ddp:adamw:false tiny:fsdp:muon:true"}
fi
if [ "$DEVICE" = cuda ]; then GLOBAL_BATCH=${GLOBAL_BATCH:-$((MBS * NGPU * 4))}; else GLOBAL_BATCH=${GLOBAL_BATCH:-$((MBS * NGPU))}; fi

echo "== tests/scenarios/test_gpu.py" >&2
tests_line=$(DS_ACCELERATOR=$DEVICE timeout 240 "$PY" -m pytest -q -p no:cacheprovider tests/scenarios/test_gpu.py 2>&1 | tail -1)
tests_line=${tests_line:-"no result (pytest timed out or crashed)"}

TABLE="$OUTDIR/gpu_check.csv"
echo "config,engine,optim,document_mask,gpus,params,tokens_per_s_per_gpu,step_time_s,mfu,peak_mem_gib,torch_peak_gib,status" > "$TABLE"
i=0
for row in $ROWS; do
    IFS=: read -r config engine optim mask <<< "$row"
    i=$((i + 1))
    if [ $(( $(date +%s) - started )) -gt "$BUDGET_S" ]; then
        echo "$config,$engine,$optim,$mask,$NGPU,,,,,,,not run (past BUDGET_S=$BUDGET_S)" >> "$TABLE"; continue
    fi
    echo "== $row" >&2
    out="$OUTDIR/row$i"; rm -rf "$out"
    OUT=$out NGPU=$NGPU DEVICE=$DEVICE STEPS=$STEPS WARMUP=$WARMUP VOCAB=$VOCAB CONFIGS=$config ENGINES=$engine \
        EXTRA="$SIZE train.micro_batch_size=$MBS train.global_batch_size=$GLOBAL_BATCH optim.name=$optim model.document_mask=$mask" \
        timeout "$RUN_TIMEOUT_S" bash bench/gpu_bench.sh > "$out.log" 2>&1
    rc=$?
    line=$(sed -n 2p "$out/gpu_bench.csv" 2>/dev/null)
    if [ -z "$line" ]; then
        echo "$config,$engine,$optim,$mask,$NGPU,,,,,,,exit$rc(see $out.log)" >> "$TABLE"; continue
    fi
    [ $rc -eq 124 ] && line="${line%,*},timed out at ${RUN_TIMEOUT_S}s"
    # gpu_bench's row: config,engine,gpus,params,tps,step_s,mfu,peak,torch_peak,status
    echo "$line" | awk -F, -v o="$optim" -v m="$mask" 'BEGIN{OFS=","} {print $1,$2,o,m,$3,$4,$5,$6,$7,$8,$9,$10}' >> "$TABLE"
done

echo
echo "dsslm GPU check on $DEVICE ($NGPU device(s)), $(( $(date +%s) - started )) s"
echo "tests/scenarios/test_gpu.py: $tests_line"
column -s, -t < "$TABLE"
echo "table: $TABLE"
