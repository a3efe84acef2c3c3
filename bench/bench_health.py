"""The cost of the per-step health check on 2 gloo ranks (train.check_health: rank 0's writer,
log and lock failures raised on every rank through engine.raise_together).

    python bench/bench_health.py [--calls 2000] [--steps 150] [--rounds 3]

(1) One engine.raise_together() (rank 0 runs a no-op check), one engine.decide() round trip and
    one all_reduce of a float: median microseconds over --calls calls.
(2) train() on 2 ranks at the tests' tiny shape, alternating rounds with check_health as shipped
    (A) and with check_health replaced by the old rank-0-only store.check() (B): median wall
    seconds per step of the loop (first step excluded), per round and over rounds.
A bench, not a test: on a shared 2-core machine the figures move with the load (printed).
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
from _ranks import rank_env, run_ranks  # noqa: E402  (bench/ is the script's own folder)

TINY = ["model.d_model=32", "model.n_layers=2", "model.n_heads=2", "model.seq_len=32", "train.micro_batch_size=2",
        "train.precision=fp32", "run.val_every=0", "run.tensorboard=false", "optim.warmup_steps=5",
        "train.device=cpu", "observe.every=0"]


def collectives(rank: int, world_size: int, port: int, calls: int, out) -> None:
    rank_env(rank, world_size, port)
    os.environ["OMP_NUM_THREADS"] = "1"
    import torch
    from dsslm.config import load
    from dsslm.engine import build_engine
    from dsslm.model import build_model
    torch.set_num_threads(1)
    cfg = load(None, [*TINY, "model.vocab_size=256"])
    engine = build_engine(cfg, build_model(cfg.model))
    timings = {"raise_together": [], "decide": [], "all_reduce": []}
    for _ in range(calls):
        started = time.perf_counter()
        engine.raise_together(lambda: None)
        timings["raise_together"].append(time.perf_counter() - started)
        started = time.perf_counter()
        engine.decide(lambda: None)
        timings["decide"].append(time.perf_counter() - started)
        started = time.perf_counter()
        engine.all_reduce_sum(torch.zeros(1))
        timings["all_reduce"].append(time.perf_counter() - started)
    engine.close()
    out.put({"rank": rank, **{k: statistics.median(v) * 1e6 for k, v in timings.items()}})


def training(rank: int, world_size: int, port: int, run_dir: str, steps: int, variant: str, out) -> None:
    rank_env(rank, world_size, port)
    os.environ["OMP_NUM_THREADS"] = "1"
    import torch
    from dsslm import train as train_module
    torch.set_num_threads(1)
    if variant == "B":  # the old boundary check: rank 0's store alone, no collective
        train_module.check_health = lambda job, wait=False, between_steps=False: job.store.wait() if wait else job.store.check()
    marks: list[float] = []
    real_account = train_module.account

    def account(*args, **kwargs):  # one timestamp per step, at the same point of every step
        marks.append(time.perf_counter())
        return real_account(*args, **kwargs)

    train_module.account = account
    cfg = train_module.load(None, [f"run.dir={run_dir}", *TINY, f"train.total_steps={steps}", "ckpt.every=100000"])
    assert train_module.train(cfg) == 0
    out.put({"rank": rank, "step_s": statistics.median(b - a for a, b in zip(marks[1:], marks[2:]))})


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--calls", type=int, default=2000)
    parser.add_argument("--steps", type=int, default=150)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    print(f"load average before: {os.getloadavg()}")
    us = run_ranks(collectives, 2, (args.calls,), timeout_s=600)[0]
    print(f"(1) 2 gloo ranks, median of {args.calls}: engine.raise_together {us['raise_together']:.0f} us, "
          f"engine.decide {us['decide']:.0f} us, all_reduce of one float {us['all_reduce']:.0f} us")
    per_step: dict[str, list[float]] = {"A": [], "B": []}
    with tempfile.TemporaryDirectory(prefix="dsslm-bench-health-") as tmp:
        for round_ in range(args.rounds):
            for variant in ("A", "B") if round_ % 2 == 0 else ("B", "A"):
                run_dir = Path(tmp) / f"{variant}{round_}"
                ranks = run_ranks(training, 2, (str(run_dir), args.steps, variant), timeout_s=600)
                per_step[variant].append(ranks[0]["step_s"])
    a, b = statistics.median(per_step["A"]), statistics.median(per_step["B"])
    print(f"(2) train(), 2 ranks, tiny shape, {args.steps} steps, median ms/step over {args.rounds} rounds:")
    print(f"    A check_health          {a * 1e3:.2f} ms  rounds {json.dumps([round(x * 1e3, 2) for x in per_step['A']])}")
    print(f"    B rank-0 store.check()  {b * 1e3:.2f} ms  rounds {json.dumps([round(x * 1e3, 2) for x in per_step['B']])}")
    print(f"    A/B = {a / b:.3f}")
    print(f"load average after: {os.getloadavg()}")


if __name__ == "__main__":
    main()
