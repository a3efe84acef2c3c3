"""Opening a triage (`Opening`, a base class of `triage.Triage`): a spike that rewinds becomes a
replay in progress. Its base is planned from the config's grid, not from what this job holds, and
its whole plan must fit the replay budget before the first replay runs, so a resumed job opens
(or falls back) exactly as the uninterrupted one; a streak whose first outlier was re-run in place
starts at the skip-window phase, and the data its re-runs committed is withheld for the triage to
decide (docs/spikes.md)."""
from __future__ import annotations

from dsslm.ckpt.train_state import TrainState
from dsslm.data.skips import merge_skip_list
from dsslm.recovery.replay import Phase, Replay


class Opening:
    """For a class holding `cfg`, `engine`, `rewinder`, `monitor`, `forensics`, `emit`, `_streak`,
    `_recent` and the other phases (`triage.Triage`)."""

    def _start(self, state: TrainState, target: int) -> None:
        spike_start, reason = self.engine.decide(lambda: (self.monitor.spike_start or target, self.monitor.last_reason))
        plan = self.rewinder.plan(state, spike_start, target)
        # Every rank: a lone candidate's document is read by a forward all ranks take part in.
        entries = self.forensics.data_entries(range(spike_start, target + 1), self.monitor)
        if plan.escalate:
            self.rewinder.escalate(target, len(state.rewinds), f"{self.cfg.monitor.max_rewinds} rewinds in this region")
        base = self._planned_base(state, plan.to_step)
        ckpt = self.rewinder.checkpoint_before(target, base, spike_start)
        # The streak's first outlier was re-run in place (same weights, batch and random state)
        # and reproduced: a same-data replay from the base would reach that step with the same
        # weights and batch and come back there, so it would only prove again that the spike is
        # no transient fault. The triage starts at the skip-window phase instead (one replay
        # fewer). A streak not re-run in place (a hard or non-finite first step, max_skips=0)
        # still replays the same data first: that is how a transient fault is found.
        in_place = self._streak is not None and self._streak[0] == spike_start
        # The same data as the original pass: without what this streak's re-runs committed.
        before = self._streak[1] if in_place else state.skip_list
        self._streak = None
        replay = Replay(phase=(Phase.SKIP_WINDOW if in_place else Phase.SAME_DATA).value, spike_start=spike_start,
                        target=target, base_step=base, window=list(plan.window),
                        skip_list=list(before), lr_scale=state.lr_scale, reason=reason, entries=entries,
                        fed_end=plan.fed_end)
        replay.evidence.append({"phase": "original", "steps": [r for r in self._recent if r[0] >= spike_start],
                                "reason": reason, **({"reproduced_in_place": spike_start} if in_place else {})})
        # The whole plan before the first replay: same_data (unless the re-run in place stood for
        # it), both skip_window replays (narrow, wide) and every backoff. A triage that could stop
        # half way would act on a verdict no replay has shown.
        if not self._affordable(replay, phases=(2 if in_place else 3) + self.cfg.monitor.max_backoffs):
            return self._fall_back(state, replay, ckpt)
        if in_place:
            self._withhold(state, replay)
        # The first phase's replay: same_data feeds the original data; skip_window leaves out the
        # spike's data as the same_data phase's successor does (_next_phase).
        self._replay_from(state, ckpt, replay, window=replay.window if in_place else None, lr_scale=replay.lr_scale)

    def _withhold(self, state: TrainState, r: Replay) -> None:
        """The streak's re-runs in place committed data (`note_rerun`) that its triage now tries
        again: its backoff replays feed that data, and its verdict decides what is skipped (a
        data verdict commits the spike's entries, which name it again; a state verdict or an
        escalation keeps the list from before the triage). skip_list.json keeps it until then
        (a restart from a checkpoint before the streak, after a crash that saved nothing of the
        triage, still never feeds it); the replay in progress names it (`withdrawn`), so that a
        resume of the replay does not merge it from the file: that resume feeds what the
        uninterrupted replay feeds."""
        before = merge_skip_list(r.skip_list)
        r.withdrawn = [e for e in state.skip_list if e not in before]
        if r.withdrawn:
            self.emit("skip_withheld", step=r.target, spike_start=r.spike_start, skip=r.withdrawn,
                      reason="the streak's re-runs in place committed this data; its triage replays it and decides")

    def _planned_base(self, state: TrainState, limit: int) -> int:
        """The step a triage replays from: the newest rewind point or checkpoint step of the
        config's grid at or before `limit` (or the run's first step). A function of the config,
        not of what this job holds: a resumed job plans the base the uninterrupted run planned."""
        start = state.lineage[-1]["step"] if state.lineage else 0
        m = self.cfg.monitor
        every = [self.cfg.ckpt.every] + ([m.rewind_every] if m.rewind_points > 0 else [])
        grid = [limit // e * e for e in every if e > 0] + ([start] if start <= limit else [])
        return max(grid, default=0)

    def _affordable(self, r: Replay, phases: int = 1) -> bool:
        """Within monitor.triage_max_replay_steps, counted from the planned base: the same answer
        whichever checkpoint this job must load to reach it, so a resumed job decides as the
        uninterrupted one (a restart's catch-up is not the triage's: docs/spikes.md)."""
        return r.replay_steps + phases * (r.target - r.base_step) <= self.cfg.monitor.triage_max_replay_steps
