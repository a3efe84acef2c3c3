"""W spawned gloo ranks for the benchmarks that measure one process per rank (fresh processes:
a clean peak RSS). `target(rank, world, port, *args, out)` puts one dict with its "rank" on
`out`; a rank that exits with an error ends the run at once instead of leaving the caller to
wait out the timeout."""
from __future__ import annotations

import os
import queue
import socket
import time
from typing import Callable

import torch.multiprocessing as mp


def rank_env(rank: int, world: int, port: int) -> None:
    """The environment a launcher gives rank `rank` of `world` on this host (CPU, gloo)."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), LOCAL_RANK=str(rank),
                      WORLD_SIZE=str(world), LOCAL_WORLD_SIZE=str(world), DS_ACCELERATOR="cpu")


def run_ranks(target: Callable, world: int, args: tuple, timeout_s: float = 3600) -> list[dict]:
    """Each rank's result, by rank."""
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    procs = [ctx.Process(target=target, args=(r, world, port, *args, out)) for r in range(world)]
    for p in procs:
        p.start()
    results, deadline = [], time.monotonic() + timeout_s
    while len(results) < world:
        try:
            results.append(out.get(timeout=5))
        except queue.Empty:
            dead = [p.exitcode for p in procs if p.exitcode not in (None, 0)]
            if dead or time.monotonic() > deadline:
                for p in procs:
                    p.kill()
                raise SystemExit(f"a rank exited with code {dead[0]}; its traceback is above" if dead
                                 else f"no result within {timeout_s:.0f} s") from None
    for p in procs:
        p.join()
    return sorted(results, key=lambda r: r["rank"])
