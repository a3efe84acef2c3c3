"""dsslm.engine.agent in this process, with torchrun stood in for: the job exits with the ranks' own
code (torchrun says 1 for any failure), the exit file it names for the ranks is gone afterwards,
and the stop signals Slurm sends every process do not end it. The agent under a real torchrun, 2
ranks: tests/scenarios/test_exits.py (the codes) and test_hangs.py (a hang verdict's exit)."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from torch.distributed.elastic.multiprocessing.errors import ChildFailedError, ProcessFailure

from dsslm.engine import agent


@pytest.fixture
def handlers():
    """The agent installs SIGTERM and SIGUSR1 handlers for its process: put pytest's back."""
    saved = {sig: signal.getsignal(sig) for sig in (signal.SIGTERM, signal.SIGUSR1)}
    yield
    for sig, handler in saved.items():
        signal.signal(sig, handler)


@pytest.mark.parametrize("failed,code", [({1: 3}, 3), ({1: 2}, 2), ({}, 0), ({0: 1, 1: 75}, 75)])
def test_the_agent_exits_with_the_ranks_own_code(monkeypatch, tmp_path, handlers, failed, code):
    seen = {}

    def torchrun():
        seen["exit_file"] = Path(os.environ[agent.EXIT_FILE_ENV])
        seen["sigterm"] = signal.getsignal(signal.SIGTERM)
        if failed:
            raise ChildFailedError("rank.py", {rank: ProcessFailure(rank, 1000 + rank, exit_code,
                                                                    str(tmp_path / "no-error-file"))
                                               for rank, exit_code in failed.items()})

    monkeypatch.setattr("torch.distributed.run.main", torchrun)
    monkeypatch.setattr(agent, "leave_after_ranks", lambda exit_file: None)  # its os._exit would end pytest
    monkeypatch.setattr(sys, "argv", ["agent", "rank.py"])
    monkeypatch.delenv(agent.EXIT_FILE_ENV, raising=False)
    assert agent.main() == code
    assert not seen["exit_file"].exists()  # created only by a rank leaving on a verdict, and removed
    assert callable(seen["sigterm"]) and seen["sigterm"] not in (signal.SIG_DFL, signal.SIG_IGN)


def test_children_are_the_running_ones_only():
    """A rank that exited but is not reaped yet (a zombie) no longer counts as running."""
    child = subprocess.Popen(["sleep", "30"])
    try:
        assert child.pid in agent.children(os.getpid())
        child.kill()
        for _ in range(100):  # the kill lands at once; the loop only absorbs a loaded machine
            if child.pid not in agent.children(os.getpid()):
                break
            time.sleep(0.05)
        assert child.pid not in agent.children(os.getpid())  # a zombie until wait() below
    finally:
        child.kill()
        child.wait()
