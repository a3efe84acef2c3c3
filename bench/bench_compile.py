"""`train.compile` on against off on CPU, at nanoGPT's CPU shape (4 layers, d 128, context 64,
batch 12, fp32, one process), through the DDP engine the loop uses (one process: no group).

    .venv/bin/python bench/bench_compile.py [--steps 50] [--rounds 5]

Two engines on the same initial weights and batches: eager and compiled (inductor, the whole
model). The compilation is timed once (the first compiled step); then rounds of `--steps`
steps alternate between the two. Per round: wall time and this process's CPU time per step
(CPU time hardly moves with other processes' load when torch runs one thread: OMP_NUM_THREADS=1).
Medians over rounds.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from dsslm.config import load  # noqa: E402
from dsslm.engine.ddp import DDPEngine  # noqa: E402
from dsslm.loss import accumulate  # noqa: E402
from dsslm.model import build_model  # noqa: E402

SHAPE = ["model.d_model=128", "model.n_layers=4", "model.n_heads=4", "model.seq_len=64", "train.micro_batch_size=12",
         "train.precision=fp32", "train.device=cpu", "model.vocab_size=257"]


def make_engine(compile_on: bool) -> DDPEngine:
    cfg = load(None, SHAPE + [f"train.compile={str(compile_on).lower()}"])
    torch.manual_seed(0)
    return DDPEngine(cfg, build_model(cfg.model))


def run(engine: DDPEngine, batches: list, steps: int) -> tuple[float, float]:
    """Wall and CPU seconds per step over `steps` steps."""
    wall, cpu = time.perf_counter(), time.process_time()
    for i in range(steps):
        x = batches[i % len(batches)]
        accumulate(engine, [(x[:, :-1], x[:, 1:])], "fp32", 1e-4, 1.0, x[:, 1:].numel())
        engine.step(1e-3)
    return (time.perf_counter() - wall) / steps, (time.process_time() - cpu) / steps


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=50)
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    gen = torch.Generator().manual_seed(0)
    batches = [torch.randint(0, 257, (12, 65), generator=gen) for _ in range(8)]
    engines = {"eager": make_engine(False), "compiled": make_engine(True)}
    started = time.perf_counter()
    run(engines["compiled"], batches, 1)
    compile_s = time.perf_counter() - started
    for engine in engines.values():
        run(engine, batches, 10)  # warm-up (and any recompilation)
    results: dict[str, list[tuple[float, float]]] = {name: [] for name in engines}
    for i in range(args.rounds):
        before = " ".join(f"{x:.2f}" for x in os.getloadavg())
        for name, engine in engines.items():
            results[name].append(run(engine, batches, args.steps))
        print(f"round {i}: " + ", ".join(f"{n} {r[-1][0] * 1e3:.2f} ms wall / {r[-1][1] * 1e3:.2f} ms CPU"
                                          for n, r in results.items()) + f"; load {before}", flush=True)
    print(f"torch threads {torch.get_num_threads()}, {args.steps} steps x {args.rounds} rounds, 768 tokens/step; "
          f"first compiled step {compile_s:.1f} s (the compilation)")
    for name, rounds in results.items():
        wall, cpu = statistics.median(r[0] for r in rounds), statistics.median(r[1] for r in rounds)
        print(f"{name:9s}: {wall * 1e3:7.2f} ms/step wall ({768 / wall:7,.0f} tokens/s), {cpu * 1e3:7.2f} ms CPU")
    speed = [e[1] / c[1] for e, c in zip(results["eager"], results["compiled"])]
    print(f"compiled/eager speed by CPU time: {statistics.median(speed):.3f} (per round "
          f"{', '.join(f'{s:.3f}' for s in speed)})")


if __name__ == "__main__":
    main()
