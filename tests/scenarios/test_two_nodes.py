"""Across two nodes (tests/scenarios/nodes.py: network namespaces, their own hostnames and
addresses, the filesystem shared), one gloo rank each unless said: the job trains, a node that
dies (every process of it killed) is diagnosed by the survivor (exit 75, the record naming the
node), and the run resumes to the bit on one node and on two; each node verifies its own copy of
the data; and a node whose link goes down ends the job with exit 75 on both sides, one record."""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from dsslm.data.corpus import default_data_dir
from dsslm.exits import EXIT_BAD_INPUT, EXIT_REQUEUE
from helpers import losses_by_step, read_jsonl, run_train
from nodes import launch, two_nodes, wait_for  # noqa: F401 (fixture)

pytestmark = pytest.mark.slow

TOTAL = 30
RUN = [f"train.total_steps={TOTAL}", "ckpt.every=10", "train.micro_batch_size=2"]
QUICK = ["observe.watchdog.floor_s=2", "observe.watchdog.beat_s=0.25", "observe.watchdog.ceiling_s=20",
         "observe.watchdog.first_s=120"]


@pytest.fixture(autouse=True)
def fresh_nodes(two_nodes):
    two_nodes.reset()
    yield
    two_nodes.reset()  # before a module fixture of the next test starts on them (the Slurm cluster)


def records(run_dir: Path) -> list[dict]:
    return [json.loads((p / "hang.json").read_text()) for p in sorted((run_dir / "hangs").iterdir())
            if not p.name.startswith(".") and (p / "hang.json").exists()]


def checkpointed(run_dir: Path, step: int) -> bool:
    return (run_dir / "checkpoints" / f"step-{step:08d}" / "MANIFEST").exists()


def test_a_dead_node_is_diagnosed_and_the_run_resumes_to_the_bit_on_one_node_and_on_two(two_nodes, tmp_path):
    reference = tmp_path / "reference"
    run_train(reference, *RUN, nproc=2)  # 2 ranks on this machine: the same math, to the bit
    a, b = two_nodes.a, two_nodes.b
    run_dir = tmp_path / "run"

    job = launch([a, b], run_dir, *RUN, *QUICK)
    wait_for(lambda: checkpointed(run_dir, 10), 180, "the checkpoint of step 10", job)
    b.kill()  # node B dies: its agent and its rank
    codes = job.wait()
    assert codes["nodea"] == EXIT_REQUEUE, job.output()
    (record,) = records(run_dir)
    assert record["cause"] in ("peer_lost", "stopped_beating"), record
    assert [s["host"] for s in record["first"]] == ["nodeb"], record
    assert [s["host"] for s in record["waiting"]] == ["nodea"] and record["called_by"]["host"] == "nodea", record
    assert not a.pids() and not b.pids()

    # The requeue lands on one node, two ranks there; its rank 1 stops at step 25 (exit 75 again).
    job = launch([a], run_dir, *RUN, *QUICK, "faults.hang_step=25", "faults.hang_rank=1", nproc=2)
    assert job.wait() == {"nodea": EXIT_REQUEUE}, job.output()
    assert not a.pids()  # the stopped rank too: its node's reaper
    # And again on two nodes, to the end.
    job = launch([a, b], run_dir, *RUN, *QUICK)
    assert job.wait() == {"nodea": 0, "nodeb": 0}, job.output()
    starts = [e for e in read_jsonl(run_dir / "events.jsonl") if e["event"] == "start"]
    assert [(e["step"], e["world_size"]) for e in starts] == [(0, 2), (10, 2), (20, 2)], starts
    assert losses_by_step(run_dir) == losses_by_step(reference)


def test_each_node_verifies_its_own_copy_of_the_data(two_nodes, tmp_path):
    """data.dir is one path; node B has its own copy mounted there. Both copies are hashed, one per
    node; a flipped byte in node B's copy stops both nodes with exit 2, naming node B."""
    shared, own = tmp_path / "data", tmp_path / "nodeb-data"
    shutil.copytree(default_data_dir(), shared)
    shutil.copytree(default_data_dir(), own)
    two_nodes.b.binds = {str(shared): str(own)}
    a, b = two_nodes.a, two_nodes.b
    run_dir = tmp_path / "run"
    args = [f"data.dir={shared}", "data.verify=full", "train.total_steps=2", "ckpt.every=2", "optim.warmup_steps=1", *QUICK]
    job = launch([a, b], run_dir, *args)
    assert job.wait() == {"nodea": 0, "nodeb": 0}, job.output()
    (verified,) = [e for e in read_jsonl(run_dir / "events.jsonl") if e["event"] == "data_verified"]
    assert verified["nodes"] == 2 and verified["hashed_shards"] == len(list(shared.rglob("*.bin"))), verified
    assert verified["hashed_per_rank"] == [verified["hashed_shards"]] * 2, verified  # each node all of its copy

    shard = sorted(own.rglob("*.bin"))[0]
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 1
    shard.write_bytes(bytes(data))
    job = launch([a, b], tmp_path / "run2", *args)
    codes = job.wait()
    assert codes == {"nodea": EXIT_BAD_INPUT, "nodeb": EXIT_BAD_INPUT}, job.output()
    assert f"on nodeb: " in job.output("nodea") and shard.name in job.output("nodea"), job.output()


def test_a_node_whose_link_goes_down_ends_the_job_with_one_record(two_nodes, tmp_path):
    a, b = two_nodes.a, two_nodes.b
    run_dir = tmp_path / "run"
    job = launch([a, b], run_dir, "train.total_steps=400", "ckpt.every=50", "train.micro_batch_size=2", *QUICK)
    wait_for(lambda: len([r for r in read_jsonl(run_dir / "metrics.jsonl") if "loss" in r]) >= 5, 180,
             "step 5", job)
    b.link(False)
    codes = job.wait(timeout_s=120)
    assert codes == {"nodea": EXIT_REQUEUE, "nodeb": EXIT_REQUEUE}, job.output()
    (record,) = records(run_dir)  # one record: both sides called it, the first claim won
    assert record["cause"] in ("stopped_beating", "store_silent"), record
    everyone = record["first"] + record["waiting"]
    assert sorted(s["host"] for s in everyone) == ["nodea", "nodeb"], record
    assert not a.pids() and not b.pids()


@pytest.fixture(scope="module")
def slurm_on_two_nodes(two_nodes, tmp_path_factory):
    """A Slurm cluster of the two nodes: one slurmd in each namespace (slurm_cluster.TwoNodeSlurm)."""
    from slurm_cluster import SlurmUnavailable, TwoNodeSlurm, ensure_installed
    try:
        ensure_installed()
    except SlurmUnavailable as exc:
        pytest.skip(f"no Slurm: {exc}")
    two_nodes.reset()
    cluster = TwoNodeSlurm(tmp_path_factory.mktemp("slurm2"), two_nodes)
    try:
        cluster.start()
        two_nodes.keep |= {proc.pid for proc in cluster.procs.values()}  # the other tests' resets spare them
        yield cluster
    finally:
        two_nodes.keep.clear()
        cluster.stop()


@pytest.mark.slurm
def test_slurm_across_two_nodes_requeues_a_hang_and_stops_a_crash_loop(slurm_on_two_nodes, tmp_path):
    """slurm/train.sbatch on 2 nodes, one rank each (srun starts a torchrun agent per node): rank 1
    stops in step 12 at every start; exit 75 and a requeue twice, then exit 6, not requeued. srun
    reports one code for both nodes' tasks; the hang caller's line in DSSLM_STATUS_FILE decides."""
    from slurm_cluster import FINISHED_STATES
    from test_slurm import JOB_TIMEOUT_S, RUN_ARGS, SBATCH, job_log
    from helpers import PYTHON, ROOT
    cluster, run_dir = slurm_on_two_nodes, tmp_path / "run"
    drill = ["faults.hang_step=12", "faults.hang_rank=1", *QUICK]
    env = {"DSSLM_PYTHON": PYTHON, "DSSLM_NPROC_PER_NODE": "1", "DS_ACCELERATOR": "cpu"}
    job_id = cluster.sbatch(SBATCH, [f"run.dir={run_dir}", *RUN_ARGS, *drill],
                            ["--nodes=2", f"--output={tmp_path}/%x-%j.out"], env=env, cwd=ROOT)
    try:
        info = cluster.wait_state(job_id, FINISHED_STATES, 2 * JOB_TIMEOUT_S)
    except TimeoutError as err:
        raise AssertionError(f"{err}\n{job_log(tmp_path, job_id)}") from None
    log = job_log(tmp_path, job_id)
    assert (info["JobState"], info["ExitCode"], info["Restarts"]) == ("FAILED", "6:0", "2"), log
    hangs = [e for e in read_jsonl(run_dir / "events.jsonl") if e["event"] == "hang"]
    assert [(e["step"], e["in_a_row"], e["exit_code"]) for e in hangs] == [(12, 1, 75), (12, 2, 75), (12, 3, 6)], log
    starts = [e for e in read_jsonl(run_dir / "events.jsonl") if e["event"] == "start"]
    assert {e["world_size"] for e in starts} == {2} and "nodeb" in log and "nodea" in log, log
    assert records(run_dir)[-1]["first"][0]["rank"] == 1, records(run_dir)[-1]
