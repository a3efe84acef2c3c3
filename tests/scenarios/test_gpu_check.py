"""bench/gpu_check.sh on a CPU (DEVICE=cpu, tiny sizes): the script a lent GPU runs first works
end to end and prints its one table, so the minutes on a device are not spent on a typo; a run cut
at the deadline is summarised from what it logged and leaves no process behind; a torch that sees
no GPU stops it before any run."""
import os
import subprocess
import sys

import pytest

from helpers import ROOT

pytestmark = pytest.mark.slow


def gpu_check(tmp_path, **env):
    env = {**os.environ, "DEVICE": "cpu", "OUT": str(tmp_path / "out"), "SCRATCH": str(tmp_path / "scratch"),
           "OMP_NUM_THREADS": "1", "PYTHON": sys.executable, **env}
    return subprocess.run(["bash", "bench/gpu_check.sh"], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=900)


def table(stdout):
    lines = stdout.splitlines()
    header = next(i for i, line in enumerate(lines) if line.split()[:4] == ["config", "engine", "optim", "document_mask"])
    return lines[header].split(), [line.split() for line in lines[header + 1:] if not line.startswith("table:")]


def test_gpu_check_runs_on_cpu_and_prints_one_table(tmp_path):
    proc = gpu_check(tmp_path, STEPS="3")
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = proc.stdout.splitlines()
    assert lines[0].startswith("python ") and "torch 2." in lines[0], lines  # what it ran on, first
    assert any(line.startswith("tests/scenarios/test_gpu.py:") and "skipped" in line for line in lines), lines
    head, rows = table(proc.stdout)
    assert head[-3:] == ["wall_s", "first_step_s", "status"]
    assert [r[:4] for r in rows] == [["tiny", "ddp", "adamw", "false"], ["tiny", "fsdp", "muon", "true"]], lines
    assert all(r[-1] == "ok" and float(r[6]) > 0 for r in rows), lines  # a tokens/s figure for each
    # What comes back from a lent device: small files only; the runs stay in the scratch folder.
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == ["env.txt", "gpu_check.csv", "rows.log",
                                                                    "test_gpu.log"]
    assert "skipped" in (tmp_path / "out" / "test_gpu.log").read_text()


def test_a_run_cut_at_the_deadline_is_summarised_and_killed_and_the_rest_is_not_run(tmp_path):
    proc = gpu_check(tmp_path, STEPS="100000", RUN_TIMEOUT_S="12", DEADLINE_S="45", MIN_ROW_S="30",
                     ROWS="tiny:ddp:adamw:false tiny:fsdp:muon:true")
    assert proc.returncode == 0, proc.stderr[-3000:]
    _, (cut, skipped) = table(proc.stdout)
    assert " ".join(cut[-3:]) == "cut at 12s" and float(cut[6]) > 0, proc.stdout  # tokens/s of the steps logged
    assert " ".join(skipped[4:]).startswith("1 not run"), proc.stdout
    left = subprocess.run(["pgrep", "-f", str(tmp_path / "scratch")], capture_output=True, text=True)
    assert left.stdout == "", left.stdout  # no trainer of the cut run goes on into the next row


def test_a_torch_that_sees_no_gpu_stops_before_any_run(tmp_path):
    proc = gpu_check(tmp_path, DEVICE="cuda")
    assert proc.returncode == 2
    assert "gpu_check: stopped before any run" in proc.stderr and "no GPU visible" in proc.stderr
    assert not (tmp_path / "out" / "gpu_check.csv").exists()
