"""A muP model exported to Hugging Face computes dsslm's logits: the output multiplier folded into an
(untied) lm_head, the attention scale into q_proj or q_norm, depth-muP's branch multiplier into
o_proj and down_proj (dsslm.hf.convert). Run by transformers itself, on the mapping's tensors."""
from __future__ import annotations

import pytest
import torch

from dsslm.config import load
from dsslm.hf.convert import export_config, hf_shapes, to_hf
from dsslm.model import build_model

transformers = pytest.importorskip("transformers")

MUP = ("model.mup_base_width=16", "model.mup_base_depth=1")  # m = 4, r = 2 at d_model 64, 2 layers


def trained_like(*overrides: str):
    """A muP model whose weights are far from their init (norm gains included: a fold into a gain of
    ones would hide a wrong one), and its config."""
    cfg = load(None, ["model.d_model=64", "model.n_heads=4", "model.n_layers=2", "model.seq_len=32",
                      "model.vocab_size=50", "model.init_std=0.2", *overrides]).model
    torch.manual_seed(0)
    model = build_model(cfg).eval()
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 1:
                p.copy_(1 + 0.3 * torch.randn_like(p))
            else:
                p.mul_(1 + torch.rand_like(p))
        model.tok_emb.weight[cfg.vocab_size:].zero_()
        model.lm_head.weight[cfg.vocab_size:].zero_()
    return model, cfg


def hf_logits(sd: dict[str, torch.Tensor], cfg, ids: torch.Tensor) -> torch.Tensor:
    config = export_config(cfg, eos_id=0, dtype=torch.float32)
    hf = getattr(transformers, config.architectures[0])(config).eval()
    tensors = to_hf(sd, cfg)
    assert {n: tuple(t.shape) for n, t in tensors.items()} == hf_shapes(cfg)
    missing, unexpected = hf.load_state_dict(tensors, strict=False)
    assert not unexpected and set(missing) <= ({"lm_head.weight"} if config.tie_word_embeddings else set()), missing
    with torch.no_grad():
        return hf(ids).logits.float()


@pytest.mark.parametrize("overrides", [MUP, (*MUP, "model.tie_embeddings=false"), (*MUP, "model.qk_norm=true"),
                                       (*MUP, "model.qk_norm=true", "model.tie_embeddings=false"),
                                       ("model.mup_base_width=16",), ("model.mup_base_depth=1",)])
def test_exported_logits_equal_dsslms(overrides):
    model, cfg = trained_like(*overrides)
    ids = torch.randint(0, 50, (2, 32), generator=torch.Generator().manual_seed(1))
    sd = {n: p.detach() for n, p in model.named_parameters()}
    with torch.no_grad():
        ours = model(ids)
    theirs = hf_logits(sd, cfg, ids)
    assert ours.abs().max() > 1  # logits large enough for a missed factor to show
    # The export's parity tolerance (hf.write.FP32_TOLERANCE); measured 2e-6 (3e-5 at |logit| 10, depth only).
    assert (ours - theirs).abs().max() < 1e-4, float((ours - theirs).abs().max())
    # The folds are what makes it exact: the same weights exported as the standard parametrisation are not.
    sp = load(None, ["model.d_model=64", "model.n_heads=4", "model.n_layers=2", "model.seq_len=32",
                     "model.vocab_size=50", *(o for o in overrides if "mup" not in o)]).model
    assert (ours - hf_logits(sd, sp, ids)).abs().max() > 1e-2


def test_a_tied_mup_model_exports_untied():
    _, cfg = trained_like(*MUP)
    assert cfg.tie_embeddings and not export_config(cfg, 0, torch.float32).tie_word_embeddings
    _, base = trained_like("model.mup_base_width=64")  # m = 1: nothing to fold, the head stays tied
    assert export_config(base, 0, torch.float32).tie_word_embeddings and "lm_head.weight" not in hf_shapes(base)
