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
