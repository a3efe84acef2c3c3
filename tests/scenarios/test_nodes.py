"""The straggler report on 2 gloo ranks of one machine (torchrun): a rank slowed in its data loading
(faults.slow_phase=data: a sleep in its loader) and, separately, in its optimizer step is named
with that phase within 2 report intervals, the other rank never; the verdict persists into an
event and run.dir/nodes.json; a clean run names nobody; and the check before the first step passes
on a healthy machine in well under 10 s. Reports every 5 steps here (50 by default): a few dozen
steps each. The two-node drills (a full run.dir, a throttled link, the Slurm requeue that leaves the
node out) are tests/scenarios/test_two_nodes.py's."""
from __future__ import annotations

from pathlib import Path

import pytest

from helpers import STOPPER, events, hook_env, read_jsonl, run_train

pytestmark = pytest.mark.slow

EVERY = 5
RUN = ["train.total_steps=30", "ckpt.every=30", f"observe.stragglers.every={EVERY}", "observe.stragglers.persist=3"]


def reports(run_dir: Path) -> list[dict]:
    return [r for r in read_jsonl(run_dir / "metrics.jsonl") if "phase_s" in r]


def named(record: dict) -> set[tuple[int, str]]:
    return {(s["rank"], s["phase"]) for s in record["stragglers"]}


@pytest.mark.parametrize("phase, slow", [("data", 1), ("optimizer", 0)])
def test_a_rank_slow_in_one_phase_is_named_with_it_within_two_reports(tmp_path, phase, slow):
    run_dir = tmp_path / "run"
    proc = run_train(run_dir, *RUN, f"faults.slow_rank={slow}", f"faults.slow_phase={phase}", "faults.slow_s=0.04",
                     nproc=2)
    records = reports(run_dir)
    assert [r["step"] for r in records] == [5, 10, 15, 20, 25, 30], records
    assert (slow, phase) in named(records[0]) | named(records[1]), records[:2]
    assert all(s["rank"] == slow for r in records for s in r["stragglers"]), records  # the other rank: never
    assert all(len(r["phase_s"][phase]) == 2 for r in records)
    (event,) = events(run_dir, "straggler")  # once, when it persisted 3 reports
    assert (event["rank"], event["phase"], event["reports"]) == (slow, phase, 3), event
    assert f"rank {slow} (" in proc.stderr and f"is a straggler in {phase}" in proc.stderr, proc.stderr[-3000:]
    (entry,) = read_jsonl_one(run_dir / "nodes.json")["stragglers"]
    assert (entry["rank"], entry["phase"], entry["step"]) == (slow, phase, event["step"]), entry


# Rank 1's interpreter starts a process that, from outside, stops it 100 ms of every 200 ms
# (SIGSTOP, then SIGCONT) until it exits: the stops fall in whatever phase it is in. Its pipes are
# not the rank's: the test's wait for the run's output would wait for this process too.
STOPPED = """
    import os, subprocess, sys
    if os.environ.get("RANK") == "1":
        # Not RANK: this hook runs in the stopper's interpreter too, which must not start another.
        subprocess.Popen([sys.executable, "-c", STOPPER, str(os.getpid()), "0"], stdin=subprocess.DEVNULL,
                         stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                         env={k: v for k, v in os.environ.items() if k != "RANK"})
"""


def test_a_rank_the_os_stops_a_fraction_of_each_second_is_named_stalled(tmp_path):
    run_dir = tmp_path / "run"
    hook = STOPPED.replace("STOPPER", repr(STOPPER))
    proc = run_train(run_dir, *RUN, "observe.stragglers.every=20", "train.total_steps=60", nproc=2,
                     env=hook_env(tmp_path / "hook", hook))
    # Windows of 20 steps, over half a second: each holds two stops or more, 100 ms and more in all,
    # twice the least excess a verdict needs (WINDOW_NOISE_S).
    records = reports(run_dir)
    assert (1, "stalled") in named(records[0]) | named(records[1]), records[:2]
    assert all(s["rank"] == 1 for r in records for s in r["stragglers"]), records  # the rank it waits for: never
    stalled = [sum(r["phase_s"]["stalled"][rank] for r in records) for rank in (0, 1)]
    assert stalled[1] > 0.01 and stalled[1] > 3 * stalled[0], stalled
    assert "is a straggler in stalled (its process stopped or starved of a CPU)" in proc.stderr, proc.stderr[-3000:]


def read_jsonl_one(path: Path) -> dict:
    import json
    return json.loads(path.read_text())


def test_a_clean_run_names_no_straggler_and_its_nodes_pass_in_seconds(tmp_path):
    run_dir = tmp_path / "run"
    run_train(run_dir, *RUN, "train.total_steps=40", nproc=2)
    records = reports(run_dir)
    assert len(records) == 8 and not any(r["stragglers"] for r in records), records
    assert not events(run_dir, "straggler")
    nodes = read_jsonl_one(run_dir / "nodes.json")
    (node,) = nodes["nodes"].values()
    assert nodes["verdict"] == "ok" and node["ranks"] == [0, 1] and nodes["seconds"] < 10, nodes
    assert set(node["checks"]) == {"run_dir", "data", "memory"}, node  # one node: no links, no clocks to compare
    (check,) = events(run_dir, "node_check")
    assert check["verdict"] == "ok" and check["exit_code"] == 0, check
