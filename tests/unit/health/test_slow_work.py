"""Healthy work at production durations is never a hang, at the default limits (floor 60 s,
ceiling 600 s): a watchdog driven beat by beat on a virtual clock through the loop's door
(health/door.py), so a 15-minute write takes milliseconds of test. Each piece of work is judged
as what it is (a write by writes, downstream evals apart from validation, a re-run as a
forward/backward, a rewind's load by loads); past its limit it waits while its own work advances
and is a hang once that stops. And blame falls only where it is proven."""
from __future__ import annotations

import dataclasses
import time
from types import SimpleNamespace

import pytest

from dsslm.config import WatchdogCfg
from dsslm.durable import IO
from dsslm.health.door import (CHECKPOINT, COLLECTIVE, DATA, DOWNSTREAM, EVALUATION, FORWARD_BACKWARD, LOAD,
                               OPTIMIZER, Health)
from dsslm.health.watchdog import Links, Progress, Seen, Verdict, Watchdog, describe, judge

DEFAULTS = WatchdogCfg()  # floor 60 s, ceiling 600 s, factor 10
MB = 1_000_000


class Job:
    """One rank's loop and its watchdog on a virtual clock: `run(seconds)` beats every 2 s."""

    def __init__(self, tmp_path, monkeypatch, cfg: WatchdogCfg = DEFAULTS):
        self.now = 10_000.0
        monkeypatch.setattr(time, "monotonic", lambda: self.now)
        self.health = Health(Progress())
        self.verdicts: list[Verdict] = []
        # beat_s large: the thread never ticks on its own; the test ticks it
        self.dog = Watchdog(dataclasses.replace(cfg, beat_s=600), tmp_path, 0, "tok", Links(), self.health.progress)
        self.dog.cfg = cfg
        self.dog.call = self.verdicts.append
        self.health.watchdog = self.dog
        self.health.first_step(1)
        for step in (1, 2, 3):  # steps of 0.1 s per phase; the first teaches nothing
            for phase in (DATA, FORWARD_BACKWARD, COLLECTIVE, OPTIMIZER):
                self.health.phase(step, phase)
                self.now += 0.1
        self.step = 3

    def run(self, seconds: float, each_beat=lambda: None) -> None:
        end = self.now + seconds
        while self.now < end:
            self.now += 2.0
            each_beat()
            self.dog.tick(self.now)
            if self.verdicts:
                return

    def close(self) -> None:
        self.dog.closed = True
        self.dog._stop.set()


@pytest.fixture
def job(tmp_path, monkeypatch):
    j = Job(tmp_path, monkeypatch)
    yield j
    j.close()


def writer(step: int, total: int) -> SimpleNamespace:
    """A checkpoint store with a write of `total` bytes in flight (its thread is the test's beats)."""
    return SimpleNamespace(writing=(step, total, IO.written), in_flight=True, settle=lambda: None)


def write_at(mb_s: float):
    def beat():
        IO.written += int(2 * mb_s * MB)  # a network filesystem's rate, every beat
    return beat


def test_a_75_s_checkpoint_write_waited_for_by_the_next_save_is_no_hang(job):
    """The issue's case: the save of step 100 waits for step 50's write (75 s, a 1B model's 14 GB on
    NFS at 200 MB/s). Before, that wait was the `checkpoint` phase, its limit learned from the
    snapshot (ms), so the floor decided: stuck at 61 s, exit 75, and the same at every start."""
    job.health.phase(4, CHECKPOINT)     # the snapshot of earlier saves: ms, timed
    job.now += 0.005
    job.health.phase(5, DATA)
    job.health.wait_write(100, writer(50, 14_000 * MB), "waited for by the save of step 100")
    assert job.dog._me(job.now).limit_s == 600  # never timed: the ceiling, never the floor
    job.run(75, write_at(200))
    assert job.verdicts == []
    job.health.progress.learn("checkpoint_write", 75.0)  # the writer's own whole-write time
    job.health.phase(100, CHECKPOINT)
    job.health.wait_write(150, writer(100, 14_000 * MB), "")
    assert job.dog._me(job.now).limit_s == 600  # 10 x 75 s, clamped to the ceiling


def test_a_write_past_its_limit_waits_while_it_writes_and_says_so_and_is_a_hang_once_it_stops(job, capsys):
    """A 7B model's 80 GB at 100 MB/s: 13 minutes, past the ceiling. It waits, with one line at the
    limit; once no byte moves for the limit (600 s), it is stuck in checkpoint_write."""
    job.health.wait_write(100, writer(50, 80_000 * MB), "waited for by the save of step 100")
    job.run(800, write_at(100))
    assert job.verdicts == []
    lines = [line for line in capsys.readouterr().err.splitlines() if "still writing" in line]
    assert len(lines) == 1 and "checkpoint write of step 50" in lines[0] and "of 80.0 GB written" in lines[0]
    stopped = job.now
    job.run(1000)  # the filesystem stopped answering: no byte moves
    (verdict,) = job.verdicts
    assert verdict.cause == "stuck" and verdict.first[0].phase == "checkpoint_write"
    assert 600 <= job.now - stopped <= 604


def test_downstream_evals_are_judged_apart_from_validation(job):
    """Validation (ms, timed) then downstream evals of 70 s at the same step: before, both were
    `evaluation`, its limit validation's (floor 60 s): exit 75 at every start."""
    forward = job.health.scoring(4, EVALUATION, lambda x: x, "validation at step 4")
    for _ in range(3):
        forward(1)
        job.now += 0.01
    forward = job.health.scoring(4, DOWNSTREAM, lambda x: x, "downstream evals at step 4")
    assert job.dog._me(job.now).limit_s == 600
    job.run(70, lambda: forward(1))
    assert job.verdicts == []
    job.health.phase(5, DATA)
    assert 69 < job.health.progress.longest[DOWNSTREAM] < 73 and job.health.progress.longest[EVALUATION] < 1


def test_an_evaluation_past_its_limit_waits_while_it_scores_and_is_a_hang_once_it_stops(job, capsys):
    job.health.progress.learn(EVALUATION, 10.0)  # limit 100 s
    forward = job.health.scoring(8, EVALUATION, lambda x: x, "validation at step 8")
    job.run(300, lambda: forward(1))
    assert job.verdicts == [] and "validation at step 8: 10" in capsys.readouterr().err
    job.run(200)
    assert [v.first[0].phase for v in job.verdicts] == [EVALUATION]


def test_a_rewinds_load_from_disk_is_judged_by_loads_and_waits_while_it_reads(job):
    """A rewind reads a checkpoint: before, charged to the step's optimizer phase (ms: the floor).
    The first load in a run gets the ceiling; later ones 10 x the longest, and past that they
    wait while bytes are read."""
    with job.health.load(4, "checkpoint load of a rewind from step 4"):
        assert job.dog._me(job.now).limit_s == 600
        job.run(70, lambda: IO.add_read(100 * MB))
    assert job.verdicts == [] and job.health.progress.longest[LOAD] >= 70
    job.health.progress.longest[LOAD] = 5.0  # a faster load taught a 60 s limit (the floor)
    with job.health.load(9, "checkpoint load of a rewind from step 9"):
        job.run(200, lambda: IO.add_read(50 * MB))
    assert job.verdicts == []
    assert job.health.progress.now[1] == OPTIMIZER  # back to the phase the load interrupted


def test_a_surges_probe_and_re_run_are_a_forward_backward_not_the_collective(tmp_path, monkeypatch):
    """At tight limits (floor 2 s): the step's decision (collective, ms) holds a probe and a re-run
    of 3 s each. Before, both were charged to the collective phase (limit 2 s) and called hangs."""
    j = Job(tmp_path, monkeypatch, WatchdogCfg(floor_s=2, ceiling_s=20, factor=10, first_s=60, beat_s=0.5))
    try:
        j.health.progress.learn(FORWARD_BACKWARD, 3.0)  # the step's own forward/backward: 3 s
        j.health.phase(4, COLLECTIVE)
        for _ in range(2):  # the probe, then the re-run
            with j.health.during(4, FORWARD_BACKWARD):
                assert j.dog._me(j.now).limit_s == 20
                j.run(3)
        assert j.verdicts == [] and j.health.progress.now[1] == COLLECTIVE
    finally:
        j.close()


# --- blame --------------------------------------------------------------------------------------

def rank(r: int, phase: str, age: float, limit: float = 60.0, step: int = 30, idle: float = -1.0) -> Seen:
    return Seen(r, f"node{r}", 100 + r, step, phase, age, limit, idle_s=idle)


def test_a_lockstep_stuck_proves_nobody_and_a_rank_the_others_passed_is_proven():
    """Every rank in the end-of-run save past its limit: `first` is whoever reported microseconds
    earlier, so no node is blamed; a rank stuck in a step the others have left is."""
    lockstep = judge([rank(0, EVALUATION, 70.001), rank(1, EVALUATION, 70.0)], 60, 1, "a:1")
    assert lockstep.cause == "stuck" and lockstep.proven == []
    behind = judge([rank(0, OPTIMIZER, 70, step=31), rank(1, FORWARD_BACKWARD, 90)], 60, 1, "a:1")
    assert [s.rank for s in behind.proven] == [1]
    for cause, v in (("store_silent", judge([rank(0, DATA, 1), rank(1, DATA, 1)], 60, 61, "a:1")),
                     ("collective_timeout", judge([rank(0, DATA, 1)], 60, 1, "a:1", broken="timeout"))):
        assert v.cause == cause and v.proven == []


def test_ranks_waiting_on_a_rank_whose_work_advances_are_no_hang():
    """Rank 1 reported its save's snapshot (a collective inside) first and waits for rank 0, which
    is still writing: the earliest report is not the one the others wait for."""
    ranks = [rank(1, CHECKPOINT, 90), rank(0, "checkpoint_write", 89, limit=600, idle=1.0)]
    assert judge(ranks, 60, 1, "a:1") is None
    ranks[1].idle_s = 700  # the write stopped: rank 1 stuck, proven by nothing
    verdict = judge(ranks, 60, 1, "a:1")
    assert verdict.cause == "stuck" and verdict.proven == []


def test_the_record_and_the_line_say_who_is_blamed():
    record = {"first": [{"rank": 1, "host": "n1", "pid": 7}], "waiting": [], "blamed": [], "exit_code": 75,
              "step": 12, "phase": EVALUATION, "cause": "stuck", "why": "in evaluation for 70 s", "in_a_row": 1}
    assert "not proven stopped (no node blamed)" in describe(record, tmp := __import__("pathlib").Path("h"))
    record["blamed"] = [{"rank": 1, "host": "n1", "pid": 7}]
    assert "not proven" not in describe(record, tmp)
