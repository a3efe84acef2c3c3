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


def test_a_rendezvous_failure_after_the_ranks_left_exits_with_their_code(monkeypatch, handlers):
    """On the node that did not host the rendezvous store, torchrun raised RendezvousConnectionError
    (exit 1) when the other node's agent left first: the ranks had left with 2 and said so."""
    from torch.distributed.elastic.rendezvous.api import RendezvousConnectionError

    def torchrun():
        Path(os.environ[agent.EXIT_FILE_ENV]).write_text("2\n")  # what train.py's rank writes on exit 2
        raise RendezvousConnectionError("The connection to the C10d store has failed.")

    monkeypatch.setattr("torch.distributed.run.main", torchrun)
    monkeypatch.setattr(agent, "leave_after_ranks", lambda exit_file: None)
    monkeypatch.setattr(sys, "argv", ["agent", "rank.py"])
    monkeypatch.delenv(agent.EXIT_FILE_ENV, raising=False)
    assert agent.main() == 2
    monkeypatch.setattr("torch.distributed.run.main", lambda: (_ for _ in ()).throw(
        RendezvousConnectionError("no rank said anything")))
    with pytest.raises(RendezvousConnectionError):  # no code from the ranks: torchrun's failure stands
        agent.main()


def test_a_rank_that_exits_non_zero_tells_the_agent_its_code(tmp_path):
    exit_file = tmp_path / "exit"
    env = {**os.environ, agent.EXIT_FILE_ENV: str(exit_file), "DS_ACCELERATOR": "cpu"}
    done = subprocess.run([sys.executable, "-m", "dsslm.train", f"run.dir={tmp_path / 'run'}",
                           f"data.dir={tmp_path / 'no-data'}"], env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 2 and exit_file.read_text().split() == ["2"], done.stderr[-2000:]


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
