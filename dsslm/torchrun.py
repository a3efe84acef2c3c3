"""`python -m dsslm.torchrun TORCHRUN_ARGS`: the multi-process command, torchrun with dsslm's exit codes.

The same arguments as `torchrun` (`--nproc_per_node 8 -m dsslm.train ...`); it is the agent
`slurm/train.sbatch` runs (`dsslm.engine.agent`), under the name a user reaches for. torchrun
itself exits 1 for any failure, and a Ctrl-C or a diagnosed hang reads as a crash: here the code is
the ranks' own (2 for a refused start, 75 for a hang, 130 for Ctrl-C; docs/run-folder.md#exit-codes).
"""
from __future__ import annotations

import sys

from dsslm.engine.agent import main

if __name__ == "__main__":
    sys.exit(main())
