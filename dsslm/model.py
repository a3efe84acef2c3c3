"""Llama-style decoder: RMSNorm (fp32 variance), RoPE, SwiGLU, causal SDPA, optional QK-norm.

A pure nn.Module: it imports nothing distributed and never learns that an engine shards it.
`forward` returns fp32 logits; the loss lives in `dsslm.loss`.
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from dsslm.config import ModelCfg


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-6):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # The mean of squares in bf16 loses about 3 significant digits; do it in fp32.
        x32 = x.float()
        normed = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return (normed * self.weight.float()).to(x.dtype)


def rope_tables(seq_len: int, head_dim: int, theta: float) -> tuple[torch.Tensor, torch.Tensor]:
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim))
    angles = torch.outer(torch.arange(seq_len, dtype=torch.float64), inv_freq)
    return angles.cos().float(), angles.sin().float()


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    # x: [batch, heads, seq, head_dim]; rotate pairs (even, odd) in fp32.
    x32 = x.float()
    even, odd = x32[..., 0::2], x32[..., 1::2]
    rotated = torch.stack((even * cos - odd * sin, even * sin + odd * cos), dim=-1)
    return rotated.flatten(-2).to(x.dtype)


class Attention(nn.Module):
    def __init__(self, cfg: ModelCfg):
        super().__init__()
        self.n_heads = cfg.n_heads
        self.head_dim = cfg.d_model // cfg.n_heads
        self.qkv = nn.Linear(cfg.d_model, 3 * cfg.d_model, bias=False)
        self.proj = nn.Linear(cfg.d_model, cfg.d_model, bias=False)
        self.q_norm = RMSNorm(self.head_dim) if cfg.qk_norm else None
        self.k_norm = RMSNorm(self.head_dim) if cfg.qk_norm else None
        self.dropout = cfg.dropout

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        batch, seq, dim = x.shape
        q, k, v = self.qkv(x).view(batch, seq, 3, self.n_heads, self.head_dim).permute(2, 0, 3, 1, 4)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        # SDPA computes its softmax in fp32 internally, whatever the input dtype.
        out = F.scaled_dot_product_attention(
            q, k, v, is_causal=True, dropout_p=self.dropout if self.training else 0.0)
        return self.proj(out.transpose(1, 2).reshape(batch, seq, dim))


class SwiGLU(nn.Module):
    def __init__(self, cfg: ModelCfg):
        super().__init__()
        hidden = cfg.ffn_hidden or 64 * math.ceil(8 * cfg.d_model / 3 / 64)
        self.gate_up = nn.Linear(cfg.d_model, 2 * hidden, bias=False)
        self.down = nn.Linear(hidden, cfg.d_model, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up(x).chunk(2, dim=-1)
        return self.down(F.silu(gate) * up)


class Block(nn.Module):
    def __init__(self, cfg: ModelCfg):
        super().__init__()
        self.attn_norm = RMSNorm(cfg.d_model)
        self.attn = Attention(cfg)
        self.mlp_norm = RMSNorm(cfg.d_model)
        self.mlp = SwiGLU(cfg)
        self.drop = nn.Dropout(cfg.dropout)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        x = x + self.drop(self.attn(self.attn_norm(x), cos, sin))
        return x + self.drop(self.mlp(self.mlp_norm(x)))


class Transformer(nn.Module):
    def __init__(self, cfg: ModelCfg):
        super().__init__()
        if cfg.vocab_size < 1:
            raise ValueError("model.vocab_size must be set (from the data manifest) before building")
        self.cfg = cfg
        self.tok_emb = nn.Embedding(cfg.vocab_size, cfg.d_model)
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layers))
        self.norm = RMSNorm(cfg.d_model)
        self.lm_head = nn.Linear(cfg.d_model, cfg.vocab_size, bias=False)
        if cfg.tie_embeddings:
            self.lm_head.weight = self.tok_emb.weight
        cos, sin = rope_tables(cfg.seq_len, cfg.d_model // cfg.n_heads, cfg.rope_theta)
        # Not persistent: recomputed from the config, so checkpoints hold only learned tensors.
        self.register_buffer("rope_cos", cos, persistent=False)
        self.register_buffer("rope_sin", sin, persistent=False)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        std = self.cfg.init_std
        # Residual projections scaled by 1/sqrt(2 * n_layers) (GPT-2) so the residual stream's
        # variance does not grow with depth.
        resid_std = std / math.sqrt(2 * self.cfg.n_layers)
        for name, param in self.named_parameters():
            if param.dim() < 2:
                nn.init.ones_(param)
            elif name.endswith(("attn.proj.weight", "mlp.down.weight")):
                nn.init.normal_(param, 0.0, resid_std)
            else:
                nn.init.normal_(param, 0.0, std)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        seq = idx.shape[1]
        cos, sin = self.rope_cos[:seq], self.rope_sin[:seq]
        x = self.tok_emb(idx)
        for block in self.blocks:
            x = block(x, cos, sin)
        # Logits in fp32: the softmax over a large vocabulary is where bf16 hurts most.
        return self.lm_head(self.norm(x)).float()


LAYER_GROUPS = ("embeddings", "attention", "mlp", "norms", "head", "other")


def layer_group(name: str) -> str:
    """The layer group of a parameter of dsslm.model.Transformer, by its name."""
    parts = name.split(".")
    if any(p.endswith("norm") for p in parts[:-1]):  # attn_norm, mlp_norm, q_norm, k_norm, final norm
        return "norms"
    if parts[0] == "tok_emb":
        return "embeddings"
    if parts[0] == "lm_head":  # present only when untied: full_state names a tied tensor once
        return "head"
    return "attention" if "attn" in parts else "mlp" if "mlp" in parts else "other"


def count_params(model: nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())


def build_model(cfg: ModelCfg) -> Transformer:
    return Transformer(cfg)
