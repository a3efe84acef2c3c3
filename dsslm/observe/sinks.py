"""Rank-0 sinks: metrics.jsonl, events.jsonl, TensorBoard, Weights & Biases, the console.

Every sink is a no-op on other ranks, so the loop calls them unconditionally. The user's alert
command hears the events in ALERT_EVENTS; what counts as an alert beyond the spike policy's own
events is decided in `observe.alerts`.
"""
from __future__ import annotations

import contextlib
import errno
import hashlib
import importlib.util
import json
import logging
import math
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any, Callable, Iterator

from dsslm.config import ConfigError, ObserveCfg
from dsslm.observe.console import Console

ALERT_EVENTS = ("skip", "rewind", "triage", "lr_scale", "escalation", "alert", "hang", "bad_node", "straggler")
ALERT_TIMEOUT_S = 30
MAX_ALERT_FAILURES_SHOWN = 3


def json_safe(value: Any) -> Any:
    # JSON has no NaN/inf; write them as strings so every line stays parseable.
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    if isinstance(value, dict):
        return {k: json_safe(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [json_safe(v) for v in value]
    return value


def _parse(line: bytes) -> dict | None:
    try:
        obj = json.loads(line)
    except (ValueError, RecursionError):  # a torn line, or not JSON at all
        return None
    return obj if isinstance(obj, dict) else None


def read_jsonl(path: Path) -> tuple[list[dict], int]:
    """Parsed objects and the count of unreadable lines (a run killed mid-write truncates one)."""
    if not path.is_file():  # missing, or a FIFO / device a read would hang on
        return [], 0
    records, bad = [], 0
    with open(path, "rb") as f:
        for line in f:
            if not line.strip():
                continue
            obj = _parse(line)
            if obj is None:
                bad += 1
            else:
                records.append(obj)
    return records, bad


def read_jsonl_backward(path: Path, chunk_bytes: int = 1 << 16) -> Iterator[dict]:
    """The objects of a JSONL file from the last to the first, reading only as far back as the
    caller iterates (a resume looks at the last few hundred steps of a long run); unreadable lines,
    such as a torn last one, are skipped."""
    if not path.is_file():
        return
    with open(path, "rb") as f:
        end = f.seek(0, os.SEEK_END)
        tail = b""
        while end > 0:
            start = max(0, end - chunk_bytes)
            f.seek(start)
            lines = (f.read(end - start) + tail).split(b"\n")
            end = start
            tail = lines.pop(0) if end > 0 else b""  # maybe the end of a line that starts earlier
            for line in reversed(lines):
                if line.strip() and (obj := _parse(line)) is not None:
                    yield obj


class LogWriteError(RuntimeError):
    """A line could not be appended to a run's log (a full disk, a lost mount): the run stops."""


class JsonlLog:
    """One JSON object per line, appended with one write(2) per line: a failed write (ENOSPC) is cut
    back off, so the file never ends in a torn line of ours, and the failure is kept for `check()`.

    Opened at the first write, so a run that stops before it has anything to say leaves no file."""

    def __init__(self, path: Path, enabled: bool):
        self.path, self.enabled = path, enabled
        self.fd: int | None = None
        self.failure: LogWriteError | None = None

    def write(self, record: dict) -> None:
        if not self.enabled or self.failure is not None:
            return  # after a failure nothing more is written: the run is stopping at the step boundary
        line = (json.dumps(json_safe(record)) + "\n").encode()
        size = None
        try:
            if self.fd is None:
                self._open()
            size = os.fstat(self.fd).st_size
            view = memoryview(line)
            while view:  # O_APPEND: lands at the end; a short write is retried, and gives the real errno
                written = os.write(self.fd, view)
                if written == 0:
                    raise OSError(errno.EIO, "write(2) wrote nothing")
                view = view[written:]
        except OSError as exc:
            if size is not None:
                with contextlib.suppress(OSError):
                    os.ftruncate(self.fd, size)  # shrinking needs no space: the torn line goes
            self.failure = LogWriteError(f"cannot append to {self.path}: {exc.strerror or exc}; free space "
                                         f"or fix the mount, then run again (it resumes from the last checkpoint)")

    def _open(self) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.fd = os.open(self.path, os.O_RDWR | os.O_APPEND | os.O_CREAT, 0o644)  # read: the last byte
        size = os.fstat(self.fd).st_size
        if size and os.pread(self.fd, 1, size - 1) != b"\n":
            # A run killed mid-line left a torn last line: end it, so our first line stays whole.
            os.write(self.fd, b"\n")

    def check(self) -> None:
        """Raise the write failure, if any (from the training thread, at a step boundary)."""
        if self.failure is not None:
            raise self.failure

    def close(self) -> None:
        if self.fd is not None:
            with contextlib.suppress(OSError):
                os.close(self.fd)
            self.fd = None


class EventLog(JsonlLog):
    """events.jsonl, plus the user's alert command for the events a human should hear about."""

    def __init__(self, run_dir: Path, enabled: bool, alert_command: str = ""):
        super().__init__(run_dir / "events.jsonl", enabled)
        self.alert_command = alert_command
        self.alert_threads: list[threading.Thread] = []
        self.alert_failures, self._alert_lock = 0, threading.Lock()  # alerts run in threads of their own

    def emit(self, event: str, **fields: Any) -> dict:
        record = {"event": event, "time": time.time(), **fields}
        self.write(record)
        if self.enabled and self.alert_command and event in ALERT_EVENTS:
            thread = threading.Thread(target=self._run_alert, args=(record,), daemon=True)
            thread.start()
            self.alert_threads.append(thread)
        return record

    def _run_alert(self, record: dict) -> None:
        # In a thread with a timeout: a hung webhook must never stall training. The command gets a
        # session (process group) of its own, so a timeout kills everything it started, not only the
        # shell (`sleep 100; true` left the sleep running, one per alert). Only the shell is waited
        # for: stdout goes nowhere and stderr to a file, so a child it leaves running in the
        # background (`notify & echo sent`) cannot hold a pipe open and make it look timed out.
        try:
            with tempfile.TemporaryFile() as stderr:
                proc = subprocess.Popen(self.alert_command, shell=True, stdin=subprocess.PIPE,
                                        stdout=subprocess.DEVNULL, stderr=stderr, start_new_session=True)
                timeout = ALERT_TIMEOUT_S
                try:
                    proc.communicate(json.dumps(json_safe(record)).encode(), timeout=timeout)
                except subprocess.TimeoutExpired:
                    with contextlib.suppress(ProcessLookupError, PermissionError):
                        os.killpg(proc.pid, signal.SIGKILL)  # the group's id is the shell's pid
                    with contextlib.suppress(subprocess.TimeoutExpired):
                        proc.wait(timeout=5)  # reaps the shell; SIGKILL is prompt unless it is stuck in the kernel
                    # (communicate's own exception says the time left, 2.99987... seconds)
                    self._alert_failed(f"{subprocess.TimeoutExpired(self.alert_command, timeout)}")
                    return
                stderr.seek(max(0, stderr.seek(0, os.SEEK_END) - 4096))
                err_tail = stderr.read().decode(errors="replace")
        except (OSError, ValueError) as err:  # cannot start (no /bin/sh, a NUL in the command)
            self._alert_failed(f"{err}")
            return
        if proc.returncode != 0:  # a mistyped command is exit 127 under the shell, not an OSError
            tail = " ".join(err_tail.split())[-200:]
            self._alert_failed(f"exit {proc.returncode} on the {record['event']} event" + (f": {tail}" if tail else ""))

    def _alert_failed(self, why: str) -> None:
        """Said on stderr, the first few times: a user whose alerts never arrive learns why."""
        with self._alert_lock:
            self.alert_failures += 1
            nth = self.alert_failures
        if nth <= MAX_ALERT_FAILURES_SHOWN:
            more = "; later failures are not shown" if nth == MAX_ALERT_FAILURES_SHOWN else ""
            print(f"dsslm: run.alert_command failed ({why}){more}", file=sys.stderr, flush=True)

    def close(self) -> None:
        for thread in self.alert_threads:
            thread.join(timeout=ALERT_TIMEOUT_S)
        super().close()


class TensorBoard:
    """Opened at the first record, like the logs: a run that never trains writes no event file."""

    def __init__(self, run_dir: Path, enabled: bool):
        self.writer, self.run_dir, self.enabled = None, run_dir, enabled

    def write(self, record: dict) -> None:
        if self.writer is None and self.enabled:
            self.enabled = False
            try:
                from torch.utils.tensorboard import SummaryWriter
            except ImportError:  # the tensorboard extra is optional
                return
            self.writer = SummaryWriter(str(self.run_dir / "tensorboard"))
        if self.writer is None:
            return
        step = record["step"]
        for key, value in record.items():
            if isinstance(value, dict):
                for sub, v in value.items():
                    if isinstance(v, (int, float)):
                        self.writer.add_scalar(f"{key}/{sub}", v, step)
            elif isinstance(value, (int, float)) and not isinstance(value, bool) and key != "step":
                self.writer.add_scalar(f"train/{key}", value, step)

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()


class WandB:
    """Optional mirror of metrics.jsonl in Weights & Biases (`pip install dsslm[wandb]`).

    One W&B run per run.dir (its id is a hash of the folder), so a resumed job appends to the same
    run. Steps repeat after a rewind and W&B's own step must only grow, so the optimizer step is
    logged as the `step` metric and used as every chart's x axis instead.
    """

    def __init__(self, run_dir: Path, enabled: bool, project: str = "dsslm", mode: str = "",
                 config: dict | None = None):
        self.run = None
        if not enabled:
            return
        import wandb  # imported only when asked for: W&B is never a requirement

        run_id = hashlib.sha256(str(run_dir.resolve()).encode()).hexdigest()[:16]
        self.run = wandb.init(project=project, dir=str(run_dir), id=run_id, name=run_dir.resolve().name,
                              resume="allow", config=config or {}, mode=mode or None)
        self.run.define_metric("*", step_metric="step")

    def write(self, record: dict) -> None:
        if self.run is None:
            return
        flat: dict[str, float] = {}
        for key, value in record.items():
            if isinstance(value, dict):
                flat.update({f"{key}/{sub}": v for sub, v in value.items() if _is_number(v)})
            elif _is_number(value):
                flat[key] = value
        self.run.log(flat)

    def close(self) -> None:
        if self.run is not None:
            self.run.finish()
            self.run = None


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


class Sinks:
    """Everything rank 0 writes about a run, behind one object the loop holds."""

    def __init__(self, run_dir: Path, is_main: bool, total_steps: int, tensorboard: bool,
                 alert_command: str = "", observe: ObserveCfg | None = None, config: dict | None = None):
        observe = observe or ObserveCfg()
        # Checked on every rank: rank 0 failing alone would leave the others waiting in a collective.
        if observe.wandb and importlib.util.find_spec("wandb") is None:
            raise ConfigError("observe.wandb=true needs the wandb package; pip install 'dsslm[wandb]' "
                              "or set observe.wandb=false")
        self.metrics = JsonlLog(run_dir / "metrics.jsonl", is_main)
        self.events = EventLog(run_dir, is_main, alert_command)
        self.tensorboard = TensorBoard(run_dir, is_main and tensorboard)
        self.wandb = WandB(run_dir, is_main and observe.wandb, observe.wandb_project, observe.wandb_mode, config)
        self.clock_origin = time.time() - time.monotonic()  # wall time at monotonic zero, for the records' `time`
        self.listeners: list[Callable[[dict], None]] = []  # shown every event after it is written (the resume audit)
        log_every = int(((config or {}).get("run") or {}).get("log_every", 1))
        self.console = Console(run_dir, is_main, total_steps, log_every)  # what a person reads

    def log_step(self, record: dict) -> None:
        # The one clock read a step's logging makes, shared with the console's ETA: the record's
        # wall time places it in the run's time for the goodput ledger (observe/goodput.py).
        now = time.monotonic()
        self.metrics.write({**record, "time": self.wall_time(now)})
        self.tensorboard.write(record)
        self.wandb.write(record)
        self.console.step(record, now)

    def wall_time(self, monotonic: float) -> float:
        """A monotonic reading as a wall time (the events' clock), to the millisecond."""
        return round(self.clock_origin + monotonic, 3)

    def log_val(self, record: dict) -> None:
        """A `{"step", "val_loss": {domain: float}}` record, to every sink (the console says one line)."""
        self.metrics.write({**record, "time": self.wall_time(time.monotonic())})
        self.tensorboard.write(record)
        self.wandb.write(record)
        self.console.val_loss(record)

    def log_phases(self, record: dict) -> None:
        """The straggler report's record (health/stragglers.py): per-rank lists, for metrics.jsonl
        and the report; TensorBoard and W&B plot numbers, not lists."""
        self.metrics.write(record)

    def say(self, text: str, level: int = logging.WARNING) -> None:
        """One console line that is no event's (rank 0; a no-op elsewhere)."""
        if self.console.enabled:
            self.console.line(level, text)

    def emit(self, event: str, **fields: Any) -> dict:
        record = self.events.emit(event, **fields)
        for listener in self.listeners:
            listener(record)
        self.console.event(event, fields)  # observe.console.LINES: which events a person hears of, and how
        return record

    def check(self) -> None:
        """LogWriteError if metrics.jsonl or events.jsonl could not be appended to."""
        self.metrics.check()
        self.events.check()

    def close(self) -> None:
        self.console.close()
        self.wandb.close()
        self.tensorboard.close()
        self.events.close()
        self.metrics.close()
