"""How a training process reacts to SIGTERM / SIGUSR1 (Slurm preemption, time limit, scancel) in
each part of its life, so that a stopped job ends with exit 0 and never with -15, which Slurm
counts as a failure:

| when                              | what a stop signal does                                           |
|-----------------------------------|-------------------------------------------------------------------|
| imports (`python -m dsslm.train`) | noted; `main()` then exits 0 before reading anything              |
| setup and start (resume, branch)  | raises `Preempted` at once: nothing is trained, nothing to save   |
| the loop                          | noted; the step in flight finishes, the loop saves there and      |
|                                   | exits 0 (Ctrl-C, SIGINT: the same save, then exit 130; a second   |
|                                   | Ctrl-C stops at once, the save in flight finished); in the last  |
|                                   | step the run finishes instead: its end, exit 0                    |
| after the end event, interpreter  | ignored (SIG_IGN): the run is finished, and Python resets its     |
|   shutdown                        | own handlers to the default (death by -15) while it shuts down    |

Only this module installs signal handlers; no rank-specific logic lives here.
"""
from __future__ import annotations

import os
import signal
import sys
import time
from typing import Callable

# When this process started, as near as dsslm can tell: `python -m dsslm.train` imports this module
# first and calls catch_early at once, which sets it (None in a process that calls train() itself:
# a test, a notebook). The `start` event carries it, so the goodput ledger counts the imports and
# the engine's build as the job's start-up rather than as time between starts.
PROCESS_STARTED: float | None = None

STOP_SIGNALS = (signal.SIGTERM, signal.SIGUSR1)

# The exit codes of `python -m dsslm.train`, one table for the trainer, the launchers
# (slurm/train.sbatch's requeue decision) and docs/run-folder.md. Two families: the codes a
# requeue may cure (the run itself is sound; a node or the cluster was not) and those that
# need a person (requeueing would fail the same way). 1 stays Python's own: a crash.
EXIT_OK = 0              # finished, or stopped by SIGTERM/SIGUSR1 (saved)
EXIT_BAD_INPUT = 2       # bad input or config: one line naming what to fix          (person)
EXIT_ESCALATED = 3       # the spike policy escalated                                 (person)
EXIT_WRITE_FAILED = 4    # rank 0 could not write into run.dir                        (requeue may cure)
EXIT_NOTHING_TO_RESUME = 5  # the run was past step 0 but every checkpoint was set aside (person)
EXIT_CRASH_LOOP = 6      # the same failure at the same step and phase, start after start (person)
EXIT_OOM_AT_FLOOR = 7    # out of memory at one sequence a micro-batch: nothing left to halve    (person)
EXIT_REQUEUE = 75        # a hang or a dead node was diagnosed: requeue (EX_TEMPFAIL) (requeue)
EXIT_BAD_NODE = 76       # a node failed its check before the first step: requeue elsewhere (requeue)
EXIT_OUT_OF_MEMORY = 77  # a step ran out of memory: requeue at half the micro-batch       (requeue)
EXIT_INTERRUPTED = 130   # Ctrl-C
# Codes no requeue can cure: a launcher that requeues on failure stops on these.
NEEDS_A_PERSON = (EXIT_BAD_INPUT, EXIT_ESCALATED, EXIT_NOTHING_TO_RESUME, EXIT_CRASH_LOOP, EXIT_OOM_AT_FLOOR)
# A file a run writes one line into as it leaves, for a launcher that must tell exits apart whose
# codes it may not see whole (srun reports one code for every node's task): rank 0's `finished` or
# `preempted` (both exit 0; slurm/train.sbatch requeues only the second), the hang caller's `hang 75`
# or `hang 6` (health/watchdog.py).
STATUS_FILE_ENV = "DSSLM_STATUS_FILE"
# The file `python -m dsslm.engine.agent` names for its ranks: the code a rank leaves with.
AGENT_EXIT_FILE_ENV = "DSSLM_AGENT_EXIT_FILE"
# Which rank's code a job's launcher reports when ranks differ (a hang's survivors exit 75 while the
# stopped rank dies of SIGKILL): a person's codes first, the crash loop the first of them (it is
# what ends the requeues), then the requeue codes (out of memory before a hang: the ranks waiting
# for one that ran out see a lost peer), then a failed write.
_JOB_ORDER = (EXIT_CRASH_LOOP, EXIT_ESCALATED, EXIT_NOTHING_TO_RESUME, EXIT_OOM_AT_FLOOR, EXIT_BAD_INPUT,
              EXIT_OUT_OF_MEMORY, EXIT_REQUEUE, EXIT_BAD_NODE, EXIT_WRITE_FAILED)


def job_exit_code(codes: list[int]) -> int:
    """The one exit code of a job whose ranks exited with `codes` (negative: killed by a signal):
    the first of _JOB_ORDER present, else the first other failure, else 1 (torchrun's own)."""
    return next((c for c in _JOB_ORDER if c in codes), next((c for c in codes if c > 0), 1))


class Preempted(BaseException):
    """A stop signal before the first step: nothing to save, exit 0. A BaseException, so no
    `except Exception` on the way out swallows it."""

    def __init__(self, signum: int):
        super().__init__(signum)
        self.signal = signal.Signals(signum).name


_early: list[int] = []  # stop signals that arrived during the imports, for the first StopFlag
# (signal, time.monotonic()) of the stop the loop is waiting to answer at the end of its step: the
# watchdog reads it, since a step that waits on a stopped peer never ends (health.watchdog).
_waiting_stop: list[tuple[int, float]] = []


_wakeup: list[int] = []  # (read, write) ends of the pipe signal.set_wakeup_fd writes signal numbers to


def stop_waiting() -> tuple[int, float] | None:
    """The stop signal the training loop has been asked for and not yet answered, and when. Read
    from any thread: a Python handler runs in the main thread only once it is back in Python, which
    a rank blocked in a collective on a stopped peer never is; the C handler's byte on the wakeup
    pipe arrives at once."""
    if _wakeup and not _waiting_stop:
        try:
            data = os.read(_wakeup[0], 512)
        except (BlockingIOError, OSError):
            data = b""
        for signum in data:
            if signum in (signal.SIGINT, *STOP_SIGNALS) and not _waiting_stop:
                _waiting_stop[:] = [(signum, time.monotonic())]
    return _waiting_stop[0] if _waiting_stop else None


def _watch_signals() -> None:
    """The wakeup pipe (main thread): every signal's number is written to it as it arrives."""
    if _wakeup:
        return
    r, w = os.pipe()
    for fd in (r, w):
        os.set_blocking(fd, False)
    try:
        signal.set_wakeup_fd(w, warn_on_full_buffer=False)
    except ValueError:  # not the main thread (train() called from another): the handlers' flag only
        os.close(r)
        os.close(w)
        return
    _wakeup[:] = [r, w]


def _unwatch_signals() -> None:
    if _wakeup:
        try:
            signal.set_wakeup_fd(-1)
        except ValueError:
            pass
        for fd in _wakeup:
            os.close(fd)
        _wakeup.clear()


def _note(signum: int, frame: object) -> None:
    _early.append(signum)


def process_started() -> float | None:
    """When `python -m dsslm.train` started (catch_early's note); None in a process that calls train()."""
    return PROCESS_STARTED


def catch_early() -> None:
    """Note stop signals from the very start of `python -m dsslm.train`, before the imports (and
    when the process started)."""
    global PROCESS_STARTED
    PROCESS_STARTED = time.time()
    for sig in STOP_SIGNALS:
        signal.signal(sig, _note)


def ignore_from_now() -> None:
    """A finished process ignores stop signals to its end (its exit code is decided)."""
    for sig in STOP_SIGNALS:
        signal.signal(sig, signal.SIG_IGN)


class StopFlag:
    """SIGTERM / SIGUSR1 during training ask for a save at the next step boundary; before the
    first step they stop the run at once (`Preempted`). Create it first thing in `train()`."""

    def __init__(self) -> None:
        self.requested = False
        self.in_loop = False
        self.stepped = False  # this job has completed a step (train.run_loop)
        self.finishing = False  # the loop is over: the end's save and alerts are being waited for
        self.signum: int | None = None
        self._sigint = None  # the SIGINT handler before the loop's, restored by close()
        _waiting_stop.clear()  # another train() of this process answered its own
        for sig in STOP_SIGNALS:
            signal.signal(sig, self._handle)
        if _early:  # arrived during the imports
            self.signum = _early.pop()
            raise Preempted(self.signum)

    def save_on_signal(self) -> None:
        """From here on a signal is answered at the end of the step in flight (a save, exit 0), and
        Ctrl-C too, unless SIGINT is ignored (a shell's background job: nohup, `cmd &`)."""
        self.in_loop = True
        _watch_signals()
        if signal.getsignal(signal.SIGINT) is not signal.SIG_IGN and self._sigint is None:
            self._sigint = signal.signal(signal.SIGINT, self._interrupt)

    def close(self) -> None:
        """Ctrl-C means KeyboardInterrupt again (train() called from a script or a notebook)."""
        _waiting_stop.clear()
        _unwatch_signals()
        if self._sigint is not None:
            signal.signal(signal.SIGINT, self._sigint)
            self._sigint = None

    @property
    def name(self) -> str:
        return signal.Signals(self.signum).name if self.signum is not None else "a stop signal"

    @property
    def exit_code(self) -> int:
        """0 for a stop signal (Slurm's preemption, time limit); 130 for Ctrl-C, as a shell expects."""
        return 130 if self.signum == signal.SIGINT else 0

    def _interrupt(self, signum: int, frame: object) -> None:
        if self.requested and self.signum == signal.SIGINT:  # the second Ctrl-C: stop now
            raise KeyboardInterrupt
        self.requested, self.signum = True, signum
        _waiting_stop[:] = [(signum, time.monotonic())]
        if int(os.environ.get("RANK", "0")) == 0:  # a terminal's Ctrl-C reaches every rank: one line
            # After the loop no step follows: the wait is for the last save (and alert commands).
            doing = "finishing the run's last save" if self.finishing else "saving at the end of this step"
            print(f"dsslm: Ctrl-C: {doing} (Ctrl-C again to stop at once)", file=sys.stderr, flush=True)

    @property
    def stopped_in_setup(self) -> bool:
        """A signal came before this job completed a step: a peer rank may have left because of it
        (raised in setup) while this one, already recording, met the broken group in the setup's
        last barrier or in step 1."""
        return self.signum is not None and not self.stepped

    def _handle(self, signum: int, frame: object) -> None:
        first = not self.requested
        self.requested, self.signum = True, signum
        if not self.in_loop:
            raise Preempted(signum)
        if first:
            _waiting_stop[:] = [(signum, time.monotonic())]
        if first and int(os.environ.get("RANK", "0")) == 0:
            # Said at once, as Ctrl-C is: a CPU step of a large model can take minutes to end.
            doing = "finishing the run's last save" if self.finishing else "saving at the end of this step"
            print(f"dsslm: {self.name}: {doing}", file=sys.stderr, flush=True)


def note_exit(emit: Callable[..., object], step_of: Callable[[], int],
              quiet: tuple[type[BaseException], ...] = (),
              said: tuple[type[BaseException], ...] = ()) -> Callable[..., bool]:
    """An ExitStack exit callback recording in events.jsonl why a run ends early: `preempted` (a
    stop signal before the first step), `interrupted` (Ctrl-C) or `failed` (an exception; not for
    `quiet` ones, such as a refused config, which have their own line or event). A `said` failure
    is recorded with `exit_line: true`: the process's last line says it, so the console does not
    say it twice. Never suppresses the exception."""
    def on_exit(exc_type, exc, tb) -> bool:
        if exc_type is None or issubclass(exc_type, quiet):
            return False
        if issubclass(exc_type, Preempted):
            emit("preempted", step=step_of(), signal=exc.signal, saved=False, exit_line=True,  # train.main says it
                 reason="the signal came before the first step: nothing trained, nothing to save")
        elif issubclass(exc_type, KeyboardInterrupt):
            emit("interrupted", step=step_of())
        elif issubclass(exc_type, Exception):
            emit("failed", step=step_of(), error=f"{exc_type.__name__}: {exc}"[:2000],
                 **({"exit_line": True} if issubclass(exc_type, said) else {}))
        return False
    return on_exit


def tell_agent(code: int) -> None:
    """The code this rank leaves with, for `python -m dsslm.engine.agent` ($DSSLM_AGENT_EXIT_FILE): it
    exits with it where torchrun's shutdown would wait on an unreachable rendezvous, or fail on one
    whose host left first. Light (no torch): a refusal before the imports tells it too."""
    write_line(AGENT_EXIT_FILE_ENV, str(code))


def note_status(line: str, is_main: bool = True) -> None:
    """How this job leaves, for the launcher ($DSSLM_STATUS_FILE; srun's exit code is one for all
    nodes): rank 0's `finished` or `preempted` (exit 0 either way), or the hang caller's `hang 75`
    / `hang 6`, or the node check's refusal. One writer for the one file."""
    if is_main:
        write_line(STATUS_FILE_ENV, line)


def write_line(env: str, line: str) -> None:
    """`line` into the file $`env` names, if any; a failed write is not this run's failure."""
    path = os.environ.get(env)
    if path:
        try:
            with open(path, "w") as f:
                f.write(line + "\n")
        except OSError:
            pass
