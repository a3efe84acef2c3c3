"""Llama-style decoder: RMSNorm (fp32 variance), RoPE, SwiGLU, causal SDPA, optional QK-norm.

A pure nn.Module: it imports nothing distributed and never learns that an engine shards it
(compilation and activation checkpointing are applied from outside, by the engines).
`forward` returns fp32 logits; the loss lives in `dsslm.loss`. With model.mup_base_width /
mup_base_depth set, muP's init, attention scale, output and branch multipliers (dsslm.config.mup;
off, not one operation differs from the standard parametrisation).

Shapes (the rule a checkpoint reader or exporter relies on):
- `tok_emb.weight` and `lm_head.weight` have `padded_vocab(vocab_size, vocab_pad_to)` rows: the
  vocabulary rounded up to a multiple of `model.vocab_pad_to` (64 by default; 1 = no padding),
  so the head's matmul has a GPU-friendly width. Rows `vocab_size..padded` are never looked up
  (token ids are `< vocab_size`) and never reach the output: `forward` returns logits for the
  first `vocab_size` rows only, so the loss, z-loss, validation and sampling never see them, and
  their gradient is exactly 0. An exporter keeps the first `vocab_size` rows.
- RoPE rotates the pairs (x[2i], x[2i+1]) of every head (the interleaved / GPT-J convention, not
  Hugging Face's rotate-half): pair i of position p turns by p * theta^(-2i/head_dim).
"""
from __future__ import annotations

import functools
import math

import torch
import torch.nn.functional as F
from torch import nn

from dsslm.config import ModelCfg, ffn_hidden_of
from dsslm.config import mup


class _RMSNormFn(torch.autograd.Function):
    """y = x / rms(x) * w with the backward written out, statistics in fp32 whatever the input
    dtype. On a CPU these small elementwise passes are bound by memory, not arithmetic, so the
    code counts fresh full-size tensors: forward writes one (the output; the mean of squares is
    a reduction that writes none) and saves x, not x / rms(x); backward writes two and works in
    place on them. Autograd of the formula writes about 13."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        out, rstd = _rms_forward(x, weight, eps)
        ctx.save_for_backward(x, rstd, weight)
        return out

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        x, rstd, weight = ctx.saved_tensors
        grad_x, grad_w = _rms_backward(x, rstd, weight, grad.float())
        return grad_x.to(grad.dtype), grad_w.to(weight.dtype), None


def _rms_forward(x: torch.Tensor, weight: torch.Tensor, eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    x32 = x.float()
    # ||x||^2 / dim is the mean of squares (to an ulp), reduced without a squared copy of x.
    rstd = torch.linalg.vector_norm(x32, dim=-1, keepdim=True).square_().div_(x.shape[-1]).add_(eps).rsqrt_()
    return (x32 * rstd).mul_(weight).to(x.dtype), rstd


def _rms_backward(x: torch.Tensor, rstd: torch.Tensor, weight: torch.Tensor,
                  grad32: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(grad of x in fp32, grad of the gain in fp32) for the fp32 output gradient `grad32`."""
    normed = x.float() * rstd
    scaled = grad32 * weight
    # d/dx of x * rstd: rstd * (g - x_hat * mean(g * x_hat)), with g the weight-scaled grad.
    coef = (scaled * normed).sum(-1, keepdim=True).div_(-x.shape[-1])
    grad_x = scaled.addcmul_(normed, coef).mul_(rstd)
    return grad_x, normed.mul_(grad32).flatten(0, -2).sum(0)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-6):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # The mean of squares in bf16 loses about 3 significant digits; do it in fp32.
        return _RMSNormFn.apply(x, self.weight, self.eps)


def padded_vocab(vocab_size: int, pad_to: int) -> int:
    """Rows of the embedding and head: `vocab_size` rounded up to a multiple of `pad_to`."""
    return -(-vocab_size // pad_to) * pad_to


def rope_table(seq_len: int, head_dim: int, theta: float) -> torch.Tensor:
    """e^{i p theta_j} for position p and pair j, complex64 [seq_len, 1, head_dim // 2]: the
    layout `apply_rope` broadcasts over [batch, seq, heads, pairs] without a reshape.
    Angles in fp64, so position 2^15 is as exact as position 1."""
    inv_freq = theta ** (-torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim)
    angles = torch.outer(torch.arange(seq_len, dtype=torch.float64), inv_freq)
    return torch.polar(torch.ones_like(angles), angles).to(torch.complex64)[:, None, :]


def _as_pairs(x: torch.Tensor) -> torch.Tensor:
    """A complex view of the (even, odd) pairs of fp32 `x`'s last dimension (a copy only where
    the strides do not allow a view)."""
    pairs = x.unflatten(-1, (-1, 2))
    if pairs.stride(-1) != 1 or any(stride % 2 for stride in pairs.stride()[:-1]) or pairs.storage_offset() % 2:
        pairs = pairs.contiguous()
    return torch.view_as_complex(pairs)


def apply_rope(x: torch.Tensor, table: torch.Tensor) -> torch.Tensor:
    """Rotate the (even, odd) pairs of `x` [batch, seq, heads, head_dim] by `table[:seq]`, in fp32
    (a no-op cast for fp32 inputs).

    Eager: one complex multiply over a view of `x` as complex pairs (no stack, no flatten copy).
    Compiled: the same rotation in real arithmetic, which inductor fuses into one kernel (it
    generates no code for complex ops).
    """
    if table.dim() == 3:  # one position per column; a [batch, seq, 1, pairs] table is per token already
        table = table[: x.shape[1]]
    if torch.compiler.is_compiling():
        cos, sin = torch.view_as_real(table).unbind(-1)
        even, odd = x.float().unflatten(-1, (-1, 2)).unbind(-1)
        rotated = torch.stack((even * cos - odd * sin, even * sin + odd * cos), dim=-1)
        return rotated.flatten(-2).to(x.dtype)
    return torch.view_as_real(_as_pairs(x.float()) * table).flatten(-2).to(x.dtype)


class _SplitRopeFn(torch.autograd.Function):
    """The qkv projection's output [batch, seq, 3 * dim] to q, k, v [batch, heads, seq, head_dim]
    with RoPE on q and k: one complex multiply over q and k together forward, and a backward that
    writes the rotated-back q and k gradients and v's straight into the one qkv gradient
    (autograd's path rotates each, then stacks the three into a fresh tensor). Same arithmetic as
    `apply_rope`, so the same bits."""

    @staticmethod
    def forward(ctx, qkv: torch.Tensor, table: torch.Tensor, n_heads: int):
        batch, seq, width = qkv.shape
        heads = qkv.view(batch, seq, 3, n_heads, width // 3 // n_heads)
        # [seq, 1, pairs] or per token [batch, seq, 1, pairs]: a slot axis before the heads'.
        rotated = torch.view_as_real(_as_pairs(heads[:, :, :2].float()) * table.unsqueeze(-3)).flatten(-2)
        q, k = rotated.to(qkv.dtype).unbind(2)
        ctx.save_for_backward(table)
        ctx.heads_shape, ctx.dtype = heads.shape, qkv.dtype
        return q.transpose(1, 2), k.transpose(1, 2), heads[:, :, 2].transpose(1, 2)

    @staticmethod
    def backward(ctx, grad_q: torch.Tensor | None, grad_k: torch.Tensor | None, grad_v: torch.Tensor | None):
        table, = ctx.saved_tensors
        unused = grad_q is None or grad_k is None or grad_v is None  # an output that took no part in the loss
        grad = (torch.zeros if unused else torch.empty)(ctx.heads_shape, dtype=torch.float32, device=table.device)
        back = table.conj()  # the inverse rotation, [(batch,) seq, 1, pairs] against [batch, seq, heads, pairs]
        for slot, g in enumerate((grad_q, grad_k)):
            if g is not None:
                # The output must be a view of `grad` (a copy would drop the result): view_as_complex
                # raises rather than copies, and a slot of a fresh contiguous tensor always is one.
                into = torch.view_as_complex(grad[:, :, slot].unflatten(-1, (-1, 2)))
                torch.mul(_as_pairs(g.transpose(1, 2).float()), back, out=into)
        if grad_v is not None:
            grad[:, :, 2].copy_(grad_v.transpose(1, 2))
        return grad.flatten(2).to(ctx.dtype), None, None


class _SplitNormRopeFn(torch.autograd.Function):
    """`_SplitRopeFn` with QK-norm between the split and the rotation: each head's q and k
    RMS-normalised with its gain (`_RMSNormFn`'s arithmetic, rounded to the input dtype where
    autograd's path rounds), then rotated. One backward in place of autograd's unbind, two norms,
    two rotations and a stack (at d 128 on the CPU the step time moved inside the VM's noise)."""

    @staticmethod
    def forward(ctx, qkv: torch.Tensor, table: torch.Tensor, n_heads: int, q_gain: torch.Tensor,
                k_gain: torch.Tensor, eps: float):
        batch, seq, width = qkv.shape
        heads = qkv.view(batch, seq, 3, n_heads, width // 3 // n_heads)
        normed = torch.empty(heads[:, :, :2].shape, dtype=torch.float32, device=qkv.device)
        rstds = []
        for slot, gain in enumerate((q_gain, k_gain)):
            out, rstd = _rms_forward(heads[:, :, slot], gain, eps)
            normed[:, :, slot].copy_(out)
            rstds.append(rstd)
        rotated = torch.view_as_real(_as_pairs(normed) * table.unsqueeze(-3)).flatten(-2)
        q, k = rotated.to(qkv.dtype).unbind(2)
        ctx.save_for_backward(table, qkv, *rstds, q_gain, k_gain)
        ctx.n_heads = n_heads
        return q.transpose(1, 2), k.transpose(1, 2), heads[:, :, 2].transpose(1, 2)

    @staticmethod
    def backward(ctx, grad_q: torch.Tensor | None, grad_k: torch.Tensor | None, grad_v: torch.Tensor | None):
        table, qkv, rstd_q, rstd_k, q_gain, k_gain = ctx.saved_tensors
        batch, seq, width = qkv.shape
        heads = qkv.view(batch, seq, 3, ctx.n_heads, width // 3 // ctx.n_heads)
        unused = grad_q is None or grad_k is None or grad_v is None  # an output that took no part in the loss
        grad = (torch.zeros if unused else torch.empty)(heads.shape, dtype=torch.float32, device=qkv.device)
        gains: list[torch.Tensor | None] = [None, None]
        back = table.conj()
        for slot, (g, rstd, gain) in enumerate(((grad_q, rstd_q, q_gain), (grad_k, rstd_k, k_gain))):
            if g is None:
                continue
            # The rotation's backward, rounded to the dtype autograd's norm would receive.
            g_normed = torch.view_as_real(_as_pairs(g.transpose(1, 2).float()) * back).flatten(-2)
            grad_x, grad_gain = _rms_backward(heads[:, :, slot], rstd, gain, g_normed.to(qkv.dtype).float())
            grad[:, :, slot].copy_(grad_x.to(qkv.dtype))
            gains[slot] = grad_gain.to(gain.dtype)
        if grad_v is not None:
            grad[:, :, 2].copy_(grad_v.transpose(1, 2))
        return grad.flatten(2).to(qkv.dtype), None, None, gains[0], gains[1], None


class Attention(nn.Module):
    def __init__(self, cfg: ModelCfg):
        super().__init__()
        self.n_heads = cfg.n_heads
        self.head_dim = cfg.d_model // cfg.n_heads
        self.qkv = nn.Linear(cfg.d_model, 3 * cfg.d_model, bias=False)
        # Its rows stack three projections of equal height, in this order (hf/convert.py relies on
        # it too): an optimizer that treats each projection as its own matrix (Muon) reads this.
        self.qkv.stacked = ("q", "k", "v")
        self.proj = nn.Linear(cfg.d_model, cfg.d_model, bias=False)
        self.q_norm = RMSNorm(self.head_dim, cfg.norm_eps) if cfg.qk_norm else None
        self.k_norm = RMSNorm(self.head_dim, cfg.norm_eps) if cfg.qk_norm else None
        self.dropout = cfg.dropout
        # muP's 1/d_head (config.mup.attention_scale); None: SDPA's own 1/sqrt(d_head), as always.
        self.scale = mup.attention_scale(cfg)

    def split_heads(self, qkv: torch.Tensor, rope: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """q, k, v [batch, heads, seq, head_dim] from the qkv projection's output: QK-norm
        (when on) and RoPE on q and k. Eager: `_SplitRopeFn` (`_SplitNormRopeFn` with QK-norm),
        whose backward writes the three gradients into one tensor. Compiled: views of one [batch,
        seq, 3, heads, head_dim] tensor, so autograd gathers the three gradients with one stack."""
        if not torch.compiler.is_compiling():
            if self.q_norm is None:
                return _SplitRopeFn.apply(qkv, rope, self.n_heads)
            return _SplitNormRopeFn.apply(qkv, rope, self.n_heads, self.q_norm.weight, self.k_norm.weight,
                                          self.q_norm.eps)
        # QK-norm sits between the split and the rotation; inductor generates no complex code.
        batch, seq, _ = qkv.shape
        q, k, v = qkv.view(batch, seq, 3, self.n_heads, self.head_dim).unbind(2)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = apply_rope(q, rope), apply_rope(k, rope)
        return q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)

    def forward(self, x: torch.Tensor, rope: torch.Tensor, mask=None) -> torch.Tensor:
        batch, seq, dim = x.shape
        q, k, v = self.split_heads(self.qkv(x), rope)
        dropout = self.dropout if self.training else 0.0
        if mask is None:  # SDPA computes its softmax in fp32 internally, whatever the input dtype.
            out = F.scaled_dot_product_attention(q, k, v, is_causal=True, dropout_p=dropout, scale=self.scale)
        elif isinstance(mask, torch.Tensor):  # the dense [batch, 1, seq, seq] causal-and-same-document mask
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=dropout, scale=self.scale)
        else:  # a FlexAttention BlockMask (CUDA): the masked-out blocks are skipped, not computed
            out = _flex_attention()(q, k, v, block_mask=mask, scale=self.scale)
        return self.proj(out.transpose(1, 2).reshape(batch, seq, dim))


def _flex_attention():
    from torch.nn.attention.flex_attention import flex_attention
    return flex_attention


def document_ids(idx: torch.Tensor, eos_id: int) -> torch.Tensor:
    """The document of every token of packed sequences [batch, seq]: the count of EOS tokens before
    it. A document's own closing EOS belongs to it (prepare writes `doc EOS doc EOS ...`)."""
    is_eos = (idx == eos_id).to(torch.int32)
    return is_eos.cumsum(1, dtype=torch.int32) - is_eos


def document_positions(doc: torch.Tensor) -> torch.Tensor:
    """Each token's position within its document [batch, seq]: 0 at every document's first token."""
    cols = torch.arange(doc.shape[1], device=doc.device).expand_as(doc)
    first = torch.ones_like(doc, dtype=torch.bool)
    first[:, 1:] = doc[:, 1:] != doc[:, :-1]
    return cols - torch.where(first, cols, torch.zeros_like(cols)).cummax(1).values


def document_mask(doc: torch.Tensor, flex: bool = False):
    """Causal attention within documents: query i sees key j iff j <= i and both are in one
    document. Dense boolean [batch, 1, seq, seq] for SDPA (CPU; its math kernel trains, where
    FlexAttention's CPU backward raises), or a FlexAttention BlockMask (CUDA), whose kernels skip
    whole masked blocks: the exact result with less work the more documents a sequence holds."""
    batch, seq = doc.shape
    if flex:
        from torch.nn.attention.flex_attention import create_block_mask

        def same_document(b, h, q, k):
            return (k <= q) & (doc[b, q] == doc[b, k])
        return create_block_mask(same_document, batch, None, seq, seq, device=doc.device)
    causal = torch.ones(seq, seq, dtype=torch.bool, device=doc.device).tril()
    return (causal & (doc[:, :, None] == doc[:, None, :]))[:, None]


class _SwiGLUFn(torch.autograd.Function):
    """silu(gate) * up from the gate_up projection's output, with a backward that writes both
    halves' gradients straight into one tensor (autograd's path writes each, then concatenates
    them into a third) and saves only its input. The same aten ops as autograd's, so the same bits."""

    @staticmethod
    def forward(ctx, gate_up: torch.Tensor) -> torch.Tensor:
        gate, up = gate_up.chunk(2, dim=-1)
        ctx.save_for_backward(gate_up)
        return F.silu(gate).mul_(up)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> torch.Tensor:
        gate_up, = ctx.saved_tensors
        gate, up = gate_up.chunk(2, dim=-1)
        grad = grad.to(gate_up.dtype)
        grad_gate_up = torch.empty_like(gate_up)
        grad_gate, grad_up = grad_gate_up.chunk(2, dim=-1)
        torch.mul(F.silu(gate), grad, out=grad_up)
        torch.ops.aten.silu_backward.grad_input(grad * up, gate, grad_input=grad_gate)
        return grad_gate_up


class SwiGLU(nn.Module):
    def __init__(self, cfg: ModelCfg):
        super().__init__()
        hidden = ffn_hidden_of(cfg.d_model, cfg.ffn_hidden)
        self.gate_up = nn.Linear(cfg.d_model, 2 * hidden, bias=False)
        self.gate_up.stacked = ("gate", "up")  # rows: gate | up (see Attention.qkv)
        self.down = nn.Linear(hidden, cfg.d_model, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate_up = self.gate_up(x)
        if torch.compiler.is_compiling():  # inductor fuses the formula itself
            gate, up = gate_up.chunk(2, dim=-1)
            return self.down(F.silu(gate) * up)
        return self.down(_SwiGLUFn.apply(gate_up))


class Block(nn.Module):
    def __init__(self, cfg: ModelCfg):
        super().__init__()
        self.attn_norm = RMSNorm(cfg.d_model, cfg.norm_eps)
        self.attn = Attention(cfg)
        self.mlp_norm = RMSNorm(cfg.d_model, cfg.norm_eps)
        self.mlp = SwiGLU(cfg)
        self.drop = nn.Dropout(cfg.dropout)
        self.branch_mult = mup.branch_mult(cfg)  # depth-muP's 1/sqrt(n_layers / mup_base_depth); None: off

    def forward(self, x: torch.Tensor, rope: torch.Tensor, mask=None) -> torch.Tensor:
        if self.branch_mult is not None:  # x + a * branch in one pass (add's alpha)
            x = torch.add(x, self.drop(self.attn(self.attn_norm(x), rope, mask)), alpha=self.branch_mult)
            return torch.add(x, self.drop(self.mlp(self.mlp_norm(x))), alpha=self.branch_mult)
        x = x + self.drop(self.attn(self.attn_norm(x), rope, mask))
        return x + self.drop(self.mlp(self.mlp_norm(x)))


class Transformer(nn.Module):
    def __init__(self, cfg: ModelCfg):
        super().__init__()
        if cfg.vocab_size < 1:
            raise ValueError("model.vocab_size must be set (from the data manifest) before building")
        if cfg.document_mask and not 0 <= cfg.eos_id < cfg.vocab_size:
            raise ValueError("model.document_mask needs model.eos_id (from the data manifest) before building")
        self.cfg = cfg
        self.vocab_size = cfg.vocab_size
        rows = padded_vocab(cfg.vocab_size, cfg.vocab_pad_to)
        self.tok_emb = nn.Embedding(rows, cfg.d_model)
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layers))
        self.norm = RMSNorm(cfg.d_model, cfg.norm_eps)
        self.lm_head = nn.Linear(cfg.d_model, rows, bias=False)
        if cfg.tie_embeddings:
            self.lm_head.weight = self.tok_emb.weight
        self.output_mult = mup.output_mult(cfg)  # muP's 1/m on the logits (tied or not); None: off
        # Not persistent: recomputed from the config, so checkpoints hold only learned tensors.
        # Complex, so no engine's cast of floating-point buffers to bf16 can coarsen the angles.
        self.register_buffer("rope", rope_table(cfg.seq_len, cfg.d_model // cfg.n_heads, cfg.rope_theta),
                             persistent=False)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        std = self.cfg.init_std
        # Residual projections scaled by 1/sqrt(2 * n_layers) (GPT-2) so the residual stream's
        # variance does not grow with depth (under depth-muP: the base depth's, the branch
        # multiplier doing the rest).
        resid_std = std / math.sqrt(2 * mup.residual_init_layers(self.cfg))
        hidden = mup.hidden_init_scale(self.cfg)  # muP: fan-in variance, today's std at the base width
        for name, param in self.named_parameters():
            if param.dim() < 2:
                nn.init.ones_(param)
            elif name.endswith(("attn.proj.weight", "mlp.down.weight")):
                nn.init.normal_(param, 0.0, resid_std if hidden == 1.0 else resid_std * hidden)
            elif name.startswith("blocks."):
                nn.init.normal_(param, 0.0, std if hidden == 1.0 else std * hidden)
            else:
                nn.init.normal_(param, 0.0, std)
        # Padded rows are never looked up and never scored, so their gradient is 0 and AdamW
        # leaves a zero row at zero: they stay 0 for the run, and an export that drops them
        # and an import that pads with zeros round-trip every bit.
        with torch.no_grad():
            self.tok_emb.weight[self.vocab_size:].zero_()
            self.lm_head.weight[self.vocab_size:].zero_()

    def attention_compiled(self) -> bool:
        """Whether the blocks run under torch.compile: the whole model traced (DDP), or each block
        compiled in place by `nn.Module.compile` (FSDP2, ZeRO-3; dsslm.engine.blocks)."""
        return torch.compiler.is_compiling() or self.blocks[0]._compiled_call_impl is not None

    def flex_attention(self) -> bool:
        """FlexAttention for the document mask (on CUDA): only where it is compiled, and without
        attention dropout. Uncompiled, flex_attention falls back to an unfused implementation
        that materialises every score (B x H x S^2 floats a layer), which SDPA's dense boolean mask
        does not; and it has no dropout, so a run with model.dropout > 0 would lose it in silence."""
        return _has_flex() and self.attention_compiled() and not (self.training and self.cfg.dropout > 0)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        rope, mask = self.rope[: idx.shape[1]], None
        if self.cfg.document_mask:
            doc = document_ids(idx, self.cfg.eos_id)
            mask = document_mask(doc, flex=idx.is_cuda and self.flex_attention())
            if self.cfg.document_positions:  # per-token angles [batch, seq, 1, pairs]
                rope = self.rope[document_positions(doc)]
        x = self.tok_emb(idx)
        for block in self.blocks:
            x = block(x, rope, mask)
        # Logits in fp32: the softmax over a large vocabulary is where bf16 hurts most. The
        # padded rows are cut off here, so nothing downstream can score or sample them.
        x = self.norm(x)
        if self.output_mult is not None:  # on the d_model-wide input, not the vocabulary-wide logits
            x = x * self.output_mult
        if x.is_cuda:  # the aligned width is what the padding is for: matmul, then drop columns
            return self.lm_head(x)[..., : self.vocab_size].float()
        # A CPU gains nothing from the alignment: multiply by the real rows only (fewer FLOPs,
        # and no backward through a column slice of the logits).
        return F.linear(x, self.lm_head.weight[: self.vocab_size]).float()


@functools.cache  # asked on every forward of a document-masked model on CUDA
def _has_flex() -> bool:
    try:
        from torch.nn.attention.flex_attention import create_block_mask, flex_attention  # noqa: F401
    except ImportError:  # an older torch: the dense mask, exact but O(seq^2) memory
        return False
    return True


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
