"""The goodput ledger over synthetic records: each drilled cost lands in its own part, and the
parts add up to the wall time (observe/goodput.py)."""
from __future__ import annotations

import json

import pytest

from dsslm.observe.goodput import PARTS, TOLERANCE, job_end_line, ledger, read_ledger, summary_line

STEP_S = 1.0


class Timeline:
    """Records as a run writes them, on a clock the test moves."""

    def __init__(self, every: int = 0):
        self.t, self.events, self.metrics, self.hangs = 1000.0, [], [], []
        self.config = {"ckpt": {"every": every}} if every else {}

    def event(self, name: str, **fields):
        self.events.append({"event": name, "time": self.t, **fields})

    def job(self, step: int, startup_s: float = 5.0, resume: bool = False):
        if resume:  # the job's first record; a fresh job's is its start
            self.event("resume", step=step)
            self.t += startup_s
            self.event("start", step=step, config=self.config)
        else:
            self.event("start", step=step, config=self.config)
            self.t += startup_s

    def steps(self, first: int, last: int, verdict: str = "ok"):
        for step in range(first, last + 1):
            self.t += STEP_S
            self.metrics.append({"step": step, "loss": 3.0, "verdict": verdict, "step_time_s": STEP_S, "time": self.t})

    def wait(self, seconds: float):
        self.t += seconds


def parts_of(tl: Timeline) -> dict:
    result = ledger(tl.events, tl.metrics, tl.hangs)
    assert set(result["parts"]) == set(PARTS)
    assert sum(result["parts"].values()) == pytest.approx(result["wall_s"], abs=1e-2)
    assert abs(result["parts"]["other"]) <= TOLERANCE * result["wall_s"]
    return result["parts"]


def test_kill_and_restart_recomputes_the_steps_after_the_checkpoint():
    tl = Timeline()
    tl.job(0, startup_s=5)
    tl.steps(1, 10)        # checkpoint at 6 (its save event below), killed after step 10
    tl.event("save", step=6, seconds=0.1)
    tl.wait(300)           # in the queue
    tl.job(6, startup_s=7, resume=True)
    tl.steps(7, 12)
    tl.event("end", step=12)
    parts = parts_of(tl)
    assert parts["recomputed"] == pytest.approx(4 * STEP_S)     # steps 7-10 of the first job
    assert parts["productive"] == pytest.approx(12 * STEP_S)
    assert parts["startup"] == pytest.approx(5 + 7 - 0)
    assert parts["between_starts"] == pytest.approx(300, abs=1e-6)


def test_checkpoint_stalls_and_the_last_save_wait():
    tl = Timeline(every=5)
    tl.job(0)
    tl.steps(1, 5)
    tl.wait(2.0)           # the blocking part of step 5's save
    tl.steps(6, 10)
    tl.wait(3.0)           # the run's end waits for step 10's write
    tl.event("save", step=10, seconds=3.0)
    tl.event("end", step=10)
    parts = parts_of(tl)
    assert parts["checkpoint"] == pytest.approx(5.0)
    assert parts["productive"] == pytest.approx(10 * STEP_S)


def test_rewind_and_triage_replays_are_recomputed():
    tl = Timeline()
    tl.job(0)
    tl.steps(1, 8)
    tl.steps(9, 9, verdict="rewind")   # the spike step: rewound to step 5
    tl.wait(1.5)                       # the load
    tl.event("rewind", step=9, to_step=5)
    tl.steps(6, 12)
    tl.event("end", step=12)
    parts = parts_of(tl)
    assert parts["recomputed"] == pytest.approx(3 + 1 + 1.5)   # steps 6-8 first time, step 9, the load
    assert parts["productive"] == pytest.approx(12 * STEP_S)  # 1-5 and 6-12 (the replayed ones stand)


def test_validation_and_evaluations():
    tl = Timeline()
    tl.job(0, startup_s=4)
    tl.wait(2.0)  # the evaluation at start
    tl.metrics.append({"step": 0, "eval_acc": {"t": 0.5}, "eval_time_s": 2.0, "time": tl.t})
    tl.steps(1, 5)
    tl.wait(1.25)
    tl.metrics.append({"step": 5, "val_loss": {"code": 3.0}, "time": tl.t})
    tl.wait(0.75)
    tl.metrics.append({"step": 5, "eval_acc": {"t": 0.6}, "eval_time_s": 0.75, "time": tl.t})
    tl.steps(6, 8)
    tl.event("end", step=8)
    parts = parts_of(tl)
    assert parts["evaluation"] == pytest.approx(4.0)
    assert parts["startup"] == pytest.approx(4.0)
    assert parts["productive"] == pytest.approx(8 * STEP_S)


def test_a_hang_costs_the_time_to_find_it_then_a_requeue():
    tl = Timeline()
    tl.job(0)
    tl.steps(1, 6)
    tl.wait(90.0)  # stuck in step 7 until the watchdog calls it
    tl.hangs.append({"schema": 1, "step": 6, "phase": "collective", "time": tl.t})
    tl.wait(1.0)
    tl.event("hang", step=6, exit_code=75)
    tl.wait(60)
    tl.job(6, resume=True)
    tl.steps(7, 9)
    tl.event("end", step=9)
    parts = parts_of(tl)
    assert parts["hang_detection"] == pytest.approx(91.0)
    assert parts["between_starts"] == pytest.approx(60.0)
    assert parts["recomputed"] == 0
    result = ledger(tl.events, tl.metrics, tl.hangs)
    assert result["hangs"] == 1 and result["restarts"] == 1


def test_summary_line_names_the_job_and_the_run():
    tl = Timeline()
    tl.job(0)
    tl.steps(1, 10)
    tl.wait(100)
    tl.job(5, resume=True)
    tl.steps(6, 20)
    tl.event("end", step=20)
    line = summary_line(ledger(tl.events, tl.metrics))
    assert line.startswith("goodput: this job: 75% productive; the run so far: ")
    assert "recomputed after 1 restart(s)" in line and "between starts" in line


def test_reader_skips_what_is_not_ours(tmp_path):
    tl = Timeline(every=5)
    tl.job(0)
    tl.steps(1, 5)
    tl.event("end", step=5)
    lines = [json.dumps(r) for r in tl.metrics] + ['{"step": 3, "loss":', "[1, 2]", '{"step": true, "time": "x"}',
                                                   '{"step": 2, "loss": 1, "verdict": "ok", "time": NaN}']
    (tmp_path / "metrics.jsonl").write_text("\n".join(lines) + "\n")
    (tmp_path / "events.jsonl").write_text("\n".join(json.dumps(e) for e in tl.events) + '\n{"event": [1]}\n{"eve')
    (tmp_path / "hangs" / "x").mkdir(parents=True)
    (tmp_path / "hangs" / "x" / "hang.json").write_text("{not json")
    result = read_ledger(tmp_path)
    assert result["parts"]["productive"] == pytest.approx(5.0)
    assert result["unreadable_lines"] == {"events.jsonl": 1, "metrics.jsonl": 2}
    line = job_end_line(tmp_path)
    assert line is not None and json.loads((tmp_path / "goodput.json").read_text())["wall_s"] == result["wall_s"]
    assert job_end_line(tmp_path / "nothing") is None and not (tmp_path / "nothing").exists()


def test_empty_records():
    assert ledger([], [])["wall_s"] == 0.0
    assert summary_line(ledger([], [])).startswith("goodput: the run so far: ?")


def test_the_process_start_before_the_first_record_is_start_up_not_a_gap():
    """A job's imports and engine build come before its first record: the `start` event's
    `process_started` moves the job's beginning there (without it, that time was between starts)."""
    tl = Timeline()
    tl.job(0, startup_s=5)
    tl.steps(1, 4)
    tl.wait(100)           # 90 s in the queue, then 10 s of imports before the first record
    tl.event("resume", step=4)
    tl.event("start", step=4, config=tl.config, process_started=tl.t - 10)
    tl.t += 1
    tl.steps(5, 6)
    parts = parts_of(tl)
    assert parts["between_starts"] == pytest.approx(90, abs=1e-6)
    assert parts["startup"] == pytest.approx(5 + 10 + 1)
