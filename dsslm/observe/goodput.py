"""The goodput ledger: where a run's wall time went, across every start of its run.dir.

A lab pays for GPU-hours, not steps. `ledger(events, metrics, hangs)` is a pure function over
the records the run already writes (events.jsonl, metrics.jsonl, hangs/*/hang.json): no clock of
its own. Each metrics record carries `time` (the wall time it was logged, from the clock the
console's ETA already reads) and a step record its `step_time_s`; each event and hang record its
`time`. Per job (from its first record: `resume`, `lock_takeover`, ..., or `start`) the time is
cut at each record:

- `startup`: the job's first record to the start of its first step (load, checks, the start
  checkpoint), less the evaluation at start;
- a step record's time since the record before it: `productive` where its update stands (the
  last record of that step in metrics.jsonl, verdict ok), else `recomputed` (trained again after
  a restart from an older checkpoint or a rewind, a triage's replay, a skipped step); after a
  record with verdict `rewind`, the time to its first replayed step (the load) is `recomputed`;
- after a step that saved (a `save` event of that step, or a multiple of `ckpt.every`), the
  time from its last record to the next step's start is `checkpoint`: the blocking part of a save
  (the snapshot, the wait for the previous write) is not recorded, this gap is it;
- a validation record's time since the record before it, an evaluation record's likewise (and
  the evaluation at start, its `eval_time_s`): `evaluation`;
- after the job's last record: `hang_detection` with a hang record or event in the job (the time
  from the last step record to the diagnosis and the exit), `checkpoint` where the job waited
  for its last save (a `save` or `end` event there), else `other`;
- `between_starts`: one job's last record to the next one's process start (the `start` event's
  `process_started`; without it, its first record): queue and requeue;
- `other`: the rest; it is what rounding and clock skew leave, within 2% of wall_s.

`write_goodput(run_dir)` reads (bad lines skipped, a damaged hang record ignored), computes and
writes run.dir/goodput.json; `job_end_line(run_dir)` does that and returns the console's line
for the end of a job.
"""
from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

from dsslm.durable import write_json_atomic
from dsslm.observe.sinks import read_jsonl

PARTS = ("productive", "recomputed", "checkpoint", "evaluation", "startup", "hang_detection", "between_starts",
         "other")
TOLERANCE = 0.02  # |other| / wall_s the ledger is held to (tests/unit/observe/test_goodput.py)
GOODPUT = "goodput.json"
# What a job records before its `start` (or `finished`: a start on a finished run): its claim of
# run.dir and the checkpoint it read. A job's time runs from the first of these.
OPENING = ("lock_takeover", "leftovers_removed", "deletes_finished", "passed_over", "resume", "branch", "import",
           "restart_from_scratch", "recovery_upgraded", "recovery_rebuilt")
BEGUN = ("start", "finished")
NOT_A_JOB = ("bad_node",)  # a start the node check refused: its time is between starts
MAX_TIME = 1e11  # a wall time past the year 5000 is a damaged line's


def _time(value: Any) -> float | None:
    ok = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
    return float(value) if ok and 0 <= value < MAX_TIME else None


def _seconds(value: Any) -> float:
    ok = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
    return float(value) if ok and 0 <= value < MAX_TIME else 0.0


def _step(value: Any) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) and 0 <= value < 1 << 62 else None


def _kind(record: dict) -> str | None:
    """step, val or eval for the metrics records the ledger places; None for the rest."""
    if _step(record.get("step")) is None or _time(record.get("time")) is None:
        return None
    if isinstance(record.get("val_loss"), dict):
        return "val"
    if isinstance(record.get("eval_acc"), dict):
        return "eval"
    if "loss" in record and isinstance(record.get("verdict"), str):
        return "step"
    return None


def standing(metrics: list[dict]) -> list[bool]:
    """For each step record: does its update stand (the last record of its step, verdict ok)?"""
    last: dict[int, int] = {}
    for i, r in enumerate(metrics):
        last[r["step"]] = i
    return [last[r["step"]] == i and r["verdict"] == "ok" for i, r in enumerate(metrics)]


def split_jobs(events: list[dict]) -> list[float]:
    """The time each job's first record was written, in order."""
    begins: list[float] = []
    begun = True  # the first record opens a job
    pending: float | None = None
    for e in events:
        name, t = e.get("event"), _time(e.get("time"))
        if t is None or name in NOT_A_JOB:
            continue
        if begun and (name in OPENING or name in BEGUN):
            pending, begun = t, False
            begins.append(pending)
        # The job's process started before its first record (the interpreter, the imports, the
        # engine): the `start` event says when, so that time is the job's start-up, not a gap.
        started = _time(e.get("process_started")) if name == "start" else None
        if started is not None and begins and started < begins[-1] and (len(begins) < 2 or started > begins[-2]):
            begins[-1] = started
        if name in BEGUN:
            begun = True
    if not begins:
        times = [t for e in events if (t := _time(e.get("time"))) is not None]
        begins = [min(times)] if times else []
    return begins


def _save_every(events: list[dict]) -> int:
    for e in reversed(events):
        if e.get("event") == "start" and isinstance(e.get("config"), dict):
            every = (e["config"].get("ckpt") or {}).get("every") if isinstance(e["config"].get("ckpt"), dict) else None
            return every if isinstance(every, int) and not isinstance(every, bool) and every > 0 else 0
    return 0


def ledger(events: list[dict], metrics: list[dict], hangs: list[dict] | None = None) -> dict:
    """Where the wall time went: `{"wall_s", "parts": {name: seconds}, "starts": [per job], ...}`.
    Every argument is a list of parsed JSON objects; anything else in them is skipped."""
    events = [e for e in events if isinstance(e, dict) and isinstance(e.get("event"), str)]
    hang_times = [t for h in hangs or [] if isinstance(h, dict) and (t := _time(h.get("time"))) is not None]
    hang_events = [t for e in events if e["event"] == "hang" and (t := _time(e.get("time"))) is not None]
    n_hangs = max(len(hang_times), len(hang_events))  # a hang's record and its event: one hang
    hang_times += hang_events
    placed = [r for r in metrics if isinstance(r, dict) and _kind(r) is not None]
    steps = [r for r in placed if _kind(r) == "step"]
    stands = dict(zip(map(id, steps), standing(steps)))
    every = _save_every(events)
    begins = split_jobs(events)
    if not begins and placed:
        begins = [min(r["time"] for r in placed)]
    jobs = []
    for j, begin in enumerate(begins):
        until = begins[j + 1] if j + 1 < len(begins) else math.inf
        in_job = [e for e in events if (t := _time(e.get("time"))) is not None and begin <= t < until
                  and e["event"] not in NOT_A_JOB]
        records = [r for r in placed if begin <= r["time"] < until]
        hung = [t for t in hang_times if begin <= t < until]
        jobs.append(job_ledger(begin, in_job, records, hung, stands, every))
    parts = dict.fromkeys(PARTS, 0.0)
    for j, job in enumerate(jobs):
        for name, seconds in job["parts"].items():
            parts[name] += seconds
        if j:
            parts["between_starts"] += max(0.0, job["begin"] - jobs[j - 1]["end"])
    wall = jobs[-1]["end"] - jobs[0]["begin"] if jobs else 0.0
    parts["other"] += wall - sum(parts.values())
    restarts = max(0, len(jobs) - 1)
    return {"wall_s": round(wall, 3), "parts": {k: round(v, 3) for k, v in parts.items()},
            "fractions": {k: round(v / wall, 4) if wall > 0 else 0.0 for k, v in parts.items()},
            "restarts": restarts, "rewinds": sum(e["event"] == "rewind" for e in events),
            "hangs": n_hangs,
            "steps": {"executed": len(steps), "standing": sum(stands.values())},
            "starts": [{"begin": round(job["begin"], 3), "wall_s": round(job["end"] - job["begin"], 3),
                        "parts": {k: round(v, 3) for k, v in job["parts"].items()}} for job in jobs],
            "tolerance": TOLERANCE}


def job_ledger(begin: float, events: list[dict], records: list[dict], hung: list[float],
               stands: dict[int, bool], every: int) -> dict:
    """One job's parts (no between_starts): its records cut its time from `begin` to its last record."""
    parts = dict.fromkeys(PARTS, 0.0)
    saved = {s for e in events if e["event"] in ("save", "preempt_save") and (s := _step(e.get("step"))) is not None}
    end = max([begin, *(t for e in events if (t := _time(e.get("time"))) is not None), *hung,
               *(r["time"] for r in records)])
    first = next((i for i, r in enumerate(records) if _kind(r) == "step"), None)
    if first is None:  # no step: start-up all along (or a hang in it, for as long as the hang record says)
        stuck = min(end - begin, max(hung) - begin if hung else 0.0)
        parts["hang_detection"] += stuck
        parts["startup"] += end - begin - stuck
        return {"begin": begin, "end": end, "parts": parts}
    at_start = sum(_seconds(r.get("eval_time_s")) for r in records[:first] if _kind(r) == "eval")
    step_begins = records[first]["time"] - _seconds(records[first].get("step_time_s"))
    parts["evaluation"] += min(at_start, max(0.0, step_begins - begin))
    parts["startup"] += max(0.0, step_begins - begin) - parts["evaluation"]
    previous, cursor = None, max(begin, step_begins)
    for r in records[first:]:
        kind, gap = _kind(r), max(0.0, r["time"] - cursor)
        if kind == "step":
            own = min(gap, _seconds(r.get("step_time_s")))
            stall = "recomputed" if previous is not None and previous["verdict"] == "rewind" else (
                "checkpoint" if previous is not None and (previous["step"] in saved or
                                                          (every and previous["step"] % every == 0)) else None)
            kept = "productive" if stands.get(id(r)) else "recomputed"
            parts[stall or kept] += gap - own
            parts[kept] += own
            previous = r
        else:
            parts["evaluation"] += gap
        cursor = max(cursor, r["time"])
    tail = max(0.0, end - cursor)
    waited = any(e["event"] in ("save", "end", "preempt_save") and (_time(e.get("time")) or 0.0) > cursor
                 for e in events)
    parts["hang_detection" if hung else "checkpoint" if waited else "other"] += tail
    return {"begin": begin, "end": end, "parts": parts}


def read_ledger(run_dir: Path) -> dict:
    """The ledger of what run_dir holds; unreadable lines and damaged hang records are skipped."""
    events, bad_events = read_jsonl(run_dir / "events.jsonl")
    metrics, bad_metrics = read_jsonl(run_dir / "metrics.jsonl")
    hangs = []
    for path in sorted((run_dir / "hangs").glob("*/hang.json")):
        try:
            if path.stat().st_size < 4 << 20:
                hangs.append(json.loads(path.read_text()))
        except (OSError, ValueError, RecursionError):
            continue  # not one a watchdog finished writing
    result = ledger(events, metrics, hangs)
    if bad_events or bad_metrics:
        result["unreadable_lines"] = {"events.jsonl": bad_events, "metrics.jsonl": bad_metrics}
    return result


def write_goodput(run_dir: Path) -> dict:
    """Compute the ledger from run_dir's records and write run_dir/goodput.json (atomically)."""
    result = read_ledger(run_dir)
    write_json_atomic(run_dir / GOODPUT, result, indent=1)
    return result


def percent(seconds: float, wall: float) -> str:
    return f"{100 * seconds / wall:.0f}%" if wall > 0 else "?"


LABELS = {"recomputed": "recomputed", "checkpoint": "checkpoint stalls", "evaluation": "evaluation",
          "startup": "start-up", "hang_detection": "finding hangs", "between_starts": "between starts",
          "other": "other"}


def summary_line(result: dict) -> str:
    """'this job: 91% productive; the run so far: 84% productive, 6% recomputed after 2 restarts, ...'"""
    wall, parts = result["wall_s"], result["parts"]
    job = result["starts"][-1] if result.get("starts") else None
    head = f"this job: {percent(job['parts']['productive'], job['wall_s'])} productive; " if job else ""
    causes = []
    if result.get("restarts"):
        causes.append(f"{result['restarts']} restart(s)")
    if result.get("rewinds"):
        causes.append(f"{result['rewinds']} rewind(s)")
    rest = []
    for name, label in LABELS.items():
        if name in parts and wall > 0 and parts[name] >= 0.005 * wall:
            after = f" after {' and '.join(causes)}" if name == "recomputed" and causes else ""
            rest.append(f"{percent(parts[name], wall)} {label}{after}")
    return (f"goodput: {head}the run so far: {percent(parts['productive'], wall)} productive"
            + "".join(f", {r}" for r in rest) + f" of {wall / 3600:.2f} h")


def job_end_line(run_dir: Path) -> str | None:
    """At the end of a job (rank 0): write run.dir/goodput.json, return the console's line. None
    where the run wrote nothing yet, or on any failure: a ledger never changes how a job ends."""
    try:
        if not (run_dir / "events.jsonl").is_file():
            return None
        return summary_line(write_goodput(run_dir))
    except Exception:  # noqa: BLE001 - called from the job's cleanup: its exit code is the news
        return None
