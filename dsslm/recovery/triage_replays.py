"""A triage's replays (`Replays`, a base class of `triage.Triage`): each phase replays from the
base (same data, the skip window narrow then wide, each backoff), and a spike that comes back
moves the triage to the next phase; one that comes back before the spike it replays runs the
phase again, once. A skip-window replay that cannot run (its list names all the data, or is more
than a checkpoint may hold) passes to the next phase. Every replay's steps count against the
budget from the planned base, whichever checkpoint it must load (docs/spikes.md)."""
from __future__ import annotations

from dsslm.ckpt.format import Checkpoint
from dsslm.fields import MAX_SKIP_ENTRIES
from dsslm.ckpt.train_state import TrainState
from dsslm.data.skips import merge_skip_list, stamp
from dsslm.data.sources import NothingLeft
from dsslm.recovery.replay import Phase, Replay


class Replays:
    """For a class holding `cfg`, `engine`, `rewinder`, `monitor`, `forensics`, `emit`, `replay`,
    `save_base` and the other phases (`triage.Triage`)."""

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

    def _widened(self, r: Replay, step: int) -> tuple[list, int | None] | None:
        """The entries with all of the planned window added by position, and `fed_end` (the
        window's start: none of it named as text for standing in the window); None when they add
        nothing. The narrow replay came back without the spike's standing-out text: what else
        brought it back is in the window. The wide replay leaves the window out of this pass only,
        and names as text only what stood out (`recovery.reach`), in the spike steps or in the
        narrow replay's steps where it came back. Before, every sequence of the spike steps was
        named as data here, and a clean replay put text that stood out nowhere on the skip list."""
        # What stood out in the narrow replay's spike steps, where it came back (their sequences
        # took the left-out ones' slots: a bad document's other chunks, a poisoned run's next
        # batch) is named as the original spike's is; every rank (a document read is collective).
        came_back = [] if self.forensics is None else \
            self.forensics.data_entries(range(r.spike_start, step + 1), self.monitor)
        wider = merge_skip_list(r.entries + came_back + [list(r.window)])
        return (wider, r.window[0]) if wider != merge_skip_list(r.entries) else None

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
