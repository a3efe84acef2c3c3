"""The loop's one door to spike recovery (docs/spikes.md): the monitor, the triage and its
replays, the rewinder and the forensics behind a few verbs, fed callables rather than the job.

    spikes = SpikePolicy(cfg, engine, run_dir, emit, loader, tokenizer)
    parts = {..., **spikes.parts()}                # its checkpoint parts: "monitor", "triage"
    spikes.bind(checkpointer, global_batch, save)  # once the checkpointer exists
    spikes.resume(state, save)                     # after a resume or a start
    factor = spikes.before_step(state, step)       # the learning rate's factor; a replay's data out
    verdict, reason, result = spikes.decide(state, step, fed, batches, result, again, probe)
    spikes.after_step(state, verdict, record)      # a rewind, or a rewind point
    spikes.before_save(state) -> checkpoints to pin

`decide` is the one place a step's verdict is made, the same on every rank: the monitor's (or
the fp16 scaler's), a surge's held-out probe and re-run, an outlier's in-place re-run, and during
a triage replay whether the spike came back. `again()` computes the step once more at the same
weights, batch and random state (its gradients dropped first); `probe()` is a held-out batch's
grad norm, or None.
"""
from __future__ import annotations

import contextlib

import math
from pathlib import Path
from typing import Any, Callable

from dsslm.ckpt.train_state import TrainState
from dsslm.config import Config
from dsslm.data.loader import Loader
from dsslm.data.stream import StepSlice
from dsslm.engine.base import Engine
from dsslm.loss import StepResult
from dsslm.recovery.forensics import Forensics
from dsslm.recovery.monitor import SpikeMonitor, Verdict
from dsslm.recovery.rewind import Rewinder
from dsslm.recovery.triage import ReplayProgress, Triage

FP16_OVERFLOW = "fp16_overflow"
# A surge is its batch's alone when a held-out batch's grad norm is under 1/PROBE_SHARE of the
# step's: a repeated 4-gram batch's norm was 11x its reference with the held-out one near 1x; a
# model-wide rise out of the unigram plateau shows on the held-out batch too (docs/spikes.md).
PROBE_SHARE = 3.0

Again = Callable[[], StepResult]
Probe = Callable[[], "float | None"]


class SpikePolicy:
    def __init__(self, cfg: Config, engine: Engine, run_dir: Path, emit: Callable[..., Any], loader: Loader,
                 tokenizer: dict):
        self.cfg, self.engine, self.emit = cfg, engine, emit
        self.run_dir, self.loader = run_dir, loader
        self.monitor = SpikeMonitor(cfg.monitor)
        self.forensics = Forensics(cfg, engine, run_dir, tokenizer, emit, loader)
        self.progress = ReplayProgress()
        # Forensics' gathers and writes, judged by the watchdog as a forward/backward (job.setup).
        self.busy: Callable[[int], contextlib.AbstractContextManager] = lambda step: contextlib.nullcontext()
        self.rewinder: Rewinder | None = None
        self.triage: Triage | None = None

    def parts(self) -> dict[str, Any]:
        """The checkpoint parts that make a resume judge and triage as if never interrupted."""
        return {"monitor": self.monitor, "triage": self.progress}

    def bind(self, checkpointer: Any, global_batch: int, save_base: Callable[[], None]) -> None:
        """The rewinder and the triage, once the checkpointer (which holds `parts`) exists.
        `save_base`: a synchronous save, for an escalating triage's base held only in memory."""
        self.rewinder = Rewinder(self.cfg, self.engine, checkpointer, self.monitor, global_batch, self.run_dir,
                                 self.emit, self.loader)
        self.triage = Triage(self.cfg, self.engine, self.rewinder, self.monitor, self.forensics, self.progress,
                             self.emit)
        self.triage.save_base = save_base

    # --- the job's start and saves -------------------------------------------------------------
    def resume(self, state: TrainState) -> None:
        """Fold in run.dir/skip_list.json (what any earlier job learnt, but the data a triage in
        progress is trying again)."""
        self.rewinder.merge_run_file(state, self.triage.replay.withdrawn if self.triage.replay else [])

    def protect_start(self, state: TrainState, save: Callable[[], None]) -> None:
        """A checkpoint at the run's first step when none is at or before it: a spike at step 7
        then rewinds instead of escalating."""
        if self.cfg.monitor.enabled:
            self.rewinder.ensure_start_checkpoint(state, save)

    def before_save(self, state: TrainState, valid_steps: Callable[[], list[int]]) -> list[int]:
        """Escalate instead of a checkpoint whose skip list a resume would refuse; the steps
        retention must keep (a rewind's and a replay's bases)."""
        self.rewinder.check_skip_list(state.skip_list, state.step)
        return self.triage.pins(state.step, valid_steps()) if self.engine.is_main else []

    def memory(self) -> dict:
        """Host bytes the rewind points hold on this rank."""
        return self.rewinder.ring.memory()

    # --- every step ----------------------------------------------------------------------------
    def before_step(self, state: TrainState, step: int) -> float:
        """Before step `step` is fed: a triage replay's data left out from its base on; returns what
        the learning rate is multiplied by (a backoff on trial, a temporary one ramping back)."""
        self.triage.before_step(state)
        return self.triage.lr_factor(state, step)

    def decide(self, state: TrainState, step: int, fed: StepSlice, batches: list, result: StepResult,
               again: Again, probe: Probe) -> tuple[Verdict, str, StepResult]:
        """The verdict (and why) for the step just computed, and the result its update uses (a
        re-run's, if any). On every rank, in the same order: its collectives match."""
        self.rewinder.note(step, fed.first, fed.end)
        if self.triage.spread_pending:  # once per job, where kernels are not bitwise deterministic
            result = self._measure_spread(step, result, again)
        verdict, reason = self._judge(step, result)
        done = False  # a surge found to be its batch's alone was captured and re-run already
        if verdict is Verdict.SURGE:
            verdict, reason, result, done = self._surge(state, step, fed, batches, result, reason, again, probe)
        spike = verdict is not Verdict.OK and not reason.startswith(FP16_OVERFLOW)
        if spike and not done:
            # A replay's evidence goes to its decision, not to a folder; its sequences are kept: a
            # wide replay names what stood out where the narrow one came back (`_widened`).
            with self.busy(step):
                self.forensics.capture(step, fed, batches, result, verdict.value, reason, self.monitor.window(),
                                       folder=not self.triage.replaying(step))
        if spike and not done and verdict is Verdict.SKIP and self.triage.may_rerun(step):
            verdict, reason, result = self._rerun_in_place(state, step, result, reason, again)
        verdict, reason = self.triage.review(state, step, verdict, reason, result.loss, result.gnorm, spike)
        return verdict, reason, result

    def after_step(self, state: TrainState, verdict: Verdict, record: Any) -> None:
        """After the step's verdict was acted on: a REWIND goes back (the triage's next replay, or
        the plain rewind; `state` restored in place on every rank); else a rewind point when due."""
        if verdict is Verdict.REWIND:
            self.triage.rewind(state, record)
        else:
            self.triage.keep_rewind_point(state.step)

    # --- how a verdict is reached --------------------------------------------------------------
    def _judge(self, step: int, result: StepResult, rerun: bool = False) -> tuple[Verdict, str]:
        """One verdict (and why) for every rank: an fp16 overflow is the scaler's skip; spikes are
        rank 0's call, followed by all. `rerun`: the in-place re-run of the step just judged."""
        loss, gnorm = result.loss, result.gnorm
        scaler = self.engine.scaler
        overflow = not rerun and scaler is not None and scaler.update(gnorm)
        skip = (Verdict.SKIP, FP16_OVERFLOW) if overflow else None  # the scale it backs off to: train_step
        # A non-finite loss too goes to the monitor, which may call it a spike and rewind; but an
        # overflowed step is never applied, whatever the monitor says or whether there is one.
        if overflow and (math.isfinite(loss) or not self.cfg.monitor.enabled):
            return skip
        if not self.cfg.monitor.enabled:
            return Verdict.OK, ""
        judge = self.monitor.rejudge if rerun else self.monitor.judge
        verdict, reason = self.engine.decide(lambda: (judge(step, loss, gnorm, result.sequence_losses),
                                                      self.monitor.last_reason))
        if overflow and verdict in (Verdict.OK, Verdict.SURGE):
            return skip
        return verdict, reason if verdict is not Verdict.OK else ""

    def _surge(self, state: TrainState, step: int, fed: StepSlice, batches: list, first: StepResult, reason: str,
               again: Again, probe: Probe) -> tuple[Verdict, str, StepResult, bool]:
        """A grad norm over its threshold with a loss that is no outlier (docs/spikes.md, "Grad-norm
        surges"). Two questions, each answered by computing again at the same weights:

        - Is it the batch's alone? A held-out batch's grad norm (`probe`): where it is under
          1/PROBE_SHARE of the step's, the surge is this batch's (a repeated n-gram, a corrupted
          gradient): an outlier after all, decided as any. Where the held-out batch shares it, it
          is the model's (leaving the unigram plateau): never skipped.
        - Is it a one-off fault? The step once more in place (it also brings the batch's gradients
          back after the probe): a normal re-run was transient, and its update is applied.

        A surge that is the model's is applied, clipped (a `gnorm_surge` event); it names no data,
        opens no streak and is no spike to a replay. In a replay (no re-run in place) the probe and
        the recompute still run, so it reaches the original pass's answer. The last value: the
        re-run's capture and verdict are done (`decide` does not repeat them)."""
        held_out = probe()
        second = again()
        rerun = self.triage.may_rerun(step)
        verdict, _ = self._judge(step, second, rerun=True)
        if verdict is Verdict.SURGE and held_out is not None and held_out * PROBE_SHARE < second.gnorm:
            why = f"{reason}; a held-out batch's grad norm {held_out:.3g}: this batch's alone"
            verdict = self.engine.decide(lambda: self.monitor.outlier(step, why))
            with self.busy(step):  # in a replay, its sequences only (as `decide` does)
                self.forensics.capture(step, fed, batches, second, verdict.value, why, self.monitor.window(),
                                       folder=not self.triage.replaying(step))
            if rerun and verdict is Verdict.SKIP:  # reproduced in place: data, or unknown (Triage.note_rerun)
                self.triage.note_rerun(state, step, (first.loss, first.gnorm, why), (second.loss, second.gnorm),
                                       verdict)
            return verdict, why, second, True
        if verdict is Verdict.OK and rerun:  # a transient fault, as an outlier's normal re-run is
            self.triage.note_rerun(state, step, (first.loss, first.gnorm, reason), (second.loss, second.gnorm),
                                   verdict, first_verdict=Verdict.SURGE.value)
        elif verdict is Verdict.SURGE:
            self.engine.decide(lambda: self.monitor.accept(second.loss, second.gnorm, second.sequence_losses))
            self.emit("gnorm_surge", step=step, loss=first.loss, gnorm=first.gnorm, reason=reason,
                      held_out_gnorm=held_out, rerun_gnorm=second.gnorm)
        elif verdict is not Verdict.OK:  # the re-run's loss is an outlier (never on a deterministic machine)
            return verdict, self.monitor.last_reason, second, False
        return Verdict.OK, "", second, False

    def _rerun_in_place(self, state: TrainState, step: int, first: StepResult, reason: str,
                        again: Again) -> tuple[Verdict, str, StepResult]:
        """Megatron-LM's rerun: the outlier's step once more with the same weights, batch and random
        state, its gradients dropped first. A normal result means the first was a transient fault,
        and the re-run's update is applied; a reproduced outlier is skipped as before."""
        result = again()
        verdict, rerun_reason = self._judge(step, result, rerun=True)
        if verdict is Verdict.SURGE:  # its loss came back normal: applied as any surge (a transient outlier)
            self.engine.decide(lambda: self.monitor.accept(result.loss, result.gnorm, result.sequence_losses))
            verdict, rerun_reason = Verdict.OK, ""
        self.triage.note_rerun(state, step, (first.loss, first.gnorm, reason), (result.loss, result.gnorm), verdict)
        return verdict, rerun_reason, result

    def _measure_spread(self, step: int, first: StepResult, again: Again) -> StepResult:
        """The job's first step once more, as a re-run in place computes it: how far apart two
        computations of one step land is what a triage replay must exceed to show a spike again."""
        second = again()
        self.triage.note_spread(step, (first.loss, first.gnorm), (second.loss, second.gnorm))
        return second
