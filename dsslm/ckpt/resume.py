"""The loop's checkpoint verbs: save, resume_or_init, rewind.

The checkpoint adapter: every engine hands over full fp32 tensors keyed by parameter name
(`engine.full_state`), every rank's RNG is gathered, and rank 0 writes one atomic folder. Loading
goes the other way on every rank, so a ZeRO checkpoint resumes under FSDP, DDP or one process.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from dsslm.ckpt.store import Checkpoint, CheckpointManager, load_checkpoint
from dsslm.config import Config, to_dict
from dsslm.engine.base import Engine
from dsslm.data.loader import Loader
from dsslm.observe.sinks import Sinks
from dsslm.recovery.monitor import SpikeMonitor, plan_rewind, rewind_record
from dsslm.data.skiplist import merge_windows
from dsslm.optim import decay_start_step
from dsslm.ckpt.train_state import (STATE_FORMAT, RunState, check_fingerprint, read_recovery, rng_state,
                         seed_everything, set_rng_state, write_recovery)

MOMENTS = ("exp_avg", "exp_avg_sq")


class Escalation(RuntimeError):
    """The spike policy ran out of rewinds: a human must look (exit code 3)."""


@dataclass
class Job:
    """Everything the loop's verbs share for one run."""
    cfg: Config
    run_dir: Path
    engine: Engine
    loader: Loader
    ckpts: CheckpointManager
    monitor: SpikeMonitor
    sinks: Sinks
    fingerprint: dict
    allow_drift: tuple[str, ...] = ()


def flatten_optim(optim_sd: dict[str, Any]) -> dict[str, torch.Tensor]:
    flat = {f"{m}/{name}": t for m in MOMENTS for name, t in optim_sd[m].items()}
    # Adam's step count per parameter, fp64 so counts past 2^24 stay exact.
    flat.update({f"step/{name}": torch.tensor([s], dtype=torch.float64) for name, s in optim_sd["step"].items()})
    return flat


def unflatten_optim(flat: dict[str, torch.Tensor]) -> dict[str, Any]:
    out: dict[str, Any] = {"step": {}, "exp_avg": {}, "exp_avg_sq": {}}
    for key, tensor in flat.items():
        kind, name = key.split("/", 1)
        out[kind][name] = float(tensor.item()) if kind == "step" else tensor
    return out


def pin_for_recovery(job: Job, step: int) -> None:
    """Keep the checkpoint a rewind starting now would need, and the one before a WSD decay."""
    m = job.cfg.monitor
    horizon = step - m.rewind_margin_steps - m.max_skips - 1
    valid = job.ckpts.valid_steps()
    pins = [s for s in valid if s <= horizon][-1:]
    decay_start = decay_start_step(job.cfg)
    if decay_start is not None:
        pins += [s for s in valid if s <= decay_start][-1:]
    job.ckpts.pin(pins)


def save(job: Job, run: RunState, sync: bool = False) -> None:
    """Snapshot on every rank (sharded engines gather collectively); rank 0 writes."""
    model_sd, optim_sd = job.engine.full_state()
    rngs = job.engine.all_gather(rng_state())
    if not job.engine.is_main:
        return
    scaler = job.engine.scaler.state_dict() if job.engine.scaler is not None else None
    state = {"format": STATE_FORMAT, "step": run.step, "skip_list": run.skip_list,
             "run": run.to_dict(), "monitor": job.monitor.state_dict(), "scaler": scaler,
             "rng": rngs, "world_size": job.engine.world_size, "engine": job.engine.name,
             "loader": {"next_data_batch": job.loader.data_batch_index(run.step, run.skip_list)},
             "fingerprint": job.fingerprint, "config": to_dict(job.cfg)}
    pin_for_recovery(job, run.step)
    tensors = {"model": model_sd, "optim": flatten_optim(optim_sd)}
    if sync or not job.cfg.ckpt.async_save:
        job.ckpts.save(run.step, tensors, state)
    else:
        job.ckpts.save_async(run.step, tensors, state)


def restore(job: Job, ckpt: Checkpoint) -> RunState:
    """Load weights, moments, RNG, monitor and scaler from `ckpt`, merged with the run-level
    recovery file so a known bad window is never replayed, whatever checkpoint we came from."""
    job.engine.load_full_state(ckpt.tensors["model"], unflatten_optim(ckpt.tensors["optim"]))
    state = ckpt.state
    run = RunState.from_dict(state["run"])
    recovery = read_recovery(job.run_dir)
    run.skip_list = merge_windows(run.skip_list + recovery["skip_list"])
    seen = {r["step"] for r in run.rewinds}
    run.rewinds += [r for r in recovery["rewinds"] if r["step"] not in seen]
    if recovery["lr_scale"] is not None:
        run.lr_scale = min(run.lr_scale, recovery["lr_scale"])
    job.monitor.load_state_dict(state["monitor"])
    if job.engine.scaler is not None and state.get("scaler"):
        job.engine.scaler.load_state_dict(state["scaler"])
    rngs = state["rng"]
    if len(rngs) == job.engine.world_size:
        set_rng_state(rngs[job.engine.rank])
    else:
        # Another world size: per-rank streams cannot map one to one; derive fresh ones.
        seed_everything(job.cfg.run.seed + 7919 * job.engine.rank + run.step)
    return run


def _choose(job: Job) -> Checkpoint | None:
    """Rank 0 picks the newest valid checkpoint; every rank loads that same folder."""
    latest = job.ckpts.load_latest() if job.engine.is_main else None
    path = job.engine.broadcast(str(latest.path) if latest is not None else None)
    if path is None:
        return None
    return latest if latest is not None else load_checkpoint(path)


def resume_or_init(job: Job) -> RunState:
    ckpt = _choose(job)
    if ckpt is not None:
        allowed = check_fingerprint(ckpt.state["fingerprint"], job.fingerprint, job.cfg,
                                    f"checkpoint {ckpt.path.name}", job.allow_drift)
        run = restore(job, ckpt)
        job.sinks.emit("resume", step=run.step, checkpoint=str(ckpt.path), drift=allowed)
        return run
    if job.cfg.run.init_from:
        return branch(job, Path(job.cfg.run.init_from))
    run = RunState()
    recovery = read_recovery(job.run_dir)
    run.skip_list = merge_windows(recovery["skip_list"])
    return run


def branch(job: Job, path: Path) -> RunState:
    """Start from another run's checkpoint (a WSD cooldown, an extension), recording lineage.

    Schedule, length and data may differ on purpose; the tokenizer and model shape may not.
    """
    parent = load_checkpoint(path)
    allowed = tuple(k for k in parent.state["fingerprint"]["config_items"] if not k.startswith("model."))
    drifted = check_fingerprint(parent.state["fingerprint"], job.fingerprint, job.cfg,
                                f"parent checkpoint {path}", allowed + ("data", "global_batch_size")
                                + job.allow_drift)
    run = restore(job, parent)
    run.lineage = run.lineage + [{"run_dir": str(path.parent.parent), "step": run.step,
                                  "checkpoint": str(path)}]
    job.sinks.emit("branch", step=run.step, parent=str(path), drift=drifted)
    return run


def rewind(job: Job, run: RunState, spike_step: int) -> RunState:
    """Go back to a checkpoint from before the spike and never feed its data window again."""
    # The monitor lives on rank 0: it plans, every rank follows the same plan.
    decided = None
    if job.engine.is_main:
        spike_start = job.monitor.spike_start if job.monitor.spike_start is not None else spike_step
        plan = plan_rewind(spike_start, spike_step, lambda s: job.loader.data_batch_index(s, run.skip_list),
                           run.rewinds, job.cfg.monitor)
        decided = (plan, rewind_record(spike_start, plan), job.monitor.last_reason)
    plan, record, reason = job.engine.broadcast(decided)
    if plan.escalate:
        job.sinks.emit("escalation", step=spike_step, rewinds=len(run.rewinds), window=plan.window)
        raise Escalation(f"spike at step {spike_step} after {len(run.rewinds)} rewinds; "
                         f"see {job.run_dir / 'events.jsonl'}")
    job.ckpts.wait()
    target = job.ckpts.latest_before(plan.to_step) if job.engine.is_main else None
    path = job.engine.broadcast(str(target.path) if target is not None else None)
    if path is None:
        job.sinks.emit("escalation", step=spike_step, reason="no checkpoint before the spike")
        raise Escalation(f"spike at step {spike_step} and no checkpoint at or before step {plan.to_step}")
    ckpt = target if target is not None else load_checkpoint(path)
    history = run.rewinds + [record]
    lr_scale = run.lr_scale * plan.lr_scale_factor
    skip_list = merge_windows(run.skip_list + [plan.window])
    new = restore(job, ckpt)
    new.skip_list = merge_windows(new.skip_list + skip_list)
    new.rewinds, new.lr_scale = history, min(new.lr_scale, lr_scale)
    new.skipped_steps, new.clipped_steps = run.skipped_steps, run.clipped_steps
    if job.engine.is_main:
        write_recovery(job.run_dir, new)
    job.monitor.reset_streak()
    job.sinks.emit("rewind", step=spike_step, to_step=new.step, window=plan.window,
                   checkpoint=str(ckpt.path), reason=reason)
    if plan.lr_scale_factor != 1.0:
        job.sinks.emit("lr_scale", step=new.step, old=run.lr_scale, new=new.lr_scale)
    return new
