"""The watchdog's parts, without processes: the verdict (`judge`), the learned limits, the
progress reports, the records in run.dir (claim, crash-loop count, phase times), the reaper, and
one watchdog thread that calls a hang on a stuck single process. The drills with real processes
are tests/scenarios/test_hangs.py and test_two_nodes.py."""
from __future__ import annotations

import dataclasses
import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from dsslm.config import WatchdogCfg
from dsslm.engine.board import collective_failure
from dsslm.exits import EXIT_CRASH_LOOP, EXIT_OOM_AT_FLOOR, EXIT_OUT_OF_MEMORY, EXIT_REQUEUE, job_exit_code
from dsslm.health import hangs, reaper, watchdog
from dsslm.health.watchdog import (CHECKPOINT, COLLECTIVE, DATA, FORWARD_BACKWARD, LOAD, Limits, Links, Progress, Seen,
                                    Verdict, Watchdog, judge)

CFG = WatchdogCfg(floor_s=60, ceiling_s=600, factor=10, first_s=1800, beat_s=2)


def seen(rank: int, phase: str = FORWARD_BACKWARD, age: float = 1.0, limit: float = 60.0, silent: float = 0.0,
         step: int = 30, exited: bool = False) -> Seen:
    return Seen(rank, f"node{rank}", 100 + rank, step, phase, age, limit, silent, exited)


# --- the verdict --------------------------------------------------------------------------------

def test_a_rank_whose_beats_stopped_is_named_first_and_the_others_wait():
    """SIGSTOP at step 30: rank 1 stops beating; rank 0 goes on into the next collective and waits there."""
    ranks = [seen(0, COLLECTIVE, age=65), seen(1, FORWARD_BACKWARD, age=66, silent=61)]
    verdict = judge(ranks, floor_s=60, store_silent_s=1, store="a:1")
    assert verdict.cause == "stopped_beating"
    assert [s.rank for s in verdict.first] == [1] and [s.rank for s in verdict.waiting] == [0]


def test_a_stopped_rank_is_named_even_when_a_waiting_rank_reported_earlier():
    """Stopped inside a collective its peer entered first: the peer's last report is the earlier one,
    but the rank that stopped beating is the one that stopped."""
    ranks = [seen(0, COLLECTIVE, age=90), seen(1, COLLECTIVE, age=70, silent=65)]
    assert [s.rank for s in judge(ranks, 60, 1, "a:1").first] == [1]


def test_the_earliest_report_past_its_limit_is_stuck():
    ranks = [seen(0, COLLECTIVE, age=30), seen(1, CHECKPOINT, age=100, limit=80), seen(2, COLLECTIVE, age=31)]
    verdict = judge(ranks, 60, 1, "a:1")
    assert verdict.cause == "stuck" and [s.rank for s in verdict.first] == [1]
    assert sorted(s.rank for s in verdict.waiting) == [0, 2]


def test_no_rank_is_stuck_while_another_has_gone_quiet():
    """Rank 1 stopped in a save; its last beat (step 4) is older than its last report (step 10), so
    rank 0, waiting since its own save began, looks like the earliest report. While rank 1 is
    quiet the stuck rule waits; at floor_s of silence rank 1 is named."""
    ranks = [seen(0, CHECKPOINT, age=61, limit=60), seen(1, FORWARD_BACKWARD, age=59, silent=50, step=4)]
    assert judge(ranks, 60, 1, "a:1", quiet_s=8) is None
    assert judge(ranks, 60, 1, "a:1").first[0].rank == 0  # without the rule: the wrong rank
    ranks[1].silent_s = 61
    assert [s.rank for s in judge(ranks, 60, 1, "a:1", quiet_s=8).first] == [1]


def test_ranks_waiting_for_a_peer_in_a_long_phase_are_no_hang():
    """Rank 0 writes a first (untimed: ceiling) save for 200 s; rank 1 waits in a collective whose own
    limit (60 s) it passed long ago. Only the rank the others wait for is judged: no verdict."""
    ranks = [seen(0, CHECKPOINT, age=200, limit=600), seen(1, COLLECTIVE, age=190, limit=60)]
    assert judge(ranks, 60, 1, "a:1") is None


def test_exited_ranks_are_not_judged():
    ranks = [seen(0, COLLECTIVE, age=5), seen(1, FORWARD_BACKWARD, age=500, silent=400, exited=True)]
    assert judge(ranks, 60, 1, "a:1") is None


def test_a_silent_store_is_a_verdict_after_the_floor():
    ranks = [seen(0, COLLECTIVE, age=50), seen(1, FORWARD_BACKWARD, age=55)]
    assert judge(ranks, 60, 59, "nodea:29500") is None
    verdict = judge(ranks, 60, 61, "nodea:29500")
    assert verdict.cause == "store_silent" and "nodea:29500" in verdict.why


def test_a_broken_collective_calls_a_silent_peer_after_the_grace_and_never_a_live_one():
    silent_peer = [seen(0, COLLECTIVE, age=3), seen(1, FORWARD_BACKWARD, age=8, silent=7)]
    assert judge(silent_peer, 60, 1, "a:1", broken="peer", grace_s=6).cause == "peer_lost"
    assert judge(silent_peer, 60, 1, "a:1", broken="peer", grace_s=8) is None
    live_peer = [seen(0, COLLECTIVE, age=3), seen(1, FORWARD_BACKWARD, age=500, limit=60)]
    assert judge(live_peer, 60, 1, "a:1", broken="peer", grace_s=6) is None  # not "stuck" either: it failed, it is not hung
    timed_out = judge(live_peer, 60, 1, "a:1", broken="timeout")
    assert timed_out.cause == "collective_timeout" and timed_out.first[0].rank == 1
    quiet_peer = [seen(0, COLLECTIVE, age=9), seen(1, FORWARD_BACKWARD, age=5, silent=5)]  # its beats lag its reports
    assert judge(quiet_peer, 60, 1, "a:1", broken="timeout", quiet_s=2).first[0].rank == 1


def test_where_the_job_stopped_is_the_furthest_step_and_phase():
    """The stopped rank's last beat (step 11, optimizer) predates its stop; the waiting rank blocks at
    the first collective that needs it: that position is the crash loop's key."""
    verdict = Verdict("stopped_beating", [seen(1, "optimizer", step=11)], [seen(0, FORWARD_BACKWARD, step=12)], "")
    assert verdict.where() == (12, FORWARD_BACKWARD)


# --- limits and reports -------------------------------------------------------------------------

def test_limits_clamp_the_learned_times_and_allow_the_first_step_and_untimed_phases():
    longest = {p: -1.0 for p in watchdog.PHASES} | {FORWARD_BACKWARD: 0.3, CHECKPOINT: 20.0, DATA: 100.0}
    limits = Limits(CFG, longest)
    assert limits.of(FORWARD_BACKWARD, first=False) == 60        # 10 x 0.3 s, up to the floor
    assert limits.of(CHECKPOINT, first=False) == 200             # 10 x 20 s
    assert limits.of(DATA, first=False) == 600                   # 10 x 100 s, down to the ceiling
    assert limits.of("evaluation", first=False) == 600           # never timed
    assert limits.of(FORWARD_BACKWARD, first=True) == 1800       # the first step: compilation
    assert limits.of(COLLECTIVE, first=False) == 600             # not timed yet
    longest[COLLECTIVE] = 0.01
    # Its own time only: a rewind's load and a re-run report their own phases (they once counted here).
    assert limits.of(COLLECTIVE, first=False) == 60
    assert limits.bound() == 600 + 60 and all(limits.bound() > limits.of(p, False) for p in watchdog.PHASES)


def test_reports_time_each_phase_except_the_start_and_the_first_step(monkeypatch):
    clock = iter([0.0, 10.0, 10.5, 12.5, 13.0, 13.2, 13.3, 13.4, 20.4, 20.5])
    monkeypatch.setattr(watchdog.time, "monotonic", lambda: next(clock))
    progress = Progress()                      # t=0: (-1, load)
    progress.report(0, LOAD)                   # 10: setup's tail: the start, judged by first_s, teaches nothing
    progress.first_step = 1
    progress.report(1, DATA)                   # 10.5: the start's load: not timed either
    progress.report(1, FORWARD_BACKWARD)       # 12.5: the first step's data: not timed
    progress.report(2, DATA)                   # 13.0: nor its forward/backward
    progress.report(2, FORWARD_BACKWARD)       # 13.2: step 2's data: 0.2 s
    progress.report(3, DATA)                   # 13.3: 0.1 s
    assert progress.longest[LOAD] == -1.0, "a rewind's load would be judged by the start's (init: ms, the floor)"
    assert progress.longest[DATA] == pytest.approx(0.2)
    assert progress.longest[FORWARD_BACKWARD] == pytest.approx(0.1) and progress.now == (3, DATA, 13.3)
    progress.report(3, LOAD)                   # 13.4: a rewind's checkpoint load ...
    progress.report(3, DATA)                   # 20.4: ... of 7 s: the loads' limit from here on
    assert progress.longest[LOAD] == pytest.approx(7.0)


def test_the_hang_drill_stops_the_rank_in_its_step_and_phase(monkeypatch):
    stops = []
    monkeypatch.setattr(watchdog.os, "kill", lambda pid, sig: stops.append((pid, sig)))
    progress = Progress(trap=(12, CHECKPOINT))
    for step in (11, 12):
        for phase in (DATA, FORWARD_BACKWARD, CHECKPOINT):
            progress.report(step, phase)
    assert stops == [(os.getpid(), signal.SIGSTOP)]


def test_the_collective_bound_is_set_by_the_training_thread_at_its_next_report():
    calls = []
    progress = Progress()
    progress.pending = lambda: calls.append(threading.current_thread())
    progress.report(5, DATA)
    progress.report(5, FORWARD_BACKWARD)
    assert calls == [threading.current_thread()]


def test_the_first_collective_bound_is_set_at_the_first_report_after_the_first_step_not_at_a_beat(tmp_path):
    """Steps after the first can all fall between two of the watchdog's beats, and a rank that
    hangs there would leave its peers in a collective at the default timeout (the flaky drill of
    tests/scenarios/test_hangs.py): the training thread sets the first bound itself."""
    timeouts: list[tuple[float, threading.Thread]] = []
    cfg = WatchdogCfg(floor_s=1, ceiling_s=3, factor=2, first_s=10, beat_s=600)  # no beat in this test
    progress = Progress()
    dog = Watchdog(cfg, tmp_path, 0, "tok", Links(set_timeout=lambda s: timeouts.append((s, threading.current_thread()))),
                   progress)
    try:
        progress.first_step = 1
        progress.report(1, DATA)
        progress.report(1, FORWARD_BACKWARD)
        assert timeouts == []                    # the first step: compilation may take first_s
        progress.report(2, DATA)
        assert timeouts == [(3 + 1, threading.current_thread())] and dog.bound == 4  # nothing timed: the ceiling's
        progress.report(3, DATA)
        assert len(timeouts) == 1                # once; the watchdog's beats move it from here
    finally:
        dog.closed = True
        dog._stop.set()


def test_a_beat_taken_as_the_training_thread_reports_is_still_a_valid_beat(tmp_path):
    """The board thread reads the clock, then the report: a report in between is newer than `now`.
    Its age was negative, the peers' check refused the beat, and a link-down record named this
    rank "?" (tests/scenarios/test_two_nodes.py, once in a full suite)."""
    progress = Progress()
    dog = Watchdog(WatchdogCfg(beat_s=600), tmp_path, 0, "tok", Links(), progress)
    try:
        now = time.monotonic()
        time.sleep(0.005)         # the board thread loses the interpreter's lock for a switch interval
        progress.report(7, DATA)  # after `now` was read
        beat = dataclasses.asdict(dog._me(now))
        assert beat["age_s"] == 0.0 and hangs.seen_ok(beat), beat
    finally:
        dog.closed = True
        dog._stop.set()


# --- the files in run.dir ----------------------------------------------------------------------

def test_one_claim_per_job_the_loser_gets_the_winners_folder_and_code(tmp_path):
    folder, code, won = hangs.claim(tmp_path, "job1", EXIT_CRASH_LOOP)
    assert won and folder.is_dir() and code == EXIT_CRASH_LOOP
    assert hangs.claim(tmp_path, "job1", EXIT_REQUEUE) == (folder, EXIT_CRASH_LOOP, False)
    assert hangs.claimed(tmp_path, "job1") == f"{folder.name} {EXIT_CRASH_LOOP}"
    assert hangs.claimed(tmp_path, "job2") is None


def test_a_rank_whose_beat_was_never_read_is_named_by_its_host_from_the_start(tmp_path):
    """A link that goes down before this watchdog read a peer's first beat: the peer was "?" in
    the record, which then named one host of two (tests/scenarios/test_two_nodes.py, once in a
    full suite under load). Every rank's host and pid are gathered at the start (health.door)."""
    dog = Watchdog(WatchdogCfg(beat_s=600), tmp_path, 0, "tok", Links(), Progress())
    try:
        now = time.monotonic()
        never = dog._seen(now, now, [None, None])[1]
        assert (never.host, never.pid, never.phase) == ("?", 0, "?")
        dog.peers = [("nodea", 11), ("nodeb", 22)]
        never = dog._seen(now, now, [None, None])[1]
        assert (never.host, never.pid, never.step, never.phase) == ("nodeb", 22, -1, "?")
    finally:
        dog.closed = True
        dog._stop.set()


def record(run_dir: Path, name: str, step: int, phase: str, row: int) -> None:
    (run_dir / "hangs" / name).mkdir(parents=True)
    hangs.write_record(run_dir / "hangs" / name, {"schema": 1, "step": step, "phase": phase, "in_a_row": row,
                                                  "exit_code": EXIT_REQUEUE, "cause": "stopped_beating"})


def test_the_crash_loop_counts_hangs_in_a_row_at_one_step_and_phase_and_progress_resets_it(tmp_path):
    assert hangs.fold_failures(tmp_path) is None and hangs.in_a_row(tmp_path, 12, FORWARD_BACKWARD) == 1
    record(tmp_path, "20260101-000000-aa", 12, FORWARD_BACKWARD, 1)
    failures = hangs.fold_failures(tmp_path)  # the next start, rank 0
    assert failures["in_a_row"] == 1 and failures["record"] == "20260101-000000-aa"
    assert hangs.in_a_row(tmp_path, 12, FORWARD_BACKWARD) == 2   # the same place again
    assert hangs.in_a_row(tmp_path, 12, CHECKPOINT) == 1         # elsewhere: a new count
    record(tmp_path, "20260101-000100-bb", 12, FORWARD_BACKWARD, 2)
    assert hangs.fold_failures(tmp_path)["in_a_row"] == 2
    assert hangs.fold_failures(tmp_path)["in_a_row"] == 2        # folded once
    hangs.reset_failures(tmp_path, hangs.fold_failures(tmp_path))  # got past step 12
    assert hangs.in_a_row(tmp_path, 12, FORWARD_BACKWARD) == 1


@pytest.mark.parametrize("text", ['{"schema": 1, "step": "12", "phase": "data", "in_a_row": 5, "record": "x"}',
                                  '{"schema": 1, "step": 12}', "[1, 2]", "not json"])
def test_a_failures_file_dsslm_did_not_write_is_ignored_with_a_line(tmp_path, capsys, text):
    (tmp_path / "failures.json").write_text(text)
    assert hangs.in_a_row(tmp_path, 12, DATA) == 1
    assert "failures.json is not a crash-loop count dsslm wrote" in capsys.readouterr().err


def test_a_tampered_hang_record_is_passed_over_for_an_older_valid_one(tmp_path, capsys):
    record(tmp_path, "20260101-000000-aa", 7, DATA, 1)
    (tmp_path / "hangs" / "20260101-000100-bb").mkdir()
    (tmp_path / "hangs" / "20260101-000100-bb" / "hang.json").write_text('{"schema": 1, "step": -5}')
    assert hangs.newest_record(tmp_path)[0] == "20260101-000000-aa"
    assert "is not a hang record" in capsys.readouterr().err


def test_learned_phase_times_round_trip_and_bad_ones_are_ignored(tmp_path, capsys):
    hangs.write_learned(tmp_path, {DATA: 0.25, CHECKPOINT: 31.0})
    assert hangs.read_learned(tmp_path) == {DATA: 0.25, CHECKPOINT: 31.0}
    (tmp_path / "watchdog.json").write_text('{"schema": 1, "longest": {"data": -3}}')
    assert hangs.read_learned(tmp_path) == {} and "watchdog.json" in capsys.readouterr().err


# --- the exit code and what a collective's failure means ------------------------------------------

def test_one_exit_code_for_the_job_a_persons_first_then_the_requeue():
    assert job_exit_code([EXIT_REQUEUE, -9]) == EXIT_REQUEUE           # the survivor, the stopped rank killed
    assert job_exit_code([EXIT_REQUEUE, EXIT_CRASH_LOOP]) == EXIT_CRASH_LOOP
    assert job_exit_code([1, EXIT_REQUEUE]) == EXIT_REQUEUE
    assert job_exit_code([2, 3]) == 3 and job_exit_code([-15]) == 1 and job_exit_code([1, 9]) == 1
    # A rank that ran out of memory, and one that waited for it (a lost peer): the job's code is 77.
    assert job_exit_code([EXIT_OUT_OF_MEMORY, EXIT_REQUEUE]) == EXIT_OUT_OF_MEMORY
    assert job_exit_code([EXIT_OOM_AT_FLOOR, EXIT_OUT_OF_MEMORY]) == EXIT_OOM_AT_FLOOR


@pytest.mark.parametrize("text, kind", [
    ("[../gloo/transport/tcp/unbound_buffer.cc:78] Timed out waiting 2000ms for recv operation to complete", "timeout"),
    ("[../gloo/transport/tcp/pair.cc:553] Connection closed by peer [10.77.0.2]:31119", "peer"),
    ("[../gloo/transport/tcp/pair.cc:598] Connection reset by peer", "peer"),
    ("step 7: escalated to a human", None), ("the checkpoint timed out", None)])
def test_a_collectives_exception_is_told_apart_by_its_message(text, kind):
    assert collective_failure(RuntimeError(text)) == kind
    assert collective_failure(ValueError(text)) is None


# --- the reaper -----------------------------------------------------------------------------------

def test_the_reaper_kills_a_stopped_rank_once_a_hang_is_claimed_and_leaves_a_running_one(tmp_path):
    stopped = subprocess.Popen(["sleep", "60"])
    running = subprocess.Popen(["sleep", "60"])
    claim = tmp_path / ".called-job"
    try:
        os.kill(stopped.pid, signal.SIGSTOP)
        ranks = [f"{p.pid}:{reaper.pid_start(p.pid)}" for p in (stopped, running)]
        proc = subprocess.Popen([sys.executable, reaper.__file__, str(claim), "60", "0.05", *ranks])
        time.sleep(0.5)
        assert stopped.poll() is None  # nothing claimed yet
        claim.write_text("folder 75\n")
        assert stopped.wait(timeout=10) == -signal.SIGKILL
        time.sleep(0.3)
        assert running.poll() is None and proc.poll() is None  # within its grace, and still watching it
        running.kill()
        assert proc.wait(timeout=10) == 0  # every rank gone: the reaper goes too
    finally:
        for p in (stopped, running):
            p.kill()
            p.wait()


def test_the_reaper_never_kills_a_reused_pid(tmp_path):
    other = subprocess.Popen(["sleep", "60"])
    try:
        (tmp_path / ".called-job").write_text("folder 75\n")
        start = reaper.pid_start(other.pid)
        assert reaper.state_of(other.pid, start + 1) is None  # another start time: not the rank
        reaper.reap(tmp_path / ".called-job", 0.0, 0.01, [(other.pid, start + 1)])  # returns: nothing to watch
        assert other.poll() is None
    finally:
        other.kill()
        other.wait()


# --- one watchdog thread, one process -------------------------------------------------------------

class Exited(Exception):
    pass


def test_a_single_process_stuck_past_its_limit_is_called_recorded_and_exits_75(tmp_path, capsys):
    cfg = WatchdogCfg(floor_s=0.4, ceiling_s=0.8, factor=2, first_s=0.8, beat_s=0.05)
    codes: list[int] = []

    def leave(code: int) -> None:
        codes.append(code)
        raise Exited  # ends the watchdog thread, as os._exit ends the process

    released = []
    progress = Progress()
    progress.first_step = 1
    progress.report(1, DATA)
    progress.report(2, DATA)   # and stays there: data was never timed (step 1 is the first), its limit the ceiling
    dog = Watchdog(cfg, tmp_path, 0, "tok", Links(on_leave=[lambda: released.append(1)], exit=leave), progress)
    try:
        deadline = time.monotonic() + 10
        while not codes and time.monotonic() < deadline:
            time.sleep(0.05)
    finally:
        dog.closed = True
        dog._stop.set()
    assert codes == [EXIT_REQUEUE] and released == [1]
    (folder,) = [p for p in (tmp_path / "hangs").iterdir() if not p.name.startswith(".")]
    record = json.loads((folder / "hang.json").read_text())
    assert (record["cause"], record["step"], record["phase"], record["in_a_row"]) == ("stuck", 2, DATA, 1)
    assert record["first"][0]["rank"] == 0 and record["first"][0]["dumped"]
    assert "Thread" in (folder / "stacks-rank0.txt").read_text()
    (event,) = [json.loads(line) for line in (tmp_path / "events.jsonl").read_text().splitlines()]
    assert event["event"] == "hang" and event["exit_code"] == EXIT_REQUEUE
    assert "hang at step 2 in data (stuck: in data for" in capsys.readouterr().err
