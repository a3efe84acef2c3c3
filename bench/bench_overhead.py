"""Framework overhead: train() against a bare loop of the same model, in one process, alternating.

The bare loop does forward, backward, clip, AdamW step on pre-built batches and nothing else.
train() adds the loader, token-weighted accumulation, the monitor, metrics.jsonl and the
checkpoint checks. Shape: nanoGPT's CPU recipe (4 layers, 4 heads, d 128, context 64, batch 12,
fp32, one process).

    .venv/bin/python bench/bench_overhead.py [--steps 300] [--rounds 3]
"""
from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

import torch

from dsslm.config import load
from dsslm.data.corpus import default_data_dir
from dsslm.data.loader import Loader
from dsslm.model import build_model
from dsslm.optim import build_adamw
from dsslm.train import train

SHAPE = ["model.d_model=128", "model.n_layers=4", "model.n_heads=4", "model.seq_len=64",
         "train.micro_batch_size=12", "train.grad_accum=1", "train.precision=fp32", "train.device=cpu",
         "run.val_every=0", "run.tensorboard=false", "train.z_loss=0"]


def bare_loop(cfg, steps: int) -> float:
    """Seconds per step of the minimal loop."""
    torch.manual_seed(cfg.run.seed)
    model = build_model(cfg.model)
    opt = build_adamw(model, cfg.optim)
    loader = Loader(default_data_dir(), cfg.model.seq_len, cfg.run.seed)
    size = cfg.train.micro_batch_size
    batches = [loader.step(s * size, [], size, 0, 1, 1)[1][0] for s in range(steps)]
    started = time.perf_counter()
    for inputs, targets in batches:
        logits = model(inputs)
        loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), targets.flatten())
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.optim.clip)
        opt.step()
        opt.zero_grad(set_to_none=True)
    return (time.perf_counter() - started) / steps


def framework_loop(overrides: list[str], steps: int) -> float:
    """Seconds per step of train(), from its start event to its end event (setup excluded)."""
    with tempfile.TemporaryDirectory() as tmp:
        cfg = load(None, overrides + [f"run.dir={tmp}", f"train.total_steps={steps}",
                                      f"ckpt.every={steps}", "optim.warmup_steps=10"])
        train(cfg)
        events = {e["event"]: e["time"] for e in map(json.loads, open(Path(tmp) / "events.jsonl"))}
        return (events["end"] - events["start"]) / steps


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    cfg = load(None, SHAPE)
    cfg.model.vocab_size = 257
    tokens_per_step = cfg.train.micro_batch_size * cfg.model.seq_len
    bare, framework = [], []
    for _ in range(args.rounds):
        bare.append(bare_loop(cfg, args.steps))
        framework.append(framework_loop(SHAPE, args.steps))
    b, f = statistics.median(bare), statistics.median(framework)
    print(f"torch threads {torch.get_num_threads()}, {args.steps} steps x {args.rounds} rounds, "
          f"{tokens_per_step} tokens/step")
    print(f"bare loop : {b * 1e3:7.2f} ms/step  {tokens_per_step / b:9,.0f} tokens/s  (all: "
          f"{', '.join(f'{x * 1e3:.2f}' for x in bare)})")
    print(f"train()   : {f * 1e3:7.2f} ms/step  {tokens_per_step / f:9,.0f} tokens/s  (all: "
          f"{', '.join(f'{x * 1e3:.2f}' for x in framework)})")
    print(f"overhead  : {100 * (f / b - 1):+.2f}%  (target <= 3%)")


if __name__ == "__main__":
    main()
