"""One gpu_bench.csv row from a run's folder (bench/gpu_bench.sh; bench/gpu_check.sh for a run it
cut at its deadline, from the steps the run logged before that):

    python bench/gpu_summary.py RUN_DIR CONFIG ENGINE GPUS PEAK_MIB STATUS WARMUP PEAK_FLOPS

tokens/s per GPU and the step time are medians over the steps after WARMUP (compile, allocator
warm-up); MFU = (6 N + 12 L d T) x tokens/s per GPU / PEAK_FLOPS (N parameters, L layers, d width,
T sequence length: the second term is attention's QK^T and AV, PaLM's form); the memory figures are
nvidia-smi's peak memory.used (PEAK_MIB: the CUDA context and allocator cache included) and torch's
max_memory_allocated over ranks (from the diagnostics records)."""
import json
import statistics
import sys
from pathlib import Path


def read_jsonl(path: Path) -> list[dict]:
    out = []
    for line in path.read_text().splitlines() if path.exists() else []:
        try:
            out.append(json.loads(line))
        except ValueError:
            continue  # the last line of a run cut mid-write
    return out


def main(argv: list[str]) -> str:
    run_dir, config, engine, gpus, peak_mib, status, warmup, peak = argv
    run_dir, gpus, warmup, peak = Path(run_dir), int(gpus), int(warmup), float(peak)
    records = read_jsonl(run_dir / "metrics.jsonl")
    steps = [r for r in records if "step_time_s" in r][warmup:]
    start = [e for e in read_jsonl(run_dir / "events.jsonl") if e.get("event") == "start"]
    memory = f"{float(peak_mib or 0) / 1024:.1f}"
    if not steps or not start:
        return f"{config},{engine},{gpus},,,,,{memory},,{status}"
    model = start[0]["config"]["model"]
    n = start[0]["n_params"]
    step_s = statistics.median(r["step_time_s"] for r in steps)
    tps_gpu = statistics.median(r["batch_tokens"] / r["step_time_s"] for r in steps) / gpus
    mfu = (6 * n + 12 * model["n_layers"] * model["d_model"] * model["seq_len"]) * tps_gpu / peak
    torch_peak = max((r["peak_mem_bytes"] for r in records if "peak_mem_bytes" in r), default=0) / 2**30
    return f"{config},{engine},{gpus},{n},{tps_gpu:.0f},{step_s:.3f},{mfu:.3f},{memory},{torch_peak:.1f},{status}"


if __name__ == "__main__":
    print(main(sys.argv[1:]))
