"""Spike policy figures: false positives on a clean run, detection delay, and what poison costs.

Runs the same config twice on the stdlib corpus: clean, and with poisoned data windows (an
isolated batch, a sustained window, and two adjacent windows). Prints skips and rewinds of the
clean run, the delay from each poisoned step to the verdict, and both final losses.

    .venv/bin/python bench/bench_spikes.py [--steps 1200]
"""
from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path

from dsslm.config import load
from dsslm.train import train

SHAPE = ["model.d_model=64", "model.n_layers=2", "model.n_heads=2", "model.seq_len=64",
         "train.micro_batch_size=8", "train.precision=fp32", "train.device=cpu", "run.val_every=0",
         "run.tensorboard=false", "optim.peak_lr=3e-3", "optim.warmup_steps=50", "ckpt.every=20",
         "ckpt.keep_last=3"]


def records(run_dir: Path, name: str) -> list[dict]:
    return [json.loads(line) for line in (run_dir / name).read_text().splitlines()]


def run(tmp: Path, tag: str, steps: int, extra: list[str]) -> Path:
    run_dir = tmp / tag
    train(load(None, SHAPE + [f"run.dir={run_dir}", f"train.total_steps={steps}", *extra]))
    return run_dir


def final_loss(run_dir: Path, last: int = 50) -> float:
    losses = [r["loss"] for r in records(run_dir, "metrics.jsonl") if r.get("verdict") == "ok"]
    return sum(losses[-last:]) / len(losses[-last:])


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=1200)
    args = parser.parse_args()
    s = args.steps
    windows = [[s // 4, s // 4 + 1], [s // 2, s // 2 + 6], [3 * s // 4, 3 * s // 4 + 4],
               [3 * s // 4 + 4, 3 * s // 4 + 8]]
    with tempfile.TemporaryDirectory() as tmp:
        clean = run(Path(tmp), "clean", s, [])
        poisoned = run(Path(tmp), "poisoned", s, [f"faults.poison_batches={json.dumps(windows)}"])
        clean_events = [e["event"] for e in records(clean, "events.jsonl")]
        print(f"clean run, {s} steps: {clean_events.count('skip')} skips, "
              f"{clean_events.count('rewind')} rewinds (false positives)")
        metrics = records(poisoned, "metrics.jsonl")
        for start, end in windows:
            first = next((i for i, r in enumerate(metrics)
                          if start <= r.get("data_position", -1) // r.get("batch_sequences", 1) < end), None)
            if first is None:
                print(f"poison {start}-{end}: never fed (an earlier rewind's window covered it)")
                continue
            hit = next((i for i in range(first, len(metrics)) if metrics[i]["verdict"] != "ok"), None)
            delay = None if hit is None else metrics[hit]["step"] - metrics[first]["step"]
            print(f"poison {start}-{end}: first poisoned step {metrics[first]['step']}, verdict "
                  f"{hit is not None and metrics[hit]['verdict']} after {delay} steps")
        for e in records(poisoned, "events.jsonl"):
            if e["event"] in ("skip", "rewind", "lr_scale", "escalation"):
                print("  event", {k: v for k, v in e.items() if k in ("event", "step", "to_step", "window", "new")})
        print(f"final loss (mean of last 50 ok steps): clean {final_loss(clean):.4f}, "
              f"poisoned {final_loss(poisoned):.4f}")


if __name__ == "__main__":
    main()
