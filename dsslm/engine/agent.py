"""`python -m dsslm.engine.agent TORCHRUN_ARGS`: torchrun, exiting with the ranks' own code.

torchrun exits 1 whenever a rank fails, whatever its code; a launcher that decides by the code
(slurm/train.sbatch requeues on EXIT_REQUEUE and never on a NEEDS_A_PERSON code) needs the
ranks' own, one code for the job: `exits.job_exit_code`.

The agent also outlives SIGTERM and SIGUSR1. Slurm signals every process of a step, so each rank
already gets the signal once from slurmstepd; an agent that died on SIGUSR1 (its default) would
take the step down mid-save, and one that forwarded SIGTERM (torchrun's default) would signal each
rank twice. Launch it with `--signals-to-handle SIGINT,SIGHUP,SIGQUIT`, as train.sbatch does.
"""
from __future__ import annotations

import signal
import sys


def main() -> int:
    for sig in (signal.SIGTERM, signal.SIGUSR1):
        signal.signal(sig, lambda *_: None)  # a handler, not SIG_IGN: exec gives the ranks the default back
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import main as torchrun

    from dsslm.exits import job_exit_code
    sys.argv[0] = "torchrun"
    try:
        torchrun()
    except ChildFailedError as exc:
        return job_exit_code([failure.exitcode for failure in exc.failures.values()])
    return 0


if __name__ == "__main__":
    sys.exit(main())
