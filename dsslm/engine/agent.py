"""`python -m dsslm.engine.agent TORCHRUN_ARGS`: torchrun, exiting with the ranks' own code.

torchrun exits 1 whenever a rank fails, whatever its code; a launcher that decides by the code
(slurm/train.sbatch requeues on EXIT_REQUEUE and never on a NEEDS_A_PERSON code) needs the
ranks', one code for the job: `exits.job_exit_code`.

The agent also outlives SIGTERM and SIGUSR1. Slurm signals every process of a step, so each rank
already gets the signal once from slurmstepd; an agent that died on SIGUSR1 (its default) would
take the step down mid-save, and one that forwarded SIGTERM (torchrun's default) would signal each
rank twice. Launch it with `--signals-to-handle SIGINT,SIGHUP,SIGQUIT`, as train.sbatch does.

And it does not outlive its ranks for long, nor lose their code. A rank that leaves on the
watchdog's verdict, or with any non-zero code, writes its code into $DSSLM_AGENT_EXIT_FILE.
torchrun's own shutdown then talks to the
rendezvous store, which on a node cut off from the store's node blocks far past its read timeout
(measured: still waiting after 120 s with read_timeout=5). Once the ranks are gone and a code is
there, the agent exits with it LINGER_S later, whatever torchrun is still waiting for. And where
torchrun itself fails once the ranks are gone (the store's node left first), the agent exits with
the ranks' code, not torchrun's 1.
"""
from __future__ import annotations

import os
import signal
import sys
import tempfile
import threading
import time
from pathlib import Path

from dsslm.exits import AGENT_EXIT_FILE_ENV as EXIT_FILE_ENV

LINGER_S = 15.0


def main() -> int:
    for sig in (signal.SIGTERM, signal.SIGUSR1):
        signal.signal(sig, lambda *_: None)  # a handler, not SIG_IGN: exec gives the ranks the default back
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import main as torchrun

    from dsslm.exits import job_exit_code
    fd, exit_file = tempfile.mkstemp(prefix="dsslm-agent-")
    os.close(fd)
    os.unlink(exit_file)  # the ranks create it only when they leave on a verdict
    os.environ[EXIT_FILE_ENV] = exit_file
    threading.Thread(target=leave_after_ranks, args=(Path(exit_file),), daemon=True).start()
    sys.argv[0] = "torchrun"
    try:
        torchrun()
    except ChildFailedError as exc:
        return job_exit_code([failure.exitcode for failure in exc.failures.values()])
    except Exception:
        # torchrun's own failure, after its ranks are gone: on the node that did not host the
        # rendezvous store, an agent still polling it when the host's agent left on its ranks'
        # failure raises RendezvousConnectionError (exit 1). The ranks' code is in the exit file.
        # Or a signal torchrun handles (Ctrl-C at the terminal): the ranks said what they did with it.
        code = ranks_code(Path(exit_file))
        if code is None:
            raise
        if not isinstance(sys.exc_info()[1], SignalException):
            print(f"dsslm: torchrun's rendezvous failed after the ranks left with exit {code}; exiting with it",
                  file=sys.stderr, flush=True)
        return code
    finally:
        Path(exit_file).unlink(missing_ok=True)
    return 0


def ranks_code(exit_file: Path) -> int | None:
    """The code a rank left with (train.py writes it on any non-zero exit), or None."""
    try:
        return int(exit_file.read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return None


def leave_after_ranks(exit_file: Path) -> None:
    """Exit with the code in `exit_file` once no rank (a child of this process) has run for LINGER_S."""
    gone_since, had_ranks = None, False
    while True:
        if children(os.getpid()):
            gone_since, had_ranks = None, True
        elif had_ranks and gone_since is None:
            gone_since = time.monotonic()
        if gone_since is not None and time.monotonic() - gone_since > LINGER_S:
            code = ranks_code(exit_file)  # None: no code, torchrun decides, however long it takes
            if code is not None:
                print(f"dsslm: the ranks left with exit {code}; not waiting for torchrun's rendezvous shutdown",
                      file=sys.stderr, flush=True)
                exit_file.unlink(missing_ok=True)
                os._exit(code)
        time.sleep(1.0)


def children(pid: int) -> list[int]:
    """The running children of `pid` (a zombie is gone: torchrun reaps it only when it gets to it)."""
    out = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                stat = (entry / "stat").read_text()
                state, ppid = stat[stat.rindex(")") + 2:].split()[:2]
                if int(ppid) == pid and state not in ("Z", "X"):
                    out.append(int(entry.name))
            except (OSError, ValueError, IndexError):
                continue
    return out


if __name__ == "__main__":
    sys.exit(main())
