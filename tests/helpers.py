"""The one helpers module (`from helpers import ...`): the tiny config, the 2-process gloo harness
that returns each rank's result, dsslm.train in a subprocess, and readers of a run's files."""
from __future__ import annotations

import hashlib
import json
import os
import shutil
import queue
import socket
import subprocess
import sys
import textwrap
import time
import traceback
from pathlib import Path
from typing import Any, Callable

import pytest
import torch
import torch.multiprocessing as mp

from dsslm.config import Config, load

ROOT = Path(__file__).resolve().parent.parent
PYTHON = sys.executable

# Small enough to train hundreds of steps in seconds on 2 cores; real text (stdlib source). The
# Llama block and GPT-2's init that the tests' expectations (parameter names, exports, monitor
# thresholds) were written for: tiny.yaml's QK-norm and init_std 0.05 have tests of their own.
LLAMA_GPT2_INIT = ["model.qk_norm=false", "model.init_std=0.02"]
TINY = ["model.d_model=32", "model.n_layers=2", "model.n_heads=2", "model.seq_len=32",
        "train.micro_batch_size=4", "train.precision=fp32", "run.val_every=0", "run.tensorboard=false",
        "optim.warmup_steps=5", "train.device=cpu", *LLAMA_GPT2_INIT]


@pytest.fixture(autouse=True)
def one_thread():
    """Autouse where a test module imports it: runs that small spin-wait on a second thread of a
    shared 2-core machine far more than they compute."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def tiny_cfg(run_dir: Path, *overrides: str) -> Config:
    """The tiny test config for a run in `run_dir`, with dotted overrides applied last."""
    return load(None, [f"run.dir={run_dir}", *TINY, *overrides])


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(rank: int, world_size: int, port: int, fn: Callable, args: tuple, out: Any) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      LOCAL_RANK=str(rank), WORLD_SIZE=str(world_size), DS_ACCELERATOR="cpu")
    try:
        out.put((rank, "ok", fn(rank, world_size, *args)))
    except BaseException:
        out.put((rank, "error", traceback.format_exc()))
        raise


def run_distributed(fn: Callable, world_size: int = 2, args: tuple = (), timeout_s: int = 300) -> list:
    """Run fn(rank, world_size, *args) on `world_size` spawned processes; return results by rank.

    fn must be importable (module level) and may create its own process group through the
    environment set here (dsslm engines do). A rank that raises or dies fails the call at once,
    with its traceback, instead of leaving the others to time out.
    """
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_worker, args=(r, world_size, port, fn, args, out)) for r in range(world_size)]
    for p in procs:
        p.start()
    results: dict[int, Any] = {}
    deadline = time.monotonic() + timeout_s
    try:
        while len(results) < world_size:
            try:
                rank, status, value = out.get(timeout=1.0)
            except queue.Empty:
                dead = [(r, p.exitcode) for r, p in enumerate(procs) if p.exitcode not in (None, 0) and r not in results]
                if dead:
                    raise AssertionError(f"rank {dead[0][0]} died with exit code {dead[0][1]} before returning") from None
                if time.monotonic() > deadline:
                    raise AssertionError(f"ranks {sorted(set(range(world_size)) - set(results))} gave no result "
                                         f"within {timeout_s}s") from None
                continue
            if status == "error":
                raise AssertionError(f"rank {rank} raised:\n{value}")
            results[rank] = value
        for p in procs:
            p.join(timeout=60)
            assert p.exitcode == 0, f"rank process exited with {p.exitcode}"
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
                p.join(timeout=10)
    return [results[r] for r in range(world_size)]


def train_cmd(nproc: int = 1) -> list[str]:
    if nproc == 1:
        return [PYTHON, "-m", "dsslm.train"]
    return [PYTHON, "-m", "torch.distributed.run", "--nproc_per_node", str(nproc),
            "--master_port", str(free_port()), "-m", "dsslm.train"]


def run_train(run_dir: Path, *overrides: str, nproc: int = 1, check: bool = True,
              timeout_s: int = 600, env: dict | None = None) -> subprocess.CompletedProcess:
    """Train in a subprocess (a fresh interpreter, as a user would) and return the result."""
    cmd = train_cmd(nproc) + [f"run.dir={run_dir}", *TINY, *overrides]
    full_env = {**os.environ, "DS_ACCELERATOR": "cpu", "OMP_NUM_THREADS": "1", **(env or {})}
    proc = subprocess.run(cmd, cwd=ROOT, env=full_env, capture_output=True, text=True, timeout=timeout_s)
    if check and proc.returncode != 0:
        raise AssertionError(f"train exited {proc.returncode}\n{proc.stderr[-4000:]}")
    return proc


def start_train(run_dir: Path, *overrides: str, env: dict | None = None) -> subprocess.Popen:
    """run_train's command, started in the background (pipes for stdout and stderr)."""
    full_env = {**os.environ, "DS_ACCELERATOR": "cpu", "OMP_NUM_THREADS": "1", **(env or {})}
    return subprocess.Popen(train_cmd() + [f"run.dir={run_dir}", *TINY, *overrides], cwd=ROOT, env=full_env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


# A process that stops process argv[1] (SIGSTOP) for 0.1 s of every 0.2 s, argv[2] times, or with
# 0 until that process exits (this one is then handed to another parent): the stall drills.
STOPPER = """
import os, signal, sys, time
pid, stops = int(sys.argv[1]), int(sys.argv[2])
done = 0
while os.getppid() == pid and (stops == 0 or done < stops):
    os.kill(pid, signal.SIGSTOP)
    try:
        time.sleep(0.1)
    finally:
        os.kill(pid, signal.SIGCONT)
    time.sleep(0.1)
    done += 1
"""


def hook_env(folder: Path, code: str) -> dict:
    """Environment for a subprocess whose interpreter runs `code` first, from a sitecustomize.py on
    PYTHONPATH: how a test patches a real `python -m dsslm.train` (or each torchrun rank of one)."""
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "sitecustomize.py").write_text(textwrap.dedent(code))
    # ROOT too: sitecustomize runs before `-m` puts the working directory on sys.path, so without it
    # an `import dsslm` there would find the installed copy, not this checkout's.
    paths = [str(folder), str(ROOT), os.environ.get("PYTHONPATH", "")]
    return {"PYTHONPATH": os.pathsep.join(filter(None, paths))}


def stdlib_sources(folder: Path, budget: int = 30_000) -> Path:
    """About `budget` bytes of stdlib source into `folder`, one document (module) per file, each
    2-8 KB: a small code corpus built locally, the same files on every machine with this Python."""
    folder.mkdir(parents=True, exist_ok=True)
    total = 0
    for path in sorted(Path(os.__file__).parent.glob("*.py")):
        text = path.read_text(errors="replace")
        if 2_000 < len(text) < 8_000:
            (folder / path.name).write_text(text)
            total += len(text)
        if total > budget:
            break
    return folder


def read_jsonl(path: Path) -> list[dict]:
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def losses_by_step(run_dir: Path) -> dict[int, float]:
    """Each step's loss as finally trained (a later record of a step replaces an earlier one)."""
    return {r["step"]: r["loss"] for r in read_jsonl(run_dir / "metrics.jsonl") if "loss" in r}


def events(run_dir: Path, name: str | None = None) -> list[dict]:
    records = read_jsonl(run_dir / "events.jsonl")
    return [r for r in records if name is None or r["event"] == name]


def remanifest(folder: Path) -> None:
    """Recompute a checkpoint folder's MANIFEST so every hash matches its (edited) files: how a
    test makes a checkpoint that an older dsslm, or an attacker, could have written."""
    manifest = json.loads((folder / "MANIFEST").read_text())
    manifest["files"] = {p.name: {"sha256": hashlib.sha256(p.read_bytes()).hexdigest(), "size": p.stat().st_size}
                         for p in sorted(folder.iterdir()) if p.name != "MANIFEST"}
    (folder / "MANIFEST").write_text(json.dumps(manifest))


def copy_run_back_to(run_dir: Path, dest: Path, step: int) -> Path:
    """A copy of `run_dir` at `dest` whose checkpoints after `step` are gone (so it resumes from
    `step`); returns that checkpoint's folder."""
    shutil.copytree(run_dir, dest)
    for folder in (dest / "checkpoints").glob("step-*"):
        if int(folder.name.split("-")[1]) > step:
            shutil.rmtree(folder)
    return dest / "checkpoints" / f"step-{step:08d}"


def capture_a_spike(run_dir: Path) -> list:
    """One spike captured by rank 0's forensics into run_dir/spikes/step-00000051/ (a batch of 4
    sequences of 8 byte tokens, loss 5.0, grad norm 9.0); returns the events it emitted."""
    import types

    import numpy as np

    from dsslm.data.stream import StepSlice
    from dsslm.recovery.forensics import Forensics
    engine = types.SimpleNamespace(is_main=True, all_gather=lambda obj: [obj], grad_norms=lambda: {"norm.weight": 1.0})
    emitted: list = []
    forensics = Forensics(Config(), engine, run_dir, {"kind": "bytes"}, lambda e, **f: emitted.append((e, f)))
    inputs, targets = torch.randint(0, 256, (4, 8)), torch.randint(0, 256, (4, 8))
    result = types.SimpleNamespace(loss=5.0, gnorm=9.0, sequence_ce=[torch.full((4,), 40.0)])
    fed = StepSlice(first=800, end=804, batch_size=4, indices=np.arange(800, 804))
    forensics.capture(51, fed, [(inputs, targets)], result, "skip_step", "loss z=9", {"losses": []})
    return emitted
