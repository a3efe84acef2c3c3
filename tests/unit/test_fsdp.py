"""FSDP2 on one rank in this process: fully_shard, no_sync over micro-batches, the DTensor norms,
full_state and load_full_state, without spawning ranks.

The 2-rank drills that compare every engine with one process are slow (tests/scenarios/
test_engines.py); this keeps dsslm/engine/fsdp.py in the fast tier (`pytest -m "not slow"`).
"""
import torch
import torch.distributed as dist

from dsslm.engine.ddp import DDPEngine
from dsslm.engine.fsdp import FSDPEngine
from dsslm.loss import accumulate
from dsslm.model import build_model
from dsslm.optim import lr_at
from helpers import tiny_cfg


def build(engine_cls, tmp_path):
    cfg = tiny_cfg(tmp_path, "model.vocab_size=64", "engine.kind=" + engine_cls.name)
    torch.manual_seed(0)
    return cfg, engine_cls(cfg, build_model(cfg.model))


def train(engine, cfg, steps=3):
    gen = torch.Generator().manual_seed(1)
    curve = []
    for step in range(steps):
        batch = torch.randint(0, 64, (4, 33), generator=gen)
        micro = [(batch[:2, :-1], batch[:2, 1:]), (batch[2:, :-1], batch[2:, 1:])]
        result = accumulate(engine, micro, "fp32", cfg.train.z_loss, cfg.optim.clip, 4 * 32)
        engine.step(lr_at(step, cfg))
        curve.append((result.loss, result.gnorm))
    return curve


def test_one_rank_fsdp_trains_like_ddp_and_its_full_state_reloads_to_the_bit(tmp_path):
    cfg, ddp = build(DDPEngine, tmp_path)
    ddp_curve = train(ddp, cfg)
    ddp_names = list(ddp.full_state()[0])
    cfg, fsdp = build(FSDPEngine, tmp_path)  # makes its own one-rank gloo group
    try:
        curve = train(fsdp, cfg)
        for (loss, gnorm), (ref_loss, ref_gnorm) in zip(curve, ddp_curve):
            assert abs(loss - ref_loss) <= 1e-5 * ref_loss and abs(gnorm - ref_gnorm) <= 1e-4 * ref_gnorm
        model_sd, optim = fsdp.full_state()
        assert list(model_sd) == ddp_names  # the unwrapped model's names, tied weights once
        assert set(optim.step.values()) == {3.0}
        assert fsdp.memory_report()["grad_bytes"] > 0
        _, fresh = build(FSDPEngine, tmp_path)  # joins the group the first one made
        fresh.load_full_state(model_sd, optim)
        again_sd, again = fresh.full_state()
        assert all(torch.equal(again_sd[n], t) for n, t in model_sd.items())
        assert again.step == optim.step
        assert all(torch.equal(again.exp_avg_sq[n], t) for n, t in optim.exp_avg_sq.items())
        fresh.close()
    finally:
        fsdp.close()
    assert not dist.is_initialized()  # the engine that made the group took it down


def test_an_engine_refused_in_its_constructor_takes_its_group_down(tmp_path, monkeypatch):
    """No engine object means no close(): build_engine itself takes down the group the failed
    constructor made, or the next train() in this process joins a group nobody owns."""
    import pytest

    from dsslm.config import ConfigError
    from dsslm.engine import build_engine, fsdp

    def refuse(*args, **kwargs):
        raise ConfigError("refused after the group was made")
    monkeypatch.setattr(fsdp, "shard_model", refuse)
    cfg = tiny_cfg(tmp_path, "model.vocab_size=64", "engine.kind=fsdp")
    with pytest.raises(ConfigError):
        build_engine(cfg, build_model(cfg.model))
    assert not dist.is_initialized()
