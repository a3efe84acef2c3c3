"""Preemption signals, branching, retention in a real run, the resume drill, alert commands."""
import json
import os
import signal
import subprocess
import sys
import time

import pytest

from dsslm.train import train
from helpers import PYTHON, ROOT, TINY, events, free_port, losses_by_step, read_jsonl, run_train, tiny_cfg, train_cmd

BASE = ["train.total_steps=60", "ckpt.every=50", "ckpt.keep_last=5"]


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("ref") / "run"
    run_train(run_dir, *BASE)
    return run_dir


def wait_for_steps(run_dir, n, proc, timeout_s=120):
    deadline = time.time() + timeout_s
    while time.time() < deadline:
        if len(read_jsonl(run_dir / "metrics.jsonl")) >= n:
            return
        assert proc.poll() is None, proc.stderr.read()
        time.sleep(0.05)
    raise AssertionError(f"no {n} steps within {timeout_s}s")


@pytest.mark.slow
@pytest.mark.parametrize("sig", [signal.SIGUSR1, signal.SIGTERM])
def test_preemption_signal_saves_at_the_current_step_and_exits_0(reference, tmp_path, sig):
    run_dir = tmp_path / "run"
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen(train_cmd() + [f"run.dir={run_dir}", *TINY, *BASE], cwd=ROOT, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    # Signalled early, far from the regular checkpoint at 50: a tiny step takes a few ms, so by
    # the time the poll sees 12 lines the run can be 20 steps further (with ckpt.every=25 it was
    # sometimes answered at step 25, a regular checkpoint step, and the test failed).
    wait_for_steps(run_dir, 3, proc)
    proc.send_signal(sig)
    assert proc.wait(timeout=120) == 0
    saved = events(run_dir, "preempt_save")
    assert len(saved) == 1 and saved[0]["step"] % 50 != 0  # not a regular checkpoint step
    step = saved[0]["step"]
    assert (run_dir / "checkpoints" / f"step-{step:08d}" / "MANIFEST").exists()
    assert not events(run_dir, "end")
    run_train(run_dir, *BASE)
    assert events(run_dir, "resume")[0]["step"] == step
    (audit,) = events(run_dir, "resume_audit")
    assert audit["verdict"] == "nothing_to_compare" and f"stopped by {sig.name} and saved" in audit["reason"]
    ref, got = losses_by_step(reference), losses_by_step(run_dir)
    assert ref == got


@pytest.mark.slow
def test_branch_from_another_runs_checkpoint_records_lineage(tmp_path):
    wsd = ["train.total_steps=40", "ckpt.every=10", "optim.schedule=wsd", "optim.decay_steps=10"]
    parent = tmp_path / "parent"
    assert train(tiny_cfg(parent, *wsd)) == 0
    child = tmp_path / "child"
    ckpt = parent / "checkpoints" / "step-00000030"
    # A longer cooldown branched from the stable phase: schedule differs on purpose.
    assert train(tiny_cfg(child, "train.total_steps=50", "ckpt.every=10", "optim.schedule=wsd",
                     "optim.decay_steps=20", f"run.init_from={ckpt}")) == 0
    branch = events(child, "branch")
    assert len(branch) == 1 and branch[0]["step"] == 30 and branch[0]["parent"] == str(ckpt)
    assert "train.total_steps" not in branch[0]["drift"] and "optim.decay_steps" in branch[0]["drift"]
    state = json.loads((child / "checkpoints" / "step-00000050" / "state.json").read_text())
    assert state["train"]["lineage"] == [{"run_dir": str(parent), "step": 30, "checkpoint": str(ckpt)}]
    assert min(r["step"] for r in read_jsonl(child / "metrics.jsonl")) == 31
    # The same config branched at 30 continues the parent's curve exactly.
    twin = tmp_path / "twin"
    assert train(tiny_cfg(twin, *wsd, f"run.init_from={ckpt}")) == 0
    parent_losses = losses_by_step(parent)
    assert all(parent_losses[s] == v for s, v in losses_by_step(twin).items())


@pytest.mark.slow
def test_branch_refuses_another_model_shape(tmp_path, capsys):
    from dsslm.train import main
    parent = tmp_path / "parent"
    assert train(tiny_cfg(parent, "train.total_steps=10", "ckpt.every=10")) == 0
    rc = main([f"run.dir={tmp_path / 'child'}", *TINY, "model.d_model=64", "train.total_steps=20",
               f"run.init_from={parent / 'checkpoints' / 'step-00000010'}"])
    err = capsys.readouterr().err  # a branch, into a new run.dir: not "resume refused ... a new run.dir"
    assert rc == 2 and "branch refused" in err and "set model.d_model=32" in err, err
    # A branch at or past the run's length would train nothing and end with a "finished" run.
    rc = main([f"run.dir={tmp_path / 'short'}", *TINY, "train.total_steps=10",
               f"run.init_from={parent / 'checkpoints' / 'step-00000010'}"])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and err[-1].endswith("leaves nothing to train; set train.total_steps above 10"), err
    assert not list((tmp_path / "short").glob("checkpoints/step-*"))


@pytest.mark.slow
def test_retention_keeps_last_k_recovery_target_and_pre_decay_checkpoint(tmp_path):
    assert train(tiny_cfg(tmp_path, "train.total_steps=60", "ckpt.every=5", "ckpt.keep_last=2",
                     "optim.schedule=wsd", "optim.decay_steps=20")) == 0
    kept = sorted(int(p.name[5:]) for p in (tmp_path / "checkpoints").glob("step-*"))
    # last 2 (55, 60); a rewind from step 60 needs <= 60-5-2-1 = 52 (50); WSD decay starts at 40.
    assert kept == [40, 50, 55, 60]


def test_ckpt_at_end_false_leaves_the_last_step_unsaved(tmp_path):
    """A benchmark's runs need no save of their last step (350m: ~4 GB written and hashed each)."""
    common = ("train.total_steps=6", "ckpt.every=4", "ckpt.keep_last=5", "monitor.enabled=false")
    assert train(tiny_cfg(tmp_path / "no", *common, "ckpt.at_end=false")) == 0
    assert train(tiny_cfg(tmp_path / "yes", *common)) == 0
    saved = {name: sorted(p.name for p in (tmp_path / name / "checkpoints").glob("step-*")) for name in ("no", "yes")}
    assert saved == {"no": ["step-00000004"], "yes": ["step-00000004", "step-00000006"]}

@pytest.mark.slow
def test_alert_command_receives_rewind_event_as_json(tmp_path):
    sink = tmp_path / "alerts.jsonl"
    command = f"{sys.executable} -c \"import sys; open('{sink}', 'a').write(sys.stdin.read() + chr(10))\""
    assert train(tiny_cfg(tmp_path / "run", "model.d_model=64", "optim.peak_lr=3e-3", "train.total_steps=80",
                     "ckpt.every=5", "monitor.min_history=15", "monitor.window=30",
                     "monitor.rewind_margin_steps=2", "faults.nan_steps=[70]",
                     f"run.alert_command={command}")) == 0
    alerts = [json.loads(line) for line in sink.read_text().splitlines()]
    rewinds = [a for a in alerts if a["event"] == "rewind"]
    assert len(rewinds) == 1 and rewinds[0]["step"] == 70 and "window" in rewinds[0]
    # The report reads this real run (a rewind, repeated steps) and draws it.
    from dsslm.report import main as report
    assert report([str(tmp_path / "run")]) == 0
    for name in ("loss.png", "lr.png", "gnorm.png", "throughput.png", "summary.md"):
        assert (tmp_path / "run" / "report" / name).stat().st_size > 0
    lines = (tmp_path / "run" / "report" / "summary.md").read_text().splitlines()
    header = next(i for i, line in enumerate(lines) if line.startswith("| skips | rewinds |"))
    assert lines[header + 2].split("|")[2].strip() == "1"  # one rewind counted


@pytest.mark.slow
def test_resume_drill_command_passes(tmp_path):
    proc = subprocess.run([PYTHON, "-m", "dsslm.drill", "resume", "--workdir", str(tmp_path), *TINY,
                           "train.total_steps=20"], cwd=ROOT, capture_output=True, text=True, timeout=300,
                          env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "PASS" in proc.stdout and "largest per-step loss difference: 0" in proc.stdout


def test_corrupted_shard_refused_with_exit_2_and_nothing_written(tmp_path, capsys):
    from dsslm.data.__main__ import main as prepare
    from dsslm.train import main
    (tmp_path / "a.txt").write_text("a line of text to train on\n" * 300)
    assert prepare(["prepare", "--input", str(tmp_path / "a.txt"), "--out", str(tmp_path / "d")]) == 0
    shard = next((tmp_path / "d").rglob("train-*.bin"))
    data = bytearray(shard.read_bytes())
    data[100] ^= 0x01
    shard.write_bytes(bytes(data))
    capsys.readouterr()
    rc = main([f"run.dir={tmp_path / 'run'}", f"data.dir={tmp_path / 'd'}", *TINY, "train.total_steps=10"])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and len(err) == 1 and shard.name in err[0]
    assert not (tmp_path / "run").exists()


@pytest.mark.slow
def test_resume_drill_under_torchrun_runs_in_process_on_two_ranks(tmp_path):
    cmd = [PYTHON, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port",
           str(free_port()), "-m", "dsslm.drill", "resume", "--workdir", str(tmp_path), *TINY,
           "train.micro_batch_size=2", "train.total_steps=20"]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300,
                          env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "PASS" in proc.stdout and "(exit 137)" in proc.stdout
