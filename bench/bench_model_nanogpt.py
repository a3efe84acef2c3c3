"""The models alone: one forward, backward and AdamW step of dsslm's Transformer against nanoGPT's
GPT at nanoGPT's CPU recipe shape (4 layers, 4 heads, d 128, context 64, batch 12, vocabulary 257,
fp32, one thread), with no trainer around either. Tells the model's share of the gap that
`bench_nanogpt.py` measures end to end from the trainer's.

    OMP_NUM_THREADS=1 .venv/bin/python bench/bench_model_nanogpt.py --nanogpt ~/src/nanoGPT [--rounds 5] [--ablate]

Variants: dsslm as shipped (vocabulary padded to 64: 320 rows; SwiGLU hidden 384), with
`model.vocab_pad_to=1` (257 rows, as nanoGPT), and with `model.ffn_hidden=344` too (SwiGLU's three
matrices hold as many weights as nanoGPT's 4x GELU MLP). `--ablate` adds dsslm with nanoGPT's
pieces in place of its own, one at a time and all together: LayerNorm for RMSNorm, the 4x GELU
MLP for SwiGLU, no RoPE (nanoGPT's learned positions are left out: one add; with QK-norm on, as
configs/tiny.yaml has it, "no-rope" drops the QK-norm too, since both live in the split of the
heads), and without QK-norm alone (`model.qk_norm=false`). What is left between "all three" and
nanoGPT is the rest of the step (the loss, the optimizer, the head). Per variant:
the median over rounds of the process CPU time per step (50 steps a round, after 5 warm-up
steps), and nanoGPT's CPU time over it (a tokens/s ratio). Rounds alternate the variants, so
load hits them alike.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
import types
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from dsslm.config import load
from dsslm.loss import token_losses
from dsslm.model import build_model

BATCH, CONTEXT, VOCAB = 12, 64, 257


def nanogpt_step(nanogpt_dir: Path):
    sys.path.insert(0, str(nanogpt_dir))
    from model import GPT, GPTConfig  # nanoGPT's model.py
    model = GPT(GPTConfig(block_size=CONTEXT, vocab_size=VOCAB, n_layer=4, n_head=4, n_embd=128, dropout=0.0,
                          bias=False))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, betas=(0.9, 0.99))

    def step(inputs: torch.Tensor, targets: torch.Tensor) -> None:
        _, loss = model(inputs, targets)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    return step


class GeluMLP(nn.Module):
    """nanoGPT's MLP: 4x wide, GELU, no bias (as its recipe sets bias=False)."""

    def __init__(self, dim: int):
        super().__init__()
        self.c_fc, self.c_proj = nn.Linear(dim, 4 * dim, bias=False), nn.Linear(4 * dim, dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.c_proj(F.gelu(self.c_fc(x)))


def split_without_rope(attn: nn.Module, qkv: torch.Tensor, rope: torch.Tensor) -> tuple[torch.Tensor, ...]:
    batch, seq, _ = qkv.shape
    q, k, v = qkv.view(batch, seq, 3, attn.n_heads, attn.head_dim).unbind(2)
    return q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)


def swap_in_nanogpt_pieces(model: nn.Module, pieces: set[str]) -> None:
    dim = model.cfg.d_model
    if "layernorm" in pieces:
        model.norm = nn.LayerNorm(dim, bias=False)
    for block in model.blocks:
        if "layernorm" in pieces:
            block.attn_norm, block.mlp_norm = nn.LayerNorm(dim, bias=False), nn.LayerNorm(dim, bias=False)
        if "gelu" in pieces:
            block.mlp = GeluMLP(dim)
        if "no-rope" in pieces:
            block.attn.split_heads = types.MethodType(split_without_rope, block.attn)


def dsslm_step(*overrides: str, pieces: frozenset[str] = frozenset()):
    cfg = load(None, ["model.d_model=128", "model.n_layers=4", "model.n_heads=4", f"model.seq_len={CONTEXT}",
                      f"model.vocab_size={VOCAB}", "model.dropout=0.0", *overrides])
    model = build_model(cfg.model)
    swap_in_nanogpt_pieces(model, pieces)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, betas=(0.9, 0.99), fused=True)  # optim.impl=auto

    def step(inputs: torch.Tensor, targets: torch.Tensor) -> None:
        ce, z = token_losses(model(inputs), targets)
        ((ce + cfg.train.z_loss * z) / targets.numel()).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    return step


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--nanogpt", type=Path, required=True, help="a nanoGPT checkout (its model.py)")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--steps", type=int, default=50)
    parser.add_argument("--ablate", action="store_true", help="also dsslm with nanoGPT's norm, MLP, no RoPE, no QK-norm")
    args = parser.parse_args()
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    torch.manual_seed(0)
    variants = {"nanoGPT": nanogpt_step(args.nanogpt), "dsslm": dsslm_step(),
                "dsslm vocab_pad_to=1": dsslm_step("model.vocab_pad_to=1"),
                "dsslm vocab_pad_to=1 ffn_hidden=344": dsslm_step("model.vocab_pad_to=1", "model.ffn_hidden=344")}
    if args.ablate:
        variants["dsslm model.qk_norm=false"] = dsslm_step("model.qk_norm=false")
        for pieces in (("layernorm",), ("gelu",), ("no-rope",), ("layernorm", "gelu", "no-rope")):
            variants["dsslm + " + " + ".join(pieces)] = dsslm_step(pieces=frozenset(pieces))
    inputs, targets = torch.randint(0, VOCAB, (BATCH, CONTEXT)), torch.randint(0, VOCAB, (BATCH, CONTEXT))
    cpu_ms: dict[str, list[float]] = {name: [] for name in variants}
    print(f"load average before: {os.getloadavg()}")
    for _ in range(args.rounds):
        for name, step in variants.items():
            for _ in range(5):
                step(inputs, targets)
            started = time.process_time()
            for _ in range(args.steps):
                step(inputs, targets)
            cpu_ms[name].append(1000 * (time.process_time() - started) / args.steps)
    base = statistics.median(cpu_ms["nanoGPT"])
    for name, values in cpu_ms.items():
        print(f"{name:44s} {statistics.median(values):7.2f} ms CPU a step  nanoGPT/this {base / statistics.median(values):.3f}"
              f"  rounds {[round(v, 1) for v in values]}")
    print(f"load average after: {os.getloadavg()}")


if __name__ == "__main__":
    main()
