"""What the watchdog keeps in run.dir: the hang records, the crash-loop count and the learned
phase times. Every file is written whole (atomic replace) and validated when read back: anyone
who can write into run.dir can write these too, and a bad one is set aside with one line, never
trusted.

    hangs/<time>/hang.json       the diagnosis: who stopped first, where, who waited in what
    hangs/<time>/rank-N.json     each reachable rank's own view as it left, with its collective
    hangs/<time>/stacks-rankN.txt  its Python stacks (faulthandler), flight-rankN.json its collectives
    hangs/.called-<job>          the claim: the first rank to call a hang in a job creates it (O_EXCL),
                                 so a job leaves one record even when a partition splits it
    failures.json                the crash-loop count: hangs in a row at one (step, phase)
    watchdog.json                the longest time each phase took: a requeue starts with them
"""
from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path
from typing import Any

from dsslm.durable import write_json_atomic
from dsslm.fields import MAX_STEP, Fields, Float, Int, MapOf, StateError, Str, validate

HANGS = "hangs"
FAILURES = "failures.json"
LEARNED = "watchdog.json"
MAX_RECORD_BYTES = 4 << 20
CLAIM_READ_S = 5.0  # how long a rank that lost the claim waits for the winner's line in it

SEEN_SPEC = Fields(open=True, rank=Int(0), host=Str(255), pid=Int(0), step=Int(-1, MAX_STEP), phase=Str(64),
                   age_s=Float(0))
HANG_SPEC = Fields(open=True, schema=Int(1, 1), step=Int(-1, MAX_STEP), phase=Str(64), in_a_row=Int(1),
                   exit_code=Int(0, 255), cause=Str(64))
FAILURES_SPEC = Fields(schema=Int(1, 1), step=Int(-1, MAX_STEP), phase=Str(64), in_a_row=Int(0),
                       record=Str(255))
LEARNED_SPEC = Fields(schema=Int(1, 1), longest=MapOf(Float(0), max_len=64))


def read_json(path: Path, spec: Fields, what: str) -> dict | None:
    """`path` validated against `spec`, or None: missing, or not what dsslm writes (said once)."""
    try:
        if path.stat().st_size > MAX_RECORD_BYTES:
            raise ValueError(f"{path.stat().st_size} bytes")
        value = json.loads(path.read_text())
        validate(value, spec, what)
        return value
    except FileNotFoundError:
        return None
    except (OSError, ValueError, StateError) as exc:
        print(f"dsslm: {path} is not a {what} dsslm wrote ({exc}); ignoring it", file=sys.stderr, flush=True)
        return None


# --- the claim: one record per job -----------------------------------------------------------

def claim(run_dir: Path, token: str, code: int) -> tuple[Path | None, int, bool]:
    """Claim this job's hang record: (its folder, the exit code, whether we are the first). A rank
    that lost the race gets the winner's folder and code. (None, code, False) where run.dir cannot
    be written: the job still ends, with no record."""
    hangs = run_dir / HANGS
    path = hangs / f".called-{token}"
    try:
        hangs.mkdir(parents=True, exist_ok=True)
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
    except FileExistsError:
        return _read_claim(path, code)
    except OSError as exc:
        print(f"dsslm: cannot write {hangs} ({exc}): the hang leaves no record", file=sys.stderr, flush=True)
        return None, code, False
    folder = hangs / (time.strftime("%Y%m%d-%H%M%S") + f"-{token[:6]}")
    try:
        folder.mkdir(exist_ok=True)
        os.write(fd, f"{folder.name} {code}\n".encode())
    except OSError:
        return None, code, True
    finally:
        os.close(fd)
    return folder, code, True


def _read_claim(path: Path, code: int) -> tuple[Path | None, int, bool]:
    deadline = time.monotonic() + CLAIM_READ_S
    while time.monotonic() < deadline:
        try:
            parts = path.read_text().split()
        except OSError:
            parts = []
        if len(parts) == 2 and parts[1].isdigit() and "/" not in parts[0] and not parts[0].startswith("."):
            return path.parent / parts[0], int(parts[1]), False
        time.sleep(0.05)  # the winner is between its create and its write
    return None, code, False


def claimed(run_dir: Path, token: str) -> str | None:
    """The announcement `FOLDER CODE` of a job whose hang a rank already called, or None."""
    path = run_dir / HANGS / f".called-{token}"
    if not path.exists():
        return None
    folder, code, _ = _read_claim(path, 0)
    return f"{folder.name} {code}" if folder is not None else None


def write_record(folder: Path, record: dict) -> None:
    write_json_atomic(folder / "hang.json", record, indent=1)


def newest_record(run_dir: Path) -> tuple[str, dict] | None:
    """The newest hang record that validates: (its folder's name, hang.json)."""
    try:
        names = sorted((p.name for p in (run_dir / HANGS).iterdir() if not p.name.startswith(".")), reverse=True)
    except OSError:
        return None
    for name in names:
        record = read_json(run_dir / HANGS / name / "hang.json", HANG_SPEC, "hang record")
        if record is not None:
            return name, record
    return None


# --- the crash loop ----------------------------------------------------------------------------

def fold_failures(run_dir: Path) -> dict | None:
    """At a start, on rank 0 under run.dir's lock: the newest hang record becomes failures.json's
    count, unless it already is. Returns the count every rank then knows (or None: no hang yet)."""
    failures = read_json(run_dir / FAILURES, FAILURES_SPEC, "crash-loop count")
    newest = newest_record(run_dir)
    if newest is None or (failures is not None and failures["record"] == newest[0]):
        return failures
    name, record = newest
    failures = {"schema": 1, "step": record["step"], "phase": record["phase"], "in_a_row": record["in_a_row"],
                "record": name}
    write_json_atomic(run_dir / FAILURES, failures)
    return failures


def reset_failures(run_dir: Path, failures: dict) -> dict:
    """The run got past the step it failed at: the count starts again (rank 0, holding the lock)."""
    failures = {**failures, "in_a_row": 0}
    write_json_atomic(run_dir / FAILURES, failures)
    return failures


def in_a_row(run_dir: Path, step: int, phase: str) -> int:
    """This failure's number among failures at (step, phase) in a row, itself included."""
    failures = read_json(run_dir / FAILURES, FAILURES_SPEC, "crash-loop count")
    same = failures is not None and (failures["step"], failures["phase"]) == (step, phase)
    return (failures["in_a_row"] if same else 0) + 1


# --- learned phase times -----------------------------------------------------------------------

def read_learned(run_dir: Path) -> dict[str, float]:
    learned = read_json(run_dir / LEARNED, LEARNED_SPEC, "watchdog phase times")
    return dict(learned["longest"]) if learned else {}


def write_learned(run_dir: Path, longest: dict[str, float]) -> None:
    write_json_atomic(run_dir / LEARNED, {"schema": 1, "longest": {k: round(v, 3) for k, v in longest.items()}})


def seen_ok(value: Any) -> bool:
    """A beat or rank view from another process is used only when it validates."""
    try:
        validate(value, SEEN_SPEC, "beat")
        return True
    except StateError:
        return False

