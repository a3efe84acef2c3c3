"""Activation checkpointing applied from outside the model: same losses and weights to the bit as
the unchecked run (dropout on, so the recomputed forward must redraw the same masks), parameter
names unchanged, and the optimizer kernels (optim.impl) all train."""
import pytest
import torch

from dsslm.config import ConfigError
from dsslm.engine.ddp import DDPEngine
from dsslm.engine.blocks import checkpointed_blocks
from dsslm.loss import accumulate
from dsslm.model import build_model
from dsslm.optim import adamw_impl, lr_at
from helpers import tiny_cfg


def train(tmp_path, *overrides, steps=5):
    cfg = tiny_cfg(tmp_path, "model.vocab_size=64", "model.n_layers=4", "model.dropout=0.1", *overrides)
    torch.manual_seed(0)
    engine = DDPEngine(cfg, build_model(cfg.model))
    gen = torch.Generator().manual_seed(1)
    losses = []
    for step in range(steps):
        batch = torch.randint(0, 64, (4, 33), generator=gen)
        result = accumulate(engine, [(batch[:, :-1], batch[:, 1:])], "fp32", cfg.train.z_loss, cfg.optim.clip, 4 * 32)
        engine.step(lr_at(step, cfg))
        losses.append(result.loss)
    return losses, engine


def test_checkpointed_blocks_choice():
    assert checkpointed_blocks(4, "none", 2) == []
    assert checkpointed_blocks(4, "full", 2) == [0, 1, 2, 3]
    assert checkpointed_blocks(6, "every_n", 2) == [1, 3, 5]
    assert checkpointed_blocks(6, "every_n", 3) == [2, 5]


@pytest.mark.parametrize("mode", ["full", "every_n"])
def test_activation_checkpointing_trains_to_the_bit_like_none(tmp_path, mode):
    plain, plain_engine = train(tmp_path, "train.activation_checkpointing=none")
    checked, engine = train(tmp_path, f"train.activation_checkpointing={mode}")
    assert checked == plain
    assert list(engine.params) == list(plain_engine.params)  # no wrapper prefix in any name
    assert all(torch.equal(p, plain_engine.params[n]) for n, p in engine.params.items())
    wrapped = [i for i, b in enumerate(engine.module.blocks) if "forward" in vars(b)]
    assert wrapped == checkpointed_blocks(4, mode, 2)


@pytest.mark.parametrize("impl", ["single", "foreach", "fused"])
def test_every_adamw_kernel_trains_alike(tmp_path, impl):
    reference, _ = train(tmp_path, "optim.impl=single", "model.dropout=0.0")
    losses, engine = train(tmp_path, f"optim.impl={impl}", "model.dropout=0.0")
    assert engine.optim_impl == impl
    assert max(abs(a - b) / b for a, b in zip(losses, reference)) < 1e-5  # rounding apart


def test_auto_picks_fused_on_cpu_and_cuda():
    assert adamw_impl("auto", torch.device("cpu")) == "fused"
    assert adamw_impl("auto", torch.device("cuda", 0)) == "fused"
    assert adamw_impl("foreach", torch.device("cpu")) == "foreach"


@pytest.mark.parametrize("override,key", [
    ("optim.impl=apex", "optim.impl"), ("train.activation_checkpointing=some", "train.activation_checkpointing"),
    ("train.activation_checkpointing_every=0", "train.activation_checkpointing_every"),
    ("model.vocab_pad_to=0", "model.vocab_pad_to"), ("engine.fsdp_grad_reduce=never", "engine.fsdp_grad_reduce"),
])
def test_new_keys_are_validated(tmp_path, override, key):
    with pytest.raises(ConfigError, match=key.replace(".", r"\.")):
        tiny_cfg(tmp_path, override)
