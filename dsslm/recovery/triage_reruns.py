"""Re-runs in place, as the triage records them (`Reruns`, a base class of `triage.Triage`): an
isolated outlier's step computed again at the same weights, batch and random state is transient
(normal again), data (reproduced, and carried by a few sequences or repeated text), batch (one
ordinary sequence: nothing named) or unknown, and a streak it
opens is marked reproduced so its triage needs no same-data replay; and the job's first step
computed twice, whose spread is the noise a replay must exceed to show a spike again where steps
are not bitwise reproducible (docs/spikes.md)."""
from __future__ import annotations

import math

from dsslm.ckpt.train_state import TrainState
from dsslm.data.skips import is_window, merge_skip_list, stamp
from dsslm.recovery.monitor import Verdict
from dsslm.recovery.replay import num as _num, relative as _relative

# One re-run samples the spread once; a replay's difference is taken as noise up to this many times it.
NOISE_MARGIN = 3.0


class Reruns:
    """For a class holding `engine`, `rewinder`, `monitor`, `forensics`, `emit`, `replay`, `_streak`
    and `spread_pending` / `noise` (`triage.Triage`)."""

    def note_rerun(self, state: TrainState, step: int, first: tuple[float, float, str], rerun: tuple[float, float],
                   verdict: Verdict, first_verdict: str = Verdict.SKIP.value) -> None:
        """The in-place re-run of an isolated outlier at `step`: a normal re-run was transient. A
        reproduced one is no transient fault, and its update is still dropped (its batch was
        fed); it is data only where the monitor blames a few sequences for it (`SpikeMonitor.
        blame`: against the run's history, the minimal explanation) or its text is one n-gram
        repeated, and then what stands out joins the skip list from the next step on
        (`recovery.reach`: a lone sequence of ordinary text names nothing, `batch`). Otherwise
        nothing in the step tells data from state: the verdict is `unknown`, nothing is
        committed, and a streak it opens is attributed by the triage if it rewinds. Either way
        the streak is marked reproduced in place (`_start` needs no same-data replay). In a
        triage's replay nothing is committed (`deferred`): the pass is tentative, and only the
        triage's verdict commits data (docs/spikes.md)."""
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
                    # Text named for good only (`recovery.reach`): a lone sequence of ordinary text
                    # is this step's, skipped already; its position, fed, is no entry to keep.
                    skip = [e for e in self.forensics.data_entries([step], self.monitor) if not is_window(e)]
                    name = "data" if skip else "batch"
                if skip:
                    # From the next step: this one and every step before it fed that data.
                    skip = stamp(skip, step + 1)
                    state.skip_list = merge_skip_list(state.skip_list + skip)
                    self.engine.decide(lambda: self.rewinder.write_run_file(state))
                elif not is_data:
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
        # A few sequences by loss, or text that is one n-gram repeated (its loss need not stand out).
        return captured is not None and bool(self.monitor.blame(captured[1]).any() or captured[2].any())

    def note_spread(self, step: int, first: tuple[float, float], again: tuple[float, float]) -> None:
        """The same step computed twice on the same weights, batch and random state (every rank,
        the global loss and grad norm): the spread a replay must exceed to show a spike again."""
        spread = max(_relative(first[0], again[0]), _relative(first[1], again[1]))
        if not math.isfinite(spread):
            return  # a non-finite step measures nothing; the next one is measured instead
        self.spread_pending, self.noise = False, NOISE_MARGIN * spread
        self.emit("replay_spread", step=step, loss=[_num(first[0]), _num(again[0])],
                  gnorm=[_num(first[1]), _num(again[1])], spread=spread, margin=self.noise)
