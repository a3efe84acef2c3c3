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
