"""The data stream end to end: prefetching changes nothing a run computes (1 and 2 ranks, through
a batch ramp and a rewind), mixture weights resume bitwise, bad mixes exit 2."""
from __future__ import annotations

import json

import numpy as np
import pytest

from dsslm.data import prepare
from dsslm.data.loader import Loader
from dsslm.recovery.faults import DrillAbort
from dsslm.train import main, train
from helpers import TINY, copy_run_back_to, events, losses_by_step, read_jsonl, remanifest, run_train, tiny_cfg

# As tests/scenarios/test_spikes.py: settled by step 60, so a poisoned window is a clear spike.
SPIKE = ["model.d_model=64", "optim.peak_lr=3e-3", "ckpt.every=5", "ckpt.keep_last=4", "monitor.min_history=15",
         "monitor.window=30", "monitor.rewind_margin_steps=2", "optim.warmup_steps=5"]


def stream(run_dir) -> list[tuple]:
    return [(r["step"], r["data_position"], r["batch_sequences"], r["loss"], r["gnorm"], r["verdict"])
            for r in read_jsonl(run_dir / "metrics.jsonl") if "loss" in r]


@pytest.mark.slow
def test_prefetch_trains_the_same_run_bitwise_through_a_ramp_and_a_rewind(tmp_path):
    # 20 sequences of 32 tokens: a ramp over the first steps. After it, step s starts at sequence
    # 238 + 4 (s - 64): the poisoned sequences 244..251 are fed by steps 65..67 alone, the streak.
    # The array order this drill's rewinds were counted on (the comment below): the order is data,
    # and under another one the poisoned steps' neighbours differ (tests/scenarios/test_shuffle_kinds.py).
    common = [*SPIKE, "train.total_steps=80", "faults.poison_batches=[[61,63]]", "train.batch_ramp.start=2",
              "train.batch_ramp.tokens=640", "data.shuffle=array"]
    runs = {}
    for prefetch in ("true", "false"):
        run_dir = tmp_path / prefetch
        assert train(tiny_cfg(run_dir, *common, f"data.prefetch={prefetch}")) == 0
        runs[prefetch] = run_dir
    # Triage: in-place re-runs that reproduce the outliers: step 65's batch holds 2 poisoned
    # sequences of 4, named as data against the run's history of sequence losses; step 66's is
    # poisoned throughout (nothing in-place tells it from state: unknown). Then one replay with
    # the spike's standing-out text left out, the 8 poisoned sequences of steps 65-67 (a step
    # bad throughout names all of its own): data; the re-runs stood for the same-data replay.
    # (Before: the narrow replay left out blame's minimal few and came back; a wide one followed.)
    rewinds = events(runs["true"], "rewind")
    verdicts = [(e["step"], e["scope"], e["verdict"]) for e in events(runs["true"], "triage")]
    assert len(rewinds) == 1 and verdicts == [(65, "step", "data"), (66, "step", "unknown"), (67, "window", "data")]
    assert stream(runs["true"]) == stream(runs["false"])
    hits = events(runs["true"], "end")[0]["prefetch"]
    # Misses: the first step, the first step after each rewind, and the step after each re-run
    # whose data joined the skip list; every other step was read ahead.
    misses = 1 + len(rewinds) + len([e for e in events(runs["true"], "triage") if e["scope"] == "step" and e["skip"]])
    assert hits["misses"] == misses and hits["hits"] == len(stream(runs["true"])) - misses
    assert events(runs["false"], "end")[0]["prefetch"] == {"hits": 0, "misses": 0}


@pytest.mark.slow
def test_prefetch_trains_the_same_run_bitwise_on_2_ranks(tmp_path):
    common = ["train.total_steps=10", "ckpt.every=5", "train.micro_batch_size=2", "train.grad_accum=2",
              "train.batch_ramp.start=4", "train.batch_ramp.tokens=640"]
    for prefetch in ("true", "false"):
        run_train(tmp_path / prefetch, *common, f"data.prefetch={prefetch}", nproc=2)
    assert stream(tmp_path / "true") == stream(tmp_path / "false")
    assert len({r[2] for r in stream(tmp_path / "true")}) > 1  # the ramp changed the batch size
    assert events(tmp_path / "true", "end")[0]["prefetch"]["hits"] == 9


@pytest.fixture
def two_domains(tmp_path):
    """Domain "prose" (~60k byte tokens) and domain "tiny" (~1,400: 43 sequences of 32)."""
    words = ["alpha", "beta", "gamma", "delta", "epsilon", "zeta", "eta", "theta"]
    rng = np.random.default_rng(3)
    (tmp_path / "prose.txt").write_text(" ".join(rng.choice(words, 10_000)))
    (tmp_path / "tiny.txt").write_text(" ".join(rng.choice(words[:3], 240)))
    for name in ("prose", "tiny"):
        prepare([tmp_path / f"{name}.txt"], tmp_path / "data", domain=name, val_fraction=0.02)
    return tmp_path / "data"


def val_domain_tokens(run_dir) -> dict[int, dict]:
    return {r["step"]: r["domain_tokens"] for r in read_jsonl(run_dir / "metrics.jsonl") if "domain_tokens" in r}


@pytest.mark.slow
def test_a_mixture_resumes_bitwise_with_its_tokens_per_domain_and_epochs(tmp_path, two_domains):
    mix = [f"data.dir={two_domains}", "data.mix.prose=0.4", "data.mix.tiny=0.6", "run.val_every=5",
           "run.val_batches=1", "train.total_steps=30", "ckpt.every=5"]
    ref = tmp_path / "ref"
    assert train(tiny_cfg(ref, *mix)) == 0
    cut = tmp_path / "cut"
    with pytest.raises(DrillAbort):
        train(tiny_cfg(cut, *mix, "faults.crash_at_step=17", "faults.crash_mode=raise"))
    assert train(tiny_cfg(cut, *mix)) == 0
    assert events(cut, "resume")[0]["step"] == 15
    assert losses_by_step(cut) == losses_by_step(ref)
    assert val_domain_tokens(cut) == val_domain_tokens(ref)
    end = events(ref, "end")[0]
    assert sum(end["domain_tokens"].values()) == end["tokens"] == 30 * 4 * 32
    lo = Loader(two_domains, 32, seed=tiny_cfg(ref).run.seed, mix={"prose": 0.4, "tiny": 0.6})
    assert end["domain_tokens"] == lo.domain_tokens_before(30 * 4, [])
    # tiny (43 sequences, 60% of 4 a step) starts its second pass near step 18, its third near 36.
    crossing = next(g for g in range(200) if lo.epochs_before(g + 1)["tiny"] == 1)
    assert [(e["domain"], e["epoch"], e["step"]) for e in events(ref, "domain_epoch")] == \
        [("tiny", 1, crossing // 4 + 1)]


@pytest.mark.slow
def test_a_checkpoint_without_domain_tokens_resumes_with_them_derived(tmp_path, two_domains):
    mix = [f"data.dir={two_domains}", "data.mix.prose=0.5", "data.mix.tiny=0.5", "train.total_steps=12",
           "ckpt.every=6"]
    ref = tmp_path / "ref"
    assert train(tiny_cfg(ref, *mix)) == 0
    old = tmp_path / "old"
    folder = copy_run_back_to(ref, old, 6)
    state = json.loads((folder / "state.json").read_text())
    del state["train"]["domain_tokens"]  # as a checkpoint written before the count existed
    (folder / "state.json").write_text(json.dumps(state))
    remanifest(folder)
    assert train(tiny_cfg(old, *mix)) == 0
    assert events(old, "end")[-1]["domain_tokens"] == events(ref, "end")[0]["domain_tokens"]


def test_a_mix_naming_a_domain_the_data_lacks_exits_2_in_one_line(tmp_path, two_domains, capsys):
    run_dir = tmp_path / "run"
    code = main([f"run.dir={run_dir}", *TINY, f"data.dir={two_domains}", "data.mix.prose=1", "data.mix.web=1"])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1 and "data.mix names domain 'web'" in err[0] and "prose, tiny" in err[0]
    assert not (run_dir / "checkpoints").exists() and not (run_dir / "metrics.jsonl").exists()


@pytest.mark.slow
def test_a_planned_mixture_changes_at_its_sequence_and_resumes_across_it_without_drift(tmp_path, two_domains):
    """Stage 1 (tiny alone) starts at sequence 26, inside step 7 (4 sequences a step): from there
    every sequence is tiny's; a resume from step 4 crosses it bitwise, with no --allow-drift."""
    plan = [f"data.dir={two_domains}", "data.mix_stages=[{start: 0, weights: {prose: 1}}, "
            "{start: 26, weights: {tiny: 1}}]", "train.total_steps=10", "ckpt.every=4"]
    ref = tmp_path / "ref"
    assert train(tiny_cfg(ref, *plan)) == 0
    seq = 32  # tokens a sequence (TINY's model.seq_len): 40 sequences, the first 26 prose's
    assert events(ref, "end")[-1]["domain_tokens"] == {"prose": 26 * seq, "tiny": 14 * seq}
    resumed = tmp_path / "resumed"
    copy_run_back_to(ref, resumed, 4)
    assert main([f"run.dir={resumed}", *TINY, *plan]) == 0
    assert losses_by_step(resumed) == losses_by_step(ref)
    assert events(resumed, "resume")[-1]["drift"] == {}
