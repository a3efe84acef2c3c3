"""Across two nodes (tests/scenarios/nodes.py: network namespaces, their own hostnames and
addresses, the filesystem shared), one gloo rank each unless said: the job trains, a node that
dies (every process of it killed) is diagnosed by the survivor (exit 75, the record naming the
node), and the run resumes to the bit on one node and on two; each node verifies its own copy of
the data; a node whose link goes down ends the job with exit 75 on both sides, one record; a node
whose run.dir is full, or whose link is throttled, is refused before the first step (exit 76 on
both, named in nodes.json); and under Slurm the requeue of a job a node refused leaves it out."""
from __future__ import annotations

import json
import os
import random
import shutil
import subprocess
from pathlib import Path

import pytest

from dsslm.data import parts
from dsslm.data.corpus import default_data_dir
from dsslm.data.prepare import prepare, quiet_datasets
from dsslm.exits import EXIT_BAD_INPUT, EXIT_BAD_NODE, EXIT_REQUEUE
from helpers import PYTHON, ROOT, losses_by_step, read_jsonl, run_train
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
    nodes = json.loads((run_dir / "nodes.json").read_text())  # and both passed their check, in seconds
    assert nodes["verdict"] == "ok" and sorted(nodes["nodes"]) == ["nodea", "nodeb"] and nodes["seconds"] < 10, nodes
    assert all(n["checks"]["network"]["ok"] and n["checks"]["clock"]["ok"] for n in nodes["nodes"].values()), nodes
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


def full_disk(mount: Path, free_bytes: int) -> Path:
    """A 1 MiB tmpfs at `mount` filled to `free_bytes` free: room for a few small files, not for a
    checkpoint. Unmounted by `unmount`."""
    mount.mkdir(parents=True, exist_ok=True)
    made = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(mount)], capture_output=True, text=True)
    if made.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs: {made.stderr.strip()}")
    st = os.statvfs(mount)
    (mount / "filler").write_bytes(b"\0" * (st.f_bavail * st.f_frsize - free_bytes))
    return mount


def unmount(mount: Path) -> None:
    subprocess.run(["umount", "-l", str(mount)], check=False)


def refused(run_dir: Path, job) -> dict:
    """Both nodes exit 76 before any rank trained; nodes.json (written by rank 0, on node A) names node B."""
    codes = job.wait()
    assert codes == {"nodea": EXIT_BAD_NODE, "nodeb": EXIT_BAD_NODE}, job.output()
    nodes = json.loads((run_dir / "nodes.json").read_text())
    assert {h: n["verdict"] for h, n in nodes["nodes"].items()} == {"nodea": "ok", "nodeb": "bad"}, nodes
    assert nodes["exit_code"] == EXIT_BAD_NODE and not (run_dir / "metrics.jsonl").exists(), nodes
    assert "dsslm: node nodeb (rank 1) failed its check before the first step: " in job.output("nodea"), job.output()
    (event,) = [e for e in read_jsonl(run_dir / "events.jsonl") if e["event"] == "bad_node"]
    assert event["nodes"] == ["nodeb"], event
    return nodes["nodes"]["nodeb"]


def test_a_node_whose_run_dir_is_full_is_refused_before_the_first_step(two_nodes, tmp_path):
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    disk = full_disk(tmp_path / "full", 100 << 10)
    two_nodes.b.binds = {str(run_dir): str(disk)}  # node B's view of run.dir: its full disk
    try:
        bad = refused(run_dir, launch([two_nodes.a, two_nodes.b], run_dir, *RUN, *QUICK))
    finally:
        unmount(disk)
    assert not bad["checks"]["run_dir"]["ok"] and bad["checks"]["network"]["ok"], bad
    assert "No space left on device" in bad["why"][0] or "MB free" in bad["why"][0], bad


def test_a_node_whose_link_is_throttled_is_refused_before_the_first_step(two_nodes, tmp_path):
    run_dir = tmp_path / "run"
    two_nodes.b.throttle("8mbit")  # node B sends at 1 MB/s; the veth carries hundreds
    bad = refused(run_dir, launch([two_nodes.a, two_nodes.b], run_dir, *RUN, *QUICK))
    network = bad["checks"]["network"]
    assert not network["ok"] and network["send_mb_s"] < 2 and network["median_send_mb_s"] > 10, network
    assert bad["why"] == [network["why"]] and "its link sends" in network["why"], bad
    assert json.loads((run_dir / "nodes.json").read_text())["seconds"] < 10


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
    assert log.count("diagnosed a hang or a dead node") == 2 and "exit 6 needs a person" in log, log
    assert "a crash loop, not requeued (exit 6)" in log, log


@pytest.mark.slurm
def test_slurm_requeues_a_job_a_node_refused_without_that_node(slurm_on_two_nodes, two_nodes, tmp_path):
    """A 1-node job lands on node B (node A is busy) whose run.dir is a full disk: it exits 76, the
    script requeues it with ExcNodeList=nodeb (dsslm.health.exclude: sinfo lists node B, and node A
    is enough for the job), and once node A is free the job runs there to its end."""
    from slurm_cluster import FINISHED_STATES
    from test_slurm import JOB_TIMEOUT_S, RUN_ARGS, SBATCH, job_log
    from helpers import PYTHON, ROOT
    cluster, run_dir = slurm_on_two_nodes, tmp_path / "run"
    run_dir.mkdir()
    # In the mount namespace of node B's slurmd (the jobs it starts share it; one made before this
    # test sees none of the host's later mounts): a 1 MiB tmpfs over run.dir, 160 KiB left free.
    in_b = ["nsenter", "-t", str(cluster.procs["slurmd-nodeb"].pid), "-m"]
    subprocess.run([*in_b, "mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(run_dir)], check=True)
    subprocess.run([*in_b, "sh", "-c", f"dd if=/dev/zero of={run_dir}/.filler bs=4k 2>/dev/null; "
                                       f"truncate -s -{160 << 10} {run_dir}/.filler"], check=True)
    blocker = tmp_path / "blocker.sbatch"
    blocker.write_text(f"#!/bin/bash\n#SBATCH --nodelist=nodea\n#SBATCH --exclusive\n#SBATCH --output={tmp_path}/b.out\n"
                       "sleep 600\n")
    env = {"DSSLM_PYTHON": PYTHON, "DSSLM_NPROC_PER_NODE": "1", "DS_ACCELERATOR": "cpu"}
    busy = job_id = None
    try:
        busy = cluster.sbatch(blocker)
        cluster.wait_state(busy, "RUNNING", 60)
        job_id = cluster.sbatch(SBATCH, [f"run.dir={run_dir}", *RUN_ARGS, "train.total_steps=10", "ckpt.every=5", *QUICK],
                                ["--nodes=1", f"--output={tmp_path}/%x-%j.out"], env=env, cwd=ROOT)
        try:
            # Restarts 1 exactly, ExcNodeList set as soon as the job is pending again: decided before
            # the requeue, set right after it. (Before, under load, the job started on node B again:
            # the helper's update came 6 s after the requeue.)
            released = cluster.wait_job(job_id, lambda j: j["Restarts"] != "0" and j["JobState"] == "PENDING"
                                        and "JobHeld" not in j["Reason"], JOB_TIMEOUT_S)
            assert (released["Restarts"], released["ExcNodeList"]) == ("1", "nodeb"), released
        except TimeoutError as err:
            raise AssertionError(f"{err}\n{job_log(tmp_path, job_id)}") from None
        cluster.client(["scancel", str(busy)])
        info = cluster.wait_state(job_id, FINISHED_STATES, JOB_TIMEOUT_S)
    finally:
        # Whatever failed above, neither job may hold a node into the tests after this one.
        for left in (busy, job_id):
            if left is not None:
                cluster.client(["scancel", str(left)], check=False)
        subprocess.run([*in_b, "umount", "-l", str(run_dir)], check=False)
    log = job_log(tmp_path, job_id)
    assert (info["JobState"], info["ExitCode"], info["Restarts"], info["ExcNodeList"]) == \
        ("COMPLETED", "0:0", "1", "nodeb"), log
    assert "a node failed its check before the first step (run.dir/nodes.json): requeueing elsewhere" in log, log
    assert "excluding nodeb from this job's requeues until" in log and "failed its check before the first step" in log
    # The second start ran on node A, whose view of run.dir is the shared one: it passed, and trained.
    nodes = json.loads((run_dir / "nodes.json").read_text())
    assert {h: n["verdict"] for h, n in nodes["nodes"].items()} == {"nodea": "ok"}, nodes
    assert [e["step"] for e in read_jsonl(run_dir / "events.jsonl") if e["event"] == "end"] == [10], log


PREPARE_SBATCH = ROOT / "slurm" / "prepare.sbatch"


def write_corpus(folder: Path) -> list[Path]:
    """Two text files of a unit each (parts.UNIT_BYTES) and a small JSONL, the third unit: one node
    makes units 0 and 2, the other unit 1. Few distinct words: the BPE encodes them fast."""
    rng = random.Random(11)
    words = ["alpha", "beta", "gamma", "delta", "naïve", "λx", "def", "return", "(", ")", ":", "\n", "    "]
    folder.mkdir()
    for name in ("a.txt", "b.txt"):
        with open(folder / name, "w") as f:
            while f.tell() < parts.UNIT_BYTES:
                f.write(" ".join(rng.choice(words) for _ in range(2000)) + "\n")
    (folder / "c.jsonl").write_text("".join(json.dumps({"text": " ".join(rng.choice(words) for _ in range(50))}) + "\n"
                                            for _ in range(100)))
    return [folder / "a.txt", folder / "b.txt", folder / "c.jsonl"]


def every_file(folder: Path) -> dict[str, bytes]:
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


@pytest.mark.slurm
def test_prepare_on_two_nodes_writes_the_bytes_one_process_writes(slurm_on_two_nodes, tmp_path):
    """slurm/prepare.sbatch on the two nodes: the tokenizer step trains a BPE once, one --part task
    on each node tokenizes its share of the input files, the merge writes the domain; the DATA_DIR
    is the same bytes as one process's prepare. Here, not in a file of its own: two Slurm clusters
    at once (two test workers) share munged, and the first to stop takes it from the other."""
    from slurm_cluster import FINISHED_STATES
    from test_slurm import JOB_TIMEOUT_S
    inputs = write_corpus(tmp_path / "src")
    args = ["--tokenizer", "bpe", "--vocab-size", "300", "--tokenizer-sample", str(1 << 20)]
    out = tmp_path / "data"
    job_id = slurm_on_two_nodes.sbatch(PREPARE_SBATCH, ["--input", *map(str, inputs), "--out", str(out), *args],
                                       ["--nodes=2", f"--output={tmp_path}/%x-%j.out"],
                                       env={"DSSLM_PYTHON": PYTHON, "DSSLM_PREPARE_WORKERS": "1"}, cwd=ROOT)
    log_path = tmp_path / f"dsslm-prepare-{job_id}.out"
    try:
        info = slurm_on_two_nodes.wait_state(job_id, FINISHED_STATES, JOB_TIMEOUT_S)
    except TimeoutError as err:
        raise AssertionError(f"{err}\n{log_path.read_text() if log_path.exists() else ''}") from None
    log = log_path.read_text()
    assert (info["JobState"], info["ExitCode"]) == ("COMPLETED", "0:0"), log
    assert "2 task(s) on 2 node(s)" in log and "step 3/3 (merge) done" in log, log
    assert "prepared part 0/2 of domain 'default'" in log and "2 of 3 units (2 made, 0 reused)" in log, log
    assert "prepared part 1/2 of domain 'default'" in log and "1 of 3 units (1 made, 0 reused)" in log, log

    quiet_datasets()
    reference = tmp_path / "reference"
    prepare(inputs, reference, tokenizer="bpe", vocab_size=300, tokenizer_sample=1 << 20)
    assert every_file(out) == every_file(reference)
    assert sorted(p.name for p in out.iterdir()) == ["default", "manifest.json", "tokenizer.json"]


def array_tasks(cluster, job_id: int) -> list[dict[str, str]]:
    """`scontrol show job` of a job array: one record per task once Slurm split them (a pending
    remainder is one record, its ArrayTaskId a range)."""
    import re
    out = cluster.client(["scontrol", "-o", "show", "job", str(job_id)]).stdout
    return [dict(re.findall(r"(\w+(?::\w+)?)=(\S*)", line)) for line in out.splitlines() if line.strip()]


@pytest.mark.slurm
def test_slurm_runs_a_ladder_of_8_points_as_a_job_array_on_two_nodes(slurm_on_two_nodes, tmp_path):
    """python -m dsslm.ladder --slurm writes the plan and submits slurm/ladder.sbatch as an array of
    8 tasks (2 widths x 2 rates x 2 seeds, 10 steps each), one node each, on both nodes; each task
    runs its point through slurm/train.sbatch; --collect then finds 8 finished points."""
    import time
    from slurm_cluster import FINISHED_STATES
    from test_slurm import JOB_TIMEOUT_S
    cluster, out = slurm_on_two_nodes, tmp_path / "ladder"
    base = ["engine.kind=ddp", "train.precision=fp32", "model.n_layers=2", "model.n_heads=2", "model.seq_len=32",
            "train.micro_batch_size=4", "train.total_steps=10", "ckpt.every=10", "optim.warmup_steps=3",
            "run.val_batches=2", "run.tensorboard=false", "train.device=cpu"]
    env = {**cluster.env, "DSSLM_PYTHON": PYTHON, "DSSLM_NPROC_PER_NODE": "1", "DS_ACCELERATOR": "cpu"}
    argv = [PYTHON, "-m", "dsslm.ladder", "--slurm", "--widths", "32,64", "--lrs", "1e-3,1e-2", "--seeds", "1,2",
            "--out", str(out), *base]
    done = subprocess.run(cluster.wrap(argv), env=env, cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0 and "--array=0-7" in done.stdout, done.stdout + done.stderr
    job_id = int(done.stdout.split()[-1])
    cluster.job_ids.append(job_id)  # scancelled with the cluster, whatever happens here

    def logs() -> str:
        return "\n".join(f"--- {p.name}\n{p.read_text()[-3000:]}" for p in sorted((out / "logs").glob("*.out")))
    deadline, tasks = time.monotonic() + 2 * JOB_TIMEOUT_S, []
    while time.monotonic() < deadline:
        tasks = array_tasks(cluster, job_id)
        if len(tasks) == 8 and all(t.get("JobState") in FINISHED_STATES for t in tasks):
            break
        time.sleep(1)
    else:
        raise AssertionError(f"job array {job_id} not done after {2 * JOB_TIMEOUT_S} s: "
                             f"{[(t.get('ArrayTaskId'), t.get('JobState')) for t in tasks]}\n{logs()}")
    assert sorted(int(t["ArrayTaskId"]) for t in tasks) == list(range(8)), tasks
    assert {(t["JobState"], t["ExitCode"]) for t in tasks} == {("COMPLETED", "0:0")}, logs()
    assert {t["BatchHost"] for t in tasks} == {"nodea", "nodeb"}, [t["BatchHost"] for t in tasks]

    collected = subprocess.run([PYTHON, "-m", "dsslm.ladder", "--collect", "--out", str(out)], cwd=ROOT,
                               capture_output=True, text=True, timeout=120)
    assert collected.returncode == 0, collected.stdout + collected.stderr
    results = json.loads((out / "ladder.json").read_text())["results"]["points"]
    assert len(results) == 8 and {r["status"] for r in results} == {"finished"}, (results, logs())
    assert all(r["val_step"] == 10 and r["val_loss"] > 0 for r in results), results
    assert "width 32, depth 2: best rate" in collected.stdout and (out / "ladder.png").exists(), collected.stdout
