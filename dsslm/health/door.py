"""The one door between the training loop and the health machinery (as recovery/policy.py is for
spikes): the loop says what it is doing, once per phase, through `Health`; behind it the
watchdog (hangs, the reaper), the node check's verdict and the straggler report.

    health = Health.start(cfg, engine, run_dir, lock, failures)   # job.setup
    health.phase(step, DATA)                    # a step's phases, each judged by its own times
    with health.during(step, FORWARD_BACKWARD): # work inside another phase (a re-run, a probe), then back
        ...
    health.wait_write(step, store, why)         # waiting for an asynchronous checkpoint write
    with health.load(step, what): ...           # a rewind's or a triage's checkpoint load
    forward = health.scoring(step, EVALUATION, forward, what)  # validation, downstream evals
    health.after_step(step); health.failed(exc); health.close()

Healthy work that may take minutes reports a `Work`, measured on the work itself (bytes written
or read, batches scored): past its limit while that still advances, the verdict waits and says so
in one console line. Which phase judges which work, with the tests: docs/hangs.md.
"""
from __future__ import annotations

import contextlib
import os
import secrets
import socket
import time
from pathlib import Path
from typing import Any, Callable, Iterator

import torch

from dsslm.durable import IO
from dsslm.exits import note_status
from dsslm.engine.board import StoreBoard, collective_failure, flight_record, set_collective_timeout, store_address
from dsslm.health import oom, reaper
from dsslm.health.hangs import fold_failures, read_learned
from dsslm.health.fits import refuse_unfit
from dsslm.health.nodecheck import BadNode, check_nodes
from dsslm.health.stragglers import Stragglers, arm_slow_drill
from dsslm.health.progress import (CHECKPOINT, CHECKPOINT_WRITE, COLLECTIVE, DATA, DOWNSTREAM, EVALUATION,
                                   FORWARD_BACKWARD, LOAD, OPTIMIZER, Progress, Work)
from dsslm.health.watchdog import Links, Watchdog
from dsslm.observe.sinks import EventLog

OutOfMemory = oom.OutOfMemory
__all__ = ["Health", "BadNode", "OutOfMemory", "check_nodes", "refuse_unfit", "fold_failures", "out_of_memory_retry",
           "Work", "LOAD", "DATA", "FORWARD_BACKWARD", "COLLECTIVE", "OPTIMIZER", "EVALUATION", "DOWNSTREAM", "CHECKPOINT",
           "CHECKPOINT_WRITE"]


def size(n: float) -> str:
    for unit, scale in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if n >= scale:
            return f"{n / scale:.1f} {unit}"
    return f"{n:.0f} B"


class Health:
    """This rank's reports to its watchdog, and the straggler report, behind a few verbs."""

    def __init__(self, progress: Progress | None = None, watchdog: Watchdog | None = None, faults: Any = None):
        self.progress = progress or Progress()
        self.watchdog = watchdog
        self.stragglers = Stragglers.off()
        self.eval_batch_s = getattr(faults, "eval_batch_s", 0.0)  # the drills' slow evaluator
        self.step_s = getattr(faults, "step_s", 0.0)              # and slow forward/backward
        if faults is not None:  # the drills' network filesystem: this process's checkpoint I/O at that rate
            IO.write_rate, IO.read_rate = 1e6 * faults.write_mb_s, 1e6 * faults.load_mb_s
        self.job: tuple[Any, int] | None = None  # (config, world size), for an out-of-memory record

    @classmethod
    def start(cls, cfg: Any, engine: Any, run_dir: Path, lock: Any, failures: dict | None) -> "Health":
        """The progress reports and this rank's watchdog (health/watchdog.py): beats in the job's
        store from 2 ranks up; each node's first rank starts the node's reaper."""
        f = cfg.faults
        drill = f.hang_step >= 0 and f.hang_rank == engine.rank
        progress = Progress((f.hang_step, f.hang_phase) if drill else (-1, ""), read_learned(run_dir))
        token = engine.decide(lambda: secrets.token_hex(8))  # the job's keys and claim: a group may outlive a job
        links = Links(flight=flight_record, classify=collective_failure, set_timeout=set_collective_timeout,
                      on_leave=[lock.release] if engine.is_main else [])
        address = store_address() if engine.world_size > 1 else None
        if address is not None:
            links.board = StoreBoard(address, token, engine.rank, engine.world_size, cfg.observe.watchdog.beat_s)
            links.store = f"{address[0]}:{address[1]}"
        watchdog = Watchdog(cfg.observe.watchdog, run_dir, engine.rank, token, links, progress, failures,
                            cfg.run.alert_command, engine.is_main)
        if engine.world_size > 1:
            ids = engine.all_gather((socket.gethostname(), os.getpid(), reaper.pid_start(os.getpid())))
            watchdog.peers = [(host, pid) for host, pid, _ in ids]
            node = [r for r, (host, _, _) in enumerate(ids) if host == ids[engine.rank][0]]
            if node[0] == engine.rank:
                watchdog.start_reaper([ids[r][1:] for r in node])
        health = cls(progress, watchdog, f)
        health.job = (cfg, engine.world_size)
        return health

    def last_hang(self) -> str | None:
        """A sentence for a start that follows a hang (its count in a row not yet reset), or None."""
        f = self.watchdog.failures if self.watchdog is not None else None
        if not f or f.get("in_a_row", 0) < 1:
            return None
        row = f", {f['in_a_row']} in a row there" if f["in_a_row"] > 1 else ""
        return (f"the job before this one ended in a hang at step {f['step']} in {f['phase']} "
                f"(run.dir/hangs/{f['record']}{row}): this one starts from the newest checkpoint before it")

    def watch_stragglers(self, cfg: Any, engine: Any, sinks: Any, run_dir: Path, nodes: Any, feed: Any) -> None:
        """The straggler report every observe.stragglers.every steps (and its drill)."""
        arm_slow_drill(cfg.faults, engine.rank, feed, engine)
        self.stragglers = Stragglers(cfg.observe.stragglers, engine, self.progress, sinks, run_dir, nodes)

    # --- what the loop is doing ------------------------------------------------------------------
    def phase(self, step: int, phase: str, work: Work | None = None) -> None:
        """Step `step` enters `phase`: judged by that phase's limit from here on."""
        self.progress.report(step, phase, work)

    @contextlib.contextmanager
    def during(self, step: int, phase: str, work: Work | None = None) -> Iterator[None]:
        """Work of another kind inside a phase (a surge's probe and re-run are a forward/backward):
        judged as that kind, then back to the phase it interrupted, its clock restarted."""
        was_step, was_phase, _ = self.progress.now
        was_work = self.progress.work
        self.phase(step, phase, work)
        try:
            yield
        finally:
            self.phase(was_step, was_phase, was_work)

    def starting(self, step: int) -> None:
        """The job's start (its checkpoint load, the first evals): observe.watchdog.first_s."""
        self.phase(step, LOAD)

    def first_step(self, step: int) -> None:
        """From here the phases are timed and judged by what they took."""
        self.progress.first_step = step

    def compute(self, step: int) -> None:
        """A forward/backward is about to run (the drills' slow step sleeps here)."""
        if self.step_s > 0:
            time.sleep(self.step_s)

    def wait_write(self, step: int, store: Any, why: str) -> None:
        """Wait for the asynchronous checkpoint write in flight (a failure is raised later, by every
        rank together), judged by the writer's own measured write times, its progress the bytes
        it has written (the snapshot is `checkpoint`). Every rank waits for its own writer, which
        waits for the save's publish: no rank enters a collective while another still writes."""
        writing = store.writing
        if writing is None or not store.in_flight:
            return
        saved_step, total, base = writing

        def describe() -> str:
            return f"{size(IO.written - base)} of {size(total)} written"
        self.phase(step, CHECKPOINT_WRITE, Work(f"checkpoint write of step {saved_step} ({why})",
                                                lambda: (IO.written, IO.peers), describe, "still writing"))
        store.settle()

    def learn_writes(self, store: Any) -> None:
        """The writer thread's whole-write times teach checkpoint_write's limit."""
        store.on_written = lambda seconds: self.progress.learn(CHECKPOINT_WRITE, seconds)

    def load(self, step: int, what: str) -> contextlib.AbstractContextManager:
        """A checkpoint load inside a step (a rewind, a triage's base), judged by the loads timed
        in this run (the ceiling before the first), its progress the bytes read."""
        base = IO.read
        return self.during(step, LOAD, Work(what, lambda: IO.read, lambda: f"{size(IO.read - base)} read",
                                            "still reading"))

    def scoring(self, step: int, phase: str, forward: Callable, what: str) -> Callable:
        """`phase` (validation's `evaluation` or the downstream evals) begins; returns `forward`
        counting the batches it scores, the phase's progress."""
        scored = [0]

        def counted(*args: Any, **kwargs: Any) -> Any:
            if self.eval_batch_s > 0:
                time.sleep(self.eval_batch_s)
            out = forward(*args, **kwargs)
            scored[0] += 1
            return out
        self.phase(step, phase, Work(what, lambda: scored[0], lambda: f"{scored[0]} batches scored", "still scoring"))
        return counted

    # --- between steps, and leaving ----------------------------------------------------------------
    def after_step(self, step: int) -> None:
        self.stragglers.after_step(step)

    def failed(self, exc: BaseException) -> None:
        """The training thread failed: out of memory is recorded and raised as OutOfMemory (its
        code, for every rank: health/oom.py); a collective's failure (a dead peer, the collectives'
        timeout) is diagnosed and the process exits there; anything else returns and goes on."""
        if isinstance(exc, torch.OutOfMemoryError) and self.watchdog is not None and self.job is not None:
            dog, (cfg, world) = self.watchdog, self.job
            step, phase, _ = self.progress.now

            def event(line: str, folder: Path, code: int, record: dict) -> None:
                events = EventLog(dog.run_dir, True, dog.alert_command)
                events.emit("oom", step=step, phase=phase, record=str(folder), exit_code=code, line=line,
                            micro_batch_size=record["micro_batch_size"], grad_accum=record["grad_accum"])
                events.close()
            error = oom.caught(dog.run_dir, dog.token, dog.rank, step, phase, cfg, world, exc, event)
            note_status(f"oom {error.code}")  # srun's code is one for every node's task
            error.echoed = True  # said once, by the job's first rank to run out
            raise error from exc
        if self.watchdog is not None:
            self.watchdog.failed(exc)

    def close(self) -> None:
        if self.watchdog is not None:
            self.watchdog.close()


def out_of_memory_retry(cfg: Any, run_dir: Path) -> str | None:
    """At a start, before the engine is built: after an out-of-memory error, the micro-batch
    halved and the accumulation raised to keep the global batch (health/oom.py); the line that
    says so, or None. OutOfMemory (exit 7) where nothing is left to halve."""
    world = int(os.environ.get("WORLD_SIZE") or 1)
    plan = oom.retry(run_dir, cfg, world)
    if plan is None:
        return None
    cfg.train.micro_batch_size = plan.micro_batch_size
    if not cfg.train.global_batch_size:  # set, the engine derives the accumulation from it
        cfg.train.grad_accum = plan.grad_accum
    return plan.line
