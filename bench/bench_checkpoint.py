"""Checkpoint save cost at ~50M parameters (weights + two fp32 Adam moments, ~600 MB).

    python bench/bench_checkpoint.py [--params-m 50] [--dir /tmp] [--repeats 3]

Prints (a) synchronous save time, (b) the training-thread stall inside save_async while a
simulated training loop keeps doing matmuls, as a % of (a), (c) save throughput against a plain
sequential write + fsync of the same bytes to the same disk, and resume (load_latest) time.
Disks are shared and noisy: each figure is the median of --repeats runs.
"""
from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from dsslm.ckpt.store import CheckpointStore  # noqa: E402

D_MODEL = 1024


def make_state(params_m: float) -> dict:
    """Square 1024x1024 matrices until params_m million parameters, plus Adam's two moments."""
    n_mats = max(1, round(params_m * 1e6 / D_MODEL**2))
    model = {f"layers.{i}.weight": torch.randn(D_MODEL, D_MODEL) for i in range(n_mats)}
    optim = {f"{kind}.{name}": torch.rand_like(t) for kind in ("exp_avg", "exp_avg_sq") for name, t in model.items()}
    return {"model": model, "optim": optim}


def nbytes(tensors: dict) -> int:
    return sum(t.numel() * t.element_size() for group in tensors.values() for t in group.values())


def plain_write(tensors: dict, path: Path) -> float:
    """The floor: the same bytes, one file, sequential write() then fsync, no hashing."""
    start = time.perf_counter()
    with open(path, "wb") as f:
        for group in tensors.values():
            for t in group.values():
                f.write(memoryview(t.reshape(-1).view(torch.uint8).numpy()))
        f.flush()
        os.fsync(f.fileno())
    seconds = time.perf_counter() - start
    path.unlink()
    return seconds


def train_step(a: torch.Tensor, b: torch.Tensor) -> None:
    for _ in range(4):
        a = a @ b


def async_run(mgr: CheckpointStore, step: int, tensors: dict, a, b) -> tuple[float, float, float]:
    """(stall_s inside save_async, mean step time while saving, mean step time before)."""
    before = []
    for _ in range(10):
        start = time.perf_counter()
        train_step(a, b)
        before.append(time.perf_counter() - start)
    start = time.perf_counter()
    mgr.save_async(step, tensors, {"step": step, "skip_list": []})
    stall = time.perf_counter() - start
    during = []
    while mgr.in_flight:
        start = time.perf_counter()
        train_step(a, b)
        for t in tensors["optim"].values():  # the optimizer touching live state, as it would
            t.mul_(1.0)
            break
        during.append(time.perf_counter() - start)
    mgr.wait()
    return stall, statistics.mean(during or [0.0]), statistics.mean(before)


def measure_saves(mgr: CheckpointStore, tensors: dict, run: Path, repeats: int, size_mb: float) -> None:
    """(a) sync save, (b) async stall, (c) save vs plain write; interleaved, so each repeat's
    figures see the same disk and CPU weather."""
    start = time.perf_counter()
    mgr.save(0, tensors, {"step": 0})
    first = time.perf_counter() - start
    a, b = torch.randn(512, 512), torch.randn(512, 512)
    sync, plain, runs = [], [], []
    for i in range(repeats):
        start = time.perf_counter()
        mgr.save(2 * i + 1, tensors, {"step": 2 * i + 1})
        sync.append(time.perf_counter() - start)
        plain.append(plain_write(tensors, run / "plain.bin"))
        runs.append(async_run(mgr, 2 * i + 2, tensors, a, b))
    sync_s, plain_s = statistics.median(sync), statistics.median(plain)
    print(f"(a) sync save: median {sync_s:.2f} s of {[round(s, 2) for s in sync]}"
          f"  (first save, host buffers allocated: {first:.2f} s)")
    stall_s = statistics.median(r[0] for r in runs)
    slow = statistics.median(r[1] / r[2] for r in runs)
    print(f"(b) async stall inside save_async: median {stall_s * 1e3:.1f} ms of "
          f"{[round(r[0] * 1e3, 1) for r in runs]} = {100 * stall_s / sync_s:.1f}% of a sync save "
          f"(target <= 5%); training steps {slow:.2f}x slower while the writer runs")
    ratio = statistics.median(p / s for p, s in zip(plain, sync))
    print(f"(c) throughput: checkpoint save {size_mb / sync_s:.0f} MB/s vs plain write+fsync "
          f"{size_mb / plain_s:.0f} MB/s (median {plain_s:.2f} s of {[round(s, 2) for s in plain]}); "
          f"median paired ratio {ratio:.2f} of plain speed")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--params-m", type=float, default=50.0)
    parser.add_argument("--dir", default=tempfile.gettempdir())
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    torch.manual_seed(0)
    tensors = make_state(args.params_m)
    size_mb = nbytes(tensors) / 1e6
    n_params = sum(t.numel() for t in tensors["model"].values())
    run = Path(tempfile.mkdtemp(prefix="bench-ckpt-", dir=args.dir))
    print(f"{n_params / 1e6:.1f}M params, {size_mb:.0f} MB to save (model + 2 fp32 moments), run dir {run}, "
          f"{os.cpu_count()} cores, load average {os.getloadavg()[0]:.1f} (other work skews every figure)")
    mgr = CheckpointStore(run, keep_last=2)
    measure_saves(mgr, tensors, run, args.repeats, size_mb)
    loads = []
    for _ in range(args.repeats):
        start = time.perf_counter()
        ckpt = CheckpointStore(run).load_latest()  # fresh manager: full verify + load
        loads.append(time.perf_counter() - start)
        del ckpt
    print(f"resume: load_latest (sha256 verify + load_file) median {statistics.median(loads):.2f} s "
          f"of {[round(s, 2) for s in loads]} (files likely in page cache)")
    mgr.close()
    shutil.rmtree(run)


if __name__ == "__main__":
    main()
