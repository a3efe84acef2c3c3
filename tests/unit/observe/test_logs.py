"""metrics.jsonl / events.jsonl: a failed append (a full disk) leaves no torn line and stops the run
with one error; a torn last line left by a kill breaks no reader and no later append."""
from __future__ import annotations

import errno
import json
import os
import signal
import time

import pytest

from dsslm.drill import losses
from dsslm.observe import sinks as sinks_module
from dsslm.observe.sinks import JsonlLog, LogWriteError, Sinks, read_jsonl, read_jsonl_backward
from dsslm.report import main as report
from dsslm.train import train
from helpers import tiny_cfg


def strict_lines(path):
    """Every line parsed with json.loads: what a careless reader does."""
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_a_short_write_is_cut_back_and_stops_the_log(tmp_path, monkeypatch):
    log = JsonlLog(tmp_path / "metrics.jsonl", enabled=True)
    log.write({"step": 1, "loss": 2.5})
    real_write = os.write

    def disk_fills_up(fd, data):
        if fd == log.fd:
            real_write(fd, data[:7])  # what fitted
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        return real_write(fd, data)

    monkeypatch.setattr(sinks_module.os, "write", disk_fills_up)
    log.write({"step": 2, "loss": 2.25})
    monkeypatch.setattr(sinks_module.os, "write", real_write)
    log.write({"step": 3, "loss": 2.0})  # after a failure nothing more is written
    assert strict_lines(tmp_path / "metrics.jsonl") == [{"step": 1, "loss": 2.5}]
    with pytest.raises(LogWriteError, match=r"metrics\.jsonl: No space left on device"):
        log.check()
    log.close()


def test_sinks_check_raises_a_failed_events_append(tmp_path, monkeypatch):
    sinks = Sinks(tmp_path, is_main=True, total_steps=1, tensorboard=False)
    sinks.check()
    monkeypatch.setattr(sinks_module.os, "write", lambda fd, data: 0)  # a write that writes nothing
    sinks.emit("save", step=1)
    with pytest.raises(LogWriteError, match=r"events\.jsonl"):
        sinks.check()
    sinks.close()


def test_nothing_is_created_before_the_first_line(tmp_path):
    sinks = Sinks(tmp_path / "run", is_main=True, total_steps=1, tensorboard=True)
    sinks.close()
    assert not (tmp_path / "run").exists()


def test_an_append_after_a_torn_line_starts_a_new_line(tmp_path):
    path = tmp_path / "events.jsonl"
    path.write_text('{"event": "start"}\n{"event": "sa')  # killed mid-line
    log = JsonlLog(path, enabled=True)
    log.write({"event": "resume"})
    log.close()
    records, bad = read_jsonl(path)
    assert records == [{"event": "start"}, {"event": "resume"}] and bad == 1


def test_read_backward_is_read_reversed_and_skips_the_torn_line(tmp_path):
    path = tmp_path / "metrics.jsonl"
    lines = [json.dumps({"step": i, "pad": "x" * (i % 37)}) for i in range(500)]
    path.write_text("\n".join(lines) + '\n{"step": 500, "lo')
    assert list(read_jsonl_backward(path, chunk_bytes=101)) == read_jsonl(path)[0][::-1]
    os.mkfifo(tmp_path / "fifo.jsonl")  # a reader must not block on it
    assert read_jsonl(tmp_path / "fifo.jsonl") == ([], 0)
    assert list(read_jsonl_backward(tmp_path / "fifo.jsonl")) == []


@pytest.mark.slow
def test_every_reader_takes_a_torn_last_line(tmp_path):
    """A run killed mid-write: report, the drill's reader and a resume all carry on."""
    run_dir = tmp_path / "run"
    assert train(tiny_cfg(run_dir, "train.total_steps=8", "ckpt.every=4")) == 0
    for name in ("metrics.jsonl", "events.jsonl"):
        with open(run_dir / name, "a") as f:
            f.write('{"step": 9, "loss": 3.1')
    assert report([str(run_dir)]) == 0
    assert sorted(losses(run_dir)) == list(range(1, 9))
    assert train(tiny_cfg(run_dir, "train.total_steps=12", "ckpt.every=4")) == 0
    assert sorted(losses(run_dir)) == list(range(1, 13))  # the resumed steps are all readable
    assert [e["step"] for e in read_jsonl(run_dir / "events.jsonl")[0] if e["event"] == "end"] == [8, 12]
    for name in ("metrics.jsonl", "events.jsonl"):
        assert read_jsonl(run_dir / name)[1] == 1  # the torn line stays one bad line


def test_a_failing_alert_command_is_said_and_not_endlessly(tmp_path, capsys):
    """A mistyped command exits 127 under the shell: the alerts never arrived, and nothing said so."""
    from dsslm.observe.sinks import EventLog
    log = EventLog(tmp_path, True, "no_such_alert_command_dsslm")
    for step in range(5):
        log.emit("rewind", step=step)
        log.emit("save", step=step)  # not an alert event: no command
    log.close()
    err = [line for line in capsys.readouterr().err.splitlines() if "alert_command" in line]
    assert len(err) == 3 and "exit 127 on the rewind event" in err[0] and "not found" in err[0], err
    assert err[-1].endswith("later failures are not shown") and log.alert_failures == 5


def alive(pid: int) -> bool:
    """Running, not a zombie waiting for a reaper (in a container, PID 1 may never reap it)."""
    try:
        state = open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return False
    return state not in ("Z", "X")


def run_alert(tmp_path, command: str) -> tuple[object, int]:
    """One alert through EventLog, waited for; the pid the command wrote to tmp_path/pid."""
    from dsslm.observe.sinks import EventLog
    log = EventLog(tmp_path, True, command.format(pidfile=tmp_path / "pid"))
    log.emit("rewind", step=1)
    for thread in log.alert_threads:
        thread.join(timeout=120)  # past any alert timeout here: the thread has said what it will
    log.close()
    return log, int((tmp_path / "pid").read_text())


def test_a_timed_out_alert_command_is_killed_with_what_it_started(tmp_path, monkeypatch, capsys):
    """subprocess.run(timeout=) killed only the shell: the sleep it was waiting on ran on, one per alert."""
    monkeypatch.setattr(sinks_module, "ALERT_TIMEOUT_S", 3)
    log, pid = run_alert(tmp_path, "sleep 60 & echo $! > {pidfile}; wait; true")
    try:
        for _ in range(100):  # SIGKILL lands at once; the loop only absorbs a loaded machine
            if not alive(pid):
                break
            time.sleep(0.1)
        assert not alive(pid)
        assert log.alert_failures == 1 and "timed out after 3 seconds" in capsys.readouterr().err
    finally:
        if alive(pid):
            os.kill(pid, signal.SIGKILL)


def test_an_alert_command_that_leaves_a_child_in_the_background_succeeds(tmp_path, monkeypatch, capsys):
    """`notify & echo sent` finished at once, but its background child kept the captured pipes open,
    so it was reported timed out. Now only the shell is waited for, and the child is left to run."""
    monkeypatch.setattr(sinks_module, "ALERT_TIMEOUT_S", 10)  # far above the shell's few milliseconds
    log, pid = run_alert(tmp_path, "sleep 60 & echo $! > {pidfile}; echo sent")
    try:
        assert log.alert_failures == 0, capsys.readouterr().err
        assert alive(pid)  # fire-and-forget: not killed
    finally:
        if alive(pid):
            os.kill(pid, signal.SIGKILL)
