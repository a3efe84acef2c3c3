"""Step time and memory per engine at 2 ranks on CPU (gloo), same model, same global batch.

    python bench/bench_engines.py [--steps 20] [--d-model 128] [--layers 4] [--seq 64] [--batch 16]

Each engine runs in fresh spawned processes (a clean peak RSS): build the model, wrap it, train
`--warmup` untimed steps, then `--steps` timed ones. Reported per engine: median step time,
tokens/s, peak RSS per rank (ru_maxrss, includes the Python/torch/DeepSpeed imports, shown
separately as the RSS before the model was built), and the engine's own memory_report (bytes of
parameters, gradients and optimizer state this rank holds, measured from its tensors).
Collectives per step: every torch.distributed collective (and the functional collectives DTensor
uses, and DDP's gradient buckets through a counting comm hook) is wrapped here, in the benchmark,
and counted over the timed steps: what one optimizer step costs each engine in calls.
A bench, not a test: numbers on a shared 2-core machine are noisy; compare rows of one run.
"""
from __future__ import annotations

import argparse
import inspect
import os
import re
import resource
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
from _ranks import rank_env, run_ranks  # noqa: E402  (bench/ is the script's own folder)

ENGINES = [("ddp", 1, 1), ("ddp", 1, 2), ("zero", 1, 2), ("zero", 2, 2), ("zero", 3, 2), ("fsdp", 1, 2)]
COLLECTIVE = re.compile(r"^(all_reduce|all_gather|reduce_scatter|broadcast|barrier|all_to_all|reduce|gather|scatter|"
                        r"send|recv|isend|irecv)(_.*)?$")
FUNCTIONAL = ("all_reduce", "all_gather_tensor", "all_gather_single", "reduce_scatter_tensor", "reduce_scatter_single",
              "all_reduce_coalesced")


class CollectiveCounter:
    """Counts the collectives torch.distributed and DTensor's functional collectives are asked
    for while active: the outermost call only (broadcast_object_list is one, not its inner
    broadcasts), DDP's gradient buckets under their own name."""

    def __init__(self, engine) -> None:
        import torch.distributed as dist
        import torch.distributed._functional_collectives as funcol
        import torch.distributed.distributed_c10d as c10d
        self.counts: dict[str, int] = {}
        self.active, self.depth, self.label = False, 0, None
        wrapped: dict[int, object] = {}
        for module in (dist, c10d):  # the same functions under two names; c10d calls its own
            for name in dir(module):
                fn = getattr(module, name)
                if COLLECTIVE.match(name) and inspect.isfunction(fn):
                    wrapped.setdefault(id(fn), self._wrap(fn, name))
                    setattr(module, name, wrapped[id(fn)])
        for name in FUNCTIONAL:
            if hasattr(funcol, name):
                setattr(funcol, name, self._wrap(getattr(funcol, name), f"funcol.{name}"))
        ddp = getattr(engine, "wrapped", None)
        if ddp is not None and hasattr(ddp, "register_comm_hook"):
            from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook

            def hook(state, bucket):
                self.label = "ddp_bucket_all_reduce"
                try:
                    return allreduce_hook(state, bucket)
                finally:
                    self.label = None
            ddp.register_comm_hook(None, hook)

    def _wrap(self, fn, name: str):
        def counted(*args, **kwargs):
            if self.active and self.depth == 0:
                key = self.label or name
                self.counts[key] = self.counts.get(key, 0) + 1
            self.depth += 1
            try:
                return fn(*args, **kwargs)
            finally:
                self.depth -= 1
        return counted


def rss_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KiB on Linux


def worker(rank: int, world_size: int, port: int, kind: str, stage: int, args: argparse.Namespace, out) -> None:
    rank_env(rank, world_size, port)
    torch.set_num_threads(1)
    from dsslm.config import load
    from dsslm.engine import build_engine
    from dsslm.loss import accumulate
    from dsslm.model import build_model
    from dsslm.rng import seed_everything
    if kind == "zero":
        import deepspeed  # noqa: F401  (import cost belongs to the baseline, not the engine)
    base_rss = rss_mib()
    cfg = load(None, [f"model.d_model={args.d_model}", f"model.n_layers={args.layers}",
                      f"model.n_heads={args.heads}", f"model.seq_len={args.seq}", "model.vocab_size=256",
                      "train.precision=fp32", "train.device=cpu",
                      f"engine.kind={kind}", f"engine.zero_stage={stage}",
                      f"train.micro_batch_size={args.batch // world_size}", f"optim.name={args.optim}", *args.set])
    seed_everything(cfg.run.seed)
    engine = build_engine(cfg, build_model(cfg.model))
    gen = torch.Generator().manual_seed(0)
    per_rank = args.batch // world_size
    counter = CollectiveCounter(engine) if world_size > 1 else None
    times = []
    for step in range(args.warmup + args.steps):
        tokens = torch.randint(0, 256, (args.batch, args.seq + 1), generator=gen)
        mine = tokens[rank * per_rank:(rank + 1) * per_rank]
        if counter is not None:
            counter.active = step >= args.warmup
        started = time.perf_counter()
        accumulate(engine, [(mine[:, :-1], mine[:, 1:])], "fp32", cfg.train.z_loss, cfg.optim.clip,
                   args.batch * args.seq)
        engine.decide(lambda: "ok")  # the loop's verdict: rank 0 judges, every rank follows
        engine.step(1e-3)
        engine.barrier()
        if step >= args.warmup:
            times.append(time.perf_counter() - started)
    memory = engine.memory_report()
    per_step = {k: v / args.steps for k, v in counter.counts.items()} if counter is not None else {}
    engine.close()
    out.put({"rank": rank, "step_s": statistics.median(times), "base_rss": base_rss, "peak_rss": rss_mib(),
             "memory": memory, "n_params": engine.n_params, "collectives": per_step})


def run(kind: str, stage: int, world_size: int, args: argparse.Namespace) -> list[dict]:
    return run_ranks(worker, world_size, (kind, stage, args), timeout_s=1800)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--d-model", type=int, default=128)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--seq", type=int, default=64)
    parser.add_argument("--batch", type=int, default=16, help="global batch (sequences), split over ranks")
    parser.add_argument("--optim", choices=["adamw", "muon"], default="adamw",
                        help="muon: Muon's whole-matrix gathers (FSDP, ZeRO) show in the collectives")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                        help="a config override for every engine (e.g. optim.muon_distribute=false)")
    parser.add_argument("--engines", default="", help="comma-separated engine x ranks to run (e.g. ddpx2,zero3x2,fsdpx2); default all")
    args = parser.parse_args()
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    tokens = args.batch * args.seq
    header = (f"{'engine':<8} {'ranks':>5} {'step ms':>8} {'tok/s':>8} {'RSS base':>9} {'RSS peak':>9} "
              f"{'params':>9} {'master':>9} {'grads':>9} {'optim':>9}   (MiB; per rank, rank 0)")
    rows, calls = [], []
    chosen = set(filter(None, args.engines.split(",")))
    for kind, stage, world_size in ENGINES:
        if chosen and f"{f'zero{stage}' if kind == 'zero' else kind}x{world_size}" not in chosen:
            continue
        ranks = run(kind, stage, world_size, args)
        r0 = ranks[0]
        name = f"zero{stage}" if kind == "zero" else kind
        mem = {k: v / 2**20 for k, v in r0["memory"].items()}
        rows.append(f"{name:<8} {world_size:>5} {1000 * r0['step_s']:>8.1f} {tokens / r0['step_s']:>8.0f} "
                    f"{r0['base_rss']:>9.0f} {max(r['peak_rss'] for r in ranks):>9.0f} {mem['param_bytes']:>9.2f} "
                    f"{mem.get('master_bytes', 0):>9.2f} {mem['grad_bytes']:>9.2f} {mem['optim_bytes']:>9.2f}")
        print(rows[-1] if len(rows) > 1 else f"{ranks[0]['n_params']:,} parameters, {tokens} tokens/step\n"
              f"{header}\n{rows[-1]}", flush=True)
        calls.append((name, world_size, r0["collectives"]))
    print("\ncollectives per optimizer step (rank 0; the timed steps include engine.step and a barrier):")
    for name, world_size, per_step in calls:
        if world_size > 1:
            listed = ", ".join(f"{k} {v:g}" for k, v in sorted(per_step.items()))
            print(f"  {name:<6} {listed}")


if __name__ == "__main__":
    main()
