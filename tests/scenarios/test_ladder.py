"""`python -m dsslm.ladder`: a local ladder of 8 tiny runs (2 widths x 2 rates x 2 seeds) trains,
collects a finite final validation loss for every point, writes the table, ladder.png and the best
rate per width, and run again trains nothing; bad input exits 2 with one line and writes nothing;
and slurm/ladder.sbatch, with stand-ins for srun and scontrol, runs array task i's point through
slurm/train.sbatch and hands it a notice that came before train.sbatch's traps. The ladder as a job
array on a real two-node cluster: tests/scenarios/test_two_nodes.py."""
from __future__ import annotations

import json
import math
import os
import subprocess
from pathlib import Path

import pytest

from helpers import PYTHON, ROOT, TINY, events

pytestmark = pytest.mark.slow

# TINY's model without its width (the ladder's), 12 steps: each run is its interpreter's start, mostly.
BASE = [o for o in TINY if not o.startswith("model.d_model=")] + ["train.total_steps=12", "run.val_batches=2",
                                                                   "ckpt.every=12"]
GRID = ["--widths", "32,64", "--lrs", "1e-3,1e-2", "--seeds", "1,2"]


def ladder(*args: str, timeout_s: int = 300, env: dict | None = None) -> subprocess.CompletedProcess:
    env = {**os.environ, "DS_ACCELERATOR": "cpu", "OMP_NUM_THREADS": "1", **(env or {})}
    return subprocess.run([PYTHON, "-m", "dsslm.ladder", *args], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=timeout_s)


def test_a_local_ladder_trains_every_point_collects_and_skips_what_finished(tmp_path):
    out = tmp_path / "ladder"
    done = ladder(*GRID, "--out", str(out), "--jobs", "2", "--target-width", "256", *BASE)
    assert done.returncode == 0, done.stdout + done.stderr
    plan = json.loads((out / "ladder.json").read_text())
    names = [p["name"] for p in plan["points"]]
    assert len(names) == 8 and "w64-d2-lr1e-2-s1" in names, names
    results = plan["results"]["points"]
    assert [r["status"] for r in results] == ["finished"] * 8, results
    assert all(math.isfinite(r["val_loss"]) and r["val_step"] == 12 for r in results), results
    # TINY has run.val_every=0: the ladder validated each point at its last step all the same.
    assert "run.val_every=12" in plan["points"][0]["args"] and "monitor.enabled=false" in plan["points"][0]["args"]
    table = (out / "ladder.md").read_text()
    assert table.count("\n| 32 | 2 |") == 2 and table.count("\n| 64 | 2 |") == 2, table
    assert (out / "ladder.png").stat().st_size > 10_000
    for width in (32, 64):
        assert f"width {width}, depth 2: best rate " in done.stdout, done.stdout
    assert "rule: best lr = " in done.stdout and "predicted best lr at width 256, depth 2: " in done.stdout, done.stdout
    assert {b["width"] for b in plan["results"]["best"]} == {32, 64} and plan["results"]["rule"]["predicted_lr"] > 0

    again = ladder(*GRID, "--out", str(out), "--jobs", "2", "--target-width", "256", *BASE)
    assert again.returncode == 0 and "8 of 8 points done; running 0" in again.stdout, again.stdout + again.stderr
    assert all(len(events(Path(p["run_dir"]), "start")) == 1 for p in plan["points"])  # nothing trained again
    collected = ladder("--collect", "--out", str(out))
    assert collected.returncode == 0 and collected.stdout.count("**best**") == 2, collected.stdout

    before = (out / "ladder.json").read_bytes()
    other = ladder("--widths", "32,64", "--lrs", "3e-3", "--out", str(out), *BASE)  # another plan in the same folder
    assert other.returncode == 2 and len(other.stderr.splitlines()) == 1 and "holds another ladder" in other.stderr
    assert (out / "ladder.json").read_bytes() == before


@pytest.mark.parametrize("args, said", [
    (["--widths", "32,64", "--lrs", ","], "is empty: the grid would have no point"),
    (["--widths", "32,64", "--lrs", "1e-3", "model.no_such_key=1"], "unknown config key 'model.no_such_key'"),
    (["--widths", "32,30", "--lrs", "1e-3"], "point w30-d2-lr1e-3-s1337: model.d_model/model.n_heads=15 must be even"),
    (["--widths", "32", "--lrs", "1e-3", "model.d_model=64"], "--widths sets model.d_model at every point"),
])
def test_bad_input_exits_2_with_one_line_and_writes_nothing(tmp_path, args, said):
    out = tmp_path / "ladder"
    done = ladder(*args, "--out", str(out), "model.n_heads=2", "model.n_layers=2")
    assert done.returncode == 2 and said in done.stderr and len(done.stderr.splitlines()) == 1, done.stderr
    assert not done.stdout and not out.exists()


def sbatch_alone(tmp_path: Path, ladder_dir: Path, task: int, venv_activate: str = "") -> tuple[int, str, str, str]:
    """slurm/ladder.sbatch as array task `task` with stand-ins for srun (notes its arguments) and
    scontrol (notes its calls): (exit status, output, srun's arguments, scontrol's calls)."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(parents=True)
    (bin_dir / "srun").write_text(f'#!/bin/bash\necho "$@" >{tmp_path}/srun\n')
    (bin_dir / "scontrol").write_text(f'#!/bin/bash\necho "$@" >>{tmp_path}/scontrol\n[[ $1 == show ]] && echo node1\n'
                                      "exit 0\n")
    for stand_in in bin_dir.iterdir():
        stand_in.chmod(0o755)
    env = {**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}", "SLURM_JOB_ID": "42", "SLURM_JOB_NODELIST": "node1",
           "SLURM_ARRAY_TASK_ID": str(task), "SLURM_SUBMIT_DIR": str(ROOT), "DSSLM_PYTHON": PYTHON,
           "DSSLM_NPROC_PER_NODE": "1", "DSSLM_MODULE": "dsslm.train"}
    if venv_activate:
        (tmp_path / "venv" / "bin").mkdir(parents=True)
        (tmp_path / "venv" / "bin" / "activate").write_text(venv_activate)
        env["DSSLM_VENV"] = str(tmp_path / "venv")
    # train.sbatch's status file lands in slurm/logs/ of the submit folder (the repository): removed after.
    done = subprocess.run(["bash", str(ROOT / "slurm" / "ladder.sbatch"), str(ladder_dir)], env=env,
                          capture_output=True, text=True, timeout=60)
    read = lambda name: (tmp_path / name).read_text() if (tmp_path / name).exists() else ""  # noqa: E731
    return done.returncode, done.stdout + done.stderr, read("srun"), read("scontrol")


def test_ladder_sbatch_runs_its_task_s_point_through_train_sbatch(tmp_path):
    """No cluster: array task 3 hands point 3's arguments to train.sbatch's srun; a task past the
    plan exits 2; a notice during the ladder script's own setup (its venv's activation, before
    train.sbatch's traps) is not lost: the task is requeued without starting the ranks."""
    out, stand_in = tmp_path / "ladder", tmp_path / "sbatch-bin"
    stand_in.mkdir()
    (stand_in / "sbatch").write_text(f'#!/bin/bash\necho "$@" >{tmp_path}/sbatch\necho 123\n')
    (stand_in / "sbatch").chmod(0o755)
    submitted = ladder(*GRID, "--out", str(out), "--slurm", "--sbatch=--partition=debug", *BASE,
                       env={"PATH": f"{stand_in}:{os.environ['PATH']}"})
    assert submitted.returncode == 0 and "submitted job array 123 (8 points, --array=0-7)" in submitted.stdout, \
        submitted.stdout + submitted.stderr
    assert (tmp_path / "sbatch").read_text() == (f"--parsable --array=0-7 --output={out}/logs/%x-%A_%a.out "
                                                 f"--partition=debug {ROOT}/slurm/ladder.sbatch {out}\n")
    points = json.loads((out / "ladder.json").read_text())["points"]
    rc, log, srun, calls = sbatch_alone(tmp_path / "a", out, 3)
    assert rc == 0 and f"-m dsslm.train {' '.join(points[3]['args'])}\n" == srun.split(" -m dsslm.engine.agent ")[1] \
        .split(" --signals-to-handle SIGINT,SIGHUP,SIGQUIT ")[1], (log, srun)
    assert f"array task 3: point {points[3]['name']} of 8" in log and "ranks exited with 0" in log, log
    rc, log, srun, _ = sbatch_alone(tmp_path / "b", out, 8)
    assert rc == 2 and not srun and "no point 8 in" in log, log
    once = f"[[ -e {tmp_path}/noticed ]] || {{ touch {tmp_path}/noticed; kill -USR1 $$; }}\n"  # before train.sbatch's traps
    rc, log, srun, calls = sbatch_alone(tmp_path / "c", out, 3, venv_activate=once)
    assert rc == 0 and "requeueing without starting them" in log and "requeue 42" in calls and not srun, (log, calls)
