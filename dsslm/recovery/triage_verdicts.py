"""A triage's verdict and what it commits (`Verdicts`, a base class of `triage.Triage`): a phase
whose replay reaches the target clean concludes (transient, data or state: the rewind history,
skip_list.json, the event, the forensics); a spike that persists through every backoff escalates
from the run as it was before the triage; a triage over its budget falls back to the plain rewind
policy, recording what its replays showed. Only a verdict commits data or a learning rate: a
replay's pass is tentative (docs/spikes.md)."""
from __future__ import annotations

from dsslm.ckpt.format import Checkpoint
from dsslm.ckpt.train_state import TrainState
from dsslm.data.skips import is_window, merge_skip_list, stamp
from dsslm.recovery.replay import VERDICT_OF, Phase, Replay


class Verdicts:
    """For a class holding `cfg`, `engine`, `rewinder`, `forensics`, `emit` and `replay`
    (`triage.Triage`)."""

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

    def _conclude(self, state: TrainState) -> None:
        r, self.replay = self.replay, None
        self._decide(state, r, VERDICT_OF[Phase(r.phase)])

    def _decide(self, state: TrainState, r: Replay, verdict: str, escalated: bool = False) -> None:
        """Record the verdict: the rewind history, skip_list.json, the event, the forensics."""
        if verdict == "data" and not any(not is_window(e) for e in r.entries):
            # The replay left out positions only: nothing in the spike's text stood out, so the
            # verdict names no text; what it committed is this pass's skip (`recovery.reach`).
            verdict = "batch"
        window = r.window if verdict in ("data", "batch") else [r.window[0], r.window[0]]
        # An escalation concluded nothing: the backoff its last replay tried is not the run's.
        factor = self.cfg.monitor.lr_backoff ** r.backoffs if verdict == "state" and not escalated else 1.0
        # What the data verdict committed: from the step after the base, as `before_step` left it out.
        skip = stamp(r.entries, r.base_step + 1) if verdict in ("data", "batch") else []
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
        # The window by position (this pass), its text named only where it stood out (`entries`).
        self.rewinder.rewind(state, r.target, r.spike_start, fallback={
            "window": r.window, "fed_end": r.window[0], "skip_list": r.skip_list, "lr_scale": r.lr_scale,
            "verdict": verdict,
            "entries": r.entries if verdict == "unknown" else []})
        # What it loaded may be a checkpoint the replay saved (its same-data run-up, or its
        # catch-up to the base), holding that replay in progress: the run resumed a triage the
        # fallback had ended, and concluded it with that phase's verdict. Ended here, and that
        # save set aside (kept): a crash before the next save resumed the replay from it again.
        if self.replay is not None:
            self.replay = None
            self.rewinder.checkpointer.leave_after(state.step - 1)
