"""The model's hand-written pieces against the formulas they replace: RoPE (the (even, odd) pair
convention, which export maps to Hugging Face's layout), RMSNorm's backward, the fused token
loss and its gradient, and the padded vocabulary."""
import math

import pytest
import torch

from dsslm.config import load
from dsslm.loss import IGNORE_INDEX, token_losses
import torch.nn.functional as F

from dsslm.model import RMSNorm, _SplitRopeFn, _SwiGLUFn, apply_rope, build_model, padded_vocab, rope_table


def old_apply_rope(x, cos, sin):
    """dsslm's RoPE before it was rewritten: x [batch, heads, seq, head_dim], pairs (even, odd)."""
    x32 = x.float()
    even, odd = x32[..., 0::2], x32[..., 1::2]
    rotated = torch.stack((even * cos - odd * sin, even * sin + odd * cos), dim=-1)
    return rotated.flatten(-2).to(x.dtype)


def old_rope_tables(seq_len, head_dim, theta):
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim))
    angles = torch.outer(torch.arange(seq_len, dtype=torch.float64), inv_freq)
    return angles.cos().float(), angles.sin().float()


@pytest.mark.parametrize("compiled_branch", [False, True])
def test_rope_equals_the_old_formula_within_fp32_rounding(monkeypatch, compiled_branch):
    batch, seq, heads, dim = 3, 40, 4, 32
    # A long context, so a position error (an fp32 angle, a shifted table) would show.
    x = torch.randn(batch, seq, heads, dim, generator=torch.Generator().manual_seed(0)) * 3
    cos, sin = old_rope_tables(4096, dim, 10000.0)
    offset = 4000  # positions 4000..4039 of the table
    expected = old_apply_rope(x.transpose(1, 2), cos[offset:offset + seq], sin[offset:offset + seq]).transpose(1, 2)
    table = rope_table(4096, dim, 10000.0)[offset:]
    monkeypatch.setattr(torch.compiler, "is_compiling", lambda: compiled_branch)
    got = apply_rope(x, table)
    assert got.dtype == x.dtype and got.shape == x.shape
    assert torch.allclose(got, expected, rtol=0, atol=4e-6 * float(x.abs().max())), (got - expected).abs().max()
    # Pair (x[2i], x[2i+1]) turns as the complex number x[2i] + i x[2i+1]: the convention export relies on.
    pos, pair = 7, 3
    angle = (offset + pos) * 10000.0 ** (-2 * pair / dim)
    z = complex(x[0, pos, 0, 2 * pair], x[0, pos, 0, 2 * pair + 1]) * complex(math.cos(angle), math.sin(angle))
    assert got[0, pos, 0, 2 * pair].item() == pytest.approx(z.real, abs=1e-5)
    assert got[0, pos, 0, 2 * pair + 1].item() == pytest.approx(z.imag, abs=1e-5)


def test_rope_in_bf16_rounds_once_like_the_old_formula():
    x = torch.randn(2, 16, 2, 16).bfloat16()
    cos, sin = old_rope_tables(16, 16, 10000.0)
    expected = old_apply_rope(x.transpose(1, 2), cos, sin).transpose(1, 2)
    got = apply_rope(x, rope_table(16, 16, 10000.0))
    assert got.dtype == torch.bfloat16
    assert (got.float() - expected.float()).abs().max() <= 2 ** -7 * float(x.float().abs().max())


def test_rmsnorm_backward_equals_autograd_of_the_formula():
    norm = RMSNorm(24)
    torch.nn.init.uniform_(norm.weight, 0.5, 2.0)
    x = torch.randn(5, 7, 24, requires_grad=True)
    grad = torch.randn(5, 7, 24)
    norm(x).backward(grad)
    got_x, got_w = x.grad.clone(), norm.weight.grad.clone()
    x.grad = None
    w = norm.weight.detach().clone().requires_grad_()
    (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * w).backward(grad)
    assert torch.allclose(got_x, x.grad, atol=1e-6) and torch.allclose(got_w, w.grad, atol=1e-5)


def test_token_losses_and_their_gradient_equal_autograd_of_the_formula():
    gen = torch.Generator().manual_seed(3)
    logits = (torch.randn(4, 9, 50, generator=gen) * 4).requires_grad_()
    targets = torch.randint(0, 50, (4, 9), generator=gen)
    targets[1, 3:] = IGNORE_INDEX
    ce, z = token_losses(logits, targets)
    (ce + 0.3 * z).backward()
    fused = logits.grad.clone()
    logits.grad = None
    real = targets != IGNORE_INDEX
    log_z = torch.logsumexp(logits, -1)
    ref_ce = (log_z - logits.gather(-1, targets.clamp(min=0)[..., None])[..., 0])[real].sum()
    ref_z = log_z[real].pow(2).sum()
    (ref_ce + 0.3 * ref_z).backward()
    assert torch.allclose(ce, ref_ce) and torch.allclose(z, ref_z)
    assert torch.allclose(fused, logits.grad, atol=1e-6)
    assert fused[1, 3:].abs().max() == 0  # ignored positions get no gradient


def model_cfg(*overrides):
    return load(None, ["model.vocab_size=257", "model.d_model=32", "model.n_layers=2", "model.n_heads=2",
                       "model.seq_len=16", *overrides]).model


def test_padded_vocab_rows_never_reach_the_output_nor_get_gradient():
    assert (padded_vocab(257, 64), padded_vocab(256, 64), padded_vocab(257, 1)) == (320, 256, 257)
    torch.manual_seed(0)
    model = build_model(model_cfg())
    assert model.tok_emb.weight.shape == (320, 32) and model.lm_head.weight is model.tok_emb.weight
    idx = torch.randint(0, 257, (2, 16))
    logits = model(idx)
    assert logits.shape == (2, 16, 257)  # the loss, z-loss, eval and sampling see real tokens only
    ce, z = token_losses(logits, idx)
    (ce + z).backward()
    assert model.tok_emb.weight.grad[257:].abs().max() == 0
    assert model.tok_emb.weight.grad[:257].abs().max() > 0


@pytest.mark.parametrize("tie", [True, False])
def test_padding_changes_nothing_the_model_computes(tie):
    """The padded model with the unpadded one's weights in its first rows gives the same logits."""
    torch.manual_seed(0)
    plain = build_model(model_cfg("model.vocab_pad_to=1", f"model.tie_embeddings={tie}"))
    padded = build_model(model_cfg(f"model.tie_embeddings={tie}"))
    with torch.no_grad():
        for name, param in padded.named_parameters():
            source = dict(plain.named_parameters())[name]
            param.zero_()
            param[: source.shape[0]].copy_(source)
    idx = torch.randint(0, 257, (2, 16))
    assert torch.allclose(plain(idx), padded(idx), atol=1e-6)


def autograd_split_heads(qkv, table, n_heads):
    """What `_SplitRopeFn` replaces: unbind, `apply_rope` on q and k, transpose; autograd's backward."""
    batch, seq, width = qkv.shape
    q, k, v = qkv.view(batch, seq, 3, n_heads, width // 3 // n_heads).unbind(2)
    q, k = apply_rope(q, table), apply_rope(k, table)
    return q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("used", ["qkv", "q"])  # "q": k and v take no part, so backward gets None for them
def test_split_rope_equals_autograd_of_apply_rope(dtype, used):
    gen = torch.Generator().manual_seed(5)
    table = rope_table(64, 16, 10000.0)[:24]
    qkv = (torch.randn(3, 24, 3 * 4 * 16, generator=gen) * 2).to(dtype)
    weights = [torch.randn(3, 4, 24, 16, generator=gen).to(dtype) for _ in range(3)]
    results = []
    for fn in (_SplitRopeFn.apply, autograd_split_heads):
        x = qkv.clone().requires_grad_()
        outs = fn(x, table, 4)
        chosen = outs if used == "qkv" else outs[:1]
        sum((out.float() * w.float()).sum() for out, w in zip(chosen, weights)).backward()
        results.append(([out.detach() for out in outs], x.grad))
    (got, got_grad), (expected, expected_grad) = results
    for g, e in zip(got, expected):
        assert g.dtype == dtype and g.shape == e.shape and torch.equal(g, e)
    assert got_grad.dtype == dtype
    # fp32: the same complex multiplies, so the same bits. bf16: autograd rounds each rotated
    # gradient to bf16 before stacking them; the hand-written path rounds once, at the end.
    tolerance = 0 if dtype == torch.float32 else 2 ** -7 * float(expected_grad.float().abs().max())
    assert (got_grad.float() - expected_grad.float()).abs().max() <= tolerance
    if used == "q":
        assert got_grad.view(3, 24, 3, 4, 16)[:, :, 1:].abs().max() == 0


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_swiglu_equals_autograd_of_the_formula_to_the_bit(dtype):
    gen = torch.Generator().manual_seed(6)
    gate_up = (torch.randn(4, 9, 2 * 40, generator=gen) * 3).to(dtype)
    weight = torch.randn(4, 9, 40, generator=gen).to(dtype)
    grads = []
    for formula in (_SwiGLUFn.apply, lambda t: F.silu(t.chunk(2, -1)[0]) * t.chunk(2, -1)[1]):
        x = gate_up.clone().requires_grad_()
        out = formula(x)
        (out * weight).sum().backward()
        grads.append((out.detach(), x.grad))
    assert torch.equal(grads[0][0], grads[1][0]) and torch.equal(grads[0][1], grads[1][1])


def autograd_split_norm_heads(qkv, table, n_heads, q_norm, k_norm):
    """What `_SplitNormRopeFn` replaces: unbind, the two RMSNorms, `apply_rope`, transpose."""
    batch, seq, width = qkv.shape
    q, k, v = qkv.view(batch, seq, 3, n_heads, width // 3 // n_heads).unbind(2)
    q, k = apply_rope(q_norm(q), table), apply_rope(k_norm(k), table)
    return q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("used", ["qkv", "q"])
def test_split_norm_rope_equals_autograd_of_the_norms_and_apply_rope(dtype, used):
    """QK-norm's eager path (tiny.yaml's default since it earned its place): the same outputs,
    qkv gradient and both gains' gradients as autograd through RMSNorm and apply_rope; fp32 to
    the bit."""
    from dsslm.model import _SplitNormRopeFn
    gen = torch.Generator().manual_seed(7)
    table = rope_table(64, 16, 10000.0)[:24]
    qkv = (torch.randn(3, 24, 3 * 4 * 16, generator=gen) * 2).to(dtype)
    weights = [torch.randn(3, 4, 24, 16, generator=gen).to(dtype) for _ in range(3)]
    gains = [1 + 0.3 * torch.randn(16, generator=gen) for _ in range(2)]
    results = []
    for fused in (True, False):
        x = qkv.clone().requires_grad_()
        norms = [RMSNorm(16, 1e-6) for _ in range(2)]
        for norm, gain in zip(norms, gains):
            norm.weight.data.copy_(gain)
        outs = (_SplitNormRopeFn.apply(x, table, 4, norms[0].weight, norms[1].weight, 1e-6) if fused
                else autograd_split_norm_heads(x, table, 4, *norms))
        chosen = outs if used == "qkv" else outs[:1]
        sum((out.float() * w.float()).sum() for out, w in zip(chosen, weights)).backward()
        results.append(([out.detach() for out in outs], x.grad, [n.weight.grad for n in norms]))
    (got, got_grad, got_gains), (expected, expected_grad, expected_gains) = results
    for g, e in zip(got, expected):
        assert g.dtype == dtype and g.shape == e.shape and torch.equal(g, e)
    tolerance = 0 if dtype == torch.float32 else 2 ** -7 * float(expected_grad.float().abs().max())
    assert got_grad.dtype == dtype and (got_grad.float() - expected_grad.float()).abs().max() <= tolerance
    # An unused output's gradient reaches a Function as zeros (autograd materialises it): k's gain
    # gets zeros where autograd's path, which never reaches k's norm, leaves None.
    for g, e in zip(got_gains, expected_gains):
        assert torch.equal(g, e if e is not None else torch.zeros_like(g))
    if used == "q":
        assert got_grad.view(3, 24, 3, 4, 16)[:, :, 1:].abs().max() == 0
