"""optim.name=muon on every engine: each hidden matrix orthogonalised once per step on every rank
(no engine falls back to SGD or AdamW), the same curve on DDP and FSDP2 at 1 and 2 ranks, the
state in the checkpoint layout, a resume to the bit on the same engine; ZeRO refuses it."""
from __future__ import annotations

import functools
import math

import pytest
import torch

from helpers import run_distributed
from test_engines import build, make_cfg, plain, run_steps, tensors

pytestmark = pytest.mark.slow
MUON = ("optim.name=muon", "optim.muon_lr=0.02")
SPLIT, TOTAL = 4, 6


def muon_worker(rank: int, world_size: int, kind: str, state=None) -> dict:
    """Steps [0, TOTAL) (full state kept at SPLIT), or, given a state, the steps after SPLIT from it."""
    from dsslm.engine.base import OptimState
    torch.set_num_threads(1)
    cfg = make_cfg(kind, 1, *MUON)
    engine = build(cfg)
    out = {}
    if state is None:
        out["curve"] = run_steps(engine, cfg, range(SPLIT), grad_accum=2)
        out["split"] = plain(engine.full_state())
    else:
        model_sd, optim = tensors(state)
        engine.load_full_state(model_sd, OptimState(**optim))
        out["curve"] = []
    out["curve"] += run_steps(engine, cfg, range(SPLIT, TOTAL), grad_accum=2)
    out["counts"] = dict(engine.optimizer.orthogonalised)
    out["final"] = plain(engine.full_state())
    engine.close()
    return out


@functools.lru_cache(maxsize=None)
def straight(kind: str, world_size: int) -> list[dict]:
    return run_distributed(muon_worker, world_size, (kind,))


def hidden_matrices() -> list[str]:
    from dsslm.model import build_model
    cfg = make_cfg("ddp", 1, *MUON)
    return sorted(n for n, p in build_model(cfg.model).named_parameters() if p.dim() == 2 and n.startswith("blocks."))


@pytest.mark.parametrize("kind,world", [("ddp", 1), ("ddp", 2), ("fsdp", 1), ("fsdp", 2)])
def test_each_hidden_matrix_is_orthogonalised_once_per_step_on_every_rank(kind, world):
    runs = straight(kind, world)
    for result in runs:
        assert result["counts"] == {name: TOTAL for name in hidden_matrices()}
    optim = runs[0]["final"][1]  # rank 0 gets the full state (sharded engines gather to it)
    assert sorted(optim["momentum"]) == hidden_matrices()  # Muon's state, by name, at full shape
    assert not set(optim["momentum"]) & set(optim["exp_avg"]) and set(optim["step"].values()) == {float(TOTAL)}
    reference = straight("ddp", 1)[0]["curve"]
    assert all(r["curve"] == runs[0]["curve"] for r in runs)  # every rank reports the same numbers
    # Another engine or world size sums the gradient in another order; Muon's Newton-Schulz runs in
    # bf16, so an fp32 ulp can flip a bf16 rounding: 1e-4 relative on the loss over 6 steps.
    for step, ((loss, _), (ref, _)) in enumerate(zip(runs[0]["curve"], reference)):
        assert math.isclose(loss, ref, rel_tol=1e-4), (kind, world, step, loss, ref)
    # And it is Muon, not AdamW: the AdamW run's curve differs well beyond that.
    adamw = run_distributed(adamw_worker, 1, ())[0] if (kind, world) == ("ddp", 1) else None
    if adamw is not None:
        assert abs(adamw[-1][0] - reference[-1][0]) > 1e-3


def adamw_worker(rank: int, world_size: int) -> list:
    torch.set_num_threads(1)
    cfg = make_cfg("ddp", 1)
    engine = build(cfg)
    curve = run_steps(engine, cfg, range(TOTAL), grad_accum=2)
    engine.close()
    return curve


@pytest.mark.parametrize("kind", ["ddp", "fsdp"])
def test_resume_from_the_full_state_continues_to_the_bit_on_the_same_engine(kind):
    first = straight(kind, 2)
    resumed = run_distributed(muon_worker, 2, (kind, first[0]["split"]))
    assert resumed[0]["curve"] == first[0]["curve"][SPLIT:]
    (model_a, optim_a), (model_b, optim_b) = first[0]["final"], resumed[0]["final"]
    for name in model_a:
        assert (model_a[name] == model_b[name]).all(), name
    for kind_ in ("momentum", "exp_avg", "exp_avg_sq"):
        for name in optim_a[kind_]:
            assert (optim_a[kind_][name] == optim_b[kind_][name]).all(), (kind_, name)
    assert optim_a["step"] == optim_b["step"]


def test_fsdp_state_resumes_under_ddp_within_the_engines_tolerance():
    resumed = run_distributed(muon_worker, 2, ("ddp", straight("fsdp", 2)[0]["split"]))
    for (loss, _), (ref, _) in zip(resumed[0]["curve"], straight("fsdp", 2)[0]["curve"][SPLIT:]):
        assert math.isclose(loss, ref, rel_tol=1e-4)


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_zero_refuses_muon_with_exit_2_and_one_line(tmp_path, capsys, stage):
    from dsslm.train import main
    from helpers import TINY
    assert main([f"run.dir={tmp_path / 'run'}", *TINY, "engine.kind=zero", f"engine.zero_stage={stage}", *MUON]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "optim.name=muon is not supported on engine.kind=zero" in err[0], err
    assert not (tmp_path / "run" / "checkpoints").exists()


def test_a_muon_run_killed_and_resumed_through_its_checkpoint_ends_on_the_same_bits(tmp_path):
    from dsslm.train import main
    from helpers import TINY, losses_by_step, run_train
    common = [*TINY, *MUON, "train.total_steps=8", "ckpt.every=4", "ckpt.async_save=false"]
    assert main([f"run.dir={tmp_path / 'straight'}", *common]) == 0
    crashed = run_train(tmp_path / "crashed", *common[len(TINY):], "faults.crash_at_step=6", check=False)
    assert crashed.returncode != 0
    assert main([f"run.dir={tmp_path / 'crashed'}", *common]) == 0
    assert losses_by_step(tmp_path / "crashed") == losses_by_step(tmp_path / "straight")
    from safetensors.torch import load_file
    optim = load_file(tmp_path / "crashed" / "checkpoints" / "step-00000008" / "optim.safetensors")
    assert any(k.startswith("momentum/blocks.") for k in optim) and not any(k.startswith("momentum/tok_emb") for k in optim)


@pytest.mark.parametrize("saved, now", [("muon", "adamw"), ("adamw", "muon")])
def test_a_switch_of_optimizer_passed_as_drift_is_refused_with_exit_2_and_one_line(tmp_path, capsys, saved, now):
    """--allow-drift optim.name accepts the config's difference, but no optimizer can read the
    other's state: one line naming both, exit 2, nothing saved (it was a KeyError traceback)."""
    from dsslm.train import main
    from helpers import TINY
    common = [f"run.dir={tmp_path}", *TINY, "optim.muon_lr=0.02", "optim.warmup_steps=2", "ckpt.every=4"]
    assert main([*common, f"optim.name={saved}", "train.total_steps=4"]) == 0
    capsys.readouterr()
    assert main(["--allow-drift", "optim.name", *common, f"optim.name={now}", "train.total_steps=6"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert "Traceback" not in "\n".join(err)
    assert f"holds {saved}'s optimizer state" in err[-1] and f"optim.name={now}" in err[-1], err
    # Nothing passed over (renamed .invalid) or resumed from the start checkpoint instead.
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == ["step-00000000", "step-00000004"]
