"""The triage's hand in every step and save outside the verdict (`Steps`, a base class of
`triage.Triage`), on every rank: the data a skip-window replay leaves out from its base on, the
learning rate's factor (a backoff on trial, a temporary one ramping back), the rewind points
kept (none taken during a replay: its later phases start from the base's), and the checkpoints
retention must keep (a replay's base). Each is a function of the replay in progress and the
train state, so a resume feeds and schedules what the uninterrupted run does."""
from __future__ import annotations

from dsslm.ckpt.train_state import TrainState
from dsslm.data.skips import merge_skip_list, stamp
from dsslm.recovery.replay import Phase
from dsslm.recovery.rewind import recovery_pins


class Steps:
    """For a class holding `cfg`, `rewinder`, `replay` and `_merged` (`triage.Triage`)."""

    def lr_factor(self, state: TrainState, step: int) -> float:
        """What step `step`'s learning rate is multiplied by for backoffs on trial and temporary
        ones: the backoff replay in progress after its planned base (a replay that had to start
        from an older checkpoint, its rewind point gone with a restart, trains the steps up to the
        base as they were), and with monitor.lr_recover_steps = R > 0 each state decision's
        factor from its base through its spike, ramping back to 1 over the next R steps."""
        recover = self.cfg.monitor.lr_recover_steps
        factor = 1.0
        r = self.replay
        if r is not None and r.phase == Phase.BACKOFF.value and step > r.base_step:
            factor *= self.cfg.monitor.lr_backoff ** r.backoffs
        if not recover:
            return factor
        for record in state.rewinds:
            if "target" in record and record["to_step"] < step < record["target"] + recover:
                low, ramp = record["lr_scale_factor"], max(0, step - record["target"]) / recover
                factor *= low + (1.0 - low) * ramp
        return factor

    def before_step(self, state: TrainState) -> None:
        """Every rank, before each step is fed: a replay's phase leaves its data out from the
        planned base on (idempotent: a resume at or after the base merges nothing new)."""
        r = self.replay
        if r is None:
            return
        if state.step == r.base_step and r.evidence[-1].get("from_step", r.base_step) < r.base_step:
            # A phase that reached its base from an older checkpoint (after a restart the point is
            # gone) keeps it as the point the uninterrupted run held there, without the replay in
            # progress (taken with the base's own idle part): the later phases, and an escalation's
            # restore, start there without the catch-up again.
            ring = self.rewinder.ring
            point = ring.newest(r.base_step)
            if ring.every and ring.capacity and (point is None or point.step != r.base_step):
                self.replay = None
                try:
                    ring.take(r.base_step)
                finally:
                    self.replay = r
        if r.phase == Phase.SKIP_WINDOW.value and state.step >= r.base_step:
            merged_already = self._merged
            if merged_already is not None and merged_already[0] is state.skip_list and \
                    merged_already[1] == (len(state.skip_list), r.phase, r.wide):
                return  # merged at an earlier step of this phase: not again every step (0.2 s at 57,660 entries)
            # Applying from the step after the base: a catch-up to the base feeds what the run fed.
            merged = merge_skip_list(state.skip_list + stamp(r.entries or [r.window], r.base_step + 1))
            if merged != state.skip_list:  # the same list object else: the loader's merged view stays cached
                state.skip_list = merged
            self._merged = (state.skip_list, (len(state.skip_list), r.phase, r.wide))

    def keep_rewind_point(self, step: int) -> None:
        """Every rank, after each applied or skipped step: a rewind point when one is due, but not
        during a replay (the points its later phases start from must stay in the ring)."""
        if self.replay is None and self.rewinder.ring.due(step):
            self.rewinder.ring.take(step)

    def pins(self, step: int, valid_steps: list[int]) -> list[int]:
        """Checkpoints retention must keep: the plain rewind's pins and a replay's base."""
        base = [self.replay.base_step] if self.replay else []
        return recovery_pins(step, valid_steps, self.cfg) + [s for s in valid_steps if s in base]
