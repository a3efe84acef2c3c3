"""Every way out of a run: the save in flight is finished (escalation, Ctrl-C), a failure only
rank 0 sees stops every rank together with one exit code, and a stop signal before the first
step or after the end event exits 0 (Slurm reads -15 as a failure)."""
from __future__ import annotations

import os
import signal
import subprocess
import time
from pathlib import Path
from unittest import mock

import pytest

from dsslm.ckpt.format import invalid_reason
from helpers import TINY, events, hook_env, read_jsonl, run_distributed, run_train, start_train

pytestmark = pytest.mark.slow

EXIT_WRITE_FAILED, EXIT_INTERRUPTED = 4, 130
SLOW_SAVE = """
    import os, time
    from dsslm.ckpt import store
    real = store._write_file
    def slow(path, chunks):
        if "{step}" in str(path):
            open(os.environ["MARKER"], "a").close()
            time.sleep(3)
        return real(path, chunks)
    store._write_file = slow
"""


def wait_for(predicate, proc: subprocess.Popen, timeout_s: float = 120) -> None:
    deadline = time.time() + timeout_s
    while not predicate():
        assert proc.poll() is None, proc.communicate()
        assert time.time() < deadline, "timed out"
        time.sleep(0.002)


def test_escalation_with_a_save_in_flight_keeps_that_save(tmp_path):
    """Step 70's save is still being written (3 s) when the spike from step 71 on escalates (exit 3)."""
    env = {**hook_env(tmp_path / "hook", SLOW_SAVE.format(step="step-00000070")), "MARKER": str(tmp_path / "m")}
    run_dir = tmp_path / "run"
    proc = run_train(run_dir, "model.d_model=64", "optim.peak_lr=3e-3", "train.total_steps=100", "ckpt.every=5",
                     "monitor.min_history=15", "monitor.window=30", "monitor.max_rewinds=0",
                     "faults.poison_batches=[[70,100000]]", check=False, env=env)
    assert proc.returncode == 3, proc.stderr[-2000:]
    assert 71 <= events(run_dir, "escalation")[0]["step"] <= 74  # skips, then the rewind that escalates
    assert invalid_reason(run_dir / "checkpoints" / "step-00000070") is None
    assert not list((run_dir / "checkpoints").glob(".tmp-*"))


def test_ctrl_c_with_a_save_in_flight_finishes_it_saves_the_step_and_exits_130(tmp_path):
    marker = tmp_path / "m"
    # A shell's background job (CI's, or `cmd &`) starts with SIGINT ignored, and Python then
    # installs no KeyboardInterrupt handler: give the trainer the one a terminal's Ctrl-C meets.
    ctrl_c = "    import signal\n    signal.signal(signal.SIGINT, signal.default_int_handler)\n"
    env = {**hook_env(tmp_path / "hook", SLOW_SAVE.format(step="step-00000010") + ctrl_c), "MARKER": str(marker)}
    run_dir = tmp_path / "run"
    proc = start_train(run_dir, "train.total_steps=200", "ckpt.every=10", env=env)
    wait_for(marker.exists, proc)
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == EXIT_INTERRUPTED, err
    assert invalid_reason(run_dir / "checkpoints" / "step-00000010") is None
    # Like SIGTERM: the step in flight ends, is saved, and the line says where the next run resumes.
    (saved,) = events(run_dir, "preempt_save")
    assert saved["signal"] == "SIGINT" and invalid_reason(run_dir / "checkpoints" / f"step-{saved['step']:08d}") is None
    assert f"resume from step {saved['step']}" in err and not (run_dir / "LOCK").exists()


def _fail_on_rank0(rank: int, world_size: int, run_dir: str, what: str) -> tuple[int, float]:
    """Train on 2 gloo ranks while rank 0 alone fails to write (its checkpoint writer, or its
    metrics.jsonl): every rank must leave at the next step boundary with the same code."""
    import errno
    from dsslm.ckpt import store
    from dsslm.observe import sinks
    from dsslm.train import main
    real_write_file, real_write = store._write_file, os.write

    def failing_save(path, chunks):
        if "step-00000006" in str(path):
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        return real_write_file(path, chunks)

    def failing_append(fd, data):
        if os.readlink(f"/proc/self/fd/{fd}").endswith("metrics.jsonl") and b'"step": 7,' in bytes(data):
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        return real_write(fd, data)

    patch = (mock.patch.object(store, "_write_file", failing_save) if what == "checkpoint"
             else mock.patch.object(sinks.os, "write", failing_append))
    started = time.monotonic()
    with patch:
        rc = main([f"run.dir={run_dir}", *TINY, "train.micro_batch_size=2", "train.total_steps=40", "ckpt.every=3"])
    return rc, time.monotonic() - started


@pytest.mark.parametrize("what", ["checkpoint", "metrics"])
def test_a_write_failure_on_rank_0_stops_both_ranks_with_exit_4(tmp_path, what):
    results = run_distributed(_fail_on_rank0, world_size=2, args=(str(tmp_path / "run"), what), timeout_s=120)
    assert [rc for rc, _ in results] == [EXIT_WRITE_FAILED, EXIT_WRITE_FAILED]
    assert max(seconds for _, seconds in results) < 60  # a hang would wait out the 1800 s collective timeout
    steps = [r["step"] for r in read_jsonl(tmp_path / "run" / "metrics.jsonl") if "loss" in r]
    assert steps and max(steps) < 12  # stopped at a step boundary right after the failure, long before 40
    assert invalid_reason(tmp_path / "run" / "checkpoints" / "step-00000003") is None  # what was saved is intact


def _signal_as_the_loop_begins(rank: int, world_size: int, run_dir: str) -> tuple[int, float]:
    """A SIGTERM reaching both ranks as setup ends: rank 0 is still on its own work after setup's
    collectives (events, the audit, the start checkpoint's host snapshot: here 1 s), rank 1 is
    already past them and gets it at 0.5 s."""
    import threading

    import dsslm.train as train_module
    real_start = train_module.start

    def start(job):
        out = real_start(job)
        if rank == 0:
            time.sleep(1.0)
            signal.raise_signal(signal.SIGTERM)
        else:
            threading.Timer(0.5, os.kill, (os.getpid(), signal.SIGTERM)).start()
        return out

    started = time.monotonic()
    with mock.patch.object(train_module, "start", start):
        rc = train_module.main([f"run.dir={run_dir}", *TINY, "train.micro_batch_size=2", "train.total_steps=40"])
    return rc, time.monotonic() - started


def test_a_stop_signal_as_setup_ends_exits_0_on_every_rank(tmp_path):
    """Rank 0 left with Preempted (nothing trained) while rank 1, already recording signals for
    the loop, went into step 1's all-reduce: under gloo that raised on rank 1 (exit 1), under
    NCCL it waited for the collective timeout. Setup now ends in a barrier before any rank
    records instead of raising, so the signal ends setup on both ranks."""
    results = run_distributed(_signal_as_the_loop_begins, world_size=2, args=(str(tmp_path / "run"),), timeout_s=120)
    assert [rc for rc, _ in results] == [0, 0]
    assert max(seconds for _, seconds in results) < 60
    assert not [r for r in read_jsonl(tmp_path / "run" / "metrics.jsonl") if "loss" in r]  # nothing trained


def sigcgt_has(pid: int, sig: int) -> bool:
    """/proc says the process has a handler for `sig` (it has caught up to that point)."""
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return False
    caught = int(next(line.split()[1] for line in status.splitlines() if line.startswith("SigCgt:")), 16)
    return bool(caught >> (sig - 1) & 1)


def test_sigterm_during_the_imports_exits_0_and_writes_nothing(tmp_path):
    run_dir = tmp_path / "run"
    proc = start_train(run_dir, "train.total_steps=50")
    wait_for(lambda: sigcgt_has(proc.pid, signal.SIGTERM), proc)  # train.py's first lines ran; torch is loading
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 0 and "SIGTERM before the first step" in err, err
    assert not run_dir.exists()


def test_sigterm_during_the_resume_exits_0_at_once_with_an_event(tmp_path):
    run_dir = tmp_path / "run"
    run_train(run_dir, "train.total_steps=10", "ckpt.every=5")
    marker = tmp_path / "m"
    slow_resume = """
        import os, time
        from dsslm.ckpt import resume
        real = resume.Checkpointer.resume_or_init
        def slow(self, *args, **kwargs):
            open(os.environ["MARKER"], "a").close()
            time.sleep(60)  # a resume hashing a large checkpoint
            return real(self, *args, **kwargs)
        resume.Checkpointer.resume_or_init = slow
    """
    status = tmp_path / "status"  # slurm/train.sbatch's: rank 0's word for the launcher's log
    proc = start_train(run_dir, "train.total_steps=20", "ckpt.every=5",
                       env={**hook_env(tmp_path / "hook", slow_resume), "MARKER": str(marker),
                            "DSSLM_STATUS_FILE": str(status)})
    wait_for(marker.exists, proc)
    sent = time.monotonic()
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 0, err
    assert time.monotonic() - sent < 20  # at once, not after the 60 s resume and a step
    preempted = events(run_dir, "preempted")
    assert len(preempted) == 1 and preempted[0]["signal"] == "SIGTERM" and preempted[0]["saved"] is False
    said = [line for line in err.splitlines() if "before the first step" in line]
    assert said == ["dsslm: SIGTERM before the first step: nothing trained, nothing to save"], err  # once
    assert status.read_text() == "preempted\n"  # before: nothing, and the log said "no word from rank 0"
    saved = sorted(p.name for p in (run_dir / "checkpoints").iterdir())
    assert saved == ["step-00000000", "step-00000005", "step-00000010"]  # the start checkpoint, then the run's
    assert not (run_dir / "LOCK").exists()


@pytest.mark.slow
def test_a_signal_to_one_rank_waiting_in_setups_last_barrier_saves_after_step_1(tmp_path):
    """Rank 1 waits in the barrier that ends setup while rank 0 still works; SIGTERM reaches rank
    1 alone. Its handler ran only once the barrier returned and raised there, on that rank alone,
    while rank 0 went into step 1's all-reduce: a broken group, exit 1. Recorded from the barrier
    on, the signal is agreed at step 1, and both ranks save after it and exit 0."""
    from helpers import train_cmd
    slow_rank0 = """
        import os, time
        from dsslm.engine import base
        real = base.Engine.barrier
        def barrier(self):
            if self.rank == 0:
                time.sleep(4)  # rank 0's own setup work (the start checkpoint's snapshot)
            else:
                open(os.environ["MARKER"], "w").write(str(os.getpid()))
            return real(self)
        base.Engine.barrier = barrier
    """
    marker, run_dir = tmp_path / "rank1.pid", tmp_path / "run"
    env = {**os.environ, "DS_ACCELERATOR": "cpu", "OMP_NUM_THREADS": "1", "MARKER": str(marker),
           **hook_env(tmp_path / "hook", slow_rank0)}
    proc = subprocess.Popen(train_cmd(2) + [f"run.dir={run_dir}", *TINY, "train.total_steps=20", "ckpt.every=10"],
                            env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    wait_for(marker.exists, proc)
    time.sleep(0.5)  # inside the barrier's wait
    os.kill(int(marker.read_text()), signal.SIGTERM)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 0, err[-3000:]
    assert [e["step"] for e in events(run_dir, "preempt_save")] == [1]  # named by rank 0, which had none
    assert (run_dir / "checkpoints" / "step-00000001" / "MANIFEST").is_file()


def test_sigterm_while_the_finished_process_shuts_down_exits_0(tmp_path):
    """Python resets its own signal handlers to the default while the interpreter shuts down; a
    SIGTERM then (torch tearing down its threads) used to end a finished run with -15."""
    marker = tmp_path / "m"
    slow_shutdown = """
        import os, time
        class _SlowShutdown:  # freed with the modules, after Python dropped its signal handlers
            def __del__(self, mknod=os.mknod, sleep=time.sleep, path=os.environ["MARKER"]):
                mknod(path)
                sleep(3)
        _slow = _SlowShutdown()
    """
    run_dir = tmp_path / "run"
    proc = start_train(run_dir, "train.total_steps=6", env={**hook_env(tmp_path / "hook", slow_shutdown),
                                                           "MARKER": str(marker)})
    wait_for(marker.exists, proc)
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 0, err
    assert events(run_dir, "end")[0]["step"] == 6


@pytest.fixture
def ctrl_c_is_keyboard_interrupt():
    """The caller of these tests is one whose Ctrl-C is KeyboardInterrupt (a script, a notebook).
    A pytest started as a shell's background job inherits SIGINT ignored, and then the loop
    rightly leaves Ctrl-C alone (save_on_signal): set the caller's handler, give back what was."""
    before = signal.signal(signal.SIGINT, signal.default_int_handler)
    yield
    signal.signal(signal.SIGINT, before)


def _signal_during_step(monkeypatch, step: int, *signals: int) -> None:
    """Send `signals` to this process during the forward/backward of step `step` (its 1-based
    call of accumulate), after the step has started: where a long step spends its time."""
    from dsslm import train as train_module
    real, calls = train_module.accumulate, []

    def accumulate(*args, **kwargs):
        calls.append(1)
        if len(calls) == step:
            for sig in signals:
                os.kill(os.getpid(), sig)
                time.sleep(0.05)  # the handler runs before the next signal
        return real(*args, **kwargs)

    monkeypatch.setattr(train_module, "accumulate", accumulate)


@pytest.mark.slow
@pytest.mark.parametrize("sig, code", [(signal.SIGTERM, 0), (signal.SIGINT, EXIT_INTERRUPTED)])
def test_a_stop_signal_or_ctrl_c_during_a_step_saves_at_the_end_of_that_step(tmp_path, monkeypatch, capsys,
                                                                                 sig, code, ctrl_c_is_keyboard_interrupt):
    from dsslm.train import main
    run_dir = tmp_path / "run"
    _signal_during_step(monkeypatch, 5, sig)
    assert main([f"run.dir={run_dir}", *TINY, "train.total_steps=40", "ckpt.every=20"]) == code
    saved = events(run_dir, "preempt_save")
    assert [(e["step"], e["signal"]) for e in saved] == [(5, signal.Signals(sig).name)]
    assert max(r["step"] for r in read_jsonl(run_dir / "metrics.jsonl") if "loss" in r) == 5
    assert invalid_reason(run_dir / "checkpoints" / "step-00000005") is None
    err = capsys.readouterr().err
    assert "resume from step 5" in err
    # Said when the signal came, before the step it waits for ended (its line precedes the save's).
    said = f"dsslm: {signal.Signals(sig).name.replace('SIGINT', 'Ctrl-C')}: saving at the end of this step"
    assert said in err and err.index(said) < err.index("saved step-00000005")
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler  # Ctrl-C is the caller's again


@pytest.mark.slow
def test_a_second_ctrl_c_stops_at_once_and_exits_130(tmp_path, monkeypatch, capsys, ctrl_c_is_keyboard_interrupt):
    from dsslm.train import main
    run_dir = tmp_path / "run"
    _signal_during_step(monkeypatch, 5, signal.SIGINT, signal.SIGINT)
    assert main([f"run.dir={run_dir}", *TINY, "train.total_steps=40", "ckpt.every=20"]) == EXIT_INTERRUPTED
    assert not events(run_dir, "preempt_save") and len(events(run_dir, "interrupted")) == 1
    err = capsys.readouterr().err
    assert "Ctrl-C again to stop at once" in err and f"resumes from the newest checkpoint in {run_dir}" in err


@pytest.mark.parametrize("code", [3, 2, 0])
def test_the_sbatch_agent_exits_with_the_ranks_own_code(tmp_path, code):
    """slurm/train.sbatch requeues a preempted job unless the ranks exited 2 (bad input) or 3
    (escalation); torchrun reported any rank failure as 1, so that branch never ran and an
    escalation near a preemption was requeued. The script's agent (dsslm.engine.agent) now exits with
    the code."""
    from helpers import PYTHON, ROOT
    assert "-m dsslm.engine.agent" in (ROOT / "slurm" / "train.sbatch").read_text()
    script = tmp_path / "rank.py"
    script.write_text(f"import os, sys\nsys.exit({code} if os.environ['RANK'] == '1' else 0)\n")
    proc = subprocess.run([PYTHON, "-m", "dsslm.engine.agent", "--nproc_per_node", "2", str(script)],
                          capture_output=True, text=True, timeout=120, cwd=tmp_path,
                          env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert proc.returncode == code, proc.stderr[-2000:]


def test_a_stop_signal_in_the_last_step_finishes_the_run(tmp_path, monkeypatch):
    """A signal answered at the end of the last step saved it as a preemption: no `end` event, a
    "run the same command again" line, and exit 130 for Ctrl-C on a finished run. The run is
    finished: it saves, ends, and exits 0."""
    from dsslm import train as train_module
    from helpers import tiny_cfg
    real = train_module.train_step

    def stopped_at_the_end(job, stop):
        verdict, record, fed, requested = real(job, stop)
        return verdict, record, fed, requested or job.state.step + 1 == job.cfg.train.total_steps  # counted after

    monkeypatch.setattr(train_module, "train_step", stopped_at_the_end)
    assert train_module.train(tiny_cfg(tmp_path, "train.total_steps=6", "ckpt.every=100")) == 0
    assert [e["step"] for e in events(tmp_path, "end")] == [6] and not events(tmp_path, "preempt_save")
    assert invalid_reason(tmp_path / "checkpoints" / "step-00000006") is None
