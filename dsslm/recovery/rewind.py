"""Rewinds: plan one (pure), carry it out (every rank, decided on rank 0), keep the run-level
record of bad data (`run.dir/skip_list.json`), and escalate to a human when rewinds run out.

Steps are step counts, as in metrics.jsonl: a spike "at step s" is the step whose update would
have made the run's step s. A rewind plans a window of the stream, half-open ranges of global
sequence indices (`data.stream`): the sequences the spike steps read, widened to at least
`monitor.skip_batches` batches. What the spike steps read is skipped as data (`data.skips`: the
chunks themselves, so the next epoch's shuffle does not bring them back); the widening is skipped
by position only. The loader shuffles chunks over the whole corpus, so the positions after a
spike hold random text: named as data, they took healthy chunks out of every later epoch (one
rewind at skip_batches=200 and a batch of 16 named every chunk of a 1,027-chunk corpus); as
positions they cost this pass a few batches and nothing after it. The window stays in the
rewind record, where it tells whether a later spike is in the same region.

The run-level file holds the skip list, every rewind carried out and the lowest lr_scale. Every
resume merges it into what its checkpoint restored: a checkpoint older than a spike does not know
about it, and without the file a resume from there would feed the bad window again.
"""
from __future__ import annotations

import collections
import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

from dsslm.ckpt.format import Checkpoint
from dsslm.ckpt.resume import Checkpointer
from dsslm.ckpt.store import aside_stamp
from dsslm.fields import MAX_SKIP_ENTRIES, Fields, Float, Int, ListOf, Optional, SkipList, StateError, validate
from dsslm.ckpt.train_state import REWIND_RECORD, TrainState
from dsslm.config import Config, MonitorCfg
from dsslm.data.loader import Loader
from dsslm.data.sources import NothingLeft
from dsslm.data.skips import is_window, merge_skip_list, restamp, stamp
from dsslm.durable import write_json_atomic
from dsslm.engine.base import Engine
from dsslm.optim import decay_start_step
from dsslm.recovery.monitor import SpikeMonitor
from dsslm.recovery.rewind_points import RewindPoint, RewindRing

RECOVERY_FILE = "skip_list.json"
RECOVERY_SCHEMA_VERSION = 2
RECOVERY_SPEC = Fields(optional=("schema",), schema=Int(1, RECOVERY_SCHEMA_VERSION),
                         skip_list=SkipList(), rewinds=ListOf(REWIND_RECORD, max_len=100_000),
                         lr_scale=Optional(Float(1e-12, 1.0)))


class Escalation(RuntimeError):
    """The spike policy ran out of rewinds: a human must look (exit code 3)."""


def skip_cap_problem(skip_list: list, run_dir: Path) -> str | None:
    """Why `skip_list` must not be committed (None: it may be): a resume reads at most
    MAX_SKIP_ENTRIES entries back (fields.SkipList), so a longer list in a checkpoint or in
    skip_list.json would be refused, and the run rebuilt without it, feeding the bad data again."""
    if len(skip_list) <= MAX_SKIP_ENTRIES:
        return None
    return (f"the skip list would hold {len(skip_list)} entries, more than the {MAX_SKIP_ENTRIES} a checkpoint "
            f"or skip_list.json may hold, so none was written with it: data this widely bad needs a person; "
            f"see the rewinds in {run_dir / 'events.jsonl'}, take the bad text out of the corpus and prepare it "
            f"again")


@dataclass
class RewindPlan:
    to_step: int              # newest checkpoint step allowed; the caller loads latest_before(to_step)
    window: list[int]         # [start, end) global sequences the rewind skips
    lr_scale_factor: float    # multiply the run's lr_scale by this (1.0, or lr_backoff)
    escalate: bool            # too many rewinds: alert a human instead of rewinding
    # The end of the sequences the spike steps read: the window's data up to here is skipped as
    # data, the rest of the window by position (`Rewinder.data_of`). None: all of it as data.
    fed_end: int | None = None


def plan_rewind(spike_start: int, spike_end: int, sequences_of: Callable[[int], tuple[int, int]],
                rewind_history: list[dict], cfg: MonitorCfg, batch_size: int) -> RewindPlan:
    """Plan the recovery from a spike over steps [spike_start, spike_end] (step counts, >= 1).

    `sequences_of(step)` gives the [first, end) global sequences that step was fed. The window
    runs from the first sequence of the first spike step to the end of the last; sequences inside
    it that an older window already skips were never fed, so covering them is harmless.
    `rewind_history` holds one `rewind_record` per rewind already made in this run; `batch_size`
    is the run's full global batch in sequences. `max_rewinds` counts the rewinds of the same
    region (`region_steps` of steps, or touching data windows), not the run's whole history:
    a long run may recover from many unrelated spikes, but not from one that keeps coming back.
    """
    if not 1 <= spike_start <= spike_end:
        raise ValueError(f"spike steps [{spike_start}, {spike_end}] must satisfy 1 <= start <= end")
    window = [sequences_of(spike_start)[0], sequences_of(spike_end)[1]]
    fed_end = window[1]
    same_region = [past for past in rewind_history if _same_region(spike_start, window, past, cfg.region_steps)]
    # A transient fault says nothing about the region's data or learning rate; it still counts
    # towards escalation (a flaky node faulting again and again needs a human too).
    repeats = sum(past.get("verdict") != "transient" for past in same_region)
    # A skip gives the freed slots to the next sequences of the stream: skip at least
    # `skip_batches` batches of it, doubling each time the region spikes again, so bad data that
    # fills the stream there costs a few rewinds, not one per batch. By position (`fed_end`): in
    # a shuffled stream those sequences are random text, not the spike's neighbours.
    window[1] = max(window[1], window[0] + cfg.skip_batches * batch_size * 2 ** repeats)
    return RewindPlan(
        # The checkpoint after step spike_start - 1 - margin: `margin` clean steps before the spike.
        to_step=max(0, spike_start - 1 - cfg.rewind_margin_steps),
        window=window,
        # The same steps spiking again on other data points at the optimizer, not the data.
        lr_scale_factor=cfg.lr_backoff if repeats else 1.0,
        escalate=len(same_region) >= cfg.max_rewinds,
        fed_end=fed_end,
    )


def rewind_record(spike_start: int, plan: RewindPlan) -> dict:
    """The JSON record of a rewind carried out, for `rewind_history`:
    {"step": first spike step, "window": [start, end), "to_step": int, "lr_scale_factor": float}."""
    return {"step": spike_start, "window": list(plan.window), "to_step": plan.to_step,
            "lr_scale_factor": plan.lr_scale_factor}


def _same_region(step: int, window: list[int], past: dict, region_steps: int) -> bool:
    past_start, past_end = past["window"]
    windows_touch = window[0] <= past_end and past_start <= window[1]
    return abs(step - past["step"]) < region_steps or windows_touch


# --- the run-level recovery file ---------------------------------------------------------------

def recovery_path(run_dir: Path) -> Path:
    return run_dir / RECOVERY_FILE


def read_recovery(run_dir: Path, batch_size: int) -> dict:
    """skip_list.json, checked field by field; StateError naming the field when it does not fit.

    Schema 1 counted rewinds by 0-based step index and windows in data batches of the run's
    global batch: converted with `batch_size`, the batch a resume of such a run keeps."""
    path = recovery_path(run_dir)
    if not path.is_file():
        return {"schema": RECOVERY_SCHEMA_VERSION, "skip_list": [], "rewinds": [], "lr_scale": None}
    try:
        recovery = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise StateError(f"{path}: unreadable ({exc})") from None
    validate(recovery, RECOVERY_SPEC, RECOVERY_FILE)
    recovery.setdefault("schema", 1)  # the file's own schema; the contents are returned in today's units
    if recovery["schema"] == 1:
        if not all(is_window(w) for w in recovery["skip_list"]):
            raise StateError(f"{RECOVERY_FILE}.skip_list: schema 1 holds windows only")
        recovery["skip_list"] = [[a * batch_size, b * batch_size] for a, b in recovery["skip_list"]]
        recovery["rewinds"] = [{**r, "step": r["step"] + 1, "window": [r["window"][0] * batch_size,
                                                                       r["window"][1] * batch_size]}
                               for r in recovery["rewinds"]]
    return recovery


def write_recovery(run_dir: Path, state: TrainState) -> None:
    """Atomically replace skip_list.json: the one record of bad data that any resume merges."""
    write_json_atomic(recovery_path(run_dir), {"schema": RECOVERY_SCHEMA_VERSION, "skip_list": state.skip_list,
                                               "rewinds": state.rewinds, "lr_scale": state.lr_scale})


def merge_recovery(state: TrainState, recovery: dict, withheld: list = ()) -> None:
    """Fold the run-level record into a state just restored from a checkpoint (or fresh), but
    for the file's entries in `withheld` (the data a triage replay in progress tries again)."""
    state.skip_list = merge_skip_list(state.skip_list + [e for e in recovery["skip_list"] if e not in withheld])
    state.rewinds = merge_history(state.rewinds, recovery["rewinds"])
    if recovery["lr_scale"] is not None:
        state.lr_scale = min(state.lr_scale, recovery["lr_scale"])


def merge_history(mine: list[dict], theirs: list[dict]) -> list[dict]:
    """`mine` plus the records of `theirs` it does not hold, counted as a multiset: one spike
    rewound twice is two decisions, and a record `mine` already holds once is not added again
    (the checkpoint's history is a prefix of the run file's, which each decision rewrites whole)."""
    have = collections.Counter(json.dumps(r, sort_keys=True) for r in mine)
    out = list(mine)
    for record in theirs:
        key = json.dumps(record, sort_keys=True)
        if have[key]:
            have[key] -= 1
        else:
            out.append(record)
    return out


def recovery_pins(step: int, valid_steps: list[int], cfg: Config) -> list[int]:
    """Checkpoints retention must keep: the one a rewind starting now would need (the oldest
    while none is old enough), and the last one before a WSD decay (to branch cooldowns from)."""
    m = cfg.monitor
    horizon = step - m.rewind_margin_steps - m.max_skips - 1
    # Until one is old enough, the oldest: the start checkpoint a spike right after a branch needs.
    pins = [s for s in valid_steps if s <= horizon][-1:] or sorted(valid_steps)[:1]
    decay_start = decay_start_step(cfg)
    if decay_start is not None:
        pins += [s for s in valid_steps if s <= decay_start][-1:]
    return pins


class Rewinder:
    """Carries out rewinds for the loop: plan on rank 0, every rank follows the same plan."""

    def __init__(self, cfg: Config, engine: Engine, checkpointer: Checkpointer, monitor: SpikeMonitor,
                 batch_size: int, run_dir: Path, emit: Callable[..., Any], loader: Loader | None = None):
        self.cfg, self.engine, self.checkpointer, self.monitor = cfg, engine, checkpointer, monitor
        self.batch_size, self.run_dir, self.emit, self.loader = batch_size, run_dir, emit, loader
        self._emptied: set[str] = set()  # domains whose every chunk the skip list names (said once)
        self._shares: dict[str, float] = {}  # each domain's share the committed skip list names (skip_share)
        # step -> [first, end) sequences it was fed, for the few steps a spike can span.
        self._fed: collections.OrderedDict[int, tuple[int, int]] = collections.OrderedDict()
        self.ring = RewindRing(engine, checkpointer, cfg.monitor.rewind_every if cfg.monitor.enabled else 0,
                               cfg.monitor.rewind_points)

    def note(self, step: int, first: int, end: int) -> None:
        """The step `step` is being fed sequences [first, end) (every rank, every step)."""
        self._fed[step] = (first, end)
        self._fed.move_to_end(step)
        while len(self._fed) > max(8, 2 * (self.cfg.monitor.max_skips + 2)):
            self._fed.popitem(last=False)

    def merge_run_file(self, state: TrainState, withheld: list = ()) -> None:
        """After a resume or at a fresh start: never replay a window this run already skipped,
        but for what a triage replay the resume continues tries again (`Replay.withdrawn`)."""
        merge_recovery(state, self.engine.decide(lambda: self._read_or_rebuild(state.step)), withheld)

    def _read_or_rebuild(self, step: int) -> dict:
        """skip_list.json, or, when it is unreadable or malformed (a torn write, an edit), the
        union of what every valid checkpoint recorded, written back with a `recovery_rebuilt` event."""
        try:
            recovery = read_recovery(self.run_dir, self.batch_size)
            if recovery.get("schema", RECOVERY_SCHEMA_VERSION) == 1:
                # Converted with this run's batch: written back in sequences now, so a later
                # change of global batch cannot convert it again with another factor.
                old = TrainState(skip_list=recovery["skip_list"], rewinds=recovery["rewinds"],
                                 lr_scale=recovery["lr_scale"] if recovery["lr_scale"] is not None else 1.0)
                self.write_run_file(old)
                self.emit("recovery_upgraded", step=step, batch_size=self.batch_size, skip_list=old.skip_list)
            return recovery
        except StateError as exc:
            rebuilt = TrainState()
            for ckpt_state in self.checkpointer.saved_train_states():
                merge_recovery(rebuilt, {"skip_list": ckpt_state["skip_list"], "rewinds": ckpt_state["rewinds"],
                                         "lr_scale": ckpt_state["lr_scale"]})
            # Kept, not replaced: an edit with one bad entry holds good ones a person can copy back.
            path = recovery_path(self.run_dir)
            aside = path.with_name(f"{path.name}.invalid-{aside_stamp()}")
            self.checkpointer.store.fence()
            os.replace(path, aside)
            self.write_run_file(rebuilt)
            self.emit("recovery_rebuilt", step=step, reason=str(exc), skip_list=rebuilt.skip_list,
                      rewinds=len(rebuilt.rewinds), lr_scale=rebuilt.lr_scale, kept_aside=aside.name)
            return {"skip_list": rebuilt.skip_list, "rewinds": rebuilt.rewinds, "lr_scale": rebuilt.lr_scale}

    def write_run_file(self, state: TrainState) -> None:
        """Rank 0: rewrite skip_list.json, fenced like a checkpoint: a trainer that lost run.dir's
        lock must not replace the new holder's record of bad data. Escalation, writing nothing, for
        a skip list a resume could not read back (`skip_cap_problem`)."""
        self.check_skip_list(state.skip_list, state.step, committed=True)
        self.checkpointer.store.fence()
        write_recovery(self.run_dir, state)

    def check_skip_list(self, skip_list: list, step: int, committed: bool = False) -> None:
        """Escalation (exit 3) for a skip list that must not be committed: too long to read back
        (`skip_cap_problem`), or naming every chunk training draws from. The second was a DataError
        at the next step's read (exit 2), after skip_list.json had it: every resume then exited 2
        until a person edited the file (a rewind's window is widened by position, and on a small
        corpus, or a small domain of a mixture, its chunks can be all there are). A `committed` list
        (skip_list.json's) that takes a domain's every chunk is said once (`domain_emptied`). Every
        rank reaches the same verdict: the skip list is the same everywhere."""
        problem = skip_cap_problem(skip_list, self.run_dir)
        if problem is None and self.loader is not None:
            try:
                emptied = self.loader.emptied_domains(skip_list)  # cached: the next step's read reuses it
            except NothingLeft as err:
                problem = (f"{err}; none was written with it: see the rewinds in {self.run_dir / 'events.jsonl'}, "
                           f"then take the bad text out of the corpus or add data")
            else:  # said once per domain, of the list the run commits (not a replay's trial): training goes on
                for name in sorted(set(emptied) - self._emptied if committed else ()):
                    self.emit("domain_emptied", step=step, domain=name, reason=f"every chunk of domain {name} is in "
                              f"the skip list: training goes on without it, and data.mix's weights no longer hold")
                self._emptied.update(emptied if committed else ())
                if committed:
                    problem = self._share_problem(skip_list, step)
        if problem is not None:
            self.emit("escalation", step=step, reason=problem)
            raise Escalation(problem)

    def _share_problem(self, skip_list: list, step: int) -> str | None:
        """The committed list's share of each domain, said when it changes (a `skip_share` event);
        past monitor.max_skip_share of a domain, why the run asks a person instead (None: it may
        go on). A domain emptied on purpose by an earlier verdict has its own event; the cap is
        for the policy naming more and more of a corpus, clean text included, unseen."""
        shares = {d: round(v, 6) for d, v in self.loader.skipped_share(skip_list).items()}
        if shares == self._shares:
            return None
        self._shares = shares
        named = {d: v for d, v in shares.items() if v > 0}
        cap = self.cfg.monitor.max_skip_share
        if named:
            self.emit("skip_share", step=step, shares=named, max_skip_share=cap)
        over = sorted((d for d, v in named.items() if v > cap and d not in self._emptied), key=lambda d: -named[d])
        if not over or cap >= 1:
            return None
        d = over[0]
        return (f"the skip list would name {named[d]:.1%} of domain {d}'s text, past monitor.max_skip_share={cap:g}: "
                f"data this widely bad, or verdicts naming clean text, need a person; see the triage events in "
                f"{self.run_dir / 'events.jsonl'} and the spikes in {self.run_dir / 'spikes'}; resume with a higher "
                f"monitor.max_skip_share to let it go on")

    def fed_of(self, step: int) -> tuple[int, int]:
        """The [first, end) global sequences step `step` was fed (the oldest step noted when
        `step` is older: a spike that began before the checkpoint a streak was restored from)."""
        return self._sequences_of(step)

    def _sequences_of(self, step: int) -> tuple[int, int]:
        # A spike that began before the checkpoint the monitor's streak was restored from is not
        # in the history: its window then starts at the oldest step seen.
        return self._fed.get(step) or next(iter(self._fed.values()))

    def rewind(self, state: TrainState, spike_step: int, spike_start: int | None = None,
               fallback: dict | None = None) -> None:
        """Go back to a checkpoint from before the spike at `spike_step` and never feed its data
        window again (the plain rewind policy: no replay tells data from state); `state` (the
        checkpointer's train part) is restored in place.

        `fallback`: a triage that cannot replay hands over what it planned before any replay
        overwrote the feed record, {"window", "skip_list", "lr_scale", "verdict", "entries"}: that
        window's data is skipped, and so are `entries` (the documents of the sequences that stood
        out in the spike's batches: they reach beyond the window, into chunks fed later, in this
        epoch or the next), on top of the skip list and lr_scale from before the triage (a
        tentative window or a backoff a replay tried is not kept); the record carries the verdict."""
        def plan() -> tuple[RewindPlan, dict, str]:
            start = spike_start or self.monitor.spike_start or spike_step
            p = plan_rewind(start, spike_step, self._sequences_of, state.rewinds, self.cfg.monitor, self.batch_size)
            if fallback is not None:
                p.window, p.fed_end = list(fallback["window"]), fallback.get("fed_end")
            return p, rewind_record(start, p), self.monitor.last_reason

        rewind_plan, record, reason = self.engine.decide(plan)
        if rewind_plan.escalate:
            self.escalate(spike_step, len(state.rewinds), f"window {rewind_plan.window}")
        ckpt = self.checkpoint_before(spike_step, rewind_plan.to_step, record["step"])
        record["to_step"] = ckpt.state["step"]  # the step loaded, not the newest one allowed
        base_skips, old_scale = state.skip_list, state.lr_scale
        if fallback is not None:
            base_skips, old_scale = fallback["skip_list"], fallback["lr_scale"]
            record["verdict"] = fallback["verdict"]
        skipped = self.engine.decide(lambda: self.data_of(rewind_plan.window, base_skips, rewind_plan.fed_end))
        if fallback is not None and fallback.get("entries"):
            skipped = skipped + fallback["entries"]
        # From the first step after the checkpoint it goes back to: the steps before it fed that data.
        skipped = merge_skip_list(stamp(skipped, ckpt.state["step"] + 1))
        skip_list = merge_skip_list(base_skips + skipped)
        self.check_skip_list(skip_list, spike_step)  # before restore() leaves the newer checkpoints
        # restore() loads the checkpoint's own skip list first: a replay's tentative window is gone.
        self.restore(state, ckpt, skip_list, old_scale * rewind_plan.lr_scale_factor, record)
        self.engine.decide(lambda: self.write_run_file(state))
        self.emit("rewind", step=spike_step, to_step=state.step, window=rewind_plan.window,
                  skip=skipped, checkpoint=str(ckpt.path), reason=reason,
                  **({"verdict": fallback["verdict"]} if fallback else {}))
        if rewind_plan.lr_scale_factor != 1.0:
            self.emit("lr_scale", step=state.step, old=old_scale, new=state.lr_scale)

    def data_of(self, window: list[int], skip_list: list, fed_end: int | None = None) -> list:
        """The skip entries for a rewind's window of the stream: the data its sequences before
        `fed_end` (the spike steps') read, where the skip list let them through, so that text is
        never fed again, in any epoch (a position window's chunks would come back in the next
        epoch's shuffle); the rest of the window, [fed_end, end), as a window of positions: the
        widening past the spike is random text of the whole corpus, not to be taken out of every
        later epoch. `fed_end` None (a replay saved before it was kept): all of it as data. The
        window itself where there is no loader to name its data."""
        if self.loader is None:
            return [list(window)]
        end = window[1] if fed_end is None else min(max(fed_end, window[0]), window[1])
        return merge_skip_list(self.loader.window_entries(window[0], end, skip_list) + [[end, window[1]]])

    def plan(self, state: TrainState, spike_start: int, spike_step: int) -> RewindPlan:
        """Rank 0's plan for the spike over steps [spike_start, spike_step], on every rank."""
        return self.engine.decide(lambda: plan_rewind(spike_start, spike_step, self._sequences_of, state.rewinds,
                                                      self.cfg.monitor, self.batch_size))

    def escalate(self, spike_step: int, rewinds: int, detail: str) -> None:
        self.emit("escalation", step=spike_step, rewinds=rewinds, reason=detail)
        raise Escalation(f"spike at step {spike_step} after {rewinds} rewinds ({detail}); "
                         f"see {self.run_dir / 'events.jsonl'}")

    def checkpoint_before(self, spike_step: int, to_step: int, spike_start: int) -> Checkpoint | RewindPoint:
        """The newest rewind point or valid checkpoint at or before `to_step` (every rank; a
        rewind point when it is at least as new: no disk read); when there is none (the first
        steps after a branch, whose only checkpoint is where it started), the newest before the
        spike's first step; else Escalation."""
        self.engine.decide(self.checkpointer.store.wait)  # rank 0's writer error reaches every rank
        for limit in (to_step, spike_start - 1):
            point = self.ring.newest(limit)
            # Called within this iteration: the closure's `limit` is this one's.
            durable = self.engine.decide(
                lambda: max((s for s in self.checkpointer.store.valid_steps() if s <= limit), default=-1))  # noqa: B023
            if point is not None and point.step >= durable:
                return point
            ckpt = self.checkpointer.latest(limit)
            if ckpt is not None and (point is None or ckpt.state["step"] > point.step):
                return ckpt
            if point is not None:
                return point
        self.emit("escalation", step=spike_step, reason="no checkpoint before the spike")
        raise Escalation(f"spike at step {spike_step} and no checkpoint at or before step {to_step}")

    def restore(self, state: TrainState, ckpt: Checkpoint | RewindPoint, skip_list: list, lr_scale: float,
                record: dict | None, new_pass: int | None = None) -> None:
        """Load `ckpt` on every rank, keeping what the run learnt since: `skip_list` (the windows
        to skip from now on), its rewind history (plus `record`), the lower lr_scale and the
        count of skipped steps. The count of clipped steps is the checkpoint's: clip_frac is
        clipped over state.step, both of the trajectory the weights came from, and the steps
        left behind would take it above 1. The run-level file is the caller's to write (a
        tentative window must not reach it).

        The skip list's entries that would apply only after `new_pass` (default: the step after
        the checkpoint's) apply from it (`data.skips.restamp`): a new pass feeds no data already
        known bad. A triage passes its planned base's next step, which a replay from an older
        checkpoint (after a restart) reaches by a catch-up that feeds what the run fed."""
        history = state.rewinds + ([record] if record else [])
        skipped, reached = state.skipped_steps, state.reached
        if isinstance(ckpt, RewindPoint):
            ckpt = self.ring.checkpoint(ckpt)  # a collective: the ranks' shares gathered back
        self.checkpointer.restore(ckpt)
        self.ring.drop_after(state.step)  # the points after it belong to the trajectory left
        self.checkpointer.leave_after(state.step)  # ...and so do the durable checkpoints after it
        first = state.step + 1 if new_pass is None else new_pass
        state.skip_list = merge_skip_list(restamp(state.skip_list + skip_list, first))
        state.rewinds, state.lr_scale = history, min(state.lr_scale, lr_scale)
        state.skipped_steps, state.reached = skipped, max(state.reached, reached)
        self.monitor.reset_streak()

    def ensure_start_checkpoint(self, state: TrainState, save: Callable[[], None]) -> None:
        """A checkpoint at the step the run starts from (step 0, or the step a branch starts at)
        when the run has none at or before it: a spike in warmup, where spikes are most likely,
        then rewinds instead of escalating. Retention lets it go once a later one can serve."""
        if self.engine.decide(lambda: not any(s <= state.step for s in self.checkpointer.store.valid_steps())):
            save()
