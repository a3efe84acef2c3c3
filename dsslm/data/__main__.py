"""`python -m dsslm.data prepare --input PATH [PATH ...] --out DATA_DIR [--domain NAME] ...`"""
from __future__ import annotations

import argparse
import sys
import time

from dsslm.config import join_problems
from dsslm.data.prepare import DEFAULT_VOCAB_SIZE, DataError, arg_problems, prepare, quiet_datasets


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
    return parser


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    started = time.perf_counter()
    try:
        # Before `datasets` is imported (seconds): a mistyped name or path is answered at once.
        problems = arg_problems(args.domain, args.tokenizer, args.vocab_size, args.val_fraction, args.input)
        if problems:
            raise DataError(join_problems(problems))
        quiet_datasets()
        manifest = prepare(args.input, args.out, domain=args.domain, tokenizer=args.tokenizer,
                           vocab_size=args.vocab_size, val_fraction=args.val_fraction, text_field=args.text_field)
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
