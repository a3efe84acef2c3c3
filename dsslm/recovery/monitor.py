"""Loss-spike monitor: judge each optimizer step, and plan the recovery when a spike persists.

`SpikeMonitor.check(step, loss, gnorm)` runs on rank 0 with the globally reduced loss and the
pre-clip grad norm; the loop broadcasts the verdict. The baseline is robust (median and MAD of the
last `window` clean steps), so one spike cannot drag it, and only clean steps enter it, so a run of
spikes cannot teach the monitor that spikes are normal. Only upward deviations count: early in
training the loss falls faster than the rolling median follows, and that is progress.

Verdicts: a non-finite loss or grad norm, or a robust z above `hard_loss_z`, rewinds at once; an
isolated outlier (z above `loss_z`, or grad norm above `gnorm_mult` x the median clean norm) is
skipped; the (max_skips+1)-th outlier in a row rewinds. Detection delay with the defaults: an
isolated spike is skipped on its own step (0 steps); a sustained one rewinds 2 steps after its
first step (max_skips=2), or at once when it is hard or non-finite.

`plan_rewind` is a pure function from the spike, the data-batch mapping and the past rewinds to
the checkpoint to go back to, the data window to skip and the learning-rate back-off. Past rewinds
are records made by `rewind_record`; keep them run-level (like the skip list), not in the
checkpoint, or a rewind forgets the rewinds made after the checkpoint it loads.
"""
from __future__ import annotations

import math
import statistics
from collections import deque
from dataclasses import dataclass
from enum import Enum
from typing import Callable

from dsslm.config import MonitorCfg

MAD_TO_STD = 1.4826  # MAD x 1.4826 estimates the standard deviation of a normal distribution
# The scale never drops below 0.2% of the median loss plus 1e-3 nats: a noise-free curve (MAD ~ 0)
# would otherwise call any wobble a spike. With loss_z=6 a skip then needs a rise of at least
# 1.2% + 0.006 nats, with hard_loss_z=20 a rewind at least 4% + 0.02 nats. Real batch-to-batch
# noise (1-2% of the loss) sits above this floor, so it only binds on unusually smooth curves.
SCALE_FLOOR_REL = 2e-3
SCALE_FLOOR_NATS = 1e-3
GNORM_FLOOR = 1e-12  # a zero median grad norm would make any gradient an outlier
STATE_FORMAT = 1


class Verdict(str, Enum):
    OK = "ok"
    SKIP = "skip_step"
    REWIND = "rewind"
    ESCALATE = "escalate"


class SpikeMonitor:
    """Rolling robust baseline of the clean steps; `check` is called once per optimizer step."""

    def __init__(self, cfg: MonitorCfg):
        self.cfg = cfg
        self._losses: deque[float] = deque(maxlen=cfg.window)
        self._gnorms: deque[float] = deque(maxlen=cfg.window)
        self._streak = 0                  # consecutive outliers so far, reset by a clean step
        self._spike_start: int | None = None
        self.last_reason = ""             # why the last verdict was not OK, for the events log

    @property
    def spike_start(self) -> int | None:
        """First step of the current run of outliers; valid after SKIP or REWIND until the next
        clean step or `reset_streak()`. None when no outlier is pending."""
        return self._spike_start

    def check(self, step: int, loss: float, gnorm: float) -> Verdict:
        loss, gnorm = float(loss), float(gnorm)
        if not self.cfg.enabled:
            return Verdict.OK
        if not (math.isfinite(loss) and math.isfinite(gnorm)):
            # Checked before the history gate: a NaN must never enter the median.
            return self._rewind(step, f"non-finite loss={loss} gnorm={gnorm}")
        if len(self._losses) < self.cfg.min_history:
            self._record(loss, gnorm)
            return Verdict.OK
        z = self.loss_z(loss)
        if z > self.cfg.hard_loss_z:
            return self._rewind(step, f"loss z={z:.1f} > hard_loss_z={self.cfg.hard_loss_z}")
        gnorm_ratio = gnorm / max(statistics.median(self._gnorms), GNORM_FLOOR)
        if z > self.cfg.loss_z or gnorm_ratio > self.cfg.gnorm_mult:
            reason = f"loss z={z:.1f}, gnorm {gnorm_ratio:.1f}x median"
            if self._streak == 0:
                self._spike_start = step
            self._streak += 1
            if self._streak > self.cfg.max_skips:
                return self._rewind(step, f"{self._streak} outliers in a row ({reason})")
            self.last_reason = reason
            return Verdict.SKIP
        self._record(loss, gnorm)
        self.reset_streak()
        return Verdict.OK

    def loss_z(self, loss: float) -> float:
        """Robust z-score of `loss` against the clean history (positive = above the median)."""
        median = statistics.median(self._losses)
        mad = statistics.median(abs(x - median) for x in self._losses)
        floor = SCALE_FLOOR_REL * abs(median) + SCALE_FLOOR_NATS
        return (loss - median) / max(mad * MAD_TO_STD, floor)

    def reset_streak(self) -> None:
        """Forget the pending run of outliers (after the loop has acted on a REWIND)."""
        self._streak = 0
        self._spike_start = None
        self.last_reason = ""

    def state_dict(self) -> dict:
        """JSON-safe state: restoring it makes the monitor judge as if never interrupted."""
        return {"format": STATE_FORMAT, "losses": list(self._losses), "gnorms": list(self._gnorms),
                "streak": self._streak, "spike_start": self._spike_start}

    def load_state_dict(self, state: dict) -> None:
        if state.get("format") != STATE_FORMAT:
            raise ValueError(f"monitor state format={state.get('format')!r}, expected {STATE_FORMAT}; "
                             "the checkpoint was written by another dsslm version")
        if len(state["losses"]) != len(state["gnorms"]):
            raise ValueError("monitor state has losses and gnorms of different lengths")
        self._losses = deque((float(x) for x in state["losses"]), maxlen=self.cfg.window)
        self._gnorms = deque((float(x) for x in state["gnorms"]), maxlen=self.cfg.window)
        self._streak = int(state["streak"])
        start = state["spike_start"]
        self._spike_start = None if start is None else int(start)

    def _record(self, loss: float, gnorm: float) -> None:
        self._losses.append(loss)
        self._gnorms.append(gnorm)

    def _rewind(self, step: int, reason: str) -> Verdict:
        if self._streak == 0:
            self._spike_start = step
        # The streak is spent on this rewind; spike_start stays readable for plan_rewind.
        self._streak = 0
        self.last_reason = reason
        return Verdict.REWIND


@dataclass
class RewindPlan:
    to_step: int              # newest checkpoint step allowed; the caller loads latest_before(to_step)
    window: list[int]         # [start, end) data batches to add to the skip list
    lr_scale_factor: float    # multiply the run's lr_scale by this (1.0, or lr_backoff)
    escalate: bool            # too many rewinds: alert a human instead of rewinding


def plan_rewind(spike_start_step: int, spike_end_step: int, data_batch_of: Callable[[int], int],
                rewind_history: list[dict], cfg: MonitorCfg) -> RewindPlan:
    """Plan the recovery from a spike over optimizer steps [spike_start_step, spike_end_step].

    `data_batch_of(step)` maps a step to its data batch under the current skip list. The window
    runs from the first to the last batch fed during the spike; batches inside it that an older
    window already skips are never fed, so covering them is harmless. `rewind_history` holds one
    `rewind_record` per rewind already made in this run.
    """
    if spike_end_step < spike_start_step:
        raise ValueError(f"spike_end_step={spike_end_step} is before spike_start_step={spike_start_step}")
    window = [data_batch_of(spike_start_step), data_batch_of(spike_end_step) + 1]
    repeats = sum(_same_region(spike_start_step, window, past, cfg.region_steps) for past in rewind_history)
    # Bad data comes in runs longer than the few batches the detector has seen (a corrupt file,
    # a dedup failure): skip at least `skip_batches`, doubling each time the region spikes again,
    # so a long bad region costs a few rewinds, not one per batch.
    window[1] = max(window[1], window[0] + cfg.skip_batches * 2 ** repeats)
    same_region = repeats > 0
    return RewindPlan(
        to_step=max(0, spike_start_step - cfg.rewind_margin_steps),
        window=window,
        # The same steps spiking again on other data points at the optimizer, not the data.
        lr_scale_factor=cfg.lr_backoff if same_region else 1.0,
        escalate=len(rewind_history) >= cfg.max_rewinds,
    )


def rewind_record(spike_start_step: int, plan: RewindPlan) -> dict:
    """The JSON record of a rewind carried out, for `rewind_history`:
    {"step": first spike step, "window": [start, end), "to_step": int, "lr_scale_factor": float}."""
    return {"step": spike_start_step, "window": list(plan.window), "to_step": plan.to_step,
            "lr_scale_factor": plan.lr_scale_factor}


def _same_region(step: int, window: list[int], past: dict, region_steps: int) -> bool:
    past_start, past_end = past["window"]
    windows_touch = window[0] <= past_end and past_start <= window[1]
    return abs(step - past["step"]) < region_steps or windows_touch
