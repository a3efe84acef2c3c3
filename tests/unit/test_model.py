import torch

from dsslm.config import load
from dsslm.model import RMSNorm, build_model, count_params


def cfg_with(*overrides):
    return load(None, ["model.vocab_size=64", "model.d_model=32", "model.n_layers=2", "model.n_heads=4",
                       "model.seq_len=16", *overrides]).model


def test_causal_future_tokens_do_not_change_past_logits():
    model = build_model(cfg_with()).eval()
    x = torch.randint(0, 64, (1, 16))
    y = x.clone()
    y[0, 10:] = (y[0, 10:] + 1) % 64
    assert torch.equal(model(x)[0, :10], model(y)[0, :10])
    assert not torch.equal(model(x)[0, 10:], model(y)[0, 10:])


def test_tied_and_untied():
    tied, untied = build_model(cfg_with()), build_model(cfg_with("model.tie_embeddings=false"))
    assert tied.lm_head.weight is tied.tok_emb.weight
    assert count_params(untied) - count_params(tied) == 64 * 32


def test_logits_fp32_under_bf16_autocast():
    model = build_model(cfg_with("model.qk_norm=true"))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        logits = model(torch.randint(0, 64, (2, 16)))
    assert logits.dtype == torch.float32 and torch.isfinite(logits).all()


def test_rmsnorm_variance_in_fp32():
    norm = RMSNorm(8)
    x = (torch.randn(4, 8) * 1e3).bfloat16()
    ref = x.float() * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + 1e-6)
    assert torch.allclose(norm(x).float(), ref, rtol=1e-2)


def test_norm_eps_reaches_every_rmsnorm():
    model = build_model(cfg_with("model.qk_norm=true", "model.norm_eps=1e-5"))
    norms = [m for m in model.modules() if isinstance(m, RMSNorm)]
    assert len(norms) == 2 * 4 + 1 and {m.eps for m in norms} == {1e-5}
