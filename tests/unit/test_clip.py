"""Clipping policies: the fixed bound, and ZClip's EMA z-score bound and its checkpointed state."""
import json
import math
import random

import pytest
import torch

from dsslm.fields import StateError
from dsslm.clip import ZClip, build_clipper
from dsslm.config import OptimCfg, load

CFG = OptimCfg(clip_mode="zclip", clip=1e9, zclip_alpha=0.9, zclip_z=2.5, zclip_warmup_steps=5)


def test_fixed_mode_is_the_plain_bound():
    clipper = build_clipper(OptimCfg(clip=0.7))
    assert clipper.limit == 0.7 and not isinstance(clipper, ZClip)
    clipper.commit()  # nothing to learn


def test_zclip_seeds_its_ema_from_the_warmup_then_clips_outliers_by_their_z():
    z = ZClip(CFG)
    warmup = [1.0, 1.2, 0.8, 1.1, 0.9]
    for g in warmup:
        assert z.bound(g) == CFG.clip  # warming up: only the absolute ceiling
        z.commit()
    assert z.mean == pytest.approx(1.0) and z.var == pytest.approx(0.02)  # population variance
    std = math.sqrt(z.var)
    assert z.bound(1.0 + 2.0 * std) == CFG.clip  # z = 2 <= 2.5: not clipped
    z.commit()
    mean, var = z.mean, z.var
    assert mean == pytest.approx(0.9 * 1.0 + 0.1 * (1.0 + 2.0 * std))
    assert var == pytest.approx(0.9 * 0.02 + 0.1 * (1.0 + 2.0 * std - mean) ** 2)
    norm = mean + 10.0 * math.sqrt(var)  # z = 10: cut to mean + 2.5^2 std / 10
    bound = z.bound(norm)
    assert bound == pytest.approx(mean + 6.25 * math.sqrt(var) / 10.0, rel=1e-6) and bound < norm
    z.commit()
    assert z.mean == pytest.approx(0.9 * mean + 0.1 * bound)  # the EMA learns the clipped value


def test_zclip_learns_only_what_is_committed_and_never_a_non_finite_norm():
    z = ZClip(CFG)
    for g in (1.0, 1.1, 0.9, 1.0, 1.0):
        z.bound(g)
        z.commit()
    before = z.state_dict()
    z.bound(50.0)               # a step the spike policy then skips or re-runs: no commit
    assert z.state_dict() == before
    assert z.bound(50.0) == z.bound(50.0)  # pure: the re-run of a step gets the same bound
    z.bound(float("nan"))
    z.commit()
    assert z.state_dict() == before
    assert z.bound(1.0) == 1e9 and OptimCfg().clip == 1.0  # the absolute ceiling is optim.clip


def test_zclip_state_round_trips_and_is_checked():
    rng = random.Random(0)
    norms = [abs(1.0 + 0.2 * rng.gauss(0, 1)) * (8.0 if i % 17 == 16 else 1.0) for i in range(80)]

    def run(z, gs):
        out = []
        for g in gs:
            out.append(z.bound(g))
            z.commit()
        return out

    reference = run(ZClip(CFG), norms)
    for cut in (3, 5, 40):
        first = ZClip(CFG)
        head = run(first, norms[:cut])
        state = json.loads(json.dumps(first.state_dict()))
        first.state_spec.validate(state, "clip")
        restored = ZClip(CFG)
        restored.load_state_dict(state)
        assert head + run(restored, norms[cut:]) == reference
        assert head + run(ZClip(CFG), norms[cut:]) != reference
    schema = ZClip(CFG).state_spec
    for bad, field in (({"format": 1, "mean": 1.0, "var": None, "warmup_norms": []}, "clip.var"),
                       ({"format": 1, "mean": None, "var": None, "warmup_norms": [-1.0]}, r"clip.warmup_norms\[0\]"),
                       ({"format": 1, "mean": 1.0, "var": 0.1, "warmup_norms": [1.0]}, "clip.warmup_norms"),
                       ({"format": 1, "mean": None, "var": None, "warmup_norms": [1.0] * 6}, "clip.warmup_norms")):
        with pytest.raises(StateError, match=f"^{field}"):
            schema.validate(bad, "clip")


def test_zclip_bound_reaches_the_gradients(tmp_path):
    """Through a real engine: the pre-clip norm is reported, the gradients end at the bound."""
    from dsslm.engine import build_engine
    from dsslm.loss import accumulate
    from dsslm.model import build_model
    cfg = load(None, ["model.d_model=32", "model.n_layers=1", "model.n_heads=2", "model.seq_len=16",
                      "train.device=cpu", "optim.clip_mode=zclip", "optim.clip=1e9"])
    cfg.model.vocab_size = 64
    engine = build_engine(cfg, build_model(cfg.model))
    x = torch.randint(0, 64, (4, 16), generator=torch.Generator().manual_seed(0))
    result = accumulate(engine, [(x, x)], "fp32", 0.0, lambda norm: norm / 4, tokens_global=4 * 16)
    clipped = math.sqrt(sum(float(p.grad.norm()) ** 2 for p in engine.params.values()))
    assert clipped == pytest.approx(result.gnorm / 4, rel=1e-5) and result.gnorm > 0
    assert sum(engine.grad_norms()[n] ** 2 for n in engine.params) == pytest.approx(result.gnorm ** 2, rel=1e-5)
    engine.close()


def test_clip_frac_counts_the_steps_zclip_clipped(tmp_path):
    """clip_frac counted norms above optim.clip, which under ZClip is only a ceiling (set high):
    0.0 where ZClip had clipped 10 of 12 steps."""
    from dsslm.train import train
    from helpers import read_jsonl, tiny_cfg
    cfg = tiny_cfg(tmp_path, "train.total_steps=12", "ckpt.every=100", "optim.clip_mode=zclip", "optim.clip=100",
                   "optim.zclip_warmup_steps=2", "optim.zclip_z=0.1", "monitor.enabled=false", "ckpt.async_save=false")
    assert train(cfg) == 0
    records = [r for r in read_jsonl(tmp_path / "metrics.jsonl") if "loss" in r]
    replay, clipped = ZClip(cfg.optim), 0
    for r in records:  # the bounds again, from the recorded pre-clip norms
        clipped += r["gnorm"] > replay.bound(r["gnorm"])
        replay.commit()
    assert 0 < clipped < 12 and records[-1]["clip_frac"] == clipped / 12
