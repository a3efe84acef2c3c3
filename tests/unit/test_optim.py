import math
import random

import pytest
import torch

from dsslm.config import load
from dsslm.model import build_model
from dsslm.optim import assert_partition, build_adamw, lr_at, param_groups


def tiny_model(**overrides):
    cfg = load(None, [f"model.{k}={v}" for k, v in overrides.items()] + ["model.vocab_size=50"])
    return build_model(cfg.model), cfg


def test_groups_exclude_norms_biases_embeddings():
    model, cfg = tiny_model(qk_norm="true", tie_embeddings="false")
    model.extra = torch.nn.Linear(4, 4, bias=True)  # a bias must land in no-decay
    decay, no_decay = param_groups(model, cfg.optim)
    assert decay["weight_decay"] == 0.1 and no_decay["weight_decay"] == 0.0
    assert "tok_emb.weight" in no_decay["names"] and "extra.bias" in no_decay["names"]
    assert all("norm" not in n for n in decay["names"])
    assert any("q_norm" in n for n in no_decay["names"])
    assert "lm_head.weight" in decay["names"] and "blocks.0.attn.qkv.weight" in decay["names"]


def test_embeddings_decay_when_configured():
    model, cfg = tiny_model()
    cfg.optim.decay_embeddings = True
    decay, _ = param_groups(model, cfg.optim)
    assert "tok_emb.weight" in decay["names"]


def test_tied_embedding_appears_once():
    model, cfg = tiny_model(tie_embeddings="true")
    groups = param_groups(model, cfg.optim)
    names = groups[0]["names"] + groups[1]["names"]
    assert len(names) == len(set(names)) == len(list(model.parameters()))


def test_partition_assertion_fires_on_missed_and_doubled_params():
    model, cfg = tiny_model()
    decay, no_decay = (g["params"] for g in param_groups(model, cfg.optim))
    with pytest.raises(AssertionError, match="missing"):
        assert_partition(model, [decay, no_decay[1:]])
    with pytest.raises(AssertionError, match="in_two_groups"):
        assert_partition(model, [decay, no_decay + decay[:1]])


def test_adamw_hyperparameters():
    model, cfg = tiny_model()
    opt = build_adamw(model, cfg.optim, torch.device("cpu"))
    assert opt.defaults["betas"] == (0.9, 0.95) and opt.defaults["eps"] == 1e-8


def schedule_cfg(*overrides):
    return load(None, ["train.total_steps=1000", "optim.peak_lr=1e-3", "optim.min_lr=1e-4",
                       "optim.warmup_steps=100", *overrides])


def test_cosine_warmup_and_floor():
    cfg = schedule_cfg()
    assert lr_at(0, cfg) == pytest.approx(1e-5)
    assert lr_at(99, cfg) == pytest.approx(1e-3)  # warmup ends at peak
    assert lr_at(100, cfg) == pytest.approx(1e-3)
    assert lr_at(550, cfg) == pytest.approx(1e-4 + 0.9e-3 * 0.5)  # halfway down the cosine
    assert lr_at(1000, cfg) == pytest.approx(1e-4) and lr_at(5000, cfg) == pytest.approx(1e-4)


@pytest.mark.parametrize("shape, mid", [("linear", 0.5), ("1-sqrt", 1 - math.sqrt(0.5))])
def test_wsd_stable_then_decay(shape, mid):
    cfg = schedule_cfg("optim.schedule=wsd", "optim.decay_steps=200", f"optim.decay_shape={shape}")
    assert lr_at(100, cfg) == lr_at(799, cfg) == pytest.approx(1e-3)  # stable phase
    assert lr_at(899, cfg) == pytest.approx(1e-4 + 0.9e-3 * mid)
    assert lr_at(999, cfg) == pytest.approx(1e-4)  # the decay's last step reaches the floor


def test_lr_is_pure_in_any_call_order():
    cfg = schedule_cfg("optim.schedule=wsd", "optim.decay_steps=300")
    steps = list(range(1000))
    forward = [lr_at(s, cfg) for s in steps]
    random.Random(0).shuffle(steps)
    shuffled = {s: lr_at(s, cfg) for s in steps}
    assert forward == [shuffled[s] for s in range(1000)]


def test_one_rate_by_default_keeps_the_two_groups_dsslm_always_had():
    """The groups a run saved before roles existed: same params, same order, no lr_ratio."""
    model, cfg = tiny_model(tie_embeddings="false")
    groups = param_groups(model, cfg.optim)
    assert [g["weight_decay"] for g in groups] == [0.1, 0.0] and not any("lr_ratio" in g for g in groups)
    named = dict(model.named_parameters())
    decayed = [n for n, p in named.items() if p.dim() >= 2 and n != "tok_emb.weight"]
    assert groups[0]["names"] == decayed and groups[1]["names"] == [n for n in named if n not in decayed]
    assert groups[0]["roles"] == ["hidden", "head"] and groups[1]["roles"] == ["embedding", "scalars"]


def test_each_role_runs_at_its_own_multiple_of_the_scheduled_rate():
    from dsslm.optim import role_table, set_lr
    model, cfg = tiny_model(tie_embeddings="false")
    for key, value in (("lr_embedding", 0.5), ("lr_head", 0.25), ("lr_scalars", 2.0)):
        setattr(cfg.optim, key, value)
    groups = param_groups(model, cfg.optim)
    by_role = {g["roles"][0]: g for g in groups}
    assert sorted(by_role) == ["embedding", "head", "hidden", "scalars"] and all(len(g["roles"]) == 1 for g in groups)
    assert by_role["embedding"]["names"] == ["tok_emb.weight"] and by_role["head"]["names"] == ["lm_head.weight"]
    assert by_role["hidden"]["weight_decay"] == 0.1 and by_role["head"]["weight_decay"] == 0.1
    assert by_role["embedding"]["weight_decay"] == 0.0 and by_role["scalars"]["weight_decay"] == 0.0
    optimizer = build_adamw(model, cfg.optim, torch.device("cpu"))
    set_lr(optimizer, 1e-3)
    rates = sorted(g["lr"] for g in optimizer.param_groups)
    assert rates == pytest.approx([2.5e-4, 5e-4, 1e-3, 2e-3])
    table = role_table(model, cfg.optim)
    # 50 ids padded to 64 rows (model.vocab_pad_to) x d_model 128
    assert table["head"] == {"params": 64 * 128, "lr_mult": 0.25, "optimizer": "adamw", "weight_decay": 0.1}
    assert sum(e["params"] for e in table.values()) == sum(p.numel() for p in model.parameters())


def test_a_role_at_rate_0_does_not_move():
    model, cfg = tiny_model()
    cfg.optim.lr_embedding = 0.0
    optimizer = build_adamw(model, cfg.optim, torch.device("cpu"))
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    from dsslm.optim import set_lr
    set_lr(optimizer, 1e-2)
    ids = torch.randint(0, 50, (2, 16))
    model(ids).float().logsumexp(-1).mean().backward()
    optimizer.step()
    after = dict(model.named_parameters())
    assert torch.equal(after["tok_emb.weight"], before["tok_emb.weight"])
    assert not torch.equal(after["blocks.0.attn.qkv.weight"], before["blocks.0.attn.qkv.weight"])


def test_muons_hidden_matrices_take_the_hidden_roles_multiplier():
    from dsslm.optim import muon_groups
    model, cfg = tiny_model()
    cfg.optim.name, cfg.optim.lr_hidden, cfg.optim.lr_embedding = "muon", 0.5, 0.25
    groups = muon_groups(model, cfg.optim)
    assert groups[0]["muon"] and groups[0]["lr_ratio"] == cfg.optim.muon_lr / cfg.optim.peak_lr * 0.5
    assert [g.get("lr_ratio", 1.0) for g in groups[1:]] == [0.25, 1.0]  # the embedding's, the scalars'
    assert all("roles" not in g for g in groups)
