"""`python -m dsslm.data prepare --input PATH [PATH ...] --out DATA_DIR [--domain NAME] ...`

One command does every step. Across processes: `--workers N`. Across tasks or nodes (slurm/prepare.sbatch):
`--tokenizer-only` once, then `--part I/N` in each of N tasks, then `--merge` once; the DATA_DIR is the
same bytes either way."""
from __future__ import annotations

import argparse
import sys
import time

from dsslm.config import join_problems
from dsslm.data.parts import Part, parse_part
from dsslm.data.prepare import (DEFAULT_VOCAB_SIZE, TOKENIZER_SAMPLE_BYTES, DataError, arg_problems, merge, prepare,
                                prepare_part, prepare_tokenizer, quiet_datasets, step_problems)


class _Parser(argparse.ArgumentParser):
    def error(self, message):  # one line on stderr, not argparse's usage block
        self.exit(2, f"{self.prog}: error: {message}; see --help\n")


def _parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="python -m dsslm.data", description="stream text into token shards plus a manifest")
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("prepare", help="tokenize text into DATA_DIR as one domain")
    p.add_argument("--input", nargs="+", required=True,
                   help="text/JSONL/JSON/Parquet files, folders of them, save_to_disk folders")
    p.add_argument("--out", required=True, help="DATA_DIR (created, or extended with a new domain)")
    p.add_argument("--domain", default="default", help="a name per source of text; each gets its own val split")
    p.add_argument("--tokenizer", default=None,
                   help="byte (default for a new DATA_DIR), bpe, or the path of a tokenizer.json (or a folder "
                        "holding one, e.g. a Hugging Face model folder): the model you continue pretraining")
    p.add_argument("--vocab-size", type=int, default=None,
                   help=f"bpe, new DATA_DIR only (a later domain reuses its tokenizer); default {DEFAULT_VOCAB_SIZE}")
    p.add_argument("--val-fraction", type=float, default=0.01, help="share of token blocks held out (0 allowed)")
    p.add_argument("--text-field", default="text", help="the field holding the text in JSON/Parquet records")
    p.add_argument("--tokenizer-sample", type=int, default=TOKENIZER_SAMPLE_BYTES, metavar="BYTES",
                   help="bpe: trained on the first BYTES of document text, in input order (default 1 GiB)")
    p.add_argument("--workers", type=int, default=1,
                   help="processes tokenizing input files at once (default 1: this one); the output is the same")
    steps = p.add_mutually_exclusive_group()
    steps.add_argument("--tokenizer-only", action="store_true",
                       help="step 1 of a split prepare: make the tokenizer (train a BPE) and stop")
    steps.add_argument("--part", default=None, metavar="I/N",
                       help="step 2: tokenize this task's share of the input files (file run u when u %% N == I) "
                            "into DATA_DIR/.parts-DOMAIN, and stop; e.g. --part $SLURM_PROCID/$SLURM_NTASKS")
    steps.add_argument("--merge", action="store_true",
                       help="step 3: every part into the domain's shards and the manifest (refused while a part is "
                            "missing)")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    started = time.perf_counter()
    try:
        # Before `datasets` is imported (seconds): a mistyped name or path is answered at once.
        part = parse_part(args.part) if args.part is not None else None
        problems = arg_problems(args.domain, args.tokenizer, args.vocab_size, args.val_fraction, args.input)
        problems += step_problems(args.workers, args.tokenizer_sample) + ([part] if isinstance(part, str) else [])
        if problems:
            raise DataError(join_problems(problems))
        quiet_datasets()
        common = dict(domain=args.domain, tokenizer=args.tokenizer, vocab_size=args.vocab_size,
                      text_field=args.text_field)
        if args.tokenizer_only:
            tok = prepare_tokenizer(args.input, args.out, tokenizer_sample=args.tokenizer_sample, **common)
            print(f"tokenizer for {args.out}: {tok.kind}, vocab {tok.vocab_size}, sha256 {tok.sha256[:12]} in "
                  f"{time.perf_counter() - started:.1f}s; next: the --part I/N tasks, then --merge")
            return 0
        if isinstance(part, Part):
            done, n_units = prepare_part(args.input, args.out, part, workers=args.workers, **common)
            mine = part.units(n_units)
            print(f"prepared part {part} of domain {args.domain!r} in {args.out}: {len(mine)} of {n_units} units "
                  f"({len(done.made)} made, {len(done.reused)} reused), {done.tokens} tokens in "
                  f"{time.perf_counter() - started:.1f}s; --merge once every part is done")
            return 0
        if args.merge:
            manifest = merge(args.input, args.out, val_fraction=args.val_fraction, **common)
        else:
            manifest = prepare(args.input, args.out, val_fraction=args.val_fraction, workers=args.workers,
                               tokenizer_sample=args.tokenizer_sample, **common)
    except DataError as e:
        print(f"dsslm.data: error: {' '.join(str(e).split())}", file=sys.stderr)
        return 2
    entry = manifest["domains"][args.domain]
    n_train = sum(s["tokens"] for s in entry["train"])
    n_val = sum(s["tokens"] for s in entry["val"])
    seconds = time.perf_counter() - started
    print(f"prepared domain {args.domain!r} in {args.out}: {n_train} train + {n_val} val tokens "
          f"({manifest['tokenizer']['kind']}, vocab {manifest['tokenizer']['vocab_size']}) in {seconds:.1f}s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
