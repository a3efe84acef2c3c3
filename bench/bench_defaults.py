"""Which recipe changes earn a default (issue 47, item 6): tokens to a target validation loss.

  .venv/bin/python bench/bench_defaults.py [--steps 400] [--seeds 1,2,3] [--corpora code,prose]
      [--variants base,qk_norm,...] [--jobs 2] [--out runs/bench_defaults]

The base is configs/tiny.yaml (d 128, 4 layers, 4 heads, seq 64, batch 12, AdamW 2e-3 -> 2e-4
cosine, tied embeddings) cut to --steps steps (warmup 10% of them), validating every --val-every
steps on 16 batches, with any `--base-set KEY=VALUE` applied. The figures in
docs/configuration.md#defaults were measured on the base before it earned init_std 0.05 and
QK-norm: `--base-set model.init_std=0.02 --base-set model.qk_norm=false` is that base again.
Each variant changes one thing from it, and `all` changes them all:

  qk_norm   model.qk_norm=true
  untied    model.tie_embeddings=false, optim.lr_embedding=--emb-mult (3: the input table's own rate)
  wsd       optim.schedule=wsd, optim.decay_steps = --decay of the steps (linear to min_lr)
  muon      optim.name=muon, optim.muon_lr=--muon-lr (AdamW at the base rate for the rest)
  mup       model.mup_base_width=64: the rates and multipliers of a width-64 model's tuning
  init      model.init_std=--init-std (0.05; GPT-2's 0.02 is the default, and small for d 128:
            docs/mup.md#the-bases-init-std-is-a-base-hyperparameter)
  A+B       any of these together (`muon+init`); `all` is every one of them

Corpora: `code` is the embedded corpus (the stdlib's source, which the defaults were tuned on);
`prose` is pydoc's topics (the language reference, ~460 KB), built here, which nothing was tuned on.
The target of a corpus is the base's median final validation loss over the seeds. A run's tokens
to the target are read at its first evaluation at or under it, interpolated linearly between that
evaluation and the one before (tokens = steps x 768). Reported per corpus and variant: the median
tokens to target over the seeds (how many seeds reached it), the ratio to the base's, and the final
loss's mean and range. A variant earns a default when it reaches the target sooner on every corpus.

A benchmark, not a test: every run's step count is fixed, so these figures do not move with the
machine's load (the wall times printed do).
"""
from __future__ import annotations

import argparse
import concurrent.futures
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
TOKENS_PER_STEP = 12 * 64  # tiny.yaml's batch x seq_len


def variants(steps: int, args: argparse.Namespace) -> dict[str, list[str]]:
    one = {
        "qk_norm": ["model.qk_norm=true"],
        "untied": ["model.tie_embeddings=false", f"optim.lr_embedding={args.emb_mult:g}"],
        "wsd": ["optim.schedule=wsd", f"optim.decay_steps={max(1, round(steps * args.decay))}"],
        "muon": ["optim.name=muon", f"optim.muon_lr={args.muon_lr:g}"],
        "mup": ["model.mup_base_width=64"],
        "init": [f"model.init_std={args.init_std:g}"],
    }
    return {"base": [], **one, "all": [o for extra in one.values() for o in extra]}


def prose_corpus(out: Path) -> str:
    """pydoc's topics (each over 500 characters a document), ASCII, prepared with the byte tokenizer."""
    data = out / "data" / "prose"
    if (data / "manifest.json").is_file():
        return str(data)
    from pydoc_data.topics import topics
    src = out / "src-prose"
    src.mkdir(parents=True, exist_ok=True)
    for i, key in enumerate(sorted(topics)):
        if len(topics[key]) > 500:
            (src / f"topic-{i:04d}.txt").write_text(topics[key].encode("ascii", "ignore").decode())
    subprocess.run([sys.executable, "-m", "dsslm.data", "prepare", "--input", str(src), "--out", str(data),
                    "--domain", "prose", "--tokenizer", "byte", "--val-fraction", "0.05"],
                   cwd=ROOT, check=True, stdout=subprocess.DEVNULL)
    return str(data)


def val_curve(run_dir: Path) -> list[tuple[int, float]]:
    """(step, validation loss: the mean over its domains) of every evaluation, in step order."""
    curve = {}
    path = run_dir / "metrics.jsonl"
    for line in path.read_text().splitlines() if path.is_file() else []:
        record = json.loads(line)
        losses = record.get("val_loss")
        if isinstance(losses, dict) and losses and all(v is not None for v in losses.values()):
            curve[int(record["step"])] = statistics.fmean(float(v) for v in losses.values())
    return sorted(curve.items())


def steps_to(curve: list[tuple[int, float]], target: float) -> float | None:
    """The step the loss first reaches `target`, linear between the evaluations around it."""
    before = (0, float("inf"))
    for step, loss in curve:
        if loss <= target:
            if before[1] == float("inf"):
                return float(step)
            return before[0] + (step - before[0]) * (before[1] - target) / (before[1] - loss)
        before = (step, loss)
    return None


def run_one(out: Path, corpus: str, data_dir: str, variant: str, extra: list[str], seed: int,
            args: argparse.Namespace) -> dict:
    run_dir = out / "runs" / f"{corpus}-{variant}-s{seed}"
    curve = val_curve(run_dir)
    if not curve or curve[-1][0] < args.steps:  # not finished before: train it (afresh)
        import shutil
        shutil.rmtree(run_dir, ignore_errors=True)
        argv = [sys.executable, "-m", "dsslm.train", "--config", "configs/tiny.yaml", f"run.dir={run_dir}",
                f"run.seed={seed}", f"train.total_steps={args.steps}", f"optim.warmup_steps={max(1, args.steps // 10)}",
                f"run.val_every={args.val_every}", "run.val_batches=16", f"ckpt.every={args.steps}",
                "run.tensorboard=false", "monitor.enabled=false", *([f"data.dir={data_dir}"] if data_dir else []),
                *args.base_set, *extra]
        started = time.perf_counter()
        env = {**os.environ, "OMP_NUM_THREADS": str(max(1, (os.cpu_count() or 2) // args.jobs))}
        with open(out / "runs" / f"{run_dir.name}.log", "w") as log:
            rc = subprocess.run(argv, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT).returncode
        print(f"  {run_dir.name}: exit {rc}, {time.perf_counter() - started:.0f} s", flush=True)
        curve = val_curve(run_dir)
    return {"corpus": corpus, "variant": variant, "seed": seed, "curve": curve}


def report(results: list[dict], names: list[str]) -> list[str]:
    lines = []
    for corpus in dict.fromkeys(r["corpus"] for r in results):
        mine = [r for r in results if r["corpus"] == corpus]
        base_final = [r["curve"][-1][1] for r in mine if r["variant"] == "base" and r["curve"]]
        if not base_final:
            continue
        target = statistics.median(base_final)
        lines += [f"\n{corpus}: target {target:.4f} (the base's median final loss)", "",
                  "| variant | tokens to target (median) | reached | vs base | final loss (mean) | min | max |",
                  "|---|---|---|---|---|---|---|"]
        base_tokens = None
        for name in names:
            runs = [r for r in mine if r["variant"] == name and r["curve"]]
            if not runs:
                continue
            reached = [s for s in (steps_to(r["curve"], target) for r in runs) if s is not None]
            finals = [r["curve"][-1][1] for r in runs]
            tokens = statistics.median(reached) * TOKENS_PER_STEP if len(reached) * 2 > len(runs) else None
            if name == "base":
                base_tokens = tokens
            ratio = f"{base_tokens / tokens:.2f}x" if tokens and base_tokens else "-"
            lines.append(f"| {name} | {f'{tokens:,.0f}' if tokens else 'not reached'} | {len(reached)}/{len(runs)} "
                         f"| {ratio} | {statistics.fmean(finals):.4f} | {min(finals):.4f} | {max(finals):.4f} |")
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=400)
    parser.add_argument("--val-every", type=int, default=25)
    parser.add_argument("--seeds", default="1,2,3")
    parser.add_argument("--corpora", default="code,prose")
    parser.add_argument("--variants", default="")
    parser.add_argument("--emb-mult", type=float, default=3.0, help="untied: optim.lr_embedding")
    parser.add_argument("--decay", type=float, default=0.25, help="wsd: the decay's share of the steps")
    parser.add_argument("--muon-lr", type=float, default=0.02)
    parser.add_argument("--init-std", type=float, default=0.05)
    parser.add_argument("--jobs", type=int, default=2)
    parser.add_argument("--base-set", action="append", default=[], metavar="KEY=VALUE",
                        help="an override of the base, before each variant's (repeatable); finished runs "
                             "in --out are reused, so another base needs another --out")
    parser.add_argument("--out", type=Path, default=ROOT / "runs" / "bench_defaults")
    args = parser.parse_args()
    table = variants(args.steps, args)
    names = [n for n in args.variants.split(",") if n] or list(table)
    if "base" not in names:
        names.insert(0, "base")
    for name in names:  # a combination: the overrides of each part, in order
        if "+" in name and all(part in table for part in name.split("+")):
            table[name] = [o for part in name.split("+") for o in table[part]]
    unknown = sorted(set(names) - set(table))
    if unknown:
        raise SystemExit(f"bench: unknown variants {unknown}; known: {', '.join(table)}")
    (args.out / "runs").mkdir(parents=True, exist_ok=True)
    corpora = {c: ("" if c == "code" else prose_corpus(args.out)) for c in args.corpora.split(",")}
    seeds = [int(s) for s in args.seeds.split(",")]
    plan = [(c, d, n, table[n], s) for c, d in corpora.items() for n in names for s in seeds]
    print(f"bench_defaults: {len(plan)} runs of {args.steps} steps, {args.jobs} at a time; load {os.getloadavg()[0]:.1f}")
    with concurrent.futures.ThreadPoolExecutor(args.jobs) as pool:
        results = list(pool.map(lambda p: run_one(args.out, *p, args), plan))
    (args.out / "results.json").write_text(json.dumps(results, indent=1))
    lines = report(results, names)
    print("\n".join(lines))
    (args.out / "report.md").write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
