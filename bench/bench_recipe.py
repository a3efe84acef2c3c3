"""Figures for the 2026 recipe on a CPU: the document mask's step-time cost, and Muon against AdamW.

  .venv/bin/python bench/bench_recipe.py mask [--seq 256] [--iters 20]
  .venv/bin/python bench/bench_recipe.py muon [--steps 150] [--out runs/bench_recipe]
  .venv/bin/python bench/bench_recipe.py mask-loss [--steps 300] [--seeds 2] [--out runs/bench_recipe]

mask: forward + backward of the tiny shape (d 128, 4 layers) on packed sequences with a document
every ~100 tokens, median ms per step of interleaved repeats: no mask (causal SDPA kernel), the
dense document mask, and the mask with restarting RoPE positions.
muon: the tiny config for --steps steps with AdamW (optim.peak_lr 2e-3) and with Muon
(optim.muon_lr 0.02, AdamW 2e-3 for the rest), one seed each, the final validation loss.
mask-loss: the mask's effect on validation loss at equal tokens: d 128, 4 layers, seq 256, batch 8
on the embedded corpus (its documents are files, EOS between them), --steps steps, --seeds seeds,
without the mask, with it, and with it and per-document positions. Validation is measured the
way each model trains (a masked model is validated masked).
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # this checkout's dsslm, not an installed one


def bench_mask(seq: int, iters: int) -> None:
    from dsslm.config import load
    from dsslm.model import build_model
    torch.manual_seed(0)
    idx = torch.randint(0, 256, (8, seq))
    idx[:, 99::100] = 256  # an EOS every 100 tokens
    variants = {"none": [], "document_mask": ["model.document_mask=true"],
                "document_mask+positions": ["model.document_mask=true", "model.document_positions=true"]}
    models = {}
    for name, extra in variants.items():
        cfg = load(None, ["model.vocab_size=257", "model.eos_id=256", f"model.seq_len={seq}", *extra]).model
        torch.manual_seed(0)
        models[name] = build_model(cfg)
    times = {name: [] for name in models}
    for _ in range(iters):
        for name, model in models.items():
            started = time.perf_counter()
            model(idx).logsumexp(-1).mean().backward()
            times[name].append(time.perf_counter() - started)
            model.zero_grad(set_to_none=True)
    base = statistics.median(times["none"])
    print(f"threads {torch.get_num_threads()}, batch 8 x {seq}, d 128, 4 layers, median of {iters}")
    for name, t in times.items():
        print(f"{name:26s} {statistics.median(t) * 1e3:8.1f} ms  x{statistics.median(t) / base:.2f}")


def bench_muon(steps: int, out: Path) -> None:
    from dsslm.train import main
    common = [f"train.total_steps={steps}", f"run.val_every={steps}", "run.val_batches=16", "run.tensorboard=false",
              "optim.warmup_steps=20", "ckpt.every=100000", "monitor.enabled=false"]
    for name, extra in (("adamw", []), ("muon", ["optim.name=muon", "optim.muon_lr=0.02"])):
        run_dir = out / name
        started = time.perf_counter()
        assert main([f"run.dir={run_dir}", *common, *extra]) == 0
        wall = time.perf_counter() - started
        records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
        val = [r["val_loss"] for r in records if "val_loss" in r][-1]
        print(f"{name}: {steps} steps, final val loss {json.dumps(val)}, wall {wall:.0f} s")


def bench_mask_loss(steps: int, seeds: int, out: Path) -> None:
    import subprocess
    shape = ["model.d_model=128", "model.n_layers=4", "model.n_heads=4", "model.seq_len=256", "train.micro_batch_size=8",
             f"train.total_steps={steps}", f"run.val_every={steps}",
             "run.val_batches=32", "run.tensorboard=false", "optim.warmup_steps=30", "ckpt.every=100000",
             "train.precision=fp32", "train.device=cpu"]
    variants = {"none": [], "document_mask": ["model.document_mask=true"],
                "document_mask+positions": ["model.document_mask=true", "model.document_positions=true"]}
    vals: dict[str, list[float]] = {name: [] for name in variants}
    for seed in range(seeds):
        for name, extra in variants.items():
            run_dir = out / f"mask-{name}-{seed}"
            subprocess.run([sys.executable, "-m", "dsslm.train", f"run.dir={run_dir}", f"run.seed={seed}", *shape, *extra],
                           check=True, capture_output=True, cwd=Path(__file__).resolve().parent.parent)
            records = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines() if x.strip()]
            val = [r["val_loss"] for r in records if "val_loss" in r][-1]
            vals[name].append(statistics.fmean(val.values()))
            print(f"seed {seed} {name:26s} val {vals[name][-1]:.4f}", flush=True)
    base = statistics.fmean(vals["none"])
    for name, v in vals.items():
        print(f"{name:26s} mean val {statistics.fmean(v):.4f} ({100 * (statistics.fmean(v) / base - 1):+.2f}% vs none; "
              f"per seed {', '.join(f'{x:.4f}' for x in v)})")


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("what", choices=["mask", "muon", "mask-loss"])
    parser.add_argument("--seeds", type=int, default=2)
    parser.add_argument("--seq", type=int, default=256)
    parser.add_argument("--iters", type=int, default=20)
    parser.add_argument("--steps", type=int, default=150)
    parser.add_argument("--out", type=Path, default=Path("runs/bench_recipe"))
    args = parser.parse_args()
    if args.what == "mask-loss":
        bench_mask_loss(args.steps, args.seeds, args.out)
    else:
        bench_mask(args.seq, args.iters) if args.what == "mask" else bench_muon(args.steps, args.out)
