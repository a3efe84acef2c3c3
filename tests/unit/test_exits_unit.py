"""dsslm.exits: what a stop signal says, and where."""
from __future__ import annotations

import signal

from dsslm.exits import STOP_SIGNALS, StopFlag


def test_ctrl_c_is_said_by_the_first_rank_only(monkeypatch, capsys):
    """A terminal's Ctrl-C reaches every rank of a torchrun: the line was printed once per rank."""
    saved = {sig: signal.getsignal(sig) for sig in STOP_SIGNALS}
    try:
        for rank, says in (("0", True), ("1", False)):
            monkeypatch.setenv("RANK", rank)
            flag = StopFlag()
            flag._interrupt(signal.SIGINT, None)
            assert flag.requested and flag.exit_code == 130
            assert ("Ctrl-C: saving at the end of this step" in capsys.readouterr().err) == says, rank
    finally:
        for sig, handler in saved.items():
            signal.signal(sig, handler)


def test_ctrl_c_after_the_last_step_says_what_it_waits_for(monkeypatch, capsys):
    """After the loop (the end's save and alert commands being waited for, up to 30 s) a Ctrl-C
    said "saving at the end of this step", of a step that never came."""
    saved = {sig: signal.getsignal(sig) for sig in STOP_SIGNALS}
    try:
        monkeypatch.setenv("RANK", "0")
        flag = StopFlag()
        flag.finishing = True
        flag._interrupt(signal.SIGINT, None)
        assert "Ctrl-C: finishing the run's last save (Ctrl-C again to stop at once)" in capsys.readouterr().err
    finally:
        for sig, handler in saved.items():
            signal.signal(sig, handler)


def test_rank_0_says_in_the_status_file_whether_the_run_finished_or_was_preempted(tmp_path, monkeypatch):
    """Both exit 0; slurm/train.sbatch requeues after a notice only what says `preempted` (before:
    a run that finished in the step the notice came in was requeued too)."""
    import os

    from dsslm.recovery.faults import Drills
    from dsslm.train import train
    from helpers import events, tiny_cfg
    status = tmp_path / "status"
    monkeypatch.setenv("DSSLM_STATUS_FILE", str(status))
    saved = {sig: signal.getsignal(sig) for sig in STOP_SIGNALS}
    try:
        monkeypatch.setattr(Drills, "maybe_crash", lambda self, step: step == 2 and os.kill(os.getpid(), signal.SIGUSR1))
        preempted = tmp_path / "preempted"
        assert train(tiny_cfg(preempted, "train.total_steps=20", "ckpt.every=100")) == 0
        assert events(preempted, "preempt_save") and status.read_text() == "preempted\n"
        monkeypatch.undo()
        monkeypatch.setenv("DSSLM_STATUS_FILE", str(status))
        finished = tmp_path / "finished"
        assert train(tiny_cfg(finished, "train.total_steps=6", "ckpt.every=100")) == 0
        assert events(finished, "end") and status.read_text() == "finished\n"
        status.unlink()
        assert train(tiny_cfg(finished, "train.total_steps=6", "ckpt.every=100")) == 0  # nothing left to train
        assert status.read_text() == "finished\n"
    finally:
        for sig, handler in saved.items():
            signal.signal(sig, handler)
