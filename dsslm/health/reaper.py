"""`python reaper.py CLAIM GRACE_S POLL_S PID:START ...`: one per node and job, started by the
node's first rank. Once a rank of the job has called a hang (CLAIM, `run.dir/hangs/.called-<job>`,
exists), this node's ranks that are stopped (SIGSTOP stops every thread of a process, so no
watchdog of theirs can act) are SIGKILLed at once, and any still alive GRACE_S later too: every
process of the job ends even where a node's only rank is the stopped one, which its torchrun
agent would otherwise wait for forever. It exits when every rank it watches is gone.

The standard library only, run by path: it starts in milliseconds and holds no memory worth
counting. A pid is matched with its start time, so a reused pid is never killed.
"""
from __future__ import annotations

import os
import signal
import sys
import time
from pathlib import Path


def pid_start(pid: int) -> int | None:
    """The process's start time in clock ticks since boot (/proc/PID/stat field 22); None if gone."""
    return _stat(pid)[1]


def _stat(pid: int) -> tuple[str | None, int | None]:
    try:
        with open(f"/proc/{pid}/stat") as f:
            stat = f.read()
        fields = stat[stat.rindex(")") + 2:].split()  # after "(comm)": field 3 on
        return fields[0], int(fields[19])
    except (OSError, ValueError, IndexError):
        return None, None


def state_of(pid: int, start: int) -> str | None:
    """The process's state letter (R, S, T, ...), or None where it is gone, a zombie or another
    process now."""
    state, started = _stat(pid)
    return state if started == start and state not in (None, "Z", "X") else None


def reap(claim: Path, grace_s: float, poll_s: float, ranks: list[tuple[int, int]]) -> None:
    called = None
    while True:
        alive = [(pid, state) for pid, start in ranks if (state := state_of(pid, start)) is not None]
        if not alive:
            return
        if called is None and claim.exists():
            called = time.monotonic()
        if called is not None:
            late = time.monotonic() - called > grace_s
            for pid, state in alive:
                if state in "Tt" or late:
                    try:
                        os.kill(pid, signal.SIGKILL)
                    except (ProcessLookupError, PermissionError):
                        pass
        time.sleep(poll_s)


def main(argv: list[str]) -> int:
    claim, grace_s, poll_s = Path(argv[0]), float(argv[1]), float(argv[2])
    ranks = [(int(pid), int(start)) for pid, start in (arg.split(":") for arg in argv[3:])]
    for sig in (signal.SIGUSR1, signal.SIGINT):  # a preemption notice or a Ctrl-C is the ranks' to answer
        signal.signal(sig, signal.SIG_IGN)
    reap(claim, grace_s, poll_s, ranks)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
