#!/usr/bin/env bash
# The GPU check: one script, one table, under 8 minutes on one H200. Run it from the repository
# root; it installs nothing (on a lent device, bench/gpu_device.sh installs what it must first).
#
#   bash bench/gpu_check.sh                          # one GPU: tests/scenarios/test_gpu.py, then the runs
#   DEVICE=cpu bash bench/gpu_check.sh               # smoke test without a GPU (tiny sizes; in the suite)
#   ROWS="125m:ddp:muon:true 350m:fsdp:adamw:false" bash bench/gpu_check.sh
#
# 0. What it runs on: the interpreter (PYTHON, else the project's .venv, else python3: a lent
#    device has no .venv but a python3 with a CUDA torch), torch, the GPU and its driver. On
#    DEVICE=cuda it stops there, exit 2, when that torch sees no GPU or cannot import dsslm: every
#    row would fail, and the minutes are better spent on a rerun.
# 1. tests/scenarios/test_gpu.py (fused AdamW chosen, a bf16 compiled run resumed to the bit, ...):
#    its whole output goes to $OUT/test_gpu.log; the summary and any FAILED/ERROR line are printed.
# 2. Tokens/s per GPU, MFU and peak memory for each row CONFIG:ENGINE:OPTIM:DOCUMENT_MASK, by
#    bench/gpu_bench.sh (bf16, compiled on CUDA, the embedded corpus with the vocabulary forced to
#    32768; MFU against the H200's dense bf16 peak), with each run's wall time and its first step
#    (the compile). The rows cover each axis the 2026 recipe adds (Muon, the document mask) on both
#    engines and both sizes without the full product, which would not fit the budget; they run in
#    order of what they tell, so a budget cut drops the least: the adamw/false rows of each size
#    first (the baselines the others are read against, and the MFU goals), then Muon and the mask.
#
# One deadline holds for the whole script (DEADLINE_S, 450 s on CUDA: 7.5 minutes): the tests and
# every row are cut at what is left of it (and a row at RUN_TIMEOUT_S), and a row that would start
# with less than MIN_ROW_S left is reported as not run. A cut run's processes are killed, every one
# (timeout signals the run's process group; torchrun's workers sit in sessions of their own and are
# killed by their run folder's name), so none trains on into the next row, and its figures are
# summarised from the steps it logged.
# Runs write to a scratch folder (SCRATCH, default a new folder under /tmp) and save no checkpoint
# (ckpt.at_end=false); $OUT gets only gpu_check.csv, test_gpu.log and rows.log (each row's log,
# the last lines of a failed one), small enough to come back from a lent device.
# The global batch is GLOBAL_BATCH sequences (default 4 micro-batches a GPU), not the configs'
# 256: a step in seconds, not tens of seconds, so steady-state figures come within the budget.
# Muon orthogonalises once per optimizer step, so its share of a step here is about 8x what the
# configs' 32 micro-batches a step would show: read the muon rows' cost as an upper bound.
set -uo pipefail
cd "$(dirname "$0")/.."
DEVICE=${DEVICE:-cuda}
if [ -n "${PYTHON:-}" ]; then PY=$PYTHON
elif [ -x .venv/bin/python ]; then PY=.venv/bin/python
else PY=python3
fi
export PYTHON=$PY  # gpu_bench.sh runs the same one
OUTDIR=${OUT:-bench/gpu_check}
mkdir -p "$OUTDIR"
if [ -z "${SCRATCH:-}" ]; then  # made here, removed at the end (the runs' folders: nothing to keep)
    SCRATCH=$(mktemp -d "${TMPDIR:-/tmp}/dsslm-gpu-check.XXXXXX"); trap 'rm -rf "$SCRATCH"' EXIT
fi
mkdir -p "$SCRATCH"
started=$(date +%s)
if [ "$DEVICE" = cuda ]; then
    NGPU=${NGPU:-1}; STEPS=${STEPS:-25}; WARMUP=${WARMUP:-8}; MBS=${MBS:-8}; VOCAB=${VOCAB:-32768}
    DEADLINE_S=${DEADLINE_S:-450}; RUN_TIMEOUT_S=${RUN_TIMEOUT_S:-150}; TESTS_TIMEOUT_S=${TESTS_TIMEOUT_S:-200}
    MIN_ROW_S=${MIN_ROW_S:-45}; SIZE=""
    # pytest-xdist workers for the tests: each resume test is two compiled runs (~a minute each with
    # the process start and compile), and 16 cores run three at once.
    TEST_WORKERS=${TEST_WORKERS:-3}
    ROWS=${ROWS:-"125m:ddp:adamw:false 350m:fsdp:adamw:false 125m:ddp:muon:false 125m:ddp:adamw:true
                  125m:fsdp:adamw:false 125m:fsdp:muon:true 350m:ddp:adamw:false 350m:fsdp:muon:true"}
else  # the smoke test: the same path through every piece, on a CPU, in about a minute
    NGPU=${NGPU:-1}; STEPS=${STEPS:-4}; WARMUP=${WARMUP:-1}; MBS=${MBS:-2}; VOCAB=${VOCAB:-512}
    DEADLINE_S=${DEADLINE_S:-900}; RUN_TIMEOUT_S=${RUN_TIMEOUT_S:-300}; TESTS_TIMEOUT_S=${TESTS_TIMEOUT_S:-240}
    MIN_ROW_S=${MIN_ROW_S:-5}; TEST_WORKERS=${TEST_WORKERS:-0}
    SIZE="model.d_model=32 model.n_layers=2 model.n_heads=2 model.seq_len=32"
    ROWS=${ROWS:-"tiny:ddp:adamw:false tiny:fsdp:muon:true"}
fi
if [ "$DEVICE" = cuda ]; then GLOBAL_BATCH=${GLOBAL_BATCH:-$((MBS * NGPU * 4))}; else GLOBAL_BATCH=${GLOBAL_BATCH:-$((MBS * NGPU))}; fi
left() { echo $(( DEADLINE_S - ($(date +%s) - started) )); }

# Kill every process whose command line names $1 (a run's folder: torchrun and its workers, which
# torch's elastic agent starts in sessions of their own, out of reach of timeout's signal), then
# wait until they are gone: a run cut by the deadline must not go on training beside the next one.
kill_runs() {
    pkill -KILL -f -- "$1" 2>/dev/null
    for _ in 1 2 3 4 5 6 7 8 9 10; do pgrep -f -- "$1" > /dev/null || return 0; sleep 0.5; done
}

echo "== what it runs on" >&2
ENV_LINE=$("$PY" - "$DEVICE" <<'EOF' 2>&1
import sys
device = sys.argv[1]
try:
    import torch
    import dsslm.train  # noqa: F401  (and every package it needs: omegaconf, safetensors, ...)
    from torch.optim._muon import DEFAULT_A, _adjust_lr  # noqa: F401  (private APIs dsslm uses)
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset  # noqa: F401
except Exception as exc:  # noqa: BLE001
    print(f"cannot import what dsslm needs: {type(exc).__name__}: {exc}")
    sys.exit(3)
gpu = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "no GPU visible"
print(f"python {sys.version.split()[0]} ({sys.executable}), torch {torch.__version__}, cuda {torch.version.cuda}, {gpu}")
sys.exit(0 if device != "cuda" or torch.cuda.is_available() else 4)
EOF
)
env_rc=$?
DRIVER=$(nvidia-smi --query-gpu=driver_version --format=csv,noheader 2>/dev/null | head -1)
echo "$ENV_LINE${DRIVER:+, driver $DRIVER}" | tee "$OUTDIR/env.txt"
if [ $env_rc -ne 0 ]; then
    echo "gpu_check: stopped before any run ($PY: $ENV_LINE); on a lent device run bench/gpu_device.sh, which" \
         "installs the carried wheels and corpus (bench/README.md)" >&2
    exit 2
fi

TESTS_LOG="$OUTDIR/test_gpu.log"
tests_timeout=$(( $(left) < TESTS_TIMEOUT_S ? $(left) : TESTS_TIMEOUT_S ))
if [ "$tests_timeout" -le 0 ]; then  # timeout 0 would mean no limit at all
    tests_line="not run (TESTS_TIMEOUT_S=$TESTS_TIMEOUT_S)"; : > "$TESTS_LOG"
else
    echo "== tests/scenarios/test_gpu.py (at most ${tests_timeout}s)" >&2
    workers=(); [ "$TEST_WORKERS" -gt 0 ] && workers=(-n "$TEST_WORKERS")
    DS_ACCELERATOR=$DEVICE timeout -k 5 "$tests_timeout" "$PY" -m pytest -q -ra -p no:cacheprovider "${workers[@]}" \
        --basetemp="$SCRATCH/pytest" tests/scenarios/test_gpu.py > "$TESTS_LOG" 2>&1
    tests_rc=$?
    kill_runs "$SCRATCH/pytest"
    tests_line=$(grep -E "(passed|failed|skipped|error|no tests ran)( |,|$)" "$TESTS_LOG" | tail -1)
    if [ $tests_rc -eq 124 ] || [ $tests_rc -eq 137 ]; then tests_line="cut at ${tests_timeout}s: ${tests_line:-no summary}"; fi
    tests_line=${tests_line:-"no result (exit $tests_rc; see $TESTS_LOG)"}
    grep -E "^(FAILED|ERROR) " "$TESTS_LOG" >&2
fi

TABLE="$OUTDIR/gpu_check.csv"
ROWS_LOG="$OUTDIR/rows.log"
: > "$ROWS_LOG"
echo "config,engine,optim,document_mask,gpus,params,tokens_per_s_per_gpu,step_time_s,mfu,peak_mem_gib,torch_peak_gib,wall_s,first_step_s,status" > "$TABLE"
i=0
for row in $ROWS; do
    IFS=: read -r config engine optim mask <<< "$row"
    i=$((i + 1))
    remaining=$(left)
    if [ "$remaining" -lt "$MIN_ROW_S" ]; then
        echo "$config,$engine,$optim,$mask,$NGPU,,,,,,,,,not run ($remaining s left of DEADLINE_S=$DEADLINE_S)" >> "$TABLE"
        continue
    fi
    limit=$(( remaining < RUN_TIMEOUT_S ? remaining : RUN_TIMEOUT_S ))
    echo "== $row (at most ${limit}s)" >&2
    out="$SCRATCH/row$i"; rm -rf "$out"
    row_started=$(date +%s)
    OUT=$out NGPU=$NGPU DEVICE=$DEVICE STEPS=$STEPS WARMUP=$WARMUP VOCAB=$VOCAB CONFIGS=$config ENGINES=$engine \
        EXTRA="$SIZE train.micro_batch_size=$MBS train.global_batch_size=$GLOBAL_BATCH optim.name=$optim model.document_mask=$mask" \
        timeout -k 5 "$limit" bash bench/gpu_bench.sh > "$out.log" 2>&1
    rc=$?
    kill_runs "$out/runs"
    wall=$(( $(date +%s) - row_started ))
    status=""
    if [ $rc -eq 124 ] || [ $rc -eq 137 ]; then
        status="cut at ${limit}s"
        # gpu_bench was stopped before it summarised: the steps the run logged still give figures.
        run_dir="$out/runs/$config-$engine"
        peak_mib=$(sort -n "$run_dir.mem" 2>/dev/null | tail -1)
        [ -d "$run_dir" ] && { echo "config,engine,gpus,params,tokens_per_s_per_gpu,step_time_s,mfu,peak_mem_gib,torch_peak_gib,status"
            "$PY" bench/gpu_summary.py "$run_dir" "$config" "$engine" "$NGPU" "${peak_mib:-0}" "$status" "$WARMUP" \
                "${PEAK_FLOPS:-989e12}"; } > "$out/gpu_bench.csv"
    fi
    first=$("$PY" - "$out" <<'EOF' 2>/dev/null
import json, sys
from pathlib import Path
for path in sorted(Path(sys.argv[1]).glob("runs/*/metrics.jsonl")):
    steps = [json.loads(line) for line in path.read_text().splitlines() if '"step_time_s"' in line]
    print(f"{steps[0]['step_time_s']:.1f}" if steps else "")
    break
EOF
)
    line=$(sed -n 2p "$out/gpu_bench.csv" 2>/dev/null)
    if [ -z "$line" ] || { [ $rc -ne 0 ] && [ -z "$status" ]; }; then
        { echo "== row $i: $row: exit $rc after ${wall}s; the last lines of its logs:"; tail -n 40 "$out.log"
          tail -n 40 "$out"/runs/*.log 2>/dev/null; } >> "$ROWS_LOG"
        tail -n 15 "$out"/runs/*.log >&2 2>/dev/null
    else
        { echo "== row $i: $row: ${wall}s"; grep -E "dsslm: (step|start|finished)" "$out"/runs/*.log 2>/dev/null | tail -n 8; } >> "$ROWS_LOG"
    fi
    if [ -z "$line" ]; then
        echo "$config,$engine,$optim,$mask,$NGPU,,,,,,,$wall,$first,${status:-exit$rc (rows.log)}" >> "$TABLE"; continue
    fi
    # gpu_bench's row: config,engine,gpus,params,tps,step_s,mfu,peak,torch_peak,status
    echo "$line" | awk -F, -v o="$optim" -v m="$mask" -v w="$wall" -v f="$first" -v s="$status" 'BEGIN{OFS=","}
        {print $1,$2,o,m,$3,$4,$5,$6,$7,$8,$9,w,f,(s == "" ? $10 : s)}' >> "$TABLE"
done

echo
echo "dsslm GPU check on $DEVICE ($NGPU device(s)), $(( $(date +%s) - started )) s; $ENV_LINE${DRIVER:+, driver $DRIVER}"
echo "tests/scenarios/test_gpu.py: $tests_line"
column -s, -t < "$TABLE" 2>/dev/null || cat "$TABLE"
echo "table: $TABLE"
