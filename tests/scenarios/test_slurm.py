"""slurm/train.sbatch on a real one-node Slurm cluster (tests/scenarios/slurm_cluster.py), 2 CPU
ranks per job.

First the launcher on its own, with a 30-line gloo stand-in for the trainer: SIGUSR1 to the batch
shell and SIGTERM from `scontrol requeue` each reach every rank exactly once, the ranks save, the
job comes back and resumes; a notice during the script's setup requeues without starting the
ranks, and one answered by a run that finished is not requeued. Then the script with stand-ins for
srun and scontrol (no cluster): what a cluster cannot time. Then dsslm.train itself: a run to the
end, a `scontrol requeue` mid-run and a SIGUSR1 preemption, both of which must end with the
uninterrupted run's losses, bit for bit.
"""
from __future__ import annotations

import json
import time
from pathlib import Path

import pytest

from helpers import ROOT, PYTHON, read_jsonl
from slurm_cluster import FINISHED_STATES, SlurmCluster, slurm_cluster  # noqa: F401 (fixture)

pytestmark = [pytest.mark.slurm, pytest.mark.slow]

SBATCH = ROOT / "slurm" / "train.sbatch"
JOB_TIMEOUT_S = 240

# Slow enough per step (about 40 ms on 2 ranks of 1 thread each) that a signal lands mid-run,
# small enough that 120 steps plus two interpreter starts stay near 15 s.
TOTAL_STEPS = 120
CKPT_EVERY = 20
RUN_ARGS = ["engine.kind=ddp", "train.precision=fp32", "model.d_model=64", "model.n_layers=2",
            "model.n_heads=2", "model.seq_len=64", "train.micro_batch_size=8", "train.grad_accum=1",
            f"train.total_steps={TOTAL_STEPS}", f"ckpt.every={CKPT_EVERY}", "ckpt.keep_last=100",
            "optim.warmup_steps=10", "run.val_every=0", "run.tensorboard=false", "train.device=cpu"]

PROBE = '''\
"""Stand-in trainer: a gloo all-reduce loop that saves and exits 0 on SIGTERM/SIGUSR1 (rank 0
then writes $PROBE_STATUS, if set, into $DSSLM_STATUS_FILE, as dsslm.train would)."""
import json, os, signal, sys, time
from pathlib import Path
got = []
for sig in (signal.SIGTERM, signal.SIGUSR1):
    signal.signal(sig, lambda n, f: got.append(signal.Signals(n).name))
import torch, torch.distributed as dist
out, total = Path(os.environ["PROBE_DIR"]), int(os.environ["PROBE_STEPS"])
save_s = float(os.environ.get("PROBE_SAVE_S", "0"))
dist.init_process_group("gloo")
rank, ckpt = dist.get_rank(), out / "step"
step = int(ckpt.read_text()) if ckpt.exists() else 0
def log(**rec):
    with open(out / f"rank{rank}.jsonl", "a") as f:
        f.write(json.dumps({**rec, "rank": rank, "restart": int(os.environ.get("SLURM_RESTART_COUNT", 0)),
                            "world": dist.get_world_size()}) + "\\n")
log(event="start", step=step)
while step < total:
    flag = torch.tensor([1.0 if got else 0.0])
    dist.all_reduce(flag, op=dist.ReduceOp.MAX)  # one decision for every rank
    if flag.item():
        time.sleep(save_s)  # a save that takes a while: must not be cut short
        if rank == 0:
            ckpt.write_text(str(step))
            if os.environ.get("PROBE_STATUS"):  # what dsslm.train's rank 0 says as it leaves
                Path(os.environ["DSSLM_STATUS_FILE"]).write_text(os.environ["PROBE_STATUS"] + "\\n")
        dist.barrier()
        log(event="saved", step=step, signals=got)
        sys.exit(0)
    time.sleep(0.1)
    step += 1
    if rank == 0 and step % 10 == 0:
        ckpt.write_text(str(step))
log(event="end", step=step, signals=got)
'''


def submit(cluster: SlurmCluster, out_dir: Path, args: list[str], env: dict[str, str]) -> int:
    env = {"DSSLM_PYTHON": PYTHON, "DSSLM_NPROC_PER_NODE": "2", "DS_ACCELERATOR": "cpu", **env}
    return cluster.sbatch(SBATCH, args, [f"--output={out_dir}/%x-%j.out"], env=env, cwd=ROOT)


def job_log(out_dir: Path, job_id: int) -> str:
    path = out_dir / f"dsslm-{job_id}.out"
    return path.read_text() if path.exists() else "(no job log)"


def wait_for(predicate, timeout_s: float, what: str, poll_s: float = 0.1):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(poll_s)
    raise TimeoutError(f"no {what} within {timeout_s:.0f}s")


def finish(cluster: SlurmCluster, out_dir: Path, job_id: int, restarts: int) -> dict[str, str]:
    """Wait for the job to end; it must have COMPLETED with exit 0 after `restarts` requeues."""
    try:
        info = cluster.wait_state(job_id, FINISHED_STATES, JOB_TIMEOUT_S)
    except TimeoutError as err:
        raise AssertionError(f"{err}\n{job_log(out_dir, job_id)}") from None
    log = job_log(out_dir, job_id)
    assert (info["JobState"], info["ExitCode"], info["Restarts"]) == ("COMPLETED", "0:0", str(restarts)), log
    return info


def probe_records(probe_dir: Path) -> list[dict]:
    return [r for path in sorted(probe_dir.glob("rank*.jsonl")) for r in read_jsonl(path)]


def test_hello_job_runs_on_the_test_cluster(slurm_cluster, tmp_path):
    script = tmp_path / "hello.sbatch"
    script.write_text(f"#!/bin/bash\n#SBATCH --output={tmp_path}/hello-%j.out\nsrun hostname\n")
    started = time.monotonic()
    job_id = slurm_cluster.sbatch(script)
    info = slurm_cluster.wait_state(job_id, FINISHED_STATES, 60)
    assert (info["JobState"], info["ExitCode"]) == ("COMPLETED", "0:0")
    assert (tmp_path / f"hello-{job_id}.out").read_text().strip() == slurm_cluster.host
    assert time.monotonic() - started < 30


def test_signals_reach_each_rank_once_and_the_job_resumes(slurm_cluster, tmp_path):
    """SIGUSR1 to the batch shell (a preemption notice), then `scontrol requeue` (SIGTERM to the
    whole job, with a 3 s save), then a run to the end: three runs of one job id."""
    (tmp_path / "gloo_probe.py").write_text(PROBE)
    probe_dir = tmp_path / "probe"
    probe_dir.mkdir()
    env = {"DSSLM_MODULE": "gloo_probe", "PYTHONPATH": str(tmp_path), "PROBE_DIR": str(probe_dir),
           "PROBE_STEPS": "60", "PROBE_SAVE_S": "3"}
    job_id = submit(slurm_cluster, tmp_path, [], env)

    def started(restart: int) -> bool:
        return sum(r["event"] == "start" and r["restart"] == restart for r in probe_records(probe_dir)) == 2

    wait_for(lambda: started(0), 60, "first start of both ranks")
    time.sleep(1)
    slurm_cluster.client(["scancel", "--signal=USR1", "--batch", str(job_id)])
    slurm_cluster.wait_job(job_id, lambda j: j["Restarts"] == "1", 60)
    wait_for(lambda: started(1), 60, "both ranks after the USR1 requeue")
    time.sleep(1)
    slurm_cluster.client(["scontrol", "requeue", str(job_id)])
    finish(slurm_cluster, tmp_path, job_id, restarts=2)

    records = probe_records(probe_dir)
    log = job_log(tmp_path, job_id)
    for restart, signal_name in ((0, "SIGUSR1"), (1, "SIGTERM")):
        saved = [r for r in records if r["event"] == "saved" and r["restart"] == restart]
        assert [r["signals"] for r in saved] == [[signal_name]] * 2, (records, log)
        resumed = [r["step"] for r in records if r["event"] == "start" and r["restart"] == restart + 1]
        assert resumed == [saved[0]["step"]] * 2 and resumed[0] > 0, (records, log)
    ends = [r for r in records if r["event"] == "end"]
    assert [(r["restart"], r["step"], r["signals"]) for r in ends] == [(2, 60, [])] * 2, (records, log)
    assert all(r["world"] == 2 for r in records)
    assert "requeueing job" in log and "SIGTERM: the job is ending" in log, log


def test_a_notice_before_the_ranks_start_requeues_and_a_finished_run_is_not_requeued(slurm_cluster, tmp_path):
    """A notice while the script sets up (here: a DSSLM_VENV whose activation takes 4 s) is answered
    with a requeue, without starting the ranks (before: SIGUSR1 killed the batch shell, the job
    ended FAILED and never came back). After the next notice rank 0 says `finished` in
    DSSLM_STATUS_FILE: the job is not requeued (before: any exit 0 after a notice was)."""
    (tmp_path / "gloo_probe.py").write_text(PROBE)
    probe_dir, venv = tmp_path / "probe", tmp_path / "slowvenv"
    probe_dir.mkdir()
    (venv / "bin").mkdir(parents=True)
    (venv / "bin" / "activate").write_text(
        f'if [[ "${{SLURM_RESTART_COUNT:-0}}" == 0 ]]; then touch {tmp_path}/activating; sleep 4; fi\n')
    env = {"DSSLM_MODULE": "gloo_probe", "PYTHONPATH": str(tmp_path), "PROBE_DIR": str(probe_dir),
           "PROBE_STEPS": "600", "PROBE_STATUS": "finished", "DSSLM_VENV": str(venv)}
    job_id = submit(slurm_cluster, tmp_path, [], env)
    wait_for(lambda: (tmp_path / "activating").exists(), 60, "the venv's activation")
    slurm_cluster.client(["scancel", "--signal=USR1", "--batch", str(job_id)])
    slurm_cluster.wait_job(job_id, lambda j: j["Restarts"] == "1", 60)
    wait_for(lambda: sum(r["event"] == "start" for r in probe_records(probe_dir)) == 2, 60, "both ranks' start")
    slurm_cluster.client(["scancel", "--signal=USR1", "--batch", str(job_id)])
    finish(slurm_cluster, tmp_path, job_id, restarts=1)

    records, log = probe_records(probe_dir), job_log(tmp_path, job_id)
    assert {(r["event"], r["restart"]) for r in records} == {("start", 1), ("saved", 1)}, (records, log)
    assert "SIGUSR1 before the ranks started" in log and "requeueing without starting them" in log, log
    assert "ranks exited with 0 (dsslm: finished)" in log and "end before the notice was answered" in log, log
    assert not (ROOT / "slurm" / "logs" / f".status-{job_id}").exists()


# The script alone: stand-ins for srun and scontrol, no cluster (and so no root), for what a real
# cluster cannot time.


def run_alone(tmp_path: Path, srun: str, env: dict[str, str] | None = None, slow_log_after_srun: bool = False,
              stand_ins: dict[str, str] | None = None, args: tuple[str, ...] = ()):
    """Run train.sbatch (with `args`) with `srun` standing in for srun (a bash body) and an scontrol
    that notes its arguments in tmp_path/scontrol (`stand_ins`: other bodies, scontrol's after the
    note); `slow_log_after_srun`: from the stand-in srun's start on, each log line of the script
    takes 0.5 s (its `date`). Returns (exit status, stdout, scontrol calls)."""
    import os
    import shutil
    import subprocess
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    stand_ins = stand_ins or {}
    stand_ins = {"srun": f"touch {tmp_path}/srun_started\n{srun}",
                 "scontrol": 'echo "$@" >>' + f" {tmp_path}/scontrol; " + stand_ins.get(
                     "scontrol", "[[ $1 == show ]] && echo node1; exit 0"),
                 **{name: body for name, body in stand_ins.items() if name != "scontrol"}}
    if slow_log_after_srun:
        stand_ins["date"] = f"[[ -e {tmp_path}/srun_started ]] && sleep 0.5; exec {shutil.which('date')} \"$@\""
    for name, body in stand_ins.items():
        (bin_dir / name).write_text(f"#!/bin/bash\n{body}\n")
        (bin_dir / name).chmod(0o755)
    env = {**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}", "SLURM_JOB_ID": "42",
           "SLURM_JOB_NODELIST": "node1", "DSSLM_ROOT": str(tmp_path), "DSSLM_NPROC_PER_NODE": "1", **(env or {})}
    done = subprocess.run(["bash", str(SBATCH), *args], env=env, capture_output=True, text=True, timeout=60)
    calls = (tmp_path / "scontrol").read_text() if (tmp_path / "scontrol").exists() else ""
    return done.returncode, done.stdout + done.stderr, calls


def test_srun_exiting_during_a_trap_is_reported_with_its_own_code(tmp_path):
    """`wait` returns 128+signal when a trap runs; srun ending while the trap runs was reported as
    that (143) instead of srun's code. srun here signals the batch shell and exits 7 while the
    trap's log line takes 0.5 s."""
    rc, out, calls = run_alone(tmp_path, "kill -TERM $PPID; sleep 0.1; exit 7", slow_log_after_srun=True)
    assert rc == 7 and "ranks exited with 7" in out and "SIGTERM: the job is ending" in out, (rc, out)
    assert "requeue" not in calls


def test_a_notice_during_setup_requeues_without_starting_srun(tmp_path):
    """The fast twin of the cluster test: a venv whose activation gets the notice (before: the
    batch shell died of SIGUSR1, exit 138, and was never requeued)."""
    (tmp_path / "venv" / "bin").mkdir(parents=True)
    (tmp_path / "venv" / "bin" / "activate").write_text("kill -USR1 $$\n")
    rc, out, calls = run_alone(tmp_path, "exit 0", {"DSSLM_VENV": str(tmp_path / "venv")})
    assert rc == 0 and "requeueing without starting them" in out and "requeue 42" in calls, (rc, out, calls)
    assert not (tmp_path / "srun_started").exists()


def test_a_sigterm_during_setup_ends_the_script_without_starting_srun(tmp_path):
    """With the traps first, a SIGTERM during setup (the job ending) only logged, and srun started
    ranks Slurm was about to kill mid-setup. Now the script ends with 143 and starts nothing."""
    (tmp_path / "venv" / "bin").mkdir(parents=True)
    (tmp_path / "venv" / "bin" / "activate").write_text("kill -TERM $$\n")
    rc, out, calls = run_alone(tmp_path, "exit 0", {"DSSLM_VENV": str(tmp_path / "venv")})
    assert rc == 143 and "not starting them" in out and "requeue" not in calls, (rc, out, calls)
    assert not (tmp_path / "srun_started").exists()


@pytest.mark.parametrize("status, requeued", [("finished", False), ("preempted", True), ("", True)])
def test_after_a_notice_only_a_preemption_save_is_requeued(tmp_path, status, requeued):
    """Rank 0's word in DSSLM_STATUS_FILE tells a save from the run's end, both exit 0; without one
    (an older dsslm) the job is requeued as before. (Before: a finished run was requeued too.)"""
    write = f'echo {status} >"$DSSLM_STATUS_FILE"; ' if status else ""
    rc, out, calls = run_alone(tmp_path, f"trap '' USR1; kill -USR1 $PPID; sleep 0.2; {write}exit 0")
    assert rc == 0 and ("requeue 42" in calls) == requeued, (out, calls)
    assert f"ranks exited with 0{f' (dsslm: {status})' if status else ''}\n" in out, out
    assert not list((tmp_path / "slurm" / "logs").glob(".status-*"))


@pytest.mark.parametrize("srun, requeued, said", [
    ("exit 75", True, "diagnosed a hang or a dead node"),
    ("exit 6", False, "exit 6 needs a person"),
    ("exit 2", False, "exit 2 needs a person"),
    # srun's one code may be a node's task that --kill-on-bad-exit killed: the caller's line decides.
    ('echo "hang 75" >"$DSSLM_STATUS_FILE"; exit 137', True, "diagnosed a hang or a dead node"),
    ('echo "hang 6" >"$DSSLM_STATUS_FILE"; exit 75', False, "exit 6 needs a person"),
    ("exit 1", False, "ranks exited with 1"),
    # Out of memory: requeued at half the micro-batch; at one sequence a micro-batch, a person's.
    ("exit 77", True, "ran out of memory"),
    ('echo "oom 77" >"$DSSLM_STATUS_FILE"; exit 137', True, "ran out of memory"),
    ('echo "oom 7" >"$DSSLM_STATUS_FILE"; exit 137', False, "exit 7 needs a person")])
def test_a_diagnosed_hang_is_requeued_and_a_crash_loop_never(tmp_path, srun, requeued, said):
    rc, out, calls = run_alone(tmp_path, srun)
    assert ("requeue 42" in calls) == requeued and said in out, (rc, out, calls)
    assert rc == (0 if requeued else int(said.split()[1]) if "needs a person" in said else 1), out


def run_with_node2_bad(tmp_path: Path, srun: str):
    """run_alone with the real exclude helper over a run.dir whose nodes.json names node2 bad (a full
    run.dir), sinfo listing node1 and node2 and scontrol showing a 1-node job with no exclusions."""
    from dsslm.health.nodes import write_nodes
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    write_nodes(run_dir, {"schema": 1, "time": time.time(), "stragglers": [], "nodes": {
        "node2": {"host": "node2", "slurm_node": None, "ranks": [1], "verdict": "bad", "checks": {},
                  "why": ["run.dir /r: 0.1 MB free, the next checkpoint needs 0.6 MB"]}}})
    show = 'if [[ $1 == -o ]]; then echo "JobId=42 Partition=debug NumNodes=1 ExcNodeList=(null)"; fi; exit 0'
    return run_alone(tmp_path, srun, {"DSSLM_PYTHON": PYTHON, "PYTHONPATH": str(ROOT)}, args=[f"run.dir={run_dir}"],
                     stand_ins={"scontrol": show, "sinfo": "echo 'node1 idle'; echo 'node2 comp'"})


def test_a_refused_node_is_requeued_and_left_out_of_the_requeue(tmp_path):
    """Exit 76 (or srun's other code with `bad_node 76` in the status file): requeued; dsslm.health.exclude
    decides before the requeue, and right after it (Slurm takes ExcNodeList only from a job no longer
    running) the script adds the node nodes.json names to the job's ExcNodeList, sinfo listing it
    and another node left for it."""
    rc, out, calls = run_with_node2_bad(tmp_path, 'echo "bad_node 76" >"$DSSLM_STATUS_FILE"; exit 137')
    assert rc == 0 and "requeueing elsewhere" in out, out
    assert "excluding node2 from this job's requeues until" in out and "0.1 MB free" in out, out
    lines = calls.splitlines()
    # Decided while the job still runs, set by the very next call after the requeue: deciding after
    # it (a Python start, scontrol, sinfo) lost the race under load, the job starting again on the
    # node being excluded before the update came.
    requeued = lines.index("requeue 42")
    assert lines.index("-o show job 42") < requeued and lines[requeued + 1] == "update job=42 ExcNodeList=node2", calls
    assert (tmp_path / "run" / "excluded_nodes.json").exists()


def test_an_expired_exclusion_is_lifted_by_the_requeue(tmp_path):
    """The record's only exclusion is past its `until`: the requeue empties the job's ExcNodeList
    (an empty list is a change too; it was once written as an empty file and never applied)."""
    import json
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (run_dir / "excluded_nodes.json").write_text(json.dumps({"nodes": {"node2": {
        "since": time.time() - 30 * 3600, "until": time.time() - 6 * 3600, "why": "full run.dir"}}}))
    show = 'if [[ $1 == -o ]]; then echo "JobId=42 Partition=debug NumNodes=1 ExcNodeList=node2"; fi; exit 0'
    rc, out, calls = run_alone(tmp_path, "exit 75", {"DSSLM_PYTHON": PYTHON, "PYTHONPATH": str(ROOT)},
                               args=[f"run.dir={run_dir}"],
                               stand_ins={"scontrol": show, "sinfo": "echo 'node1 idle'; echo 'node2 idle'"})
    lines = calls.splitlines()
    assert rc == 0 and lines[lines.index("requeue 42") + 1] == "update job=42 ExcNodeList=", (out, calls)


def test_a_preemption_is_requeued_before_its_bad_nodes_are_decided(tmp_path):
    """After a notice's save the requeue must not wait for a Python start: requeued first, the
    helper after it, its list set after that (what a preemption excludes is a straggler or an
    older record, never a node that just failed)."""
    rc, out, calls = run_with_node2_bad(
        tmp_path, 'trap "" USR1; kill -USR1 $PPID; sleep 0.2; echo preempted >"$DSSLM_STATUS_FILE"')
    lines = calls.splitlines()
    assert rc == 0 and "excluding node2 from this job's requeues until" in out, out
    requeued = lines.index("requeue 42")
    assert requeued < lines.index("-o show job 42") < lines.index("update job=42 ExcNodeList=node2"), calls


def test_the_scripts_exit_codes_are_dsslms():
    from dsslm.exits import EXIT_BAD_NODE, EXIT_OUT_OF_MEMORY, EXIT_REQUEUE, NEEDS_A_PERSON
    script = SBATCH.read_text()
    assert f"\nEXIT_REQUEUE={EXIT_REQUEUE}\n" in script and f"\nEXIT_BAD_NODE={EXIT_BAD_NODE}\n" in script
    assert f"\nEXIT_OUT_OF_MEMORY={EXIT_OUT_OF_MEMORY}\n" in script
    assert f'\nNEEDS_A_PERSON=" {" ".join(map(str, sorted(NEEDS_A_PERSON)))} "\n' in script


# dsslm.train under the launcher


def last_loss_per_step(run_dir: Path) -> dict[int, float]:
    """After a resume, steps after the checkpoint appear twice: the later record is the one kept."""
    losses: dict[int, float] = {}
    for record in read_jsonl(run_dir / "metrics.jsonl"):
        if "loss" in record:
            losses[record["step"]] = record["loss"]
    return losses


def events(run_dir: Path) -> list[dict]:
    return read_jsonl(run_dir / "events.jsonl")


def steps_logged(run_dir: Path) -> int:
    records = [r for r in read_jsonl(run_dir / "metrics.jsonl") if "loss" in r]
    return records[-1]["step"] if records else 0


def checkpoint_done(run_dir: Path, step: int) -> bool:
    return (run_dir / "checkpoints" / f"step-{step:08d}" / "MANIFEST").exists()


@pytest.fixture(scope="module")
def reference_run(slurm_cluster, tmp_path_factory) -> Path:
    """The uninterrupted job every interrupted one is compared with."""
    out_dir = tmp_path_factory.mktemp("reference")
    run_dir = out_dir / "run"
    job_id = submit(slurm_cluster, out_dir, [f"run.dir={run_dir}", *RUN_ARGS], {})
    finish(slurm_cluster, out_dir, job_id, restarts=0)
    return run_dir


def test_sbatch_trains_to_the_end(reference_run):
    losses = last_loss_per_step(reference_run)
    assert sorted(losses) == list(range(1, TOTAL_STEPS + 1))
    names = [e["event"] for e in events(reference_run)]
    assert names[0] == "start" and names[-1] == "end" and "resume" not in names, names
    start = events(reference_run)[0]
    assert start["world_size"] == 2 and start["engine"] == "ddp", start
    assert checkpoint_done(reference_run, TOTAL_STEPS)
    (log,) = [path.read_text() for path in reference_run.parent.glob("dsslm-*.out")]
    assert "ranks exited with 0 (dsslm: finished)" in log, log


def test_scontrol_requeue_resumes_bit_exact(slurm_cluster, reference_run, tmp_path):
    run_dir = tmp_path / "run"
    job_id = submit(slurm_cluster, tmp_path, [f"run.dir={run_dir}", *RUN_ARGS], {})
    wait_for(lambda: checkpoint_done(run_dir, CKPT_EVERY), JOB_TIMEOUT_S, f"checkpoint at step {CKPT_EVERY}")
    reached = steps_logged(run_dir)
    assert reached < TOTAL_STEPS - 10, f"run reached step {reached} before the requeue: too fast to test"
    slurm_cluster.client(["scontrol", "requeue", str(job_id)])
    finish(slurm_cluster, tmp_path, job_id, restarts=1)

    resumes = [e for e in events(run_dir) if e["event"] == "resume"]
    assert len(resumes) == 1, events(run_dir)
    assert [e["event"] for e in events(run_dir)][-1] == "end"
    assert last_loss_per_step(run_dir) == last_loss_per_step(reference_run)


def test_usr1_saves_at_the_step_reached_and_requeues(slurm_cluster, reference_run, tmp_path):
    run_dir = tmp_path / "run"
    job_id = submit(slurm_cluster, tmp_path, [f"run.dir={run_dir}", *RUN_ARGS], {})
    # Past the first step the trainer's handlers are installed; before, SIGUSR1 would kill a rank.
    wait_for(lambda: steps_logged(run_dir) >= 3, JOB_TIMEOUT_S, "third step")
    slurm_cluster.client(["scancel", "--signal=USR1", "--batch", str(job_id)])
    slurm_cluster.wait_job(job_id, lambda j: j["Restarts"] == "1", 60)
    # The first run is over: its save is the newest checkpoint, at the step it reached.
    run_events = events(run_dir)
    saved_step = max(int(p.name.split("-")[1]) for p in (run_dir / "checkpoints").glob("step-*")
                     if (p / "MANIFEST").exists())
    assert 3 <= saved_step < TOTAL_STEPS, run_events
    assert steps_logged(run_dir) == saved_step, run_events
    finish(slurm_cluster, tmp_path, job_id, restarts=1)

    resumes = [e for e in events(run_dir) if e["event"] == "resume"]
    assert len(resumes) == 1 and f"step-{saved_step:08d}" in json.dumps(resumes[0]), events(run_dir)
    log = job_log(tmp_path, job_id)
    assert "SIGUSR1: forwarding" in log and "(dsslm: preempted)" in log and "requeueing job" in log, log
    assert last_loss_per_step(run_dir) == last_loss_per_step(reference_run)
