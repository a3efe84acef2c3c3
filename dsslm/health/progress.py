"""What the training thread tells its watchdog: the phases of a step, each phase's measure of its
own progress (`Work`), the reports (`Progress`: one tuple stored, the longest time each phase took)
and the limits learned from them (`Limits`). Read by health/watchdog.py's thread and by the
straggler report; written through health/door.py."""
from __future__ import annotations

import os
import signal
import time
from dataclasses import dataclass
from typing import Any, Callable

from dsslm.config import WatchdogCfg

LOAD, DATA, FORWARD_BACKWARD, OPTIMIZER = "load", "data", "forward_backward", "optimizer"
COLLECTIVE, CHECKPOINT, EVALUATION = "collective", "checkpoint", "evaluation"
# Healthy work that may take minutes, each judged by its own kind's times, never another's:
# waiting for an asynchronous checkpoint write (the snapshot is `checkpoint`), downstream evals
# (validation is `evaluation`).
CHECKPOINT_WRITE, DOWNSTREAM = "checkpoint_write", "downstream"
PHASES = (LOAD, DATA, FORWARD_BACKWARD, OPTIMIZER, COLLECTIVE, CHECKPOINT, EVALUATION, CHECKPOINT_WRITE, DOWNSTREAM)
# The order of a step's phases: where the job stopped is the furthest (step, phase) a rank reached.
ORDER = {LOAD: 0, DATA: 1, FORWARD_BACKWARD: 2, COLLECTIVE: 3, OPTIMIZER: 4, EVALUATION: 5, DOWNSTREAM: 6,
         CHECKPOINT_WRITE: 7, CHECKPOINT: 8}
@dataclass(eq=False)
class Work:
    """What a phase's work has done so far, measured on the work itself (the bytes a checkpoint
    writer wrote, the batches an evaluation scored), never on CPU use or beats, which a rank
    spinning in a stuck collective shows too. A phase past its limit whose work still advances is
    slow, not stopped (`judge`)."""
    what: str                         # "checkpoint write of step 50", for the console line
    done: Callable[[], Any]           # a value that changes whenever the work advances
    describe: Callable[[], str] = lambda: ""  # "4.1 GB of 14 GB written"
    verb: str = "still working"


class Progress:
    """The training thread's reports: `now = (step, phase, since)`, replaced whole, so the watchdog
    thread reads a consistent triple without a lock, the longest time each phase took (the job's
    first step aside: compilation, warm-up) and the time spent in each so far (`spent`, the
    straggler report's). A report is a clock read (vDSO, no syscall), a tuple, an add and a few
    compares: about 0.3 us (bench/bench_overhead.py)."""

    def __init__(self, trap: tuple[int, str] = (-1, ""), longest: dict[str, float] | None = None):
        self.now: tuple[int, str, float] = (-1, LOAD, time.monotonic())
        self.work: Work | None = None  # the current phase's measure of its own progress, if it has one
        self.first_step: int | None = None  # the job's first step: set by job.start
        # Every phase has its key from the start (-1: not timed yet): the watchdog thread reads the
        # dict while this thread writes it, which is safe while no key is added.
        self.longest = {phase: float((longest or {}).get(phase, -1.0)) for phase in PHASES}
        self.spent = dict.fromkeys(PHASES, 0.0)  # seconds in each phase so far: the straggler report's (health/stragglers.py)
        self.trap_step, self.trap_phase = trap  # faults.hang_step / hang_phase
        self.pending: Callable[[], None] | None = None  # the watchdog's work for this thread (the collective bound)
        # Run by this thread at its first report after the first step: the collectives' first bound
        # is set there, not at the watchdog's next beat, which a hang within that beat would never see.
        self.after_first: Callable[[], None] | None = None

    def report(self, step: int, phase: str, work: Work | None = None) -> None:
        now = time.monotonic()
        last_step, last_phase, since = self.now
        self.work = work
        self.now = (step, phase, now)
        self.spent[last_phase] += now - since
        # Learned only from the job's steps: its start (the load, the first evals, a start
        # checkpoint) and first step (compilation) are judged by first_s and teach no limit, so a
        # later rewind's load is judged by loads timed in the run, or the ceiling, never the floor.
        if self.first_step is not None and last_step > self.first_step:
            self.learn(last_phase, now - since)
        if self.after_first is not None and self.first_step is not None and step > self.first_step:
            after_first, self.after_first = self.after_first, None
            after_first()
        if self.pending is not None:
            pending, self.pending = self.pending, None
            pending()
        if step == self.trap_step and phase == self.trap_phase:
            os.kill(os.getpid(), signal.SIGSTOP)  # the hang drill: every thread of this rank stops here

    def learn(self, phase: str, seconds: float) -> None:
        """A phase's time, measured: from the reports, and from the checkpoint writer's own thread
        (the whole write's time, which the training thread's wait for it never exceeds)."""
        if seconds > self.longest[phase]:
            self.longest[phase] = seconds


class Limits:
    """How long each phase may take, from the longest time it took in this run (`longest`, the
    Progress's table: -1 = not timed yet)."""

    def __init__(self, cfg: WatchdogCfg, longest: dict[str, float]):
        self.cfg, self.longest = cfg, longest

    def of(self, phase: str, first: bool) -> float:
        c = self.cfg
        if first:
            return c.first_s
        longest = self.longest.get(phase, -1.0)
        if longest < 0:  # never done in this run: the ceiling, never the floor
            return c.ceiling_s
        return min(c.ceiling_s, max(c.floor_s, c.factor * longest))

    def bound(self) -> float:
        """The collectives' timeout after the first step: past every phase's limit by floor_s, the
        watchdog's time to call it and leave."""
        return max(self.of(p, first=False) for p in PHASES) + self.cfg.floor_s
