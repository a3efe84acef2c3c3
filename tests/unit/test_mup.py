"""muP (model.mup_base_width, model.mup_base_depth; dsslm.config.mup): the coordinate check, the
standard parametrisation untouched when it is off, the base width and depth reproducing it, the
rates by role with AdamW and Muon, validation and the resume refusal."""
from __future__ import annotations

import argparse
import math

import pytest
import torch
import torch.nn.functional as F

from dsslm.ckpt.drift import check_allow_drift
from dsslm.ckpt.train_state import ResumeRefused, check_fingerprint
from dsslm.config import ConfigError, load
from dsslm.coordcheck import coord_check, main as coordcheck_main, parse
from dsslm.model import build_model
from dsslm.optim import build_optimizer, muon_groups, param_groups, role_table, set_lr
from helpers import LLAMA_GPT2_INIT

# GPT-2's init and no QK-norm: the figures below (SP's growth, 0.02/sqrt(2L)) were measured so.
TINY = ["model.vocab_size=64", "model.d_model=64", "model.n_layers=2", "model.n_heads=4", "model.seq_len=16",
        *LLAMA_GPT2_INIT]


def coord_args(base: int) -> argparse.Namespace:
    # Through the CLI's parser: its defaults (lr 1e-2, GPT-2's init, no QK-norm, ...) are the check's.
    return parse(["--widths", "32,64,128,256", "--steps", "4", "--mup-base-width", str(base), "--seq-len", "16",
                  "--batch", "4"])


def test_coordinate_check_is_flat_under_mup_and_grows_under_the_standard_parametrisation():
    """After 3 updates at a rate that blows the standard parametrisation's wide models up, no
    layer's mean |x| at width 256 is twice its width-32 value under muP (measured: at most 1.4x);
    under SP the logits are (4x measured) and the residual stream 60x."""
    mup, sp = coord_check(coord_args(32)), coord_check(coord_args(0))
    grown = {layer: round(ratio, 2) for layer, ratio in mup["ratio_last_step"].items() if ratio >= 2}
    assert not grown, f"under muP these layers' scales grow with width: {grown}"
    assert all(s < 0.3 for s in mup["slope_last_step"].values()), mup["slope_last_step"]  # measured: at most 0.11
    assert sp["ratio_last_step"]["logits"] > 2.5 and sp["ratio_last_step"]["block1.resid"] > 10, sp["ratio_last_step"]
    # The base width is the standard parametrisation: the narrowest model is the same in both.
    assert all(mup["scales"][layer]["32"] == sp["scales"][layer]["32"] for layer in mup["scales"])


def losses_and_weights(*overrides: str, steps: int = 3) -> tuple[list[float], dict[str, torch.Tensor], list[dict]]:
    cfg = load(None, [*TINY, *overrides])
    torch.manual_seed(0)
    model = build_model(cfg.model)
    groups = [{k: v for k, v in g.items() if k != "params"} for g in param_groups(model, cfg.optim)]
    optimizer = build_optimizer(model, cfg.optim, torch.device("cpu"))
    set_lr(optimizer, 3e-3)
    gen, losses = torch.Generator().manual_seed(1), []
    for _ in range(steps):
        ids = torch.randint(0, 64, (2, 17), generator=gen)
        loss = F.cross_entropy(model(ids[:, :-1]).flatten(0, 1), ids[:, 1:].flatten())
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    return losses, {n: p.detach().clone() for n, p in model.named_parameters()}, groups


@pytest.mark.parametrize("extra", [(), ("optim.name=muon",), ("model.tie_embeddings=false", "model.qk_norm=true")])
def test_off_and_at_the_base_it_is_the_standard_parametrisation_to_the_bit(extra):
    """mup_base_width=0 changes nothing (the same groups, losses and weights as the key absent);
    base width = d_model and base depth = n_layers make every factor exactly 1: also SP's bits.
    (Checked once against the commit before muP too: the same losses, groups and role table.)"""
    absent = losses_and_weights(*extra)
    for overrides in (("model.mup_base_width=0", "model.mup_base_depth=0"),
                      ("model.mup_base_width=64", "model.mup_base_depth=2")):
        losses, weights, groups = losses_and_weights(*extra, *overrides)
        assert losses == absent[0] and groups == absent[2], overrides
        assert all(torch.equal(weights[n], absent[1][n]) for n in weights), overrides


def test_a_wider_model_takes_mups_init_attention_scale_and_output_multiplier():
    sp, mup = build_model(load(None, [*TINY, "model.d_model=256"]).model), \
        build_model(load(None, [*TINY, "model.d_model=256", "model.mup_base_width=64"]).model)
    attn = mup.blocks[0].attn
    assert attn.scale == pytest.approx(math.sqrt(64 / 4) / 64) and sp.blocks[0].attn.scale is None  # 1/d_head x 4
    assert mup.output_mult == 0.25 and sp.output_mult is None and mup.blocks[0].branch_mult is None
    for name in ("blocks.0.attn.qkv.weight", "blocks.0.mlp.down.weight"):
        ratio = float(dict(mup.named_parameters())[name].detach().std() / dict(sp.named_parameters())[name].detach().std())
        assert ratio == pytest.approx(0.5, rel=0.05), name  # 1/sqrt(m), m = 4
    embedding = float(mup.tok_emb.weight.detach().std()) / float(sp.tok_emb.weight.detach().std())
    assert embedding == pytest.approx(1.0, rel=0.05)  # the embedding: unchanged


def test_depth_rule_scales_branches_and_keeps_the_initial_function():
    base = load(None, [*TINY, "model.n_layers=8", "model.mup_base_depth=2"]).model
    model = build_model(base)
    assert model.blocks[0].branch_mult == 0.5  # 1/sqrt(8/2)
    proj = model.blocks[0].attn.proj.weight.detach().std() * 0.5  # the branch's effective std: SP's 0.02/sqrt(2 x 8)
    assert float(proj) == pytest.approx(0.02 / math.sqrt(16), rel=0.05)


def test_rates_by_role_adamw_and_muon():
    cfg = load(None, [*TINY, "model.d_model=256", "model.n_layers=8", "model.mup_base_width=64",
                      "model.mup_base_depth=2", "optim.lr_hidden=0.5", "optim.lr_embedding=2"])
    model = build_model(cfg.model)
    groups = {tuple(g["roles"]): g for g in param_groups(model, cfg.optim)}
    hidden = groups[("hidden",)]
    assert hidden["lr_ratio"] == pytest.approx(0.5 / 4 / 2)  # lr_hidden x 1/m x 1/sqrt(r)
    assert hidden["weight_decay"] == pytest.approx(0.1 * 8)  # rate x decay per step: the base's
    assert groups[("embedding",)]["lr_ratio"] == 2.0 and "lr_ratio" not in groups[("scalars",)]
    table = role_table(model, cfg.optim)
    assert table["hidden"]["mup_mult"] == pytest.approx(1 / 8) and table["embedding"]["mup_mult"] == 1.0
    assert "mup_mult" not in role_table(build_model(load(None, TINY).model), cfg.optim)["hidden"]
    cfg.optim.name = "muon"  # Muon's update is shaped for width already: only the depth factor
    muon = muon_groups(model, cfg.optim)[0]
    assert muon["lr_ratio"] == pytest.approx(cfg.optim.muon_lr / cfg.optim.peak_lr * 0.5 / 2)
    assert role_table(model, cfg.optim)["hidden"]["mup_mult"] == pytest.approx(0.5)


@pytest.mark.parametrize("overrides, says", [
    (["model.mup_base_width=-64"], "model.mup_base_width=-64 and model.mup_base_depth=0 must be >= 0"),
    (["model.mup_base_depth=-1"], "must be >= 0"),
    (["model.mup_base_width=64", "run.init_from=hf:/some/folder"], "standard-parametrisation weights"),
])
def test_bad_values_are_one_line(overrides, says):
    with pytest.raises(ConfigError, match=says) as err:
        load(None, [*TINY, *overrides])
    assert "\n" not in str(err.value)


def test_a_resume_that_changes_the_parametrisation_is_refused():
    from dsslm.ckpt.drift import hashed_items
    saved_cfg, now = load(None, TINY), load(None, [*TINY, "model.mup_base_width=32"])
    saved = {"config_items": hashed_items(saved_cfg), "data_manifest_sha256": "d", "tokenizer_sha256": "t",
             "global_batch_size": 12}
    fingerprint = {**saved, "config_items": hashed_items(now)}
    for allow in ((), ("model.mup_base_width",)):
        with pytest.raises(ResumeRefused, match="mup_base_width=0, now 32: a model of another parametrisation"):
            check_fingerprint(saved, fingerprint, now, "checkpoint step-00000008", allow)
    with pytest.raises(ConfigError, match="model.mup_base_depth sets the model's parametrisation"):
        check_allow_drift(["model.mup_base_depth"])
    # A checkpoint saved before the keys existed lacks them: read as 0, no difference.
    old = {k: v for k, v in saved["config_items"].items() if not k.startswith("model.mup_")}
    assert check_fingerprint({**saved, "config_items": old}, saved, saved_cfg, "checkpoint step-00000008") == {}


def test_the_cli_refuses_bad_flags_with_one_line(capsys):
    with pytest.raises(SystemExit) as exit_:
        coordcheck_main(["--widths", "64,32"])
    assert exit_.value.code == 2 and len(capsys.readouterr().err.strip().splitlines()) == 1
    with pytest.raises(SystemExit):
        coordcheck_main(["--widths", "36,72", "--heads", "4"])  # head_dim 9: odd, RoPE needs even
