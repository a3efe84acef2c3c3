"""`python -m dsslm.export CHECKPOINT_OR_RUN_DIR --out HF_DIR [--dtype fp32|bf16] [--no-check]`

Writes a folder `transformers.AutoModelForCausalLM.from_pretrained(HF_DIR)` and
`AutoTokenizer.from_pretrained(HF_DIR)` load with no custom code: config.json (LlamaForCausalLM,
or Qwen3ForCausalLM for model.qk_norm=true), model.safetensors (sharded past --max-shard-size
with the standard index), generation_config.json, the tokenizer files (the byte tokenizer as an
equivalent `tokenizers` definition), and dsslm_export.json (where it came from, the parity
figures, every file's SHA-256).

The parity check runs by default: transformers loads the written folder and runs a fixed probe
batch next to dsslm's model; unless the largest absolute logit difference is within 1e-4 (fp32
compute on the exported values) and both tokenizers give the same ids on a probe text, the
export fails with exit 2. Everything is written into a temporary folder beside HF_DIR and renamed
into place only after the check, so HF_DIR never looks complete when it failed. An existing
HF_DIR must be empty: a previous export is refused like any other folder (its checkpoint may be
gone by now; remove it yourself if you mean to replace it).
"""
from __future__ import annotations

import sys
from pathlib import Path

from dsslm.ckpt.format import CheckpointError
from dsslm.ckpt.trained import OneLineParser, ToolError
from dsslm.config import ConfigError
from dsslm.data import DataError
from dsslm.hf.write import DTYPES, FP32_TOLERANCE, export, quiet_transformers


def main(argv: list[str] | None = None) -> int:
    parser = OneLineParser(prog="python -m dsslm.export", description=__doc__.split("\n\n")[1])
    parser.add_argument("source", metavar="CHECKPOINT_OR_RUN_DIR")
    parser.add_argument("--out", required=True, metavar="HF_DIR", help="a new or empty folder")
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="fp32", help="of the exported weights")
    parser.add_argument("--no-check", action="store_true", help="skip the parity check (not recommended)")
    parser.add_argument("--data", default=None, metavar="DATA_DIR",
                        help="where the run's tokenizer is, if not at the run's data.dir")
    parser.add_argument("--max-shard-size", default="5GB", help="split model.safetensors past this (default 5GB)")
    args = parser.parse_args(argv)
    quiet_transformers()
    try:
        record = export(args.source, Path(args.out), args.dtype, not args.no_check, args.data, args.max_shard_size)
    except (ToolError, ConfigError, DataError, CheckpointError, OSError) as exc:
        print(f"dsslm.export: error: {' '.join(str(exc).split())}", file=sys.stderr)
        return 2
    parity = record["parity"]
    figures = (f"max |logit diff| fp32 {parity['max_abs_logit_diff_fp32']:.3g} (tolerance {FP32_TOLERANCE:g}), "
               f"bf16 {parity['max_abs_logit_diff_bf16']:.3g} (dsslm's own bf16: {parity['dsslm_own_bf16_diff']:.3g}), "
               f"tokenizer ids equal" if isinstance(parity, dict) else "parity check skipped")
    if "document_mask" in record:
        print(f"dsslm.export: warning: {record['document_mask']}", file=sys.stderr)
    print(f"exported step {record['step']} of {record['checkpoint']} to {args.out}: {record['architecture']}, "
          f"{record['dtype']}, in {record['total_s']:.1f}s; {figures}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
