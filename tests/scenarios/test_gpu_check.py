"""bench/gpu_check.sh on a CPU (DEVICE=cpu, tiny sizes): the script a lent GPU runs first works
end to end and prints its one table, so the minutes on a device are not spent on a typo."""
import os
import subprocess

import pytest

from helpers import ROOT

pytestmark = pytest.mark.slow


def test_gpu_check_runs_on_cpu_and_prints_one_table(tmp_path):
    env = {**os.environ, "DEVICE": "cpu", "OUT": str(tmp_path), "OMP_NUM_THREADS": "1", "STEPS": "3"}
    proc = subprocess.run(["bash", "bench/gpu_check.sh"], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = proc.stdout.splitlines()
    assert any(line.startswith("tests/scenarios/test_gpu.py:") and "skipped" in line for line in lines), lines
    header = next(i for i, line in enumerate(lines) if line.split()[:4] == ["config", "engine", "optim", "document_mask"])
    rows = [line.split() for line in lines[header + 1:header + 3]]
    assert [r[:4] for r in rows] == [["tiny", "ddp", "adamw", "false"], ["tiny", "fsdp", "muon", "true"]], lines
    assert all(r[-1] == "ok" and float(r[6]) > 0 for r in rows), lines  # a tokens/s figure for each
