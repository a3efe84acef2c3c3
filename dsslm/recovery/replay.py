"""The triage's replay in progress (`Replay`) and the checkpoint part it travels in
(`ReplayProgress`, "triage"): the phase, the spike, the base, the data a phase leaves out, the
evidence so far, and what recovery shares with the rewinder and the forensics, so that a resume
decides from the same records as the uninterrupted run (docs/spikes.md)."""
from __future__ import annotations

import collections
import dataclasses
import math
from dataclasses import dataclass, field
from enum import Enum
from typing import Any

import numpy as np

from dsslm.fields import (MAX_COUNT, MAX_STEP, Bool, Fields, Float, Int, Json, ListOf, Optional, SkipList, Spec,
                          StateError, Str, Window)

STATE_FORMAT = 1


class Phase(str, Enum):
    SAME_DATA = "same_data"
    SKIP_WINDOW = "skip_window"
    BACKOFF = "backoff"


# The verdict a phase stands for when its replay reaches the target clean.
VERDICT_OF = {Phase.SAME_DATA: "transient", Phase.SKIP_WINDOW: "data", Phase.BACKOFF: "state"}


@dataclass
class Replay:
    """One spike's triage in progress."""
    phase: str
    spike_start: int           # first step of the spike (step count)
    target: int                # the step that rewound: the last step a replay must pass
    base_step: int             # the checkpoint every replay of this spike restarts from
    window: list               # [start, end) sequences the skip_window replay leaves out
    skip_list: list            # the run's skip list before the triage (what every replay keeps)
    lr_scale: float            # the run's lr_scale before the triage
    reason: str = ""           # why the monitor called the spike
    backoffs: int = 0
    replay_steps: int = 0      # steps replayed for this spike so far (against the budget)
    # One entry per pass: {"phase", "from_step", "steps": [[step, loss, gnorm, verdict], ...]}.
    evidence: list = field(default_factory=list)
    # The spike's data (data.skips entries) the skip_window replay leaves out and a data verdict
    # commits; empty in a replay saved before this version, which skips `window` instead.
    entries: list = field(default_factory=list)
    # The skip_window replay leaves out all the data of `window` (entries widened to it).
    wide: bool = False
    # Data the streak's re-runs in place committed (`note_rerun`) that this triage tries again:
    # skip_list.json keeps it, and a resume of this replay does not merge it from there.
    withdrawn: list = field(default_factory=list)
    # The end of what the wide replay leaves out as data, the rest of `window` by position
    # (`Rewinder.data_of`): the spike steps' sequences, and once the narrow replay came back, what
    # it read up to there (`_widened`). None in a replay saved before this version, which left
    # out all of the window's data.
    fed_end: int | None = None


class ReplayProgress:
    """The checkpoint part "triage": everything recovery decides from that is not the monitor's
    or the train state's. The replay in progress (or None); `fed`, which sequences the last steps
    were fed (`Rewinder.note`: a streak open at a checkpoint plans its window from the steps
    before it); `recent`, the original pass's last rows (a triage's "original" evidence).

    `fed` and `recent` are shared with the Rewinder and the Triage (`bind`) and refilled in place,
    so a restore (a resume, or a rewind loading its base) hands both what the checkpoint knew:
    the uninterrupted run and every resume decide from the same records. Checkpoints written
    before these fields existed load with both empty (the old behaviour).

    Also bound: `sequences`, Forensics' per-sequence losses of the spike steps (what a data
    verdict names; gathered on every rank, so rank 0's state.json holds them all), saved for the
    steps still in `fed` only (the steps a streak open at the checkpoint can span: a few steps x
    the global batch); and `streak`, Triage's open streak (first step, the skip list before its
    re-runs committed data), which a same-data replay of that streak feeds; and `suspects`,
    Forensics' chunks that stood out once, alone (a second time, in another pass, names them).
    Without them a resume in the middle of a streak names other data and replays with the data
    its re-runs committed: another verdict than the uninterrupted run's."""

    def __init__(self) -> None:
        self.replay: Replay | None = None
        self.state_spec = _TriageState()
        self.fed: collections.OrderedDict[int, tuple[int, int]] = collections.OrderedDict()
        self.recent: collections.deque = collections.deque()
        self.sequences: collections.OrderedDict[int, tuple[np.ndarray, ...]] = collections.OrderedDict()
        self.streak: tuple[int, list] | None = None
        self.suspects: collections.OrderedDict[int, int] = collections.OrderedDict()

    def bind(self, fed: collections.OrderedDict, recent: collections.deque,
             sequences: collections.OrderedDict | None = None, suspects: collections.OrderedDict | None = None) -> None:
        self.fed, self.recent = fed, recent
        if sequences is not None:
            self.sequences = sequences
        if suspects is not None:
            self.suspects = suspects

    def state_dict(self) -> dict:
        # The repeated-n-gram sequences of the steps kept (`recovery.reach.repeated`), by index:
        # written only where there are some, so the part reads as before on a run without them.
        repeated = [[step, [int(i) for i in seq[0][seq[2]]]] for step, seq in self.sequences.items()
                    if step in self.fed and len(seq) > 2 and seq[2].any()]
        return {"format": STATE_FORMAT, "replay": dataclasses.asdict(self.replay) if self.replay else None,
                "fed": [[step, first, end] for step, (first, end) in self.fed.items()],
                "recent": [list(row) for row in self.recent],
                "sequences": [[step, [int(i) for i in seq[0]], [num(x) for x in seq[1]]]
                              for step, seq in self.sequences.items() if step in self.fed],
                "streak": {"start": self.streak[0], "skip_list": list(self.streak[1])} if self.streak else None,
                **({"repeated": repeated} if repeated else {}),
                # Chunks that stood out once, alone (`recovery.reach`): [chunk, epoch], oldest first.
                **({"suspects": [[c, e] for c, e in self.suspects.items()]} if self.suspects else {})}

    def load_state_dict(self, state: dict) -> None:
        self.replay = Replay(**state["replay"]) if state["replay"] else None
        self.fed.clear()
        self.fed.update((int(step), (int(first), int(end))) for step, first, end in state.get("fed", []))
        self.recent.clear()
        self.recent.extend(list(row) for row in state.get("recent", []))
        # Replaced, not merged: the uninterrupted run (restoring a rewind's base) and a resume
        # then hold the same losses. float("nan") reads the strings non-finite losses are saved as.
        self.sequences.clear()
        repeated = {int(step): set(indices) for step, indices in state.get("repeated", [])}
        for step, indices, losses in state.get("sequences", []):
            rep = repeated.get(int(step), set())
            self.sequences[int(step)] = (np.asarray(indices, dtype=np.int64),
                                         np.asarray([float(x) for x in losses], dtype=np.float64),
                                         np.asarray([int(i) in rep for i in indices], dtype=bool))
        self.suspects.clear()
        self.suspects.update((int(c), int(e)) for c, e in state.get("suspects", []))
        streak = state.get("streak")
        self.streak = (int(streak["start"]), list(streak["skip_list"])) if streak else None


def relative(a: float, b: float) -> float:
    """|a - b| relative to the larger of the two (a re-run's spread)."""
    return abs(float(a) - float(b)) / max(abs(float(a)), abs(float(b)), 1e-12)


def num(x: float) -> float | str:
    """JSON has no NaN: non-finite numbers as the strings the sinks write."""
    x = float(x)
    return x if math.isfinite(x) else str(x)


class _TriageState(Spec):
    """The triage part of state.json: {"format": 1, "replay": null or a Replay, "fed", "recent",
    "sequences", "streak", "repeated", "suspects"} (the last six optional: older checkpoints lack
    them)."""

    replay = Fields(phase=Str(32), spike_start=Int(1, MAX_STEP), target=Int(1, MAX_STEP), base_step=Int(0, MAX_STEP),
                    window=Window(), skip_list=SkipList(), lr_scale=Float(1e-12, 1.0),
                    reason=Str(), backoffs=Int(0, 1000), replay_steps=Int(0, MAX_STEP),
                    evidence=ListOf(Json(), max_len=10_000), entries=SkipList(),
                    wide=Bool(), withdrawn=SkipList(), fed_end=Optional(Int(0, MAX_COUNT)),
                    optional=("entries", "wide", "withdrawn", "fed_end"))

    fed = ListOf(ListOf(Int(0, MAX_COUNT), length=3), max_len=1000)
    recent = ListOf(ListOf(Json(), length=4), max_len=1000)
    # [step, [global sequence index, ...], [loss, ...]] per spike step; "nan"/"inf" for non-finite.
    sequences = ListOf(ListOf(Json(), length=3), max_len=1000)
    # [step, [global sequence index, ...]]: which of a step's sequences are a repeated n-gram.
    repeated = ListOf(ListOf(Json(), length=2), max_len=1000)
    suspects = ListOf(ListOf(Int(0, MAX_COUNT), length=2), max_len=1 << 16)
    steps, indices = Int(1, MAX_STEP), ListOf(Int(0, MAX_COUNT), max_len=10_000_000)
    losses = ListOf(Float(finite=False), max_len=10_000_000)
    streak = Optional(Fields(start=Int(1, MAX_STEP), skip_list=SkipList()))

    def validate(self, value: Any, path: str) -> None:
        Fields(optional=("fed", "recent", "sequences", "streak", "repeated", "suspects"),
               format=Int(STATE_FORMAT, STATE_FORMAT), replay=Json(), fed=self.fed, recent=self.recent,
               sequences=self.sequences, streak=self.streak, repeated=self.repeated,
               suspects=self.suspects).validate(value, path)
        for i, (step, indices) in enumerate(value.get("repeated", [])):
            self.steps.validate(step, f"{path}.repeated[{i}][0]")
            self.indices.validate(indices, f"{path}.repeated[{i}][1]")
        for i, (step, indices, losses) in enumerate(value.get("sequences", [])):
            where = f"{path}.sequences[{i}]"
            self.steps.validate(step, f"{where}[0]")
            self.indices.validate(indices, f"{where}[1]")
            self.losses.validate(losses, f"{where}[2]")
            if len(indices) != len(losses):
                raise StateError(f"{where}: {len(indices)} sequence indices but {len(losses)} losses")
        r = value["replay"]
        if r is None:
            return
        self.replay.validate(r, f"{path}.replay")
        if r["phase"] not in {p.value for p in Phase}:
            raise StateError(f"{path}.replay.phase: {r['phase']!r} is not one of {', '.join(p.value for p in Phase)}")
        if not r["base_step"] < r["spike_start"] <= r["target"]:
            raise StateError(f"{path}.replay.base_step: {r['base_step']} must come before spike_start "
                             f"{r['spike_start']} <= target {r['target']}")
        fed_end = r.get("fed_end")
        if fed_end is not None and not r["window"][0] <= fed_end <= r["window"][1]:
            raise StateError(f"{path}.replay.fed_end: {fed_end} is outside the window {r['window']}")
