"""`python -m dsslm.sample CHECKPOINT_OR_RUN_DIR --prompt TEXT [--max-new-tokens N] [--temperature T]
[--top-k K] [--seed S]`

Text from a checkpoint in one command (nanoGPT's sample.py). The prompt is encoded with the run's
tokenizer; each next token is drawn from softmax(logits / T) over the K most likely ids (T=0: the
most likely one), until EOS or N new tokens. The draws come from one torch.Generator seeded with
--seed, so the same command on the same device prints the same text. The model sees the last
model.seq_len tokens; there is no KV cache, so each token costs one forward over that window
(milliseconds at the sizes dsslm trains, on CPU too).
"""
from __future__ import annotations

import sys

import torch

from dsslm.ckpt.format import CheckpointError
from dsslm.config import ConfigError
from dsslm.data import DataError
from dsslm.precision import autocast
from dsslm.ckpt.trained import OneLineParser, ToolError, Trained, open_trained, pick_device, tokenizer_of


@torch.no_grad()
def generate(trained: Trained, prompt_ids: list[int], max_new_tokens: int, temperature: float, top_k: int,
             eos_id: int, seed: int) -> list[int]:
    """The new ids only (EOS, if drawn, included)."""
    cfg, device = trained.cfg, trained.device
    generator = torch.Generator(device=device).manual_seed(seed)
    ids = torch.tensor([prompt_ids or [eos_id]], device=device)  # no prompt: start a new document
    new: list[int] = []
    # bf16 on a GPU where the run trained in it; fp32 on CPU, where autocast only slows things down.
    precision = cfg.train.precision if device.type == "cuda" else "fp32"
    for _ in range(max_new_tokens):
        with autocast(precision, device):
            logits = trained.model(ids[:, -cfg.model.seq_len:])[0, -1, :cfg.model.vocab_size].float()
        if temperature == 0:
            next_id = int(logits.argmax())
        else:
            # In float64 and from the largest: a tiny temperature (1e-300) overflowed float32 to
            # inf, and softmax of infs is NaN; here it is the argmax's one-hot, as it should be.
            logits = (logits.double() - logits.max().double()) / temperature
            if 0 < top_k < logits.numel():
                kth = torch.topk(logits, top_k).values[-1]
                logits = logits.masked_fill(logits < kth, float("-inf"))
            next_id = int(torch.multinomial(torch.softmax(logits, dim=-1), 1, generator=generator))
        new.append(next_id)
        if next_id == eos_id:
            break
        ids = torch.cat([ids, torch.tensor([[next_id]], device=device)], dim=1)
    return new


def main(argv: list[str] | None = None) -> int:
    parser = OneLineParser(prog="python -m dsslm.sample", description=__doc__.split("\n\n")[1])
    parser.add_argument("source", metavar="CHECKPOINT_OR_RUN_DIR")
    parser.add_argument("--prompt", required=True, help='the text to continue ("" starts a new document)')
    parser.add_argument("--max-new-tokens", type=int, default=200)
    parser.add_argument("--temperature", type=float, default=0.8, help="0 = always the most likely token")
    parser.add_argument("--top-k", type=int, default=200, help="draw among the K most likely (0 = all)")
    parser.add_argument("--seed", type=int, default=1337)
    parser.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto")
    parser.add_argument("--data", default=None, metavar="DATA_DIR",
                        help="where the run's tokenizer is, if not at the run's data.dir")
    args = parser.parse_args(argv)
    for name, value, ok in (("--max-new-tokens", args.max_new_tokens, 0 <= args.max_new_tokens <= 10**6),
                            ("--temperature", args.temperature, 0 <= args.temperature < float("inf")),
                            ("--top-k", args.top_k, args.top_k >= 0), ("--seed", args.seed, 0 <= args.seed < 2**64)):
        if not ok:
            parser.error(f"{name} {value} is out of range")
    try:
        args.prompt.encode("utf-8")  # before any loading; `tokenizers` raises TypeError, not UnicodeError
        trained = open_trained(args.source, pick_device(args.device))
        tok = tokenizer_of(trained, args.data)
        prompt_ids = tok.encode(args.prompt)
        new = generate(trained, prompt_ids, args.max_new_tokens, args.temperature, args.top_k, tok.eos_id, args.seed)
    except UnicodeError:  # a shell passes bytes that are not UTF-8 as surrogates
        print("dsslm.sample: error: --prompt is not valid UTF-8 text; pass UTF-8", file=sys.stderr)
        return 2
    except (ToolError, ConfigError, DataError, CheckpointError) as exc:
        print(f"dsslm.sample: error: {' '.join(str(exc).split())}", file=sys.stderr)
        return 2
    print(tok.decode(prompt_ids + new), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
