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

`step` is the step count (the step whose update is being judged, as in metrics.jsonl). What to
do about a rewind is planned in `recovery.rewind`.
"""
from __future__ import annotations

import math
import statistics
from collections import deque
from enum import Enum

from dsslm.ckpt.schema import MAX_STEP, Fields, Float, Int, ListOf, Optional
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
    """What happens to a step's update. Escalation is no verdict: it is `rewind.Escalation` (exit 3)."""
    OK = "ok"
    SKIP = "skip_step"
    REWIND = "rewind"


class SpikeMonitor:
    """Rolling robust baseline of the clean steps; `check` is called once per optimizer step."""

    def __init__(self, cfg: MonitorCfg):
        self.cfg = cfg
        self.state_schema = Fields(
            format=Int(STATE_FORMAT, STATE_FORMAT), losses=ListOf(Float(), max_len=cfg.window),
            gnorms=ListOf(Float(0.0), max_len=cfg.window), streak=Int(0, MAX_STEP),
            spike_start=Optional(Int(1, MAX_STEP)))
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
