"""Rewinds: plan one (pure), carry it out (every rank, decided on rank 0), keep the run-level
record of bad data (`run.dir/skip_list.json`), and escalate to a human when rewinds run out.

Steps are step counts, as in metrics.jsonl: a spike "at step s" is the step whose update would
have made the run's step s. Its data batch is the loader's batch of step index s - 1.

The run-level file holds the skip list, every rewind carried out and the lowest lr_scale. Every
resume merges it into what its checkpoint restored: a checkpoint older than a spike does not know
about it, and without the file a resume from there would feed the bad window again.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

from dsslm.ckpt.resume import Checkpointer
from dsslm.ckpt.schema import Fields, Float, Int, ListOf, Optional, StateError, Window, check
from dsslm.ckpt.train_state import REWIND_RECORD, TrainState
from dsslm.config import Config, MonitorCfg
from dsslm.data.loader import merge_windows
from dsslm.durable import write_json_atomic
from dsslm.engine.base import Engine
from dsslm.optim import decay_start_step
from dsslm.recovery.monitor import SpikeMonitor

RECOVERY_FILE = "skip_list.json"
RECOVERY_SCHEMA_VERSION = 2
RECOVERY_SCHEMA = Fields(optional=("schema",), schema=Int(1, RECOVERY_SCHEMA_VERSION),
                         skip_list=ListOf(Window(), max_len=100_000), rewinds=ListOf(REWIND_RECORD, max_len=100_000),
                         lr_scale=Optional(Float(1e-12, 1.0)))


class Escalation(RuntimeError):
    """The spike policy ran out of rewinds: a human must look (exit code 3)."""


@dataclass
class RewindPlan:
    to_step: int              # newest checkpoint step allowed; the caller loads latest_before(to_step)
    window: list[int]         # [start, end) data batches to add to the skip list
    lr_scale_factor: float    # multiply the run's lr_scale by this (1.0, or lr_backoff)
    escalate: bool            # too many rewinds: alert a human instead of rewinding


def plan_rewind(spike_start: int, spike_end: int, data_batch_of: Callable[[int], int],
                rewind_history: list[dict], cfg: MonitorCfg) -> RewindPlan:
    """Plan the recovery from a spike over steps [spike_start, spike_end] (step counts, >= 1).

    `data_batch_of(step)` maps a step count to the data batch it was fed under the current skip
    list. The window runs from the first to the last batch fed during the spike; batches inside
    it that an older window already skips are never fed, so covering them is harmless.
    `rewind_history` holds one `rewind_record` per rewind already made in this run.
    """
    if not 1 <= spike_start <= spike_end:
        raise ValueError(f"spike steps [{spike_start}, {spike_end}] must satisfy 1 <= start <= end")
    window = [data_batch_of(spike_start), data_batch_of(spike_end) + 1]
    repeats = sum(_same_region(spike_start, window, past, cfg.region_steps) for past in rewind_history)
    # Bad data comes in runs longer than the few batches the detector has seen (a corrupt file,
    # a dedup failure): skip at least `skip_batches`, doubling each time the region spikes again,
    # so a long bad region costs a few rewinds, not one per batch.
    window[1] = max(window[1], window[0] + cfg.skip_batches * 2 ** repeats)
    return RewindPlan(
        # The checkpoint after step spike_start - 1 - margin: `margin` clean steps before the spike.
        to_step=max(0, spike_start - 1 - cfg.rewind_margin_steps),
        window=window,
        # The same steps spiking again on other data points at the optimizer, not the data.
        lr_scale_factor=cfg.lr_backoff if repeats else 1.0,
        escalate=len(rewind_history) >= cfg.max_rewinds,
    )


def rewind_record(spike_start: int, plan: RewindPlan) -> dict:
    """The JSON record of a rewind carried out, for `rewind_history`:
    {"step": first spike step, "window": [start, end), "to_step": int, "lr_scale_factor": float}."""
    return {"step": spike_start, "window": list(plan.window), "to_step": plan.to_step,
            "lr_scale_factor": plan.lr_scale_factor}


def _same_region(step: int, window: list[int], past: dict, region_steps: int) -> bool:
    past_start, past_end = past["window"]
    windows_touch = window[0] <= past_end and past_start <= window[1]
    return abs(step - past["step"]) < region_steps or windows_touch


# --- the run-level recovery file ---------------------------------------------------------------

def recovery_path(run_dir: Path) -> Path:
    return run_dir / RECOVERY_FILE


def read_recovery(run_dir: Path) -> dict:
    """skip_list.json, checked field by field; StateError naming the field when it does not fit."""
    path = recovery_path(run_dir)
    if not path.is_file():
        return {"skip_list": [], "rewinds": [], "lr_scale": None}
    try:
        recovery = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise StateError(f"{path}: unreadable ({exc})") from None
    check(recovery, RECOVERY_SCHEMA, RECOVERY_FILE)
    if recovery.get("schema", 1) == 1:  # rewinds counted by 0-based step index then
        recovery["rewinds"] = [{**r, "step": r["step"] + 1} for r in recovery["rewinds"]]
    return recovery


def write_recovery(run_dir: Path, state: TrainState) -> None:
    """Atomically replace skip_list.json: the one record of bad data that any resume merges."""
    write_json_atomic(recovery_path(run_dir), {"schema": RECOVERY_SCHEMA_VERSION, "skip_list": state.skip_list,
                                               "rewinds": state.rewinds, "lr_scale": state.lr_scale})


def merge_recovery(state: TrainState, recovery: dict) -> None:
    """Fold the run-level record into a state just restored from a checkpoint (or fresh)."""
    state.skip_list = merge_windows(state.skip_list + recovery["skip_list"])
    seen = {r["step"] for r in state.rewinds}
    state.rewinds = state.rewinds + [r for r in recovery["rewinds"] if r["step"] not in seen]
    if recovery["lr_scale"] is not None:
        state.lr_scale = min(state.lr_scale, recovery["lr_scale"])


def recovery_pins(step: int, valid_steps: list[int], cfg: Config) -> list[int]:
    """Checkpoints retention must keep: the one a rewind starting now would need, and the last
    one before a WSD decay (to branch cooldowns from)."""
    m = cfg.monitor
    horizon = step - m.rewind_margin_steps - m.max_skips - 1
    pins = [s for s in valid_steps if s <= horizon][-1:]
    decay_start = decay_start_step(cfg)
    if decay_start is not None:
        pins += [s for s in valid_steps if s <= decay_start][-1:]
    return pins


class Rewinder:
    """Carries out rewinds for the loop: plan on rank 0, every rank follows the same plan."""

    def __init__(self, cfg: Config, engine: Engine, checkpointer: Checkpointer, monitor: SpikeMonitor,
                 data_batch_of: Callable[[int, list], int], run_dir: Path, emit: Callable[..., Any]):
        self.cfg, self.engine, self.checkpointer, self.monitor = cfg, engine, checkpointer, monitor
        self.data_batch_of, self.run_dir, self.emit = data_batch_of, run_dir, emit

    def merge_run_file(self, state: TrainState) -> None:
        """After a resume or at a fresh start: never replay a window this run already skipped."""
        merge_recovery(state, self.engine.decide(lambda: self._read_or_rebuild(state.step)))

    def _read_or_rebuild(self, step: int) -> dict:
        """skip_list.json, or, when it is unreadable or malformed (a torn write, an edit), the
        union of what every valid checkpoint recorded, written back with a `recovery_rebuilt` event."""
        try:
            return read_recovery(self.run_dir)
        except StateError as exc:
            rebuilt = TrainState()
            for ckpt_state in self.checkpointer.saved_train_states():
                merge_recovery(rebuilt, {"skip_list": ckpt_state["skip_list"], "rewinds": ckpt_state["rewinds"],
                                         "lr_scale": ckpt_state["lr_scale"]})
            write_recovery(self.run_dir, rebuilt)
            self.emit("recovery_rebuilt", step=step, reason=str(exc), skip_list=rebuilt.skip_list,
                      rewinds=len(rebuilt.rewinds), lr_scale=rebuilt.lr_scale)
            return {"skip_list": rebuilt.skip_list, "rewinds": rebuilt.rewinds, "lr_scale": rebuilt.lr_scale}

    def rewind(self, state: TrainState, spike_step: int) -> None:
        """Go back to a checkpoint from before the spike at `spike_step` and never feed its data
        window again; `state` (the checkpointer's train part) is restored in place."""
        def plan() -> tuple[RewindPlan, dict, str]:
            start = self.monitor.spike_start if self.monitor.spike_start is not None else spike_step
            p = plan_rewind(start, spike_step, lambda s: self.data_batch_of(s - 1, state.skip_list),
                            state.rewinds, self.cfg.monitor)
            return p, rewind_record(start, p), self.monitor.last_reason

        rewind_plan, record, reason = self.engine.decide(plan)
        if rewind_plan.escalate:
            self.emit("escalation", step=spike_step, rewinds=len(state.rewinds), window=rewind_plan.window)
            raise Escalation(f"spike at step {spike_step} after {len(state.rewinds)} rewinds; "
                             f"see {self.run_dir / 'events.jsonl'}")
        self.engine.decide(self.checkpointer.store.wait)  # rank 0's writer error reaches every rank
        ckpt = self.checkpointer.latest(rewind_plan.to_step)
        if ckpt is None:
            self.emit("escalation", step=spike_step, reason="no checkpoint before the spike")
            raise Escalation(f"spike at step {spike_step} and no checkpoint at or before step {rewind_plan.to_step}")
        # What the run learnt since that checkpoint survives the restore.
        old_scale = state.lr_scale
        history, lr_scale = state.rewinds + [record], state.lr_scale * rewind_plan.lr_scale_factor
        skip_list = merge_windows(state.skip_list + [rewind_plan.window])
        counters = state.skipped_steps, state.clipped_steps
        self.checkpointer.restore(ckpt)
        state.skip_list = merge_windows(state.skip_list + skip_list)
        state.rewinds, state.lr_scale = history, min(state.lr_scale, lr_scale)
        state.skipped_steps, state.clipped_steps = counters
        self.engine.decide(lambda: write_recovery(self.run_dir, state))
        self.monitor.reset_streak()
        self.emit("rewind", step=spike_step, to_step=state.step, window=rewind_plan.window,
                  checkpoint=str(ckpt.path), reason=reason)
        if rewind_plan.lr_scale_factor != 1.0:
            self.emit("lr_scale", step=state.step, old=old_scale, new=state.lr_scale)
