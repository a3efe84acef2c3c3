"""Mixture schedules (`data.mix_stages`): each stage's weights from its first global sequence, its
counts exact, the same at any world size and split, each domain's numbers running on across
stages; a single stage at 0 is data.mix's stream."""
from __future__ import annotations

import numpy as np
import pytest

from dsslm.config import ConfigError, load
from dsslm.data.loader import Loader
from dsslm.data.mixture import Mixture, StagedMixture, weight_units

from test_mixture import SEQ_LEN, data_dir  # noqa: F401  (the three-domain fixture)

DOMAINS = ["big", "mid", "tiny"]
PLAN = [(0, {"big": 0.7, "mid": 0.3}), (1_000, {"big": 0.2, "mid": 0.3, "tiny": 0.5}), (5_003, {"tiny": 1.0})]


def staged(seed: int = 5) -> StagedMixture:
    return StagedMixture([(s, weight_units(w, DOMAINS)) for s, w in PLAN], seed)


def test_each_stage_draws_exactly_its_own_mixture_between_its_bounds():
    mix = staged()
    domains, _ = mix.locate(np.arange(0, 9_000, dtype=np.int64))
    bounds = [s for s, _ in PLAN] + [9_000]
    for k, (start, weights) in enumerate(PLAN):
        end = bounds[k + 1]
        counts = np.bincount(domains[start:end], minlength=3)
        alone = Mixture(weight_units(weights, DOMAINS), 5, stage=k)
        assert counts.tolist() == alone.count_before(end - start).tolist()  # exact to the sequence
        shares = counts / (end - start)
        expected = np.array([weights.get(d, 0.0) for d in DOMAINS]) / sum(weights.values())
        assert np.abs(shares - expected).max() < 0.01  # stages of 1,000 to 4,003 sequences
        assert not set(np.flatnonzero(counts)) - {DOMAINS.index(d) for d in weights}  # no weight, no draw


def test_a_domains_numbers_run_on_across_stages_without_gaps_or_repeats():
    mix = staged()
    domains, numbers = mix.locate(np.arange(0, 12_000, dtype=np.int64))
    for d in range(3):
        assert np.array_equal(numbers[domains == d], np.arange((domains == d).sum()))
    for g in (0, 999, 1_000, 1_001, 5_003, 11_999):
        assert mix.count_before(g).tolist() == np.bincount(domains[:g], minlength=3).tolist()


def test_one_stage_at_zero_is_data_mix_bit_for_bit(data_dir):  # noqa: F811
    flat = Loader(data_dir, SEQ_LEN, seed=5, mix=PLAN[0][1])
    stages = Loader(data_dir, SEQ_LEN, seed=5, mix=[(0, PLAN[0][1])])
    g = np.arange(0, 3_000, dtype=np.int64)
    assert np.array_equal(flat.chunk_ids(g), stages.chunk_ids(g))


@pytest.mark.parametrize("world_size,grad_accum", [(1, 1), (2, 8), (4, 2)])
def test_the_stream_across_a_stage_is_the_same_at_any_split(data_dir, world_size, grad_accum):  # noqa: F811
    """Steps of 64 sequences from 960 (the stage at 1,000 starts inside the first): each rank's
    share concatenated is the one-rank stream, and the step's tokens per domain are the whole step's."""
    lo = Loader(data_dir, SEQ_LEN, seed=5, mix=PLAN)
    one = Loader(data_dir, SEQ_LEN, seed=5, mix=PLAN)
    position = 960
    for _ in range(3):
        parts = [lo.step(position, [[990, 995]], 64, r, world_size, grad_accum) for r in range(world_size)]
        whole, micro = one.step(position, [[990, 995]], 64, 0, 1, 1)
        rows = np.concatenate([np.concatenate([x.numpy() for x, _ in m]) for _, m in parts])
        assert np.array_equal(rows, micro[0][0].numpy())
        assert all(p.domain_tokens == whole.domain_tokens for p, _ in parts)
        position = whole.end
    assert lo.domain_tokens_before(position, [[990, 995]])["tiny"] > 0  # the second stage drew it


@pytest.mark.parametrize("stages,message", [
    ("[{start: 5, weights: {a: 1}}]", "the first stage must have start: 0"),
    ("[{start: 0, weights: {a: 1}}, {start: 0, weights: {b: 1}}]", "must increase"),
    ("[{start: 0, weights: {a: -1}}]", "data.mix_stages[0].weights.a=-1 must be a finite number"),
    ("[{start: 0}]", "must be {start: a global sequence"),
    ("[{start: 0, weights: {a: x}}]", "must be a finite number"),
])
def test_a_bad_schedule_is_refused_naming_the_stage(stages, message):
    with pytest.raises(ConfigError, match=message.replace("[", r"\[").replace("{", r"\{")):
        load(None, [f"data.mix_stages={stages}"])


def test_data_mix_beside_a_schedule_is_refused():
    with pytest.raises(ConfigError, match="both set"):
        load(None, ["data.mix.a=1", "data.mix_stages=[{start: 0, weights: {a: 1}}]"])
