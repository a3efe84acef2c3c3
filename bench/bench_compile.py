"""`train.compile` on against off on CPU: train() at nanoGPT's CPU shape, alternating rounds.

    .venv/bin/python bench/bench_compile.py [--steps 200] [--rounds 3]

Each round runs train() eagerly, then compiled (inductor, every block), in this process, on
the embedded corpus. Reported per mode: the median step time (metrics.jsonl `step_time_s`)
over the steps after the first 10 (the first compiled steps carry the compilation; later
rounds hit inductor's cache), and the compiled run's first-step time (the compile cost).
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from bench.bench_overhead import SHAPE  # noqa: E402
from dsslm.config import load  # noqa: E402
from dsslm.train import train  # noqa: E402


def step_times(compile_on: bool, steps: int) -> list[float]:
    with tempfile.TemporaryDirectory() as tmp:
        cfg = load(None, SHAPE + [f"run.dir={tmp}", f"train.total_steps={steps}", f"ckpt.every={steps}",
                                  "optim.warmup_steps=10", f"train.compile={str(compile_on).lower()}"])
        train(cfg)
        lines = (Path(tmp) / "metrics.jsonl").read_text().splitlines()
        return [r["step_time_s"] for r in map(json.loads, lines) if "step_time_s" in r]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    tokens = 12 * 64
    medians: dict[str, list[float]] = {"eager": [], "compiled": []}
    first_compiled = []
    for i in range(args.rounds):
        before = " ".join(f"{x:.2f}" for x in os.getloadavg())
        for name in medians:
            times = step_times(name == "compiled", args.steps)
            medians[name].append(statistics.median(times[10:]))
            if name == "compiled":
                first_compiled.append(times[0])
        print(f"round {i}: eager {medians['eager'][-1] * 1e3:.2f} ms, compiled {medians['compiled'][-1] * 1e3:.2f} ms "
              f"(first compiled step {first_compiled[-1]:.1f} s); load {before} -> "
              f"{' '.join(f'{x:.2f}' for x in os.getloadavg())}", flush=True)
    eager, compiled = statistics.median(medians["eager"]), statistics.median(medians["compiled"])
    print(f"torch threads {torch.get_num_threads()}, {args.steps} steps x {args.rounds} rounds, {tokens} tokens/step")
    print(f"eager    : {eager * 1e3:7.2f} ms/step  {tokens / eager:9,.0f} tokens/s")
    print(f"compiled : {compiled * 1e3:7.2f} ms/step  {tokens / compiled:9,.0f} tokens/s  "
          f"(first step {statistics.median(first_compiled):.1f} s: the compilation, cache cold in round 0)")
    print(f"compiled/eager speed: {eager / compiled:.3f}")


if __name__ == "__main__":
    main()
