"""Host memory and time of one rewind point (monitor.rewind_every) on W gloo ranks (CPU): taking
it and restoring it, per rank, for a sharded engine (FSDP) and a replicated one (DDP).

    python bench/bench_rewind_points.py [--d-model 512] [--layers 8] [--ranks 2] [--engines fsdp ddp]

Each rank builds the model, trains one step (so AdamW's moments exist), then takes a point and
restores it through the Checkpointer as a rewind does. Peak RSS (ru_maxrss) is read before the
point, after taking it and after restoring it: the growth is what the point and its restore
cost on top of training's own peak (a point can fit in memory the step freed). `held_mb` is the
resident memory the point keeps (RSS after minus before). `restore` is the extra peak of the
restore over that. Run it from another checkout (PYTHONPATH) to compare
versions. Figures include allocator slack; other work on the machine skews the times.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import resource
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from _ranks import rank_env, run_ranks  # noqa: E402


def peak_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KiB on Linux


def rss_mb() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def worker(rank: int, world: int, port: int, engine_kind: str, d_model: int, layers: int, run: str, out) -> None:
    rank_env(rank, world, port)
    torch.set_num_threads(1)
    from dsslm.ckpt.resume import Checkpointer
    from dsslm.ckpt.store import CheckpointStore
    from dsslm.ckpt.train_state import TrainState
    from dsslm.config import load
    from dsslm.engine import build_engine
    from dsslm.loss import accumulate
    from dsslm.model import build_model
    from dsslm.recovery.rewind_points import RewindRing
    from dsslm.rng import seed_everything
    cfg = load(None, [f"model.d_model={d_model}", f"model.n_layers={layers}", "model.n_heads=8", "model.seq_len=64",
                      "train.precision=fp32", "train.device=cpu", f"engine.kind={engine_kind}",
                      "train.micro_batch_size=2", "train.total_steps=200"])
    cfg.model.vocab_size = 256
    seed_everything(0)
    engine = build_engine(cfg, build_model(cfg.model))
    tokens = torch.randint(0, 256, (2, 65), generator=torch.Generator().manual_seed(rank))
    accumulate(engine, [(tokens[:, :-1], tokens[:, 1:])], "fp32", 0.0, cfg.optim.clip, 2 * 64 * world)
    engine.step(1e-4)
    checkpointer = Checkpointer(engine, CheckpointStore(Path(run) / f"rank{rank}"), {"train": TrainState()}, {},
                                cfg, lambda *a, **k: None)
    ring = RewindRing(engine, checkpointer, every=1, capacity=1)
    torch.distributed.barrier()
    base, held = peak_mb(), rss_mb()
    t0 = time.perf_counter()
    ring.take(1)
    take_s, after_take, held = time.perf_counter() - t0, peak_mb(), rss_mb() - held
    torch.distributed.barrier()
    t0 = time.perf_counter()
    checkpointer.restore(ring.checkpoint(ring.newest(1)))
    restore_s, after_restore = time.perf_counter() - t0, peak_mb()
    out.put({"rank": rank, "params_m": round(sum(math.prod(s) for s in engine.param_shapes.values()) / 1e6, 1),
             "held_mb": round(held), "take_peak_mb": round(after_take - base),
             "restore_peak_mb": round(after_restore - after_take),
             "take_s": round(take_s, 3), "restore_s": round(restore_s, 3)})
    engine.close()


def launch(world: int, engine_kind: str, d_model: int, layers: int, run: str) -> list[dict]:
    return run_ranks(worker, world, (engine_kind, d_model, layers, run), timeout_s=1800)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--d-model", type=int, default=512)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--engines", nargs="+", default=["fsdp", "ddp"])
    args = parser.parse_args()
    import dsslm
    print(f"dsslm from {Path(dsslm.__file__).parent}; {os.cpu_count()} cores, load {os.getloadavg()[0]:.1f}; "
          f"state = 12 B x params (fp32 weight + two moments)", flush=True)
    for kind in args.engines:
        with tempfile.TemporaryDirectory(prefix="bench-rewind-") as run:
            ranks = launch(args.ranks, kind, args.d_model, args.layers, run)
        print(json.dumps({"engine": kind, "world": args.ranks, "params_m": ranks[0]["params_m"],
                          "state_mb": round(ranks[0]["params_m"] * 12e6 / 2**20),
                          "held_mb": [r["held_mb"] for r in ranks],
                          "take_peak_mb": [r["take_peak_mb"] for r in ranks],
                          "restore_peak_mb": [r["restore_peak_mb"] for r in ranks],
                          "take_s": [r["take_s"] for r in ranks], "restore_s": [r["restore_s"] for r in ranks]}),
              flush=True)


if __name__ == "__main__":
    main()
