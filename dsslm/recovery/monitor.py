"""Loss-spike monitor: judge each optimizer step, and plan the recovery when a spike persists.

`SpikeMonitor.judge(step, loss, gnorm)` runs on rank 0 with the globally reduced loss and the
pre-clip grad norm; the loop broadcasts the verdict. Only clean steps enter the baseline, so a run
of spikes cannot teach the monitor that spikes are normal, and only upward deviations count:
early in training the loss falls faster than a rolling baseline follows, and that is progress.

Three detectors (`monitor.detector`), each over the same clean history:

- `mad` (default): robust z = (loss - median) / (1.4826 MAD) of the last `window` clean steps,
  so one spike cannot drag the baseline; grad norm over `gnorm_mult` x its reference (the larger
  of its window median and the median of its last `gnorm_trend` steps: its own trend).
- `zscore`: OLMo-core's skip-step test, z = (x - mean) / std of the last `window` clean steps for
  the loss and the grad norm alike (OLMo-core: window 128, 6 sigma: `monitor.window=128
  monitor.min_history=64 monitor.loss_z=6`). Unlike OLMo-core, outliers never enter the window.
- `max_multiple`: Megatron-LM's rerun check, a loss at least `max_multiple` (10) x the largest of
  the first `max_multiple_steps` (100) steps' losses. Blind to anything smaller: a net for
  blow-ups, not for spikes.

The loss decides what is a spike. A grad norm over its threshold with a loss that is not an
outlier is a `SURGE`: early in training the norm rises 5-70x while the loss falls (the run leaves
the unigram plateau), and skipping or rewinding that is a false alarm (docs/spikes.md, "Grad-norm
surges"). The loop re-runs a surge in place once (a one-off gradient fault is transient: the
re-run's normal update is applied) and otherwise applies it, clipped, and notes it (`accept`);
a surge never skips a step, opens a streak, names data or rewinds.

Verdicts: a non-finite loss or grad norm rewinds at once (`monitor.nonfinite=skip` makes it an
outlier, as OLMo-core's skip-step treats it); so does a z above `hard_loss_z` (mad, zscore); an
isolated outlier is skipped; the (max_skips+1)-th outlier in a row rewinds. Detection delay with
the defaults: an isolated spike is skipped on its own step (0 steps); a sustained one rewinds 2
steps after its first step (max_skips=2), or at once when it is hard or non-finite.

`rejudge` judges an in-place re-run of the step just judged as if the first attempt had never
been seen (its outlier is taken back out of the streak), so the monitor never learns a transient.

`step` is the step count (the step whose update is being judged, as in metrics.jsonl). What to
do about a rewind is planned in `recovery.rewind`.
"""
from __future__ import annotations

import math
import statistics
from collections import deque
from enum import Enum

from typing import Any

import numpy as np

from dsslm.data.skips import concentrated, offending
from dsslm.fields import MAX_STEP, Fields, Float, Int, ListOf, Optional, Spec, StateError, Str
from dsslm.config import MonitorCfg

MAD_TO_STD = 1.4826  # MAD x 1.4826 estimates the standard deviation of a normal distribution
# The scale never drops below 0.2% of the median loss plus 1e-3 nats: a noise-free curve (MAD ~ 0)
# would otherwise call any wobble a spike. With loss_z=6 a skip then needs a rise of at least
# 1.2% + 0.006 nats, with hard_loss_z=20 a rewind at least 4% + 0.02 nats. Real batch-to-batch
# noise (1-2% of the loss) sits above this floor, so it only binds on unusually smooth curves.
SCALE_FLOOR_REL = 2e-3
SCALE_FLOOR_NATS = 1e-3
GNORM_FLOOR = 1e-12  # a zero median grad norm would make any gradient an outlier
# 1: the mad detector's windows only (read as mad with no max_multiple baseline); 2: no sequence
# losses (a data verdict then blames against its batch alone until the history refills)
STATE_FORMAT = 3
# A sequence is blamed for a data verdict when its loss is this many robust standard deviations
# from the run's recent sequence losses (`blame`). Lower than the batch test's 6 (data.skips.
# OUTLIER_Z): the history holds ~1,000 sequences, so its median and MAD are steady, and a blamed
# sequence must also be needed to explain the spike (the minimal explanation).
REFERENCE_Z = 4.0
# Sequences in the history before it is trusted over the batch's own median.
MIN_REFERENCE = 64


class Verdict(str, Enum):
    """What happens to a step's update. Escalation is no verdict: it is `rewind.Escalation` (exit 3)."""
    OK = "ok"
    SKIP = "skip_step"
    REWIND = "rewind"
    # Never leaves the loop's `decide`: a surge step is applied (or its re-run's update is).
    SURGE = "gnorm_surge"


class SpikeMonitor:
    """Rolling baseline of the clean steps; `check` is called once per optimizer step."""

    def __init__(self, cfg: MonitorCfg):
        self.cfg = cfg
        self.state_spec = _MonitorState(cfg)
        self._losses: deque[float] = deque(maxlen=cfg.window)
        self._gnorms: deque[float] = deque(maxlen=cfg.window)
        # Mean loss per token of each of rank 0's sequences in the last clean steps: what a
        # sequence of a spiking step is measured against when a data verdict names it (`blame`).
        self._sequences: deque[float] = deque(maxlen=max(cfg.sequence_window, 1))
        self._streak = 0                  # consecutive outliers so far, reset by a clean step
        self._spike_start: int | None = None
        self._baseline_max: float | None = None  # max_multiple: largest of the first steps' losses
        self._baseline_count = 0
        self._before: tuple[int, int | None] = (0, None)  # the streak before the last verdict (rejudge)
        self.last_reason = ""             # why the last verdict was not OK, for the events log

    @property
    def spike_start(self) -> int | None:
        """First step of the current run of outliers; valid after SKIP or REWIND until the next
        clean step or `reset_streak()`. None when no outlier is pending."""
        return self._spike_start

    def judge(self, step: int, loss: float, gnorm: float, sequences: Any = ()) -> Verdict:
        """The verdict of one step; `sequences`, rank 0's per-sequence mean losses of it, join the
        history a data verdict blames against when the step is clean."""
        loss, gnorm = float(loss), float(gnorm)
        if not self.cfg.enabled:
            return Verdict.OK
        self._before = (self._streak, self._spike_start)
        if not (math.isfinite(loss) and math.isfinite(gnorm)):
            # Checked before the history gate: a NaN must never enter the baseline.
            reason = f"non-finite loss={loss} gnorm={gnorm}"
            return self._outlier(step, reason) if self.cfg.nonfinite == "skip" else self._rewind(step, reason)
        if not self._ready():
            trend = self._trend_z(loss)  # the descent's first steps: the trend alone can see a rise
            calm = gnorm <= self.cfg.gnorm_mult * max(self._gnorm_reference(), GNORM_FLOOR) if self._gnorms else True
            if trend is not None and trend > self.cfg.loss_trend_z and calm:
                return self._outlier(step, f"loss {trend:.1f} x the step-to-step noise over its recent level "
                                           f"(the first {len(self._losses)} steps)")
            self._record(loss, gnorm, sequences)
            return Verdict.OK
        hard, outlier, surge, reason = self._assess(loss, gnorm)
        if hard:
            return self._rewind(step, reason)
        if outlier:
            return self._outlier(step, reason)
        if surge:  # nothing recorded yet: the loop re-runs it, then `accept`s what it applies
            self.last_reason = reason
            return Verdict.SURGE
        self._record(loss, gnorm, sequences)
        self.reset_streak()
        return Verdict.OK

    def accept(self, loss: float, gnorm: float, sequences: Any = ()) -> None:
        """A SURGE step the loop applies: a clean step (its loss was not an outlier), so it enters
        the history, and the grad norm's trend follows the rise instead of calling every step of
        it a surge."""
        self._record(float(loss), float(gnorm), sequences)
        self.reset_streak()

    def outlier(self, step: int, reason: str) -> Verdict:
        """A SURGE the loop found to be its batch's alone (a held-out batch's grad norm is normal:
        `train.surge`): an outlier after all, in the streak as any (SKIP, or REWIND past
        max_skips)."""
        return self._outlier(step, reason)

    def rejudge(self, step: int, loss: float, gnorm: float, sequences: Any = ()) -> Verdict:
        """Judge an in-place re-run of the step `check` just called an outlier, as if that first
        attempt had not been seen (it never entered the baseline; its place in the streak goes)."""
        self._streak, self._spike_start = self._before
        return self.judge(step, loss, gnorm, sequences)

    def beyond_noise(self, loss: float, gnorm: float, rel: float) -> bool:
        """Is a step just judged an outlier still one with `rel` (relative) taken off its loss and
        grad norm? A replay on kernels that are not bitwise deterministic differs from its
        original by up to the measured spread; within it, it does not show the spike again."""
        if not (math.isfinite(loss) and math.isfinite(gnorm)) or rel <= 0 or not self._ready():
            return True
        hard, outlier, _, _ = self._assess(loss - rel * abs(loss), gnorm * (1.0 - rel))
        return hard or outlier

    def loss_outlier(self, loss: float) -> bool:
        """Would a step of this loss (its grad norm at the clean median) be an outlier or a hard
        spike against the clean history? False before the history is ready (nothing is judged
        then). `data.skips.concentrated` asks it of a spiking batch without its offending
        sequences."""
        loss = float(loss)
        if not math.isfinite(loss):
            return True
        if not self._ready():
            return False
        hard, outlier, _, _ = self._assess(loss, statistics.median(self._gnorms) if self._gnorms else 0.0)
        return hard or outlier

    def blame(self, losses: Any) -> np.ndarray:
        """Which sequences of a spiking step (their mean losses per token, every rank's) a data
        verdict names, as a bool mask: the fewest, taken by how far each stands from the run's
        recent sequence losses, whose removal leaves a step the monitor would pass; none when no
        such few exist (the whole batch rose: state, or a batch bad throughout, for a replay to
        tell). A sequence is a candidate when it is non-finite or REFERENCE_Z robust sigmas from
        the history's median (either side: a repeated n-gram can sit far below); at most half the
        step is ever named, and nothing of a step whose loss is no outlier (one flagged by its grad
        norm alone). Measured against history, not the batch's median, so a step of 1-7
        sequences names its bad sequence and not its neighbours. Until the history holds
        MIN_REFERENCE sequences, the batch test (`data.skips.offending`) decides."""
        x = np.asarray(losses, dtype=np.float64)
        if len(x) == 0 or not self.loss_outlier(float(np.mean(x))):
            # A step whose loss passes (an outlier by its grad norm alone) has nothing to explain:
            # naming a sequence of it would put healthy text on the skip list.
            return np.zeros(len(x), dtype=bool)
        if len(self._sequences) < MIN_REFERENCE:
            return offending(x) if concentrated(x, self.loss_outlier) else np.zeros(len(x), dtype=bool)
        median, scale = self._reference()
        z = np.where(np.isfinite(x), np.abs(x - median) / scale, np.inf)
        hit = np.zeros(len(x), dtype=bool)
        for i in np.argsort(-z, kind="stable")[:max(1, len(x) // 2)]:
            if z[i] <= REFERENCE_Z:
                break
            hit[i] = True
            if hit.all() or not self.loss_outlier(float(np.mean(x[~hit]))):
                return hit if not hit.all() else np.zeros(len(x), dtype=bool)
        return np.zeros(len(x), dtype=bool)

    def standing_out(self, losses: Any) -> np.ndarray:
        """Which sequences of a spiking step stand out on their own against the history (a bool
        mask): non-finite, or more than REFERENCE_Z robust sigmas from its median, either side;
        none of a step whose loss is no outlier. Unlike `blame`, no minimal explanation and no
        cap: a batch bad throughout (every sequence random tokens) has every sequence standing
        out, where a state spike raises each by a fraction of the history's spread. What a
        replay-proven data verdict names (`recovery.reach`); until the history holds
        MIN_REFERENCE sequences, `blame`'s batch test."""
        x = np.asarray(losses, dtype=np.float64)
        if len(x) == 0 or not self.loss_outlier(float(np.mean(x))):
            return np.zeros(len(x), dtype=bool)
        if len(self._sequences) < MIN_REFERENCE:
            return self.blame(x)
        median, scale = self._reference()
        return ~np.isfinite(x) | (np.abs(np.where(np.isfinite(x), x, median) - median) > REFERENCE_Z * scale)

    def _reference(self) -> tuple[float, float]:
        """The history of sequence losses as (median, robust scale): what `blame` measures from."""
        history = np.asarray(self._sequences)
        median = float(np.median(history))
        return median, max(MAD_TO_STD * float(np.median(np.abs(history - median))), SCALE_FLOOR_REL * abs(median),
                           SCALE_FLOOR_NATS)

    def z_of(self, loss: Any) -> Any:
        """How many robust standard deviations a mean loss per token (or an array of them: the
        history's median taken once) stands from the history of sequence losses (signed), or None
        until the history holds MIN_REFERENCE sequences."""
        if len(self._sequences) < MIN_REFERENCE:
            return None
        median, scale = self._reference()
        return (np.asarray(loss, dtype=np.float64) - median) / scale if np.ndim(loss) else (float(loss) - median) / scale

    def forgive(self) -> None:
        """Take back the last verdict's place in the streak (a replayed step within the noise)."""
        self._streak, self._spike_start = self._before
        self.last_reason = ""

    def loss_z(self, loss: float) -> float:
        """Robust z-score of `loss` against the clean history (positive = above the median)."""
        median = statistics.median(self._losses)
        mad = statistics.median(abs(x - median) for x in self._losses)
        floor = SCALE_FLOOR_REL * abs(median) + SCALE_FLOOR_NATS
        return (loss - median) / max(mad * MAD_TO_STD, floor)

    def window(self) -> dict:
        """The clean history the next verdict is judged against (forensics)."""
        return {"detector": self.cfg.detector, "losses": list(self._losses), "gnorms": list(self._gnorms),
                "baseline_max": self._baseline_max, "sequences": len(self._sequences)}

    def reset_streak(self) -> None:
        """Forget the pending run of outliers (after the loop has acted on a REWIND)."""
        self._streak = 0
        self._spike_start = None
        self.last_reason = ""

    def state_dict(self) -> dict:
        """JSON-safe state: restoring it makes the monitor judge as if never interrupted."""
        return {"format": STATE_FORMAT, "detector": self.cfg.detector, "losses": list(self._losses),
                "gnorms": list(self._gnorms), "streak": self._streak, "spike_start": self._spike_start,
                "baseline_max": self._baseline_max, "baseline_count": self._baseline_count,
                "sequences": list(self._sequences)}

    def load_state_dict(self, state: dict) -> None:
        if state.get("format") not in (1, 2, STATE_FORMAT):
            raise ValueError(f"monitor state format={state.get('format')!r}, expected {STATE_FORMAT}; "
                             "the checkpoint was written by another dsslm version")
        if len(state["losses"]) != len(state["gnorms"]):
            raise ValueError("monitor state has losses and gnorms of different lengths")
        self._losses = deque((float(x) for x in state["losses"]), maxlen=self.cfg.window)
        self._gnorms = deque((float(x) for x in state["gnorms"]), maxlen=self.cfg.window)
        self._streak = int(state["streak"])
        start = state["spike_start"]
        self._spike_start = None if start is None else int(start)
        self._baseline_max = state.get("baseline_max")
        self._baseline_count = int(state.get("baseline_count", 0))
        self._sequences = deque((float(x) for x in state.get("sequences", [])), maxlen=self._sequences.maxlen)

    # --- detectors ----------------------------------------------------------------------------
    def _ready(self) -> bool:
        if self.cfg.detector == "max_multiple":
            return self._baseline_count >= self.cfg.max_multiple_steps
        return len(self._losses) >= self.cfg.min_history

    def _assess(self, loss: float, gnorm: float) -> tuple[bool, bool, bool, str]:
        """(hard, outlier, surge, reason) of a finite step against the clean history. Only the
        loss makes an outlier; a grad norm over its threshold with a loss that is not one is a
        surge."""
        cfg = self.cfg
        if cfg.detector == "max_multiple":
            ratio = loss / max(self._baseline_max, SCALE_FLOOR_NATS)
            return False, ratio >= cfg.max_multiple, False, f"loss {ratio:.1f}x the first steps' max"
        if cfg.detector == "zscore":
            z, gnorm_z = _zscore(loss, self._losses, relative_floor=True), _zscore(gnorm, self._gnorms)
            reason = f"loss z={z:.1f}, gnorm z={gnorm_z:.1f} (mean/std)"
            if z > cfg.hard_loss_z:
                return True, True, False, f"loss z={z:.1f} > hard_loss_z={cfg.hard_loss_z} (mean/std)"
            return False, z > cfg.loss_z, z <= cfg.loss_z and gnorm_z > cfg.loss_z, reason
        z = self.loss_z(loss)
        if z > cfg.hard_loss_z:
            return True, True, False, f"loss z={z:.1f} > hard_loss_z={cfg.hard_loss_z}"
        ratio = gnorm / max(self._gnorm_reference(), GNORM_FLOOR)
        trend = self._trend_z(loss)
        # Over the recent level while the loss falls, with a calm grad norm. With a surging one it
        # is the plateau's exit, whose loss wobbles as the norm jumps 10-50x (two false alarms of
        # the clean bench, one an LR cut): a surge, for the held-out probe to tell apart.
        rose = trend is not None and trend > cfg.loss_trend_z and ratio <= cfg.gnorm_mult
        reason = (f"loss z={z:.1f}{f' ({trend:.1f} over its recent level)' if rose else ''}, "
                  f"gnorm {ratio:.1f}x its reference")
        outlier = z > cfg.loss_z or rose
        return False, outlier, not outlier and ratio > cfg.gnorm_mult, reason

    def _trend_z(self, loss: float) -> float | None:
        """The loss's rise over its recent level (the median of the last `loss_trend` clean losses)
        in units of the step-to-step noise (the robust spread of successive clean losses'
        differences around their median difference, / sqrt 2: a steady descent's slope is no
        noise), where the recent level is below the window's median (the loss is falling faster
        than the median follows: its MAD is then the descent's, and a batch of garbage at step 31
        stood under the window's threshold); None otherwise, or before loss_trend + 3 clean steps."""
        k = self.cfg.loss_trend
        if self.cfg.detector != "mad" or k <= 0 or len(self._losses) < k + 3:
            return None
        losses = list(self._losses)
        recent = statistics.median(losses[-k:])
        if recent >= statistics.median(losses):
            return None
        steps = [b - a for a, b in zip(losses, losses[1:])]
        middle = statistics.median(steps)
        noise = MAD_TO_STD * statistics.median(abs(d - middle) for d in steps) / math.sqrt(2)
        return (loss - recent) / max(noise, SCALE_FLOOR_REL * abs(recent) + SCALE_FLOOR_NATS)

    def _gnorm_reference(self) -> float:
        """The grad norm a step's is measured against: its window median, or the median of its
        last `gnorm_trend` steps when that is higher (a norm that has been rising for a few clean
        steps is judged against where it is now, not against a median that lags by half a window)."""
        reference = statistics.median(self._gnorms)
        k = self.cfg.gnorm_trend
        if k > 0 and len(self._gnorms) >= k:
            reference = max(reference, statistics.median(list(self._gnorms)[-k:]))
        return reference

    def _record(self, loss: float, gnorm: float, sequences: Any = ()) -> None:
        self._losses.append(loss)
        self._gnorms.append(gnorm)
        self._sequences.extend(float(x) for x in sequences if math.isfinite(x))
        if self._baseline_count < self.cfg.max_multiple_steps:
            self._baseline_max = loss if self._baseline_max is None else max(self._baseline_max, loss)
            self._baseline_count += 1

    def _outlier(self, step: int, reason: str) -> Verdict:
        if self._streak == 0:
            self._spike_start = step
        self._streak += 1
        if self._streak > self.cfg.max_skips:
            return self._rewind(step, f"{self._streak} outliers in a row ({reason})")
        self.last_reason = reason
        return Verdict.SKIP

    def _rewind(self, step: int, reason: str) -> Verdict:
        if self._streak == 0:
            self._spike_start = step
        # The streak is spent on this rewind; spike_start stays readable for plan_rewind.
        self._streak = 0
        self.last_reason = reason
        return Verdict.REWIND


def _zscore(x: float, history: deque, relative_floor: bool = False) -> float:
    """(x - mean) / std of `history` (sample std, as torch.std_mean); a loss's std never drops
    below the same floor the mad detector uses, a grad norm's below GNORM_FLOOR."""
    mean = math.fsum(history) / len(history)
    var = math.fsum((h - mean) ** 2 for h in history) / max(len(history) - 1, 1)
    floor = SCALE_FLOOR_REL * abs(mean) + SCALE_FLOOR_NATS if relative_floor else GNORM_FLOOR
    return (x - mean) / max(math.sqrt(var), floor)


class _MonitorState(Spec):
    """The monitor part of state.json: types and ranges, and the detector this run judges with."""

    def __init__(self, cfg: MonitorCfg):
        self.detector = cfg.detector
        self.fields = Fields(
            optional=("detector", "baseline_max", "baseline_count", "sequences"),
            format=Int(1, STATE_FORMAT), detector=Str(32), losses=ListOf(Float(), max_len=cfg.window),
            gnorms=ListOf(Float(0.0), max_len=cfg.window), streak=Int(0, MAX_STEP),
            spike_start=Optional(Int(1, MAX_STEP)), baseline_max=Optional(Float()),
            baseline_count=Int(0, MAX_STEP), sequences=ListOf(Float(), max_len=max(cfg.sequence_window, 1)))

    def validate(self, value: Any, path: str) -> None:
        self.fields.validate(value, path)
        if len(value["losses"]) != len(value["gnorms"]):  # one pair per judged step
            raise StateError(f"{path}.gnorms: {len(value['gnorms'])} values for {len(value['losses'])} losses")
        saved = value.get("detector", "mad")
        if saved != self.detector:
            raise StateError(f"{path}.detector: {saved!r}, but this run judges with monitor.detector="
                             f"{self.detector!r}")
