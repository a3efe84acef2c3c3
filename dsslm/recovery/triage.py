"""Spike triage by replay: was a spike the data, the optimizer state, or a one-off fault?

`Triage` answers it for a spike that rewinds, decided on rank 0 and followed by every rank, by
replaying from the newest checkpoint or rewind point before it (the base): the same data (clean:
transient), without the spike's data (clean: data), with the learning rate backed off (clean:
state), within a replay budget; and records an isolated outlier's re-run in place (`note_rerun`).
How and why, with the figures, is docs/spikes.md; the replay in progress and the checkpoint part
it travels in are `recovery/replay.py`.
"""
from __future__ import annotations

import collections
import math
from typing import Any, Callable

from dsslm.ckpt.format import Checkpoint
from dsslm.fields import MAX_SKIP_ENTRIES
from dsslm.ckpt.train_state import TrainState
from dsslm.config import Config
from dsslm.data.skips import merge_skip_list, stamp
from dsslm.data.sources import NothingLeft
from dsslm.engine.base import Engine
from dsslm.recovery.forensics import Forensics
from dsslm.recovery.monitor import SpikeMonitor, Verdict
from dsslm.recovery.replay import VERDICT_OF, Phase, Replay, ReplayProgress, num as _num, relative as _relative
from dsslm.recovery.rewind import Rewinder, recovery_pins

# One re-run samples the spread once; a replay's difference is taken as noise up to this many times it.
NOISE_MARGIN = 3.0


class Triage:
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
        # replayed step counts as the spike coming back only beyond NOISE_MARGIN x the spread of one
        # step computed twice, measured on this job's first step (`note_spread`).
        self.spread_pending = self.enabled and (engine is not None and engine.device.type != "cpu"
                                                or cfg.faults.replay_noise > 0)
        self.noise = 0.0
        # The original pass's last few steps, for the evidence of a spike that rewinds.
        self._recent: collections.deque = collections.deque(maxlen=max(8, 2 * (cfg.monitor.max_skips + 2)))
        # All three travel in the checkpoint part "triage", and so does `_streak`.
        progress.bind(rewinder._fed, self._recent, forensics.sequences if forensics is not None else None)

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

    def note_rerun(self, state: TrainState, step: int, first: tuple[float, float, str], rerun: tuple[float, float],
                   verdict: Verdict, first_verdict: str = Verdict.SKIP.value) -> None:
        """The in-place re-run of an isolated outlier at `step`: a normal re-run was transient. A
        reproduced one is no transient fault, and its update is still dropped (its batch was
        fed); it is data only where the monitor blames a few sequences for it (`SpikeMonitor.
        blame`: against the run's history, the minimal explanation), and then their data joins the
        skip list from the next step on. Otherwise nothing in the step tells data from state: the
        verdict is `unknown`, nothing is committed, and a streak it opens is attributed by the
        triage if it rewinds. Either way the streak is marked reproduced in place (`_start`
        needs no same-data replay). In a triage's replay nothing is committed (`deferred`): the
        pass is tentative, and only the triage's verdict commits data (docs/spikes.md)."""
        name = "transient" if verdict is Verdict.OK else "data"
        skip, deferred = [], {}
        if name == "data":
            start, is_data = self.engine.decide(lambda: (self.monitor.spike_start or step, self._concentrated(step)))
            if self.replay is not None:
                r = self.replay
                deferred = {"deferred": f"in the {r.phase} replay of the spike at steps [{r.spike_start}, {r.target}]: "
                                        f"only the triage's verdict commits data"}
                name = name if is_data else "unknown"
            else:
                if self._streak is None or self._streak[0] != start:
                    self._streak = (start, list(state.skip_list))
                if is_data:  # the documents read: only here, where they are committed (reading shards)
                    skip = self.engine.decide(lambda: self.forensics.data_entries(
                        [step], self.rewinder.fed_of, self.monitor.blame, state.skip_list))
                    # From the next step: this one and every step before it fed that data.
                    skip = stamp(skip, step + 1)
                    state.skip_list = merge_skip_list(state.skip_list + skip)
                    self.engine.decide(lambda: self.rewinder.write_run_file(state))
                else:
                    name = "unknown"
        evidence = [{"phase": "original", "steps": [[step, _num(first[0]), _num(first[1]), first_verdict]],
                     "reason": first[2]},
                    {"phase": "rerun_in_place", "steps": [[step, _num(rerun[0]), _num(rerun[1]), verdict.value]]}]
        decision = {"verdict": name, "scope": "step", "spike_start": step, "target": step, "replay_steps": 1,
                    "skip": skip, "evidence": evidence, **deferred}
        self.emit("triage", step=step, **decision)
        self.forensics.record_decision([step], decision)

    def _concentrated(self, step: int) -> bool:
        """Rank 0: is the outlier at `step` (captured by the forensics) carried by a few sequences?"""
        captured = self.forensics.sequences.get(step)
        return captured is not None and bool(self.monitor.blame(captured[1]).any())

    def note_spread(self, step: int, first: tuple[float, float], again: tuple[float, float]) -> None:
        """The same step computed twice on the same weights, batch and random state (every rank,
        the global loss and grad norm): the spread a replay must exceed to show a spike again."""
        spread = max(_relative(first[0], again[0]), _relative(first[1], again[1]))
        if not math.isfinite(spread):
            return  # a non-finite step measures nothing; the next one is measured instead
        self.spread_pending, self.noise = False, NOISE_MARGIN * spread
        self.emit("replay_spread", step=step, loss=[_num(first[0]), _num(again[0])],
                  gnorm=[_num(first[1]), _num(again[1])], spread=spread, margin=self.noise)

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

    # --- the phases ----------------------------------------------------------------------------
    def _start(self, state: TrainState, target: int) -> None:
        spike_start, reason = self.engine.decide(lambda: (self.monitor.spike_start or target, self.monitor.last_reason))
        plan = self.rewinder.plan(state, spike_start, target)
        entries = self.engine.decide(lambda: self.forensics.data_entries(range(spike_start, target + 1),
                                                                         self.rewinder.fed_of, self.monitor.blame,
                                                                         state.skip_list))
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

    def _next_phase(self, state: TrainState, step: int) -> None:
        r = self.replay
        wider = self._widened(r, step) if r.phase == Phase.SKIP_WINDOW.value and not r.wide and r.entries else None
        if r.phase == Phase.SAME_DATA.value:
            r.phase, window, lr_scale = Phase.SKIP_WINDOW.value, r.window, r.lr_scale
        elif wider is not None:  # without the whole window before calling it state
            (r.entries, r.fed_end), r.wide, window, lr_scale = wider, True, r.window, r.lr_scale
        elif r.phase == Phase.SKIP_WINDOW.value or r.backoffs < self.cfg.monitor.max_backoffs:
            r.phase, r.backoffs = Phase.BACKOFF.value, r.backoffs + 1
            # On trial through lr_factor (from the base on); a lasting verdict sets lr_scale in _decide.
            window, lr_scale = None, r.lr_scale
        else:
            self.replay = None
            held_in_memory = self._restore_base(state, r)
            self._decide(state, r, "state", escalated=True)
            if held_in_memory and self.save_base is not None:  # with the escalation's record
                self.save_base()
            self.rewinder.escalate(r.target, len(state.rewinds), f"the spike persists after {r.backoffs} lr backoffs")
        ckpt = self.rewinder.checkpoint_before(r.target, r.base_step, r.spike_start)
        if not self._affordable(r):
            return self._fall_back(state, r, ckpt)
        self._replay_from(state, ckpt, r, window, lr_scale)

    def _spiked_ahead(self, state: TrainState) -> None:
        """A REWIND in a replay's run-up, before the spike it replays: a new spike (a fault of its
        own; on GPU, a step outside the thresholds by the kernels' noise; or what this phase
        changed reached an earlier step: a skipped document's other chunk, read before the spike,
        moves the stream). The replay never reached the spike, so it shows nothing about it; it
        was taken as the spike coming back (a transient fault then passed the skip-window replay
        and was called data). The phase runs again from the base, once; a second one, or a
        budget that cannot cover the phases left after it, falls back to the plain rewind."""
        r = self.replay
        ckpt = self.rewinder.checkpoint_before(r.target, r.base_step, r.spike_start)
        ahead = r.evidence[-1]["spiked_ahead"]
        if r.evidence[-1].get("retry"):
            return self._fall_back(state, r, ckpt, f"the {r.phase} replay spiked at step {ahead} again, before the "
                                                   f"spike at steps [{r.spike_start}, {r.target}] it replays")
        left = {Phase.SAME_DATA.value: 3, Phase.SKIP_WINDOW.value: 1 if r.wide else 2, Phase.BACKOFF.value: 1}[r.phase]
        if not self._affordable(r, phases=left + self.cfg.monitor.max_backoffs - r.backoffs):
            budget = self.cfg.monitor.triage_max_replay_steps
            return self._fall_back(state, r, ckpt, f"the {r.phase} replay spiked at step {ahead}, before the spike at "
                                   f"steps [{r.spike_start}, {r.target}] it replays, and the replay budget "
                                   f"(monitor.triage_max_replay_steps={budget}, {r.replay_steps} replayed so far) "
                                   f"does not cover running it again and the phases after it")
        window = r.window if r.phase == Phase.SKIP_WINDOW.value else None
        self._replay_from(state, ckpt, r, window, r.lr_scale, retry=True)

    def _restore_base(self, state: TrainState, r: Replay) -> bool:
        """Before an escalation: the run as it was before the triage. The checkpoints a replay
        saved hold its replay in progress, and a restart after exit 3 resumed it: at the trial
        learning rate, escalating again at once, one more rewind record each time. They are set
        aside (restore's leave_after). Returns whether the base is held only in memory: the
        caller saves it, so the restart a person makes starts there, nothing of the triage in
        flight."""
        ckpt = self.rewinder.checkpoint_before(r.target, r.base_step, r.spike_start)
        self.rewinder.restore(state, ckpt, merge_skip_list(r.skip_list), r.lr_scale, None, new_pass=r.base_step + 1)
        return not self.engine.decide(lambda: state.step in self.rewinder.checkpointer.store.valid_steps())

    def _widened(self, r: Replay, step: int) -> tuple[list, int | None] | None:
        """The entries with all of the planned window added, and the end of what is named as data
        (`fed_end`); None when they add nothing (the narrowed entries already name all of it).
        Named as data: what the spike steps read, and what the narrow replay read up to `step`,
        where it came back: the sequences that took the skipped ones' slots are what brought the
        spike back, not random text. The rest of the window by position (`Rewinder.data_of`)."""
        def widen() -> tuple[list, int | None]:
            fed_end = r.fed_end
            if fed_end is not None:
                fed_end = min(max(fed_end, self.rewinder.fed_of(step)[1]), r.window[1])
            return merge_skip_list(r.entries + self.rewinder.data_of(r.window, r.skip_list, fed_end)), fed_end
        wider, fed_end = self.engine.decide(widen)
        return (wider, fed_end) if wider != merge_skip_list(r.entries) else None

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

    def _replay_from(self, state: TrainState, ckpt: Checkpoint, r: Replay, window: list | None,
                     lr_scale: float, retry: bool = False) -> None:
        if r.phase == Phase.SKIP_WINDOW.value and not retry:
            why_not = self._cannot_run(r)
            if why_not:  # the next phase (the wide one, or a backoff) instead
                r.evidence.append({"phase": r.phase, "from_step": ckpt.state["step"], "steps": [],
                                   "wide": r.wide or not r.entries, "not_run": why_not})
                self.emit("triage_phase_not_run", step=r.target, spike_start=r.spike_start, phase=r.phase,
                          reason=why_not)
                return self._next_phase(state, r.target)
        # r.base_step stays the planned base: a phase that must load an older checkpoint (after a
        # restart the rewind point is gone) changes nothing before it (window, lr_factor).
        loaded = ckpt.state["step"]
        r.replay_steps += r.target - r.base_step  # a catch-up from an older checkpoint is not the triage's
        trial = self.cfg.monitor.lr_backoff ** r.backoffs if r.phase == Phase.BACKOFF.value else 1.0
        r.evidence.append({"phase": r.phase, "from_step": loaded, "lr_scale": lr_scale * trial, "steps": [],
                           **({"wide": r.wide or not r.entries} if r.phase == Phase.SKIP_WINDOW.value else {}),
                           **({"retry": True} if retry else {})})
        # The skip_window phase leaves out the spike's data where it was named, else its window:
        # from the base on (before_step), so that steps replayed up to it from an older
        # checkpoint feed what they fed.
        self.rewinder.restore(state, ckpt, merge_skip_list(r.skip_list), lr_scale, None, new_pass=r.base_step + 1)
        self.replay = r  # after the restore, which loaded the checkpoint's own (idle) triage part
        self.before_step(state)
        self.emit("rewind", step=r.target, to_step=state.step, window=window if window and not r.entries else [],
                  skip=stamp(r.entries, r.base_step + 1) if window else [], checkpoint=str(ckpt.path), reason=r.reason,
                  triage_phase=r.phase, lr_scale=state.lr_scale * trial)

    def _cannot_run(self, r: Replay) -> str:
        """Why a skip-window replay without its data cannot run, or ''. Its list names every chunk
        training draws from (on a small corpus, a wide window's data can be all of it): a DataError
        at the replay's first read (exit 2), on every resume of it. Or its list is longer than a
        checkpoint may hold (a wide window at a large batch, doubled per repeat of the region: 8
        batches x 1024 x 16 is 131,072 chunks): the replay's checkpoints would be refused on
        resume, and the run resumed from before the triage without knowing it."""
        listed = merge_skip_list(r.skip_list + (r.entries or [r.window]))
        longest = max(len(listed), len(r.entries))
        if longest > MAX_SKIP_ENTRIES:
            return (f"its skip list would hold {longest} entries, more than the {MAX_SKIP_ENTRIES} a checkpoint "
                    f"may hold")
        loader = self.rewinder.loader
        if loader is None:
            return ""
        try:
            loader.skipped_chunks(listed)
        except NothingLeft as err:
            return str(err)
        return ""

    def _conclude(self, state: TrainState) -> None:
        r, self.replay = self.replay, None
        self._decide(state, r, VERDICT_OF[Phase(r.phase)])

    def _decide(self, state: TrainState, r: Replay, verdict: str, escalated: bool = False) -> None:
        """Record the verdict: the rewind history, skip_list.json, the event, the forensics."""
        window = r.window if verdict == "data" else [r.window[0], r.window[0]]
        # An escalation concluded nothing: the backoff its last replay tried is not the run's.
        factor = self.cfg.monitor.lr_backoff ** r.backoffs if verdict == "state" and not escalated else 1.0
        # What the data verdict committed: from the step after the base, as `before_step` left it out.
        skip = stamp(r.entries, r.base_step + 1) if verdict == "data" else []
        record = {"step": r.spike_start, "window": window, "to_step": r.base_step,
                  "lr_scale_factor": min(1.0, factor), "verdict": verdict, "skip": skip}
        if verdict == "state" and self.cfg.monitor.lr_recover_steps and not escalated:
            record["target"] = r.target  # temporary: lr_factor ramps it back from here
        if escalated:  # what a person restarting after exit 3 resumes with: the run before the triage
            state.lr_scale, state.skip_list = r.lr_scale, merge_skip_list(r.skip_list)
        elif verdict == "state" and not self.cfg.monitor.lr_recover_steps:
            state.lr_scale = r.lr_scale * factor  # lasting: the backoff the replay tried, from now on
        state.rewinds = state.rewinds + [record]
        self.engine.decide(lambda: self.rewinder.write_run_file(state))
        decision = {"verdict": verdict, "scope": "window", "spike_start": r.spike_start, "target": r.target,
                    "from_step": r.base_step, "replay_steps": r.replay_steps, "window": window, "skip": skip,
                    "lr_scale": state.lr_scale, "lr_factor": factor, "escalated": escalated, "evidence": r.evidence}
        self.emit("triage", step=r.target, **decision)
        if verdict == "state" and not escalated:
            self.emit("lr_scale", step=r.target, old=r.lr_scale, new=r.lr_scale * factor,
                      recover_steps=self.cfg.monitor.lr_recover_steps)
        self.forensics.record_decision(list(range(r.spike_start, r.target + 1)), decision)

    def _fall_back(self, state: TrainState, r: Replay, ckpt: Checkpoint, why: str = "") -> None:
        """Over the replay budget (or `why`): the plain rewind policy with the window planned
        before any replay (the feed record now holds what the replays fed), recording what the
        replays showed: `state` when the spike came back without its window's data, else
        `unknown` (a skip_window replay without the narrowed data alone shows nothing: more of it
        may follow), which also skips the spike's named documents (`entries`)."""
        self.replay = None
        # Every phase replayed so far came back, but for one that spiked before the spike (_spiked_ahead).
        shown = any(e["phase"] == Phase.BACKOFF.value or (e["phase"] == Phase.SKIP_WINDOW.value and e.get("wide", True))
                    for e in r.evidence[1:] if "spiked_ahead" not in e and "not_run" not in e)
        verdict = "state" if shown else "unknown"
        budget = self.cfg.monitor.triage_max_replay_steps
        why = why or (f"replay budget: monitor.triage_max_replay_steps={budget} does not cover the triage's "
                      f"replays of {r.target - r.base_step} steps each from its base at step {r.base_step} "
                      f"({r.replay_steps} replayed so far)")
        self.emit("triage", step=r.target, verdict=verdict, scope="window", spike_start=r.spike_start,
                  target=r.target, from_step=ckpt.state["step"], replay_steps=r.replay_steps, window=r.window,
                  fallback=f"{why}; the plain rewind policy skips the planned window {r.window}"
                  f"{' and the documents its outlying sequences read' if verdict == 'unknown' and r.entries else ''}"
                  f" untested", evidence=r.evidence)
        # The checkpoints the replay in flight saved after its base hold its trajectory (data left
        # out, a trial learning rate), but for a same-data replay's: set aside (kept), so the plain
        # rewind loads the run as it was, as the uninterrupted run, which saves none there, does.
        if r.evidence[-1]["phase"] not in ("original", Phase.SAME_DATA.value):
            self.rewinder.checkpointer.leave_after(r.base_step)
        # Where no replay showed the data innocent, its named documents go with the window: the
        # plain policy's best guess at the culprit, whose other chunks the window does not hold.
        self.rewinder.rewind(state, r.target, r.spike_start, fallback={
            "window": r.window, "fed_end": r.fed_end, "skip_list": r.skip_list, "lr_scale": r.lr_scale,
            "verdict": verdict,
            "entries": r.entries if verdict == "unknown" else []})
        # What it loaded may be a checkpoint the replay saved (its same-data run-up, or its
        # catch-up to the base), holding that replay in progress: the run resumed a triage the
        # fallback had ended, and concluded it with that phase's verdict. Ended here, and that
        # save set aside (kept): a crash before the next save resumed the replay from it again.
        if self.replay is not None:
            self.replay = None
            self.rewinder.checkpointer.leave_after(state.step - 1)
