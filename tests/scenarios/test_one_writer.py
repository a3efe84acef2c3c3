"""One trainer per run.dir: a second one started on it (one process or torchrun) exits 2 naming
the holder and writes nothing; the lock of a killed holder, and its half-written saves, are
cleared by the next trainer."""
from __future__ import annotations

import signal
import socket
import time

import pytest

from dsslm.ckpt.format import invalid_reason
from helpers import events, read_jsonl, run_train, start_train

pytestmark = pytest.mark.slow


def step_records(run_dir):
    return [r for r in read_jsonl(run_dir / "metrics.jsonl") if "loss" in r]


def test_a_second_trainer_exits_2_naming_the_holder_and_writes_nothing(tmp_path):
    run_dir = tmp_path / "run"
    holder = start_train(run_dir, "train.total_steps=5000", "ckpt.every=1000")
    deadline = time.time() + 120
    while len(step_records(run_dir)) < 3:
        assert holder.poll() is None and time.time() < deadline, holder.communicate()
        time.sleep(0.05)
    for nproc in (1, 2):  # the same config, and another learning rate: both must be refused
        other = run_train(run_dir, "train.total_steps=60", "optim.peak_lr=5e-3", "train.micro_batch_size=2",
                          nproc=nproc, check=False, timeout_s=180)
        if nproc == 1:
            assert other.returncode == 2, other.stderr[-3000:]
        else:  # torchrun itself exits 1 when a rank fails; its summary has each rank's code
            # Once (CI, 2026-12-07) rank 0 was still there 30 s after rank 1's exit 2 and torchrun
            # killed it; not reproduced in 11 runs under load. The ranks' own lines come first in
            # stderr, torchrun's summary last: both are shown.
            assert other.stderr.count("exitcode  : 2 ") == 2, other.stderr[:4000] + "\n[...]\n" + other.stderr[-3000:]
        ours = [line for line in other.stderr.splitlines() if line.startswith("dsslm:")]
        assert len(ours) == 1, other.stderr[-3000:]  # rank 0 says it for every rank (each exits 2, above)
        assert all(f"pid {holder.pid} on host {socket.gethostname()}" in line for line in ours)
        if nproc == 1:
            assert other.stderr.strip() == ours[0]
    holder.send_signal(signal.SIGTERM)
    assert holder.wait(timeout=120) == 0
    steps = [r["step"] for r in step_records(run_dir)]
    assert steps == list(range(1, len(steps) + 1))  # every step once: nobody else wrote here
    assert len(events(run_dir, "start")) == 1 and not (run_dir / "LOCK").exists()


def test_a_killed_holders_lock_and_half_written_save_are_cleared(tmp_path):
    run_dir = tmp_path / "run"
    crashed = run_train(run_dir, "train.total_steps=30", "ckpt.every=10", "faults.crash_in_save=20", check=False)
    assert crashed.returncode == 137  # died inside the save of step 20, like a SIGKILL: no cleanup ran
    leftovers = sorted(p.name for p in (run_dir / "checkpoints").glob(".tmp-*"))
    assert leftovers and (run_dir / "LOCK").exists()
    run_train(run_dir, "train.total_steps=30", "ckpt.every=10")
    takeover = events(run_dir, "lock_takeover")
    assert len(takeover) == 1 and "not running" in takeover[0]["reason"]
    assert events(run_dir, "leftovers_removed")[0]["folders"] == leftovers
    assert not list((run_dir / "checkpoints").glob(".tmp-*")) and not (run_dir / "LOCK").exists()
    assert invalid_reason(run_dir / "checkpoints" / "step-00000030") is None
