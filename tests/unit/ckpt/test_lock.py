"""dsslm.ckpt.lock: one trainer per run.dir. Who holds a lock, when a holder counts as gone, and a
takeover race between contenders that start together."""
from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import textwrap
import threading
import time

import pytest

from dsslm.ckpt import lock as lock_module
from dsslm.ckpt.lock import LOCK_FILE, LockHeld, LockLost, RunLock, identity
from dsslm.config import ConfigError
from helpers import ROOT


def write_lock(run_dir, age_s: float = 0.0, **fields) -> dict:
    run_dir.mkdir(parents=True, exist_ok=True)
    holder = {**identity(), **fields}
    (run_dir / LOCK_FILE).write_text(json.dumps(holder))
    if age_s:
        stamp = time.time() - age_s
        os.utime(run_dir / LOCK_FILE, (stamp, stamp))
    return holder


def dead_pid() -> int:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


def test_a_live_holder_on_this_host_is_respected_and_named(tmp_path):
    first = RunLock(tmp_path / "run")
    assert first.acquire() is None
    with pytest.raises(LockHeld) as info:
        RunLock(tmp_path / "run").acquire()
    message = str(info.value)
    assert f"pid {os.getpid()}" in message and socket.gethostname() in message and "\n" not in message
    first.release()
    assert not (tmp_path / "run" / LOCK_FILE).exists()
    assert RunLock(tmp_path / "run").acquire() is None  # released: free again


def test_a_dead_pid_on_this_host_is_taken_over(tmp_path):
    pid = dead_pid()
    write_lock(tmp_path, pid=pid)
    lock = RunLock(tmp_path)
    takeover = lock.acquire()
    assert takeover["previous"]["pid"] == pid and "not running" in takeover["reason"]
    assert json.loads((tmp_path / LOCK_FILE).read_text())["token"] == lock.me["token"]


def test_a_reused_pid_is_taken_over(tmp_path):
    write_lock(tmp_path, pid=os.getpid(), pid_start=1)  # our pid, but a process that started at boot
    assert "reused" in RunLock(tmp_path).acquire()["reason"]


def test_a_live_holder_on_another_host_is_respected(tmp_path):
    write_lock(tmp_path, host="node-17", boot_id="other-boot", pid=4242)
    with pytest.raises(LockHeld, match=r"pid 4242 on host node-17"):
        RunLock(tmp_path).acquire()
    assert json.loads((tmp_path / LOCK_FILE).read_text())["host"] == "node-17"  # untouched


def test_another_hosts_lock_without_a_heartbeat_is_taken_over(tmp_path):
    write_lock(tmp_path, age_s=3600, host="node-17", boot_id="other-boot", pid=4242)
    takeover = RunLock(tmp_path, stale_after_s=600).acquire()
    assert takeover["previous"]["host"] == "node-17" and "heartbeat" in takeover["reason"]


def fast_heartbeat(monkeypatch) -> float:
    """A heartbeat every 0.05 s: a restart rule waits restart_grace_s() (0.2 s) for one to stop."""
    monkeypatch.setattr(lock_module, "HEARTBEAT_S", 0.05)
    monkeypatch.setattr(lock_module, "RESTART_GRACE_MARGIN_S", 0.1)
    return 2 * 0.05 + 0.1


def test_a_requeued_slurm_job_takes_its_own_lock(tmp_path, monkeypatch):
    fast_heartbeat(monkeypatch)
    write_lock(tmp_path, host="node-17", boot_id="other-boot", pid=4242, slurm_job_id="777", slurm_restart=0)
    monkeypatch.setenv("SLURM_JOB_ID", "777")
    monkeypatch.setenv("SLURM_RESTART_COUNT", "0")
    with pytest.raises(LockHeld, match="Slurm job 777"):  # the same run of the job: a second job step
        RunLock(tmp_path).acquire()
    monkeypatch.setenv("SLURM_RESTART_COUNT", "1")  # scontrol requeue, a node failure's requeue
    assert "restarted" in RunLock(tmp_path).acquire()["reason"]


def beating(path, stop, period_s: float = 0.02) -> threading.Thread:
    """A live holder elsewhere: LOCK's mtime refreshed until `stop` is set."""
    def beat():
        while not stop.wait(period_s):
            os.utime(path)
    thread = threading.Thread(target=beat, daemon=True)
    thread.start()
    return thread


@pytest.mark.parametrize("job, restart, value", [("SLURM_JOB_ID", "SLURM_RESTART_COUNT", "777"),
                                                 ("TORCHELASTIC_RUN_ID", "TORCHELASTIC_RESTART_COUNT", "myrun")])
def test_a_restart_rule_waits_for_the_heartbeat_to_stop(tmp_path, monkeypatch, job, restart, value):
    """A job id can be shared (a literal --rdzv_id reused by an unrelated trainer on another node):
    the restart rules trust it only once the holder's heartbeat has stopped. (Before: an unrelated
    trainer restarted by torchrun took a live trainer's lock at once; that one exited 4.)"""
    grace = fast_heartbeat(monkeypatch)
    key = "slurm_job_id" if job == "SLURM_JOB_ID" else "elastic_run_id"
    count = "slurm_restart" if job == "SLURM_JOB_ID" else "elastic_restart"
    monkeypatch.setenv(job, value)
    monkeypatch.setenv(restart, "1")
    holder = write_lock(tmp_path, host="node-17", boot_id="other-boot", pid=4242, **{key: value, count: 0})
    stop = threading.Event()
    thread = beating(tmp_path / LOCK_FILE, stop)
    with pytest.raises(LockHeld, match=rf"{key} {value} restarted \(0 -> 1\), but it refreshed the lock while we watched"):
        RunLock(tmp_path).acquire()
    stop.set()
    thread.join()
    assert json.loads((tmp_path / LOCK_FILE).read_text()) == holder  # untouched
    started = time.monotonic()  # the heartbeat stopped just now: taken over once it is older than the grace
    takeover = RunLock(tmp_path).acquire()
    assert "restarted" in takeover["reason"] and "heartbeat stopped" in takeover["reason"]
    assert grace * 0.5 <= time.monotonic() - started < grace + 5


def test_a_restart_rule_does_not_wait_on_a_holder_alive_on_this_machine(tmp_path, monkeypatch):
    """The same Slurm job at a lower restart count, alive here (its pid runs): refused at once. It
    waited out the restart grace first (25 s), for a holder the pid rule had already found alive."""
    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    try:
        write_lock(tmp_path, pid=proc.pid, pid_start=lock_module._pid_start(proc.pid), slurm_job_id="777",
                   slurm_restart=0)
        monkeypatch.setenv("SLURM_JOB_ID", "777")
        monkeypatch.setenv("SLURM_RESTART_COUNT", "1")
        started = time.monotonic()
        with pytest.raises(LockHeld, match=f"pid {proc.pid}"):
            RunLock(tmp_path).acquire()
        assert time.monotonic() - started < lock_module.restart_grace_s() / 2
    finally:
        proc.kill()
        proc.wait()


@pytest.mark.parametrize("run_id", ["none", "", "None"])
def test_an_unset_torchrun_run_id_is_no_restart(tmp_path, monkeypatch, run_id):
    """`accelerate launch` (static rendezvous) and torchrun without --rdzv_id give every run the id
    "none": a lower restart count under it says nothing about the holder (before: taken over)."""
    fast_heartbeat(monkeypatch)
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", run_id)
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "1")
    write_lock(tmp_path, age_s=60, host="node-17", boot_id="other-boot", pid=4242, elastic_run_id=run_id,
               elastic_restart=0)
    with pytest.raises(LockHeld, match="pid 4242 on host node-17"):
        RunLock(tmp_path, stale_after_s=600).acquire()


def test_an_unreadable_lock_is_respected_until_it_is_stale(tmp_path):
    (tmp_path / LOCK_FILE).write_text('{"host": "nod')
    with pytest.raises(LockHeld, match="unreadable"):
        RunLock(tmp_path).acquire()
    stamp = time.time() - 3600
    os.utime(tmp_path / LOCK_FILE, (stamp, stamp))
    assert "unreadable" in RunLock(tmp_path, stale_after_s=600).acquire()["reason"]


def test_a_lock_taken_over_is_noticed_and_not_released_by_the_old_holder(tmp_path):
    mine = RunLock(tmp_path)
    mine.acquire()
    mine.check(fresh=True)
    theirs = write_lock(tmp_path, host="node-17", boot_id="other-boot", pid=4242)
    with pytest.raises(LockLost, match="node-17"):
        mine.check(fresh=True)
    with pytest.raises(LockLost):
        mine.check()  # remembered
    mine.release()
    assert json.loads((tmp_path / LOCK_FILE).read_text()) == theirs


def test_the_heartbeat_refreshes_the_lock_and_sees_it_deleted(tmp_path, monkeypatch):
    monkeypatch.setattr(lock_module, "HEARTBEAT_S", 0.05)
    lock = RunLock(tmp_path)
    lock.acquire()
    stamp = time.time() - 3600
    os.utime(tmp_path / LOCK_FILE, (stamp, stamp))
    deadline = time.time() + 10
    while os.stat(tmp_path / LOCK_FILE).st_mtime < time.time() - 60 and time.time() < deadline:
        time.sleep(0.02)
    assert os.stat(tmp_path / LOCK_FILE).st_mtime > time.time() - 60
    (tmp_path / LOCK_FILE).unlink()
    while lock._lost is None and time.time() < deadline:
        time.sleep(0.02)
    with pytest.raises(LockLost, match="deleted"):
        lock.check()
    lock.release()


def test_run_dir_that_is_a_file_is_a_config_error_and_created_folders_go_when_empty(tmp_path):
    (tmp_path / "afile").write_text("x")
    with pytest.raises(ConfigError, match="is a file"):
        RunLock(tmp_path / "afile").acquire()
    with pytest.raises(ConfigError, match="is a file"):
        RunLock(tmp_path / "afile" / "run").acquire()
    lock = RunLock(tmp_path / "a" / "b" / "run")
    lock.acquire()
    lock.release()
    assert not (tmp_path / "a").exists()  # nothing was written: no trace left
    lock = RunLock(tmp_path / "c" / "run")
    lock.acquire()
    (tmp_path / "c" / "run" / "metrics.jsonl").write_text("")
    lock.release()
    assert (tmp_path / "c" / "run" / "metrics.jsonl").exists()


CONTENDER = textwrap.dedent("""
    import sys, time
    from pathlib import Path
    from dsslm.ckpt.lock import LockHeld, RunLock
    run_dir, signals, me = Path(sys.argv[1]), Path(sys.argv[2]), sys.argv[3]
    inspect = RunLock._inspect
    def slow_inspect(self):  # contenders judge the stale lock together, then remove it one by one
        seen = inspect(self)
        time.sleep(0.03 * int(me))
        return seen
    RunLock._inspect = slow_inspect
    (signals / f"ready-{me}").touch()
    while not (signals / "go").exists():
        time.sleep(0.001)
    lock = RunLock(run_dir)
    try:
        lock.acquire()
    except LockHeld:
        print("held")
        sys.exit(0)
    print("won", flush=True)
    while not (signals / "done").exists():  # hold it until every other contender has tried
        time.sleep(0.01)
    lock.release()
""")


@pytest.mark.slow
def test_contenders_on_a_stale_lock_have_exactly_one_winner(tmp_path):
    for round_ in range(3):
        run_dir, signals = tmp_path / f"run{round_}", tmp_path / f"signals{round_}"
        signals.mkdir()
        write_lock(run_dir, pid=dead_pid())
        procs = [subprocess.Popen([sys.executable, "-c", CONTENDER, str(run_dir), str(signals), str(i)], cwd=ROOT,
                                  stdout=subprocess.PIPE, text=True) for i in range(4)]
        deadline = time.time() + 60
        while len(list(signals.glob("ready-*"))) < 4 and time.time() < deadline:
            time.sleep(0.01)
        (signals / "go").touch()  # all four try at the same moment
        while sum(p.poll() is not None for p in procs) < 3 and time.time() < deadline:
            time.sleep(0.01)
        (signals / "done").touch()
        outcomes = sorted(p.communicate(timeout=60)[0].strip() for p in procs)
        assert outcomes == ["held", "held", "held", "won"], outcomes


def test_a_transient_read_error_of_the_lock_is_retried_not_taken_as_lost(tmp_path, monkeypatch):
    """A shared filesystem's hiccup (EIO, a stale handle) must not stop every rank with exit 4."""
    import builtins
    import errno
    lock = RunLock(tmp_path)
    lock.acquire()
    real_open, failures = builtins.open, []

    def flaky(path, *args, **kwargs):
        if str(path) == str(lock.path) and len(failures) < 3:
            failures.append(1)
            raise OSError(errno.EIO, "Input/output error")
        return real_open(path, *args, **kwargs)

    monkeypatch.setattr(builtins, "open", flaky)
    lock.check(fresh=True)  # read again until it succeeds
    assert len(failures) == 3
    # One that does not pass within the deadline is a lost lock, named as such.
    monkeypatch.setattr(lock_module, "READ_RETRY_S", 0.3)
    failures.clear()
    monkeypatch.setattr(builtins, "open", lambda path, *a, **k: (_ for _ in ()).throw(OSError(errno.EIO, "EIO"))
                        if str(path) == str(lock.path) else real_open(path, *a, **k))
    started = time.monotonic()
    with pytest.raises(LockLost, match="stayed unreadable for 0 s"):
        lock.check(fresh=True)
    assert 0.3 <= time.monotonic() - started < 5
    monkeypatch.setattr(builtins, "open", real_open)
    lock.release()


def test_a_trainer_that_lost_the_lock_sets_aside_none_of_the_new_holders_checkpoints(tmp_path):
    """A rewind renames the checkpoints after its base (`leave_after`), and a spike verdict
    rewrites skip_list.json: both are writes into run.dir, fenced like a save. (Before: the rename
    was not, so a trainer taken over set aside the new holder's newer checkpoints and its next
    resume went back to the old one.)"""
    import torch

    from dsslm.ckpt.store import CheckpointStore
    from dsslm.config import Config
    from dsslm.recovery.rewind import Rewinder
    mine = RunLock(tmp_path)
    mine.acquire()
    store = CheckpointStore(tmp_path, keep_last=5, fence=lambda: mine.check(fresh=True))
    for step in (4, 8):
        store.save(step, {"model": {"w": torch.ones(4)}}, {"step": step})
    write_lock(tmp_path, host="node-17", boot_id="other-boot", pid=4242)
    before = sorted(os.listdir(tmp_path / "checkpoints"))
    with pytest.raises(LockLost, match="node-17"):
        store.leave_after(4)
    assert sorted(os.listdir(tmp_path / "checkpoints")) == before
    engine = type("Engine", (), {"decide": staticmethod(lambda fn: fn())})()
    checkpointer = type("Checkpointer", (), {"store": store})()
    rewinder = Rewinder(Config(), engine, checkpointer, None, 16, tmp_path, lambda *a, **k: None)
    with pytest.raises(LockLost):
        rewinder.write_run_file(__import__("dsslm.ckpt.train_state", fromlist=["x"]).TrainState())
    assert not (tmp_path / "skip_list.json").exists()
    mine.release()


def test_a_stop_signal_just_after_the_link_removes_the_lock(tmp_path, monkeypatch):
    """A signal's Preempted between link(2) and acquire's return (here in the fsync of run.dir that
    follows the link) left LOCK behind: a new job on another node met it for run.lock_stale_s."""
    from dsslm.exits import Preempted

    def stopped(path):
        raise Preempted(10)

    monkeypatch.setattr(lock_module, "fsync_dir", stopped)
    lock = RunLock(tmp_path / "run")
    with pytest.raises(Preempted):
        lock.acquire()
    monkeypatch.undo()
    lock.release()  # what the job's cleanup does too: nothing left to do
    assert not (tmp_path / "run").exists()  # LOCK gone, and the folder acquire made


def test_a_stop_signal_while_setup_shares_the_lock_decision_releases_it(tmp_path, monkeypatch):
    """job.setup registers the lock's release before acquiring: a Preempted raised once rank 0 holds
    LOCK (in engine.decide's broadcast of the result) still releases it (before: LOCK stayed)."""
    from dsslm.engine.base import Engine
    from dsslm.exits import Preempted
    from dsslm.train import train
    from helpers import tiny_cfg
    decide = Engine.decide

    def broadcast_interrupted(self, fn):
        result = decide(self, fn)
        if getattr(fn, "__func__", None) is RunLock.acquire:
            raise Preempted(10)
        return result

    monkeypatch.setattr(Engine, "decide", broadcast_interrupted)
    run_dir = tmp_path / "run"
    with pytest.raises(Preempted):
        train(tiny_cfg(run_dir, "train.total_steps=6"))
    assert not (run_dir / LOCK_FILE).exists()
