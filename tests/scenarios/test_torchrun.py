"""The README's multi-process command (`python -m dsslm.torchrun`, torchrun's arguments) exits with
dsslm's own codes where torchrun exits 1: a typo'd key is 2 in a few lines, Ctrl-C is 130 with the
step saved, and no rank outlives it."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest

from helpers import ROOT, TINY, free_port

pytestmark = pytest.mark.slow


def torchrun(*args: str) -> list[str]:
    return [sys.executable, "-m", "dsslm.torchrun", "--nproc_per_node", "2", "--master_port", str(free_port()),
            "-m", "dsslm.train", *args]


ENV = {**os.environ, "OMP_NUM_THREADS": "1", "DS_ACCELERATOR": "cpu"}


def test_the_readme_names_the_command():
    readme = (ROOT / "README.md").read_text()
    assert "-m dsslm.torchrun --nproc_per_node" in readme and ".venv/bin/torchrun" not in readme


def test_a_typo_exits_2_in_at_most_10_lines(tmp_path):
    proc = subprocess.run(torchrun(f"run.dir={tmp_path / 'run'}", *TINY, "train.total_stepz=3"), cwd=ROOT, env=ENV,
                          capture_output=True, text=True, timeout=300)
    lines = (proc.stdout + proc.stderr).strip().splitlines()
    assert proc.returncode == 2 and len(lines) <= 10, proc.stderr
    assert any("unknown config key 'train.total_stepz'" in line for line in lines)
    assert not (tmp_path / "run" / "checkpoints").exists()


def test_ctrl_c_exits_130_with_the_step_saved_and_no_rank_left(tmp_path):
    run_dir = tmp_path / "run"
    proc = subprocess.Popen(torchrun(f"run.dir={run_dir}", *TINY, "train.total_steps=100000", "run.log_every=1",
                                     "run.preflight=false"),
                            cwd=ROOT, env=ENV, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)  # its own group: the terminal's Ctrl-C reaches every process
    for line in proc.stdout:
        if "step 3/" in line:
            break
    os.killpg(proc.pid, signal.SIGINT)
    rest = proc.communicate(timeout=120)[0]
    assert proc.returncode == 130, rest
    assert "stopped by SIGINT after step" in rest and "rendezvous failed" not in rest
    time.sleep(1)
    alive = subprocess.run(["pgrep", "-f", f"run.dir={run_dir}"], capture_output=True, text=True).stdout.split()
    assert not alive and not (run_dir / "LOCK").exists()
