"""Engines under the real loop (`python -m dsslm.train` in subprocesses, 2 gloo ranks).

One process with the whole global batch of 8 sequences is the reference curve; every 2-rank run
uses the same global batch (micro-batch 4, or 2 x 2 micro-batches), so fp32 losses agree to
rounding (observed: ~1e-7 relative; asserted: 1e-5).
"""
from __future__ import annotations

import functools
import os
import shutil
import subprocess
from pathlib import Path

import pytest

from helpers import PYTHON, ROOT, TINY, events, free_port, losses_by_step, run_train

pytestmark = pytest.mark.slow

STEPS = 20
COMMON = (f"train.total_steps={STEPS}", "ckpt.every=10", "optim.warmup_steps=5")
LAYOUT = {  # engine overrides -> per-rank batch layout giving a global batch of 8
    "ddp": ("engine.kind=ddp", "train.micro_batch_size=4"),
    "zero1": ("engine.kind=zero", "engine.zero_stage=1", "train.micro_batch_size=4"),
    "zero2": ("engine.kind=zero", "engine.zero_stage=2", "train.micro_batch_size=2", "train.grad_accum=2"),
    "zero3": ("engine.kind=zero", "engine.zero_stage=3", "train.micro_batch_size=4"),
    "fsdp": ("engine.kind=fsdp", "train.micro_batch_size=2", "train.grad_accum=2"),
}
ONE_PROCESS = ("engine.kind=ddp", "train.micro_batch_size=8")


def assert_curve(losses: dict[int, float], ref: dict[int, float], steps: range, rel: float = 1e-5) -> None:
    assert set(steps) <= set(losses), f"missing steps {sorted(set(steps) - set(losses))}"
    worst = max(abs(losses[s] - ref[s]) / ref[s] for s in steps)
    assert worst <= rel, f"worst relative loss difference {worst:.2e} > {rel}"


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """Run directories by engine name, trained once per module on first use."""
    base = tmp_path_factory.mktemp("engines")

    @functools.lru_cache(maxsize=None)
    def get(name: str) -> Path:
        run_dir = base / name
        if name == "one_process":
            run_train(run_dir, *COMMON, *ONE_PROCESS)
        else:
            run_train(run_dir, *COMMON, *LAYOUT[name], nproc=2)
        return run_dir
    return get


@pytest.mark.parametrize("name", ["ddp", "zero1", "zero2", "fsdp"])
def test_two_ranks_train_the_one_process_curve(runs, name):
    ref = losses_by_step(runs("one_process"))
    assert_curve(losses_by_step(runs(name)), ref, range(1, STEPS + 1))
    start = events(runs(name), "start")[0]
    n_params = events(runs("one_process"), "start")[0]["n_params"]
    assert (start["engine"], start["world_size"], start["n_params"]) == (name, 2, n_params)


def resume_from(source: Path, run_dir: Path, step: int) -> Path:
    """A fresh run.dir holding only `source`'s checkpoint at `step` (as after a crash)."""
    name = f"step-{step:08d}"
    shutil.copytree(source / "checkpoints" / name, run_dir / "checkpoints" / name)
    return run_dir


@pytest.mark.parametrize("target,nproc", [("fsdp", 2), ("one_process", 1)])
def test_zero1_checkpoint_resumes_under_another_engine(runs, tmp_path, target, nproc):
    """Weights and both moments come back bit-exact (fp32 safetensors), so the resumed curve is the
    uninterrupted ZeRO-1 curve up to reduction-order rounding (asserted 1e-5 relative)."""
    source = runs("zero1")
    run_dir = resume_from(source, tmp_path / target, 10)
    overrides = ONE_PROCESS if target == "one_process" else LAYOUT[target]
    run_train(run_dir, *COMMON, *overrides, nproc=nproc)
    assert events(run_dir, "resume")[0]["step"] == 10
    assert_curve(losses_by_step(run_dir), losses_by_step(source), range(11, STEPS + 1))


def test_zero3_trains_saves_and_resumes_after_a_kill(runs, tmp_path):
    run_dir = tmp_path / "zero3"
    killed = run_train(run_dir, *COMMON, *LAYOUT["zero3"], "faults.crash_at_step=13", nproc=2, check=False)
    assert killed.returncode != 0
    saved = sorted(p.name for p in (run_dir / "checkpoints").iterdir() if p.name.startswith("step-"))
    assert saved == ["step-00000000", "step-00000010"]  # the start checkpoint (a spike at step 1 can rewind)
    # Same command again: the kill fires once per run.dir, so this resumes from step 10.
    run_train(run_dir, *COMMON, *LAYOUT["zero3"], "faults.crash_at_step=13", nproc=2)
    assert events(run_dir, "resume")[0]["step"] == 10
    # The steps after 10 recomputed from the sharded checkpoint equal the killed job's, to the bit:
    # each rank's working partitions came from its own master fragments, none read whole.
    audit = events(run_dir, "resume_audit")[0]
    assert audit["verdict"] == "exact" and audit["compared"] >= 2, audit
    assert_curve(losses_by_step(run_dir), losses_by_step(runs("one_process")), range(1, STEPS + 1))


def test_two_node_torchrun_on_loopback(runs, tmp_path):
    """Two torchrun launchers (one per 'node', one process each) meet through c10d rendezvous."""
    run_dir = tmp_path / "multinode"
    port = free_port()
    env = {**os.environ, "DS_ACCELERATOR": "cpu", "OMP_NUM_THREADS": "1"}
    procs = [subprocess.Popen(
        [PYTHON, "-m", "torch.distributed.run", "--nnodes", "2", "--nproc_per_node", "1",
         "--rdzv_backend", "c10d", "--rdzv_endpoint", f"127.0.0.1:{port}", "--rdzv_id", "dsslm-test",
         "--node_rank", str(node), "-m", "dsslm.train", f"run.dir={run_dir}", *TINY, *COMMON, *LAYOUT["zero1"]],
        cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for node in (0, 1)]
    outputs = [p.communicate(timeout=600) for p in procs]
    for p, (_, err) in zip(procs, outputs):
        assert p.returncode == 0, err[-3000:]
    assert events(run_dir, "start")[0]["world_size"] == 2
    assert_curve(losses_by_step(run_dir), losses_by_step(runs("one_process")), range(1, STEPS + 1))


def test_accelerate_launch_use_deepspeed_selects_zero(runs, tmp_path):
    """`accelerate launch` with configs/accelerate/zero2.yaml runs ZeRO-2 although the config
    says engine.kind=ddp, and says so on stderr."""
    run_dir = tmp_path / "accelerate"
    cmd = [str(Path(PYTHON).parent / "accelerate"), "launch", "--config_file", "configs/accelerate/zero2.yaml",
           "--num_processes", "2", "--main_process_port", str(free_port()), "-m", "dsslm.train",
           f"run.dir={run_dir}", *TINY, *COMMON, *LAYOUT["ddp"]]
    env = {**os.environ, "DS_ACCELERATOR": "cpu", "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "engine.kind=zero engine.zero_stage=2 (accelerate launch --use_deepspeed)" in proc.stderr
    assert events(run_dir, "start")[0]["engine"] == "zero2"
    assert_curve(losses_by_step(run_dir), losses_by_step(runs("one_process")), range(1, STEPS + 1))


def test_accelerate_precision_mismatch_exits_2(tmp_path):
    run_dir = tmp_path / "mismatch"
    proc = run_train(run_dir, *COMMON, check=False, env={"ACCELERATE_MIXED_PRECISION": "bf16"})
    assert proc.returncode == 2
    assert "train.precision=bf16" in proc.stderr and len(proc.stderr.strip().splitlines()) == 1
    assert not (run_dir / "checkpoints").exists()


def test_accelerate_launch_of_2_processes_on_a_cpu_stops_at_once_with_the_command_that_runs_2(tmp_path):
    """Without a GPU, `accelerate launch --num_processes 2` starts one process (its single-process
    launcher): it trained alone and exited 0. Now exit 2 before anything is written, one line
    naming the command that starts 2, and that command trains on 2 ranks. (accelerate reports a
    process's failure as its own exit 1, naming the process's code.)"""
    run_dir = tmp_path / "run"
    accelerate = [str(Path(PYTHON).parent / "accelerate"), "launch"]
    script = ["-m", "dsslm.train", f"run.dir={run_dir}", *TINY, "train.total_steps=2", "optim.warmup_steps=1",
              "ckpt.every=2"]
    env = {**os.environ, "DS_ACCELERATOR": "cpu", "OMP_NUM_THREADS": "1", "HF_HOME": str(tmp_path / "hf")}
    port = ["--main_process_port", str(free_port())]
    proc = subprocess.run([*accelerate, "--num_processes", "2", *port, *script], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=300)
    said = [line for line in proc.stderr.splitlines() if line.startswith("dsslm")]
    assert "returned non-zero exit status 2" in proc.stderr and len(said) == 1, proc.stderr[-3000:]
    assert "accelerate launch --multi_gpu --num_processes N -m dsslm.train" in said[0]
    assert not run_dir.exists()
    proc = subprocess.run([*accelerate, "--multi_gpu", "--num_processes", "2", *port, *script], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert events(run_dir, "start")[0]["world_size"] == 2


ROLES = ("optim.lr_embedding=0.3", "optim.lr_scalars=3.0", "optim.lr_head=0.5", "model.tie_embeddings=false")


@pytest.mark.parametrize("name", ["zero2", "fsdp"])
def test_per_role_rates_train_the_one_process_curve_on_sharded_engines(tmp_path, name):
    """Each role's group at its own rate (4 AdamW groups) on 2 ranks whose engines flatten or shard
    the groups: the one process's curve to rounding, and the roles in the start event."""
    ref, run = tmp_path / "one", tmp_path / name
    run_train(ref, *COMMON, *ONE_PROCESS, *ROLES)
    run_train(run, *COMMON, *LAYOUT[name], *ROLES, nproc=2)
    assert_curve(losses_by_step(run), losses_by_step(ref), range(1, STEPS + 1))
    roles = events(run, "start")[0]["roles"]
    assert {r: roles[r]["lr_mult"] for r in roles} == {"embedding": 0.3, "hidden": 1.0, "head": 0.5, "scalars": 3.0}
    one_rate = tmp_path / "one-rate"  # the multipliers change the run: they reached the optimizer
    run_train(one_rate, *COMMON, *ONE_PROCESS, "model.tie_embeddings=false")
    assert losses_by_step(one_rate)[STEPS] != losses_by_step(ref)[STEPS]
