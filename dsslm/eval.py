"""`python -m dsslm.eval CHECKPOINT_OR_RUN_DIR [--data DATA_DIR] [--batches N] [--batch-size B]`

Validation loss per domain (nats per target token) and bits per byte, of any checkpoint on any
prepared DATA_DIR that uses the run's tokenizer (another tokenizer exits 2: its ids would mean
other text). It is the pass training runs (`loss.validation_sums` on each domain's held-out split)
with the run's batch size, number of batches and precision unless told otherwise, so on the run's
own data and device it reproduces the val_loss training logged at that step. Bits per byte is the
loss in bits times tokens over the bytes of text those tokens stand for: it compares across
tokenizers (a byte run and a BPE run on the same text). Printed as a table, then as one JSON line.
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

from dsslm.ckpt.format import CheckpointError
from dsslm.config import ConfigError
from dsslm.data import DataError, Loader
from dsslm.data.bytecount import ByteCounter
from dsslm.durable import write_json_atomic
from dsslm.loss import validation_sums
from dsslm.ckpt.trained import OneLineParser, ToolError, Trained, open_data, open_trained, pick_device


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
                               trained.device, lambda targets: counter.count(domain, targets))
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


def main(argv: list[str] | None = None) -> int:
    parser = OneLineParser(prog="python -m dsslm.eval", description=__doc__.split("\n\n")[1])
    parser.add_argument("source", metavar="CHECKPOINT_OR_RUN_DIR")
    parser.add_argument("--data", default=None, metavar="DATA_DIR", help="default: the run's own data.dir")
    parser.add_argument("--batches", type=int, default=None, help="per domain (default: the run's run.val_batches)")
    parser.add_argument("--batch-size", type=int, default=None, help="default: the run's train.micro_batch_size")
    parser.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto")
    parser.add_argument("--json", default=None, metavar="FILE", help="also write the result to FILE")
    args = parser.parse_args(argv)
    for name, value in (("--batches", args.batches), ("--batch-size", args.batch_size)):
        if value is not None and value < 1:
            parser.error(f"{name} {value} must be >= 1")
    try:
        result = evaluate(open_trained(args.source, pick_device(args.device)), args.data, args.batches,
                          args.batch_size)
    except (ToolError, ConfigError, DataError, CheckpointError) as exc:
        print(f"dsslm.eval: error: {' '.join(str(exc).split())}", file=sys.stderr)
        return 2
    print(table(result))
    print(json.dumps(result), flush=True)
    if args.json:
        write_json_atomic(Path(args.json), result, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
