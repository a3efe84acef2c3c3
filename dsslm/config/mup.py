"""The width- and depth-transferable parametrisation (`model.mup_base_width`, `model.mup_base_depth`)
as pure functions of the model's config: one definition the model, the optimizer's groups and the
Hugging Face export read (docs/mup.md says why each rule is what it is).

Width: muP for Adam (Tensor Programs V, Yang et al. 2022, arXiv 2203.03466), in the formulation
with an output multiplier (TP5's Table 8, the `mup` package's MuReadout / MuSharedReadout), with
m = d_model / mup_base_width:
- hidden matrices (attention q/k/v/out, MLP gate/up/down): init std x 1/sqrt(m) (variance by fan-in,
  today's init_std at the base width), Adam rate x 1/m (and weight decay x m: the fraction of a
  matrix decayed per step, rate x decay, stays the base width's, as the `mup` package's MuAdamW);
- output logits x 1/m (the head's, tied or not, init and rate unchanged);
- attention scores x sqrt(b) / d_head with b = mup_base_width / n_heads, the head dimension of the
  base width at this head count: 1/d_head as muP asks, and at the base width 1/sqrt(d_head);
- the embedding, norm gains and biases: unchanged.

Depth: depth-muP (Tensor Programs VI, Yang, Yu, Zhu & Hayou 2023, arXiv 2310.02244; the alpha = 1/2
member of CompleteP's family, Dey et al. 2025, arXiv 2505.01618), with r = n_layers / mup_base_depth:
- each residual branch (attention, MLP) x 1/sqrt(r), and the residual projections initialised at the
  base depth's std (init_std / sqrt(2 mup_base_depth)), so the initial function matches SP's;
- the hidden matrices' rate (AdamW's or Muon's) x 1/sqrt(r) (decay x sqrt(r), as above).

Muon's update is already shaped for width (orthogonalised, then scaled by sqrt(max(1, rows/cols)):
its spectral norm does not grow with width, which is what muP's 1/m does for Adam), so Muon's
hidden matrices take the depth factor only; the roles AdamW trains take their muP rates.

With both keys 0 (the default) every function here returns the neutral value and the callers skip
the operation: the standard parametrisation, bit for bit. At mup_base_width == d_model and
mup_base_depth == n_layers every factor is exactly 1 and the model is SP's too.
"""
from __future__ import annotations

import math

from dsslm.config.keys import ModelCfg


def enabled(cfg: ModelCfg) -> bool:
    return bool(cfg.mup_base_width or cfg.mup_base_depth)


def width_mult(cfg: ModelCfg) -> float:
    """m = d_model / mup_base_width (1 when the width rule is off)."""
    return cfg.d_model / cfg.mup_base_width if cfg.mup_base_width else 1.0


def depth_mult(cfg: ModelCfg) -> float:
    """r = n_layers / mup_base_depth (1 when the depth rule is off)."""
    return cfg.n_layers / cfg.mup_base_depth if cfg.mup_base_depth else 1.0


def hidden_init_scale(cfg: ModelCfg) -> float:
    """The hidden matrices' init std relative to SP's: 1/sqrt(m) (fan-in variance; exactly 1 at the base)."""
    return math.sqrt(cfg.mup_base_width / cfg.d_model) if cfg.mup_base_width else 1.0


def residual_init_layers(cfg: ModelCfg) -> int:
    """The depth the residual projections' init std is taken at (GPT-2's 1/sqrt(2 L)): the model's
    own under SP; the base depth under the depth rule, whose branch multiplier scales with depth instead."""
    return cfg.mup_base_depth or cfg.n_layers


def output_mult(cfg: ModelCfg) -> float | None:
    """The logits' multiplier 1/m, or None where it is 1 (nothing to multiply)."""
    m = width_mult(cfg)
    return None if m == 1.0 else 1.0 / m


def attention_scale(cfg: ModelCfg) -> float | None:
    """SDPA's scale: sqrt(mup_base_width / n_heads) / d_head, or None for SDPA's own 1/sqrt(d_head)
    (off, or at the base width, where the two are one number)."""
    if not cfg.mup_base_width or cfg.mup_base_width == cfg.d_model:
        return None
    return math.sqrt(cfg.mup_base_width / cfg.n_heads) / (cfg.d_model // cfg.n_heads)


def branch_mult(cfg: ModelCfg) -> float | None:
    """Each residual branch's multiplier 1/sqrt(r), or None where it is 1."""
    r = depth_mult(cfg)
    return None if r == 1.0 else 1.0 / math.sqrt(r)


def lr_mults(cfg: ModelCfg, muon: bool = False) -> dict[str, float]:
    """Each optimizer role's muP multiplier of its rate (times optim.lr_<role>): the hidden matrices'
    1/m (AdamW only) x 1/sqrt(r); every other role 1."""
    hidden = 1.0 if muon else 1.0 / width_mult(cfg)
    if cfg.mup_base_depth:
        hidden /= math.sqrt(depth_mult(cfg))
    return {"embedding": 1.0, "hidden": hidden, "head": 1.0, "scalars": 1.0}
