"""bench/gpu_check.sh on a CPU (DEVICE=cpu, tiny sizes): the script a lent GPU runs first works
end to end and prints its one table, so the minutes on a device are not spent on a typo; a run cut
at the deadline is summarised from what it logged and leaves no process behind; a torch that sees
no GPU stops it before any run."""
import os
import subprocess
import sys
from pathlib import Path

import pytest

from helpers import ROOT

pytestmark = pytest.mark.slow


def gpu_check(tmp_path, **env):
    env = {**os.environ, "DEVICE": "cpu", "OUT": str(tmp_path / "out"), "SCRATCH": str(tmp_path / "scratch"),
           "OMP_NUM_THREADS": "1", "PYTHON": sys.executable, **env}
    return subprocess.run(["bash", "bench/gpu_check.sh"], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=900)


def running_with(text: str) -> list[str]:
    """The command lines of this machine's processes that name `text` (read from /proc)."""
    found = []
    for cmdline in Path("/proc").glob("[0-9]*/cmdline"):
        try:
            line = cmdline.read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue  # gone meanwhile
        if text in line:
            found.append(line)
    return found


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
    # Nothing of the cut run is left. (On CPU its tiny steps end within timeout's 5 s grace, so
    # kill_runs is not needed here; the next test shows it kills what that grace does not.)
    assert not running_with(str(tmp_path / "scratch"))


def test_kill_runs_kills_a_trainer_in_a_session_of_its_own_that_ignores_sigterm(tmp_path):
    """torchrun starts its workers in sessions of their own, out of reach of timeout's signal to
    the row's process group, and a worker mid-step (minutes, compiling on a GPU) answers SIGTERM
    only at the step's end: the cut row's trainer went on beside the next row. gpu_check.sh's
    kill_runs kills every process whose command line names the run's folder."""
    import time
    marker = str(tmp_path / "scratch" / "row1" / "runs")
    worker = subprocess.Popen([sys.executable, "-c", "import signal, time; signal.signal(signal.SIGTERM, "
                               "signal.SIG_IGN); time.sleep(300)", marker], start_new_session=True)
    try:
        deadline = time.time() + 10
        while not running_with(marker) and time.time() < deadline:
            time.sleep(0.05)
        assert running_with(marker)
        script = (ROOT / "bench" / "gpu_check.sh").read_text()
        kill_runs = script[script.index("kill_runs() {"):script.index("\n}\n", script.index("kill_runs() {")) + 3]
        # The folder through the environment: on bash's own command line pkill would match bash.
        subprocess.run(["bash", "-c", f'{kill_runs}\nkill_runs "$MARK"'], env={**os.environ, "MARK": marker},
                       check=True, timeout=30)
        assert worker.wait(timeout=5) == -9 and not running_with(marker)
    finally:
        if worker.poll() is None:
            worker.kill()


def test_a_torch_that_sees_no_gpu_stops_before_any_run(tmp_path):
    proc = gpu_check(tmp_path, DEVICE="cuda")
    assert proc.returncode == 2
    assert "gpu_check: stopped before any run" in proc.stderr and "no GPU visible" in proc.stderr
    assert not (tmp_path / "out" / "gpu_check.csv").exists()
