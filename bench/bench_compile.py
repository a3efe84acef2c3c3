"""`train.compile` on against off on CPU, at nanoGPT's CPU shape (4 layers, d 128, context 64,
batch 12, fp32, one process), through the DDP engine the loop uses (one process: no group).

    .venv/bin/python bench/bench_compile.py [--steps 50] [--rounds 5]
    .venv/bin/python bench/bench_compile.py --restarts [--pairs 2]

Two engines on the same initial weights and batches: eager and compiled (inductor, the whole
model). The compilation is timed once (the first compiled step); then rounds of `--steps`
steps alternate between the two. Per round: wall time and this process's CPU time per step
(CPU time hardly moves with other processes' load when torch runs one thread: OMP_NUM_THREADS=1).
Medians over rounds.

`--restarts`: what `train.compile_cache` saves a requeue. Each pair is two fresh processes on one
new cache folder (dsslm.engine.compile_cache, as a run's `run.dir/cache/compile-<key>/`): the first
start's first compiled step (cold: nothing cached) and the restart's (inductor's FX graph and AOT
autograd caches hit), each timed in its own process from the step's start to its end, with
inductor's cache counters. Measured on the 2-core CPU VM (torch 2.13.0+cpu, one thread, load 0.5-2.9):
first start 38.9 / 31.6 / 38.1 s, restart 5.4 / 6.8 / 5.1 s (fxgraph cache: 2 misses, then 2 hits).
"""
from __future__ import annotations

import argparse
import os
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from dsslm.config import load  # noqa: E402
from dsslm.engine.compile_cache import kept_with_run  # noqa: E402
from dsslm.engine.ddp import DDPEngine  # noqa: E402
from dsslm.loss import accumulate  # noqa: E402
from dsslm.model import build_model  # noqa: E402

SHAPE = ["model.d_model=128", "model.n_layers=4", "model.n_heads=4", "model.seq_len=64", "train.micro_batch_size=12",
         "train.precision=fp32", "train.device=cpu", "model.vocab_size=257"]


def make_engine(compile_on: bool, *extra: str) -> DDPEngine:
    cfg = load(None, SHAPE + [f"train.compile={str(compile_on).lower()}", *extra])
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


def first_step(cache: str) -> None:
    """One process's first compiled step with its caches in `cache`: seconds and cache counters."""
    from torch._dynamo.utils import counters
    engine = make_engine(True, f"train.compile_cache={cache}")
    batch = torch.randint(0, 257, (12, 65), generator=torch.Generator().manual_seed(0))
    with kept_with_run(engine.cfg, 1, torch.device("cpu")):
        started = time.perf_counter()
        run(engine, [batch], 1)
        seconds = time.perf_counter() - started
    print(json.dumps({"seconds": seconds, "inductor": dict(counters["inductor"]),
                      "aot_autograd": dict(counters["aot_autograd"])}))


def restarts(pairs: int) -> None:
    """`pairs` times: a cold start and a restart on one new cache folder, each its own process."""
    def child(cache: str) -> dict:
        out = subprocess.run([sys.executable, __file__, "--first-step", cache], check=True, capture_output=True,
                             text=True).stdout
        return json.loads(out.strip().splitlines()[-1])

    firsts, again = [], []
    for i in range(pairs):
        with tempfile.TemporaryDirectory(prefix="bench-compile-") as tmp:
            before = " ".join(f"{x:.2f}" for x in os.getloadavg())
            cold, warm = child(tmp), child(tmp)
            firsts.append(cold["seconds"])
            again.append(warm["seconds"])
            print(f"pair {i}: first start {cold['seconds']:.2f} s (fxgraph miss "
                  f"{cold['inductor'].get('fxgraph_cache_miss', 0)}, hit {cold['inductor'].get('fxgraph_cache_hit', 0)}), "
                  f"restart {warm['seconds']:.2f} s (fxgraph hit {warm['inductor'].get('fxgraph_cache_hit', 0)}, "
                  f"miss {warm['inductor'].get('fxgraph_cache_miss', 0)}; autograd cache hit "
                  f"{warm['aot_autograd'].get('autograd_cache_hit', 0)}); load {before}", flush=True)
    cold_s, warm_s = statistics.median(firsts), statistics.median(again)
    print(f"torch {torch.__version__}, threads {torch.get_num_threads()}, d 128 x 4 layers, DDP engine, one process: "
          f"first compiled step, first start {cold_s:.2f} s, restart {warm_s:.2f} s: {cold_s / warm_s:.1f}x faster "
          f"(medians of {pairs})")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=50)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--restarts", action="store_true", help="time a restart's first step against a first start's")
    parser.add_argument("--pairs", type=int, default=2, help="--restarts: cold/warm pairs")
    parser.add_argument("--first-step", metavar="CACHE", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.first_step:
        return first_step(args.first_step)
    if args.restarts:
        return restarts(args.pairs)
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
