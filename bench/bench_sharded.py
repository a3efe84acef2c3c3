"""Gathered against sharded checkpoints on W gloo ranks (CPU): save wall time, the stall inside
an async save, peak RSS per rank at save and at load, bytes read per rank at load.

    python bench/bench_sharded.py [--params-m 100] [--ranks 1 2 4] [--dir /tmp]

The state is what a sharded engine holds: 1024x1024 fp32 matrices to --params-m million
parameters plus two moments (12 bytes a parameter). Sharded: each rank holds 1/W of it (its rows,
`engine.state.rows_of`), writes it through `CheckpointStore.save_shard_async` and reads back only
its rows through `TensorReader` after hashing its share of the folder. Gathered: rank 0 holds the
full state (what a gather hands it) and writes it; at load rank 0 hashes the folder and every rank
reads every tensor (the pre-sharding path). Each phase runs in fresh processes, so ru_maxrss is
that phase's peak. The figures include the interpreter and torch (~0.3 GB a process).
"""
from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import sys
import tempfile
import time
import zlib
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from _ranks import rank_env, run_ranks  # noqa: E402
from dsslm.ckpt.format import invalid_reason, load_verified, read_manifest  # noqa: E402
from dsslm.ckpt.shards import open_folder, split_files, verify_share  # noqa: E402
from dsslm.ckpt.store import CheckpointStore  # noqa: E402
from dsslm.engine.ranks import Exchange  # noqa: E402
from dsslm.engine.state import Shard, rows_of  # noqa: E402

D = 1024
KINDS = ("model", "optim/exp_avg", "optim/exp_avg_sq")


def peak_gb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1e6  # KiB on Linux


def keys(params_m: float) -> list[str]:
    n = max(1, round(params_m * 1e6 / D**2))
    return [f"{kind}/layers.{i}.weight" for kind in KINDS for i in range(n)]


def my_rows(key: str, rank: int, world: int) -> torch.Tensor:
    """This rank's rows of tensor `key`, made deterministically (so no rank ever holds the rest)."""
    start, end = rows_of((D, D), rank, world)
    g = torch.Generator().manual_seed(zlib.crc32(key.encode()))
    return torch.rand(end - start, generator=g)


def worker(rank: int, world: int, port: int, phase: str, fmt: str, params_m: float, run: str, out) -> None:
    rank_env(rank, world, port)
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=timedelta(seconds=1800))
    run_dir = Path(run)
    store = CheckpointStore(run_dir, keep_last=1)
    result: dict = {"rank": rank}
    if phase == "save":
        if fmt == "sharded":
            shards = []
            for key in keys(params_m):
                start, end = rows_of((D, D), rank, world)
                shards.append(Shard(key, (D, D), start, end, my_rows(key, rank, world)))
        else:  # rank 0 holds the gathered state, the others nothing
            shards = [Shard(k, (D, D), 0, D * D, torch.rand(D * D)) for k in keys(params_m)] if rank == 0 else []
        dist.barrier()
        start = time.perf_counter()
        if fmt == "sharded":
            tmp = [store.make_tmp(1) if rank == 0 else None]
            dist.broadcast_object_list(tmp, src=0)
            exchange = Exchange(dist.PrefixStore(f"bench/{tmp[0]}/", dist.distributed_c10d._get_default_store()),
                                world)
            t0 = time.perf_counter()
            store.save_shard_async(1, tmp[0], rank, world, shards, {}, exchange,
                                   {"step": 1, "world_size": world} if rank == 0 else None)
            result["stall_s"] = time.perf_counter() - t0
            store.wait()
        elif rank == 0:
            tensors = {"model": {}, "optim": {}}
            for s in shards:
                group, _, name = s.key.partition("/")
                tensors[group][name] = s.tensor.reshape(D, D)
            t0 = time.perf_counter()
            store.save_async(1, tensors, {"step": 1})
            result["stall_s"] = time.perf_counter() - t0
            store.wait()
        dist.barrier()
        result["save_s"] = time.perf_counter() - start
    else:
        folder = run_dir / "checkpoints" / "step-00000001"
        dist.barrier()
        start = time.perf_counter()
        files = read_manifest(folder)["files"]
        if fmt == "sharded":
            mine = split_files(files, world)[rank]
            verify_share(folder, files, mine)
            reader = open_folder(folder, files).reader
            held = []
            for key in keys(params_m):
                held.append(reader.read(key, *rows_of((D, D), rank, world)))
            result["bytes_read"] = reader.bytes_read + sum(files[n]["size"] for n in mine)
        else:
            if rank == 0:
                assert invalid_reason(folder) is None  # rank 0 hashes everything
            dist.barrier()
            ckpt = load_verified(folder)  # every rank reads everything
            # touched, as a restore does (safetensors maps the file; untouched pages cost no RSS)
            held = [t.clone() for group in ckpt.tensors.values() for t in group.values()]
            result["bytes_read"] = sum(f["size"] for f in files.values()) * (1 + (rank == 0))
            del ckpt, held
        dist.barrier()
        result["load_s"] = time.perf_counter() - start
    result["peak_rss_gb"] = round(peak_gb(), 3)
    out.put(result)
    dist.destroy_process_group()


def launch(world: int, phase: str, fmt: str, params_m: float, run: str) -> list[dict]:
    return run_ranks(worker, world, (phase, fmt, params_m, run))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--params-m", type=float, default=100.0)
    parser.add_argument("--ranks", type=int, nargs="+", default=[1, 2, 4])
    parser.add_argument("--dir", default=tempfile.gettempdir())
    parser.add_argument("--formats", nargs="+", default=["gathered", "sharded"])
    args = parser.parse_args()
    size_gb = len(keys(args.params_m)) * D * D * 4 / 1e9
    print(f"{args.params_m:.0f}M params, {size_gb:.2f} GB of state, {os.cpu_count()} cores, load average "
          f"{os.getloadavg()[0]:.1f} (other work skews every figure)")
    for world in args.ranks:
        for fmt in args.formats:
            run = tempfile.mkdtemp(prefix="bench-sharded-", dir=args.dir)
            save = launch(world, "save", fmt, args.params_m, run)
            load = launch(world, "load", fmt, args.params_m, run)
            print(json.dumps({"world": world, "format": fmt,
                              "save_s": round(max(r["save_s"] for r in save), 2),
                              "stall_s_rank0": round(save[0]["stall_s"], 3) if "stall_s" in save[0] else None,
                              "save_peak_rss_gb": [r["peak_rss_gb"] for r in save],
                              "load_s": round(max(r["load_s"] for r in load), 2),
                              "load_peak_rss_gb": [r["peak_rss_gb"] for r in load],
                              "load_gb_read": [round(r["bytes_read"] / 1e9, 3) for r in load]}), flush=True)
            shutil.rmtree(run)


if __name__ == "__main__":
    main()
