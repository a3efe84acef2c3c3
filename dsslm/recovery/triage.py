"""Spike triage by replay: was a spike the data, the optimizer state, or a one-off fault?

`Triage` answers it for a spike that rewinds, decided on rank 0 and followed by every rank, by
replaying from the newest checkpoint or rewind point before it (the base): the same data (clean:
transient), without the spike's data (clean: data), with the learning rate backed off (clean:
state), within a replay budget; and records an isolated outlier's re-run in place (`note_rerun`).
How and why, with the figures, is docs/spikes.md; the replay in progress and the checkpoint part
it travels in are `recovery/replay.py`.

This class holds what every phase shares and answers the loop (`review`, `rewind`); the phases
are its base classes, a module each, so that each reads as one idea:

- `triage_open.py` (`Opening`): a spike that rewinds opens a triage: its base, budget, first replay;
- `triage_replays.py` (`Replays`): each phase's replay from the base, and which phase comes next;
- `triage_verdicts.py` (`Verdicts`): the verdict and what it commits, an escalation, the fallback;
- `triage_reruns.py` (`Reruns`): an isolated outlier's re-run in place, a step's spread measured;
- `triage_steps.py` (`Steps`): its hand in every step and save: the data a replay leaves out, the
  learning rate's factor, rewind points, the checkpoints retention keeps.

Base classes rather than modules of functions: the phases call one another through `self` (so a
test that stands in for one, patching `Triage._replay_from`, is called by all of them), and read
and write the state held here.
"""
from __future__ import annotations

import collections
from typing import Any, Callable

from dsslm.ckpt.train_state import TrainState
from dsslm.config import Config
from dsslm.engine.base import Engine
from dsslm.recovery.forensics import Forensics
from dsslm.recovery.monitor import SpikeMonitor, Verdict
from dsslm.recovery.replay import Replay, ReplayProgress, num as _num
from dsslm.recovery.rewind import Rewinder
from dsslm.recovery.triage_open import Opening
from dsslm.recovery.triage_replays import Replays
from dsslm.recovery.triage_reruns import Reruns
from dsslm.recovery.triage_steps import Steps
from dsslm.recovery.triage_verdicts import Verdicts


class Triage(Opening, Replays, Verdicts, Reruns, Steps):
    """The loop's spike policy: `review` every step, `rewind` on a REWIND verdict."""

    def __init__(self, cfg: Config, engine: Engine, rewinder: Rewinder, monitor: SpikeMonitor,
                 forensics: Forensics, progress: ReplayProgress, emit: Callable[..., Any]):
        self.cfg, self.engine, self.rewinder, self.monitor = cfg, engine, rewinder, monitor
        self.forensics, self.progress, self.emit = forensics, progress, emit
        self.enabled = cfg.monitor.enabled and cfg.monitor.triage
        self.save_base: Callable[[], None] | None = None  # a synchronous save (job.setup sets it)
        # (the skip list before_step last merged a phase's data into, what it was merged for): held,
        # so its id is not reused; a restore or a new phase replaces the list or the key.
        self._merged: tuple[list, tuple] | None = None
        # Where a step is not bitwise reproducible (CUDA kernels; the faults.replay_noise drill), a
        # replayed step counts as the spike coming back only beyond NOISE_MARGIN (triage_reruns.py)
        # x the spread of one step computed twice, measured on this job's first step (`note_spread`).
        self.spread_pending = self.enabled and (engine is not None and engine.device.type != "cpu"
                                                or cfg.faults.replay_noise > 0)
        self.noise = 0.0
        # The original pass's last few steps, for the evidence of a spike that rewinds.
        self._recent: collections.deque = collections.deque(maxlen=max(8, 2 * (cfg.monitor.max_skips + 2)))
        # All three travel in the checkpoint part "triage", and so does `_streak`.
        progress.bind(rewinder._fed, self._recent, forensics.sequences if forensics is not None else None,
                      forensics.suspects if forensics is not None else None)

    @property
    def _streak(self) -> tuple[int, list] | None:
        """(first step of the open streak, the skip list before its re-runs committed data): a
        streak that goes on to rewind replays the same data first (kept in the checkpoint, so a
        resume in the middle of a streak replays the same data too)."""
        return self.progress.streak

    @_streak.setter
    def _streak(self, value: tuple[int, list] | None) -> None:
        self.progress.streak = value

    @property
    def replay(self) -> Replay | None:
        return self.progress.replay

    @replay.setter
    def replay(self, value: Replay | None) -> None:
        self.progress.replay = value

    # --- asked by the loop ---------------------------------------------------------------------
    def replaying(self, step: int) -> bool:
        """True while a replay is judging `step` (a step of the spike it replays)."""
        r = self.replay
        return r is not None and r.spike_start <= step <= r.target

    def may_rerun(self, step: int) -> bool:
        """Re-run an isolated outlier in place? Not while a replay is asking whether it comes back."""
        return self.enabled and not self.replaying(step)

    def review(self, state: TrainState, step: int, verdict: Verdict, reason: str, loss: float,
               gnorm: float, spike: bool = True) -> tuple[Verdict, str]:
        """The verdict (and why) the loop acts on for the step just computed: during a replay a
        spike step outside the thresholds is the spike coming back (REWIND: the next phase), and
        the target passing clean concludes the triage. `spike`: False for a skip that is no
        spike (an fp16 loss-scaler overflow, scheduled by the scaler's growth): that step is
        skipped as in any pass, and says nothing about whether the spike came back."""
        row = [step, _num(loss), _num(gnorm), verdict.value]
        if not self.replaying(step):
            self._recent.append(row)
            r = self.replay
            if r is not None and verdict is Verdict.REWIND:  # before the spike it replays: see rewind()
                r.evidence[-1]["steps"].append(row)
                r.evidence[-1]["spiked_ahead"] = step
                return verdict, (f"triage: a new spike in the {r.phase} replay's run-up, before the spike at steps "
                                 f"[{r.spike_start}, {r.target}] it replays ({reason})")
            return verdict, reason
        self.replay.evidence[-1]["steps"].append(row)
        if verdict is not Verdict.OK and spike and self.noise and \
                not self.engine.decide(lambda: self.monitor.beyond_noise(loss, gnorm, self.noise)):
            self.monitor.forgive()
            row[3] = "within_noise"
            verdict, reason = Verdict.OK, ""
        if verdict is not Verdict.OK and spike:
            return Verdict.REWIND, f"triage: the spike came back in the {self.replay.phase} replay ({reason})"
        if step == self.replay.target:
            self._conclude(state)
        return verdict, reason

    def rewind(self, state: TrainState, record: Any) -> None:
        """Act on a REWIND at step `record.step`: start a triage, take its next phase, or (triage
        off, or over budget) the plain rewind policy. Restores `state` in place on every rank."""
        if self.replay is not None and record.step < self.replay.spike_start:
            self._spiked_ahead(state)
        elif self.replay is not None:
            self._next_phase(state, record.step)
        elif self.enabled:
            self._start(state, record.step)
        else:
            self.rewinder.rewind(state, record.step)
