"""The straggler report (dsslm/health/stragglers.py): a rank's own time apart from its waiting,
the verdict against the other ranks' median, and what rank 0 records as a verdict persists. The
2-rank drills are tests/scenarios/test_nodes.py's."""
from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
import time

import pytest

from helpers import STOPPER

from dsslm.config import FaultsCfg, StragglersCfg
from dsslm.health.nodes import read_nodes
from dsslm.health.stragglers import (BLAMED as ALL_BLAMED, DATA, KEYS, LOOP, OPTIMIZER, STALLED, WAIT, Stalls,
                                      Stragglers, arm_slow_drill, describe, own_times, verdicts)
from dsslm.health.watchdog import CHECKPOINT, COLLECTIVE, EVALUATION, FORWARD_BACKWARD, PHASES, Progress

BLAMED = (DATA, OPTIMIZER)


def window(data=0.001, fb=0.020, coll=0.002, opt=0.003, update=0.002, ckpt=0.0, evaluation=0.0) -> dict:
    """One rank's wall seconds a step per phase (and in the engine's update)."""
    return {DATA: data, FORWARD_BACKWARD: fb, COLLECTIVE: coll, OPTIMIZER: opt, "step": update,
            CHECKPOINT: ckpt, EVALUATION: evaluation, "load": 0.0}


def test_the_rank_that_waits_is_not_charged_for_its_wait():
    # Rank 1 reads its batch 20 ms late; rank 0 spends those 20 ms in the step's collectives.
    own = own_times([window(fb=0.040), window(data=0.021)])
    assert own[0][FORWARD_BACKWARD] == own[1][FORWARD_BACKWARD] == 0.020
    assert own[0][WAIT] == pytest.approx(0.022) and own[1][WAIT] == pytest.approx(0.002)
    assert own[0][OPTIMIZER] == 0.002 and own[0][LOOP] == pytest.approx(0.001)  # the update apart from the logs
    found = verdicts(own, BLAMED, factor=1.5, min_share=0.05)
    assert [(v["rank"], v["phase"]) for v in found] == [(1, DATA)] and found[0]["factor"] == 21.0, found


def test_small_or_even_differences_name_nobody():
    noisy = own_times([window(data=0.0001), window(data=0.0004), window(), window()])  # 4x, but 1% of a step
    assert verdicts(noisy, BLAMED, 1.5, 0.05) == []
    even = own_times([window(opt=0.010, update=0.009), window(opt=0.011, update=0.010)])
    assert verdicts(even, BLAMED, 1.5, 0.05) == []
    assert verdicts(own_times([window()]), BLAMED, 1.5, 0.05) == []


def test_of_many_ranks_the_slow_one_against_the_others_median():
    own = own_times([window(), window(), window(update=0.015, opt=0.016), window(), window(update=0.0025)])  # 1.25x: no
    found = verdicts(own, BLAMED, 1.5, 0.05)
    assert [(v["rank"], v["phase"], v["factor"]) for v in found] == [(2, OPTIMIZER, 7.5)], found


class FakeSinks:
    def __init__(self):
        self.records, self.lines, self.events = [], [], []

    def log_phases(self, record):
        self.records.append(record)

    def say(self, text, level=logging.WARNING):
        self.lines.append(text)

    def emit(self, event, **fields):
        self.events.append({"event": event, **fields})


class FakeEngine:
    world_size, is_main = 2, True

    def __init__(self):
        self.updates = 0

    def step(self, lr):
        self.updates += 1


def test_rank_0_says_it_once_records_it_when_it_persists_and_when_it_ends(tmp_path):
    sinks = FakeSinks()
    report = Stragglers(StragglersCfg(every=10, persist=2), FakeEngine(), Progress(), sinks, tmp_path, None)
    slow = [("a", "na", window()), ("b", "nb", window(data=0.030))]
    for step in (10, 20, 30):
        report.judge(step, slow)
    assert [r["stragglers"][0]["reports"] for r in sinks.records] == [1, 2, 3]
    assert len(sinks.lines) == 1 and sinks.lines[0].startswith("step 10: rank 1 (b) is a straggler in data"), sinks.lines
    (event,) = sinks.events
    assert (event["event"], event["step"], event["rank"], event["phase"], event["reports"]) == \
        ("straggler", 20, 1, DATA, 2)
    (entry,) = read_nodes(tmp_path)["stragglers"]
    assert (entry["host"], entry["slurm_node"], entry["phase"], entry["step"]) == ("b", "nb", DATA, 20)
    assert json.loads(json.dumps(sinks.records[0]))["phase_s"][DATA] == [0.001, 0.03]
    for step in (40, 50, 60):
        report.judge(step, [("a", "na", window()), ("b", "nb", window())])
    assert any("rank 1 (b) is no longer a straggler (was: data)" in line for line in sinks.lines), sinks.lines
    assert not sinks.records[-1]["stragglers"]


def test_a_few_slices_of_preemption_in_a_short_window_name_nobody_the_same_excess_over_a_long_one_does(tmp_path):
    # Measured on a clean 2-rank run with 4 busy loops on the 2 cores: rank 0's loader took 3.1 ms a
    # step against 0.19 ms over a 5-step window (15.6 ms in all, one or two slices off its core).
    clean_but_preempted = [("a", "na", window(data=0.0031)), ("b", "nb", window(data=0.00019))]
    for steps, named in ((5, []), (50, [(0, DATA)])):
        sinks = FakeSinks()
        report = Stragglers(StragglersCfg(every=steps), FakeEngine(), Progress(), sinks, tmp_path, None)
        found = report.judge(steps, clean_but_preempted, steps)
        assert [(v["rank"], v["phase"]) for v in found] == named, found


def test_windows_leave_out_the_first_step_and_time_the_update_alone(tmp_path):
    class Gather(FakeEngine):
        rank = 0

        def all_gather(self, value):
            return [value, ("b", None)]

        def all_reduce_sum(self, table):
            self.sent = (table[0].tolist(), table[1].tolist())
            return table
    engine, progress = Gather(), Progress()
    report = Stragglers(StragglersCfg(every=4), engine, progress, FakeSinks(), tmp_path, None)
    assert report.blamed == (DATA, OPTIMIZER, STALLED)
    progress.spent[DATA] = 100.0  # the first step: compilation, warm-up
    report.after_step(1)
    for step in (2, 3, 4):
        progress.spent[DATA] += 0.5
        engine.step(0.1)
        report.after_step(step)
    mine, other = engine.sent
    sent = dict(zip(KEYS, mine))
    assert sent[DATA] == pytest.approx(0.5) and sent["step"] >= 0 and engine.updates == 3, sent
    assert other == [0.0] * len(KEYS)  # each rank fills its own row; the all-reduce adds them up
    assert progress.now[1] == COLLECTIVE  # the exchange is waiting, not the optimizer's time
    assert set(PHASES) <= set(sent) and sent[STALLED] < 0.05  # this process was not stopped
    report.close()


def test_the_drill_slows_one_rank_in_one_phase():
    class Feed:
        def step(self, position, skips):
            return "batch"
    feed, engine = Feed(), FakeEngine()
    arm_slow_drill(FaultsCfg(slow_rank=1, slow_phase="data", slow_s=0.001), 0, feed, engine)
    assert "step" not in vars(feed)  # another rank: untouched
    arm_slow_drill(FaultsCfg(slow_rank=1, slow_phase="optimizer", slow_s=0.001), 1, feed, engine)
    assert "step" in vars(engine) and "step" not in vars(feed)
    engine.step(0.1)
    assert engine.updates == 1


def test_a_rank_the_os_stopped_is_named_in_stalled_wherever_the_stops_fell():
    # Rank 1 was stopped 12 ms a step; the stops fell in its forward/backward, so its peer waited
    # as long in the collectives and the wall times alone name nobody.
    ranks = [{**window(fb=0.032), STALLED: 0.0}, {**window(fb=0.032), STALLED: 0.012}]
    assert verdicts(own_times(ranks), BLAMED, 1.5, 0.05) == []
    found = verdicts(own_times(ranks), ALL_BLAMED, 1.5, 0.05)
    assert [(v["rank"], v["phase"]) for v in found] == [(1, STALLED)], found
    assert "in stalled (its process stopped or starved of a CPU)" in describe(found[0])


def test_the_stall_sampler_adds_up_the_time_this_process_was_stopped_but_not_in_a_save():
    """Another process stops this one 5 times for 0.1 s: the sampler counts 0.25-0.5 s (each stop
    less up to the tick it slept through); a quiet second, and the same stops in a save, count nothing."""
    progress = Progress()
    stalls = Stalls(progress)
    try:
        time.sleep(0.5)
        quiet = stalls.total
        subprocess.run([sys.executable, "-c", STOPPER, str(os.getpid()), "5"], check=True, timeout=60)
        time.sleep(0.1)
        stopped = stalls.total - quiet
        progress.report(3, CHECKPOINT)
        subprocess.run([sys.executable, "-c", STOPPER, str(os.getpid()), "5"], check=True, timeout=60)
        time.sleep(0.1)
        in_a_save = stalls.total - quiet - stopped
    finally:
        stalls.close()
    assert quiet < 0.05, quiet  # noise on a loaded machine, never a stop's worth
    assert 0.2 <= stopped <= 0.8, stopped
    assert in_a_save == 0.0, in_a_save
