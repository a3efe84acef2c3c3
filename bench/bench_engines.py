"""Step time, memory and bytes on the wire per engine on CPU (gloo), same model, same global batch.

    python bench/bench_engines.py [--steps 20] [--d-model 128] [--layers 4] [--seq 64] [--batch 16]
    python bench/bench_engines.py --optim muon --engines zero3x8,fsdpx4 --steps 2 --warmup 1   # any engine x ranks
    python bench/bench_engines.py --extrapolate configs/1b.yaml --world 64   # Muon's bytes there, by its plan

Each engine runs in fresh spawned processes (a clean peak RSS): build the model, wrap it, train
`--warmup` untimed steps, then `--steps` timed ones. Reported per engine: median step time,
tokens/s, peak RSS per rank (ru_maxrss, includes the Python/torch/DeepSpeed imports, shown
separately as the RSS before the model was built), and the engine's own memory_report (bytes of
parameters, gradients and optimizer state this rank holds, measured from its tensors).
Collectives per step: every torch.distributed collective (and the functional collectives DTensor
uses, and DDP's gradient buckets through a counting comm hook) is wrapped here, in the benchmark,
and counted over the timed steps: what one optimizer step costs each engine in calls.
Bytes per step: what each collective moves per rank, counted in the same wrappers: all_to_all
exactly (its splits to and from the other ranks), the others by the ring algorithm's volume
(nccl-tests' bus bytes): all_reduce 2 (W-1)/W of the tensor each way, reduce_scatter (W-1)/W of
its input, all_gather (W-1) times its input; the small object collectives (the loop's verdict)
are counted as calls only. Muon's own (the collectives inside its step) are also shown apart,
with the reduce-scatter of the hidden matrices' fp32 gradients as the yardstick.
A bench, not a test: timings on a shared 2-core machine are noisy; compare rows of one run.
"""
from __future__ import annotations

import argparse
import inspect
import math
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


def _nbytes(t) -> int:
    if isinstance(t, (list, tuple)):
        return sum(_nbytes(x) for x in t)
    return t.numel() * t.element_size() if isinstance(t, torch.Tensor) else 0


def wire_bytes(name: str, fn, args: tuple, kwargs: dict, world: int, rank: int) -> tuple[int, int]:
    """(sent, received) bytes of one collective for this rank (see the module docstring)."""
    try:
        a = inspect.signature(fn).bind(*args, **kwargs).arguments
    except (TypeError, ValueError):
        return 0, 0
    first = next(iter(a.values()), None)
    name = name.removeprefix("funcol.")
    if name == "all_to_all_single":
        out, inp = a["output"], a["input"]
        recv_splits, send_splits = a.get("output_split_sizes"), a.get("input_split_sizes")
        row = inp.element_size() * (inp[0].numel() if inp.dim() > 1 else 1)
        mine_in = send_splits[rank] if send_splits else inp.shape[0] // world
        mine_out = recv_splits[rank] if recv_splits else out.shape[0] // world
        return _nbytes(inp) - mine_in * row, _nbytes(out) - mine_out * row
    if name.startswith("all_reduce"):
        n = 2 * (world - 1) * _nbytes(first) // world
    elif name.startswith("reduce_scatter"):
        source = a.get("input", a.get("input_list", first))
        n = (world - 1) * _nbytes(source) // world
    elif name.startswith("all_gather") and "object" not in name:
        source = a.get("tensor", a.get("input_tensor", first if name.startswith("all_gather_") else None))
        n = (world - 1) * _nbytes(source)
    elif name == "broadcast":
        return (_nbytes(first), 0) if a.get("src", 0) == rank else (0, _nbytes(first))
    else:
        return 0, 0
    return n, n


class CollectiveCounter:
    """Counts the collectives torch.distributed and DTensor's functional collectives are asked
    for while active: the outermost call only (broadcast_object_list is one, not its inner
    broadcasts), DDP's gradient buckets under their own name."""

    def __init__(self, engine) -> None:
        import torch.distributed as dist
        import torch.distributed._functional_collectives as funcol
        import torch.distributed.distributed_c10d as c10d
        self.counts: dict[str, int] = {}
        self.bytes: dict[str, list[int]] = {}  # name -> [sent, received], this rank
        self.world, self.rank = dist.get_world_size(), dist.get_rank()
        self.active, self.depth, self.label, self.prefix = False, 0, None, ""
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
                if self.active:
                    n = 2 * (self.world - 1) * _nbytes(bucket.buffer()) // self.world
                    self._add_bytes(self.label, n, n)
                try:
                    return allreduce_hook(state, bucket)
                finally:
                    self.label = None
            ddp.register_comm_hook(None, hook)

    def _add_bytes(self, key: str, sent: int, received: int) -> None:
        total = self.bytes.setdefault(key, [0, 0])
        total[0] += sent
        total[1] += received

    def label_muon(self, optimizer) -> None:
        """Name the collectives Muon's step makes `muon ...` (DeepSpeed calls ours inside its own)."""
        inner = optimizer.step

        def step(*args, **kwargs):
            self.prefix = "muon "
            try:
                return inner(*args, **kwargs)
            finally:
                self.prefix = ""
        optimizer.step = step

    def _wrap(self, fn, name: str):
        def counted(*args, **kwargs):
            if self.active and self.depth == 0:
                key = self.prefix + (self.label or name)
                self.counts[key] = self.counts.get(key, 0) + 1
                if self.label is None:
                    self._add_bytes(key, *wire_bytes(name, fn, args, kwargs, self.world, self.rank))
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
    muon = getattr(engine.optimizer, "optimizer", engine.optimizer)  # ZeRO wraps ours
    if counter is not None and hasattr(muon, "buffer_peak"):
        counter.label_muon(muon)
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
    wire = {k: [b / args.steps for b in v] for k, v in counter.bytes.items()} if counter is not None else {}
    hidden = sum(math.prod(s) for n, s in engine.param_shapes.items() if len(s) == 2 and n.startswith("blocks."))
    peak = getattr(muon, "buffer_peak", 0)
    engine.close()
    out.put({"rank": rank, "step_s": statistics.median(times), "base_rss": base_rss, "peak_rss": rss_mib(),
             "memory": memory, "n_params": engine.n_params, "collectives": per_step, "wire": wire,
             "hidden": hidden, "muon_peak": peak})


def run(kind: str, stage: int, world_size: int, args: argparse.Namespace) -> list[dict]:
    return run_ranks(worker, world_size, (kind, stage, args), timeout_s=1800)


def muon_plan_bytes(config: str | None, overrides: list[str], world: int, layout: str,
                    ns_bytes: int) -> tuple[int, int, int]:
    """(hidden elements, the most bytes any rank sends, the most it receives) in Muon's
    collectives per step, from MuonAdamW's own plan for `world` ranks: `layout` rows (FSDP's
    dim-0 shards) or flat (ZeRO-3's per-parameter partitions). Nothing is allocated (meta)."""
    from dsslm.config import load
    from dsslm.model import build_model
    from dsslm.muon import Fragment, MuonAdamW, Ranks
    from dsslm.optim import muon_groups
    cfg = load(config, [*overrides, "optim.name=muon"])
    cfg.model.vocab_size = cfg.model.vocab_size or 256  # the data's; Muon's matrices do not depend on it
    with torch.device("meta"):
        group = muon_groups(build_model(cfg.model), cfg.optim)[0]
    spans = {}
    for name, p in zip(group["names"], group["params"]):
        unit = p.shape[1] if layout == "rows" else 1  # FSDP cuts whole rows, torch.chunk's way
        per = -(-p.numel() // unit // world) * unit
        spans[name] = tuple((min(p.numel(), r * per), max(0, min(p.numel(), (r + 1) * per) - r * per))
                            for r in range(world))
    opt = MuonAdamW([group])
    opt.ranks = Ranks(0, world, None, None)
    opt.register([(p, [Fragment(n, tuple(p.shape), 0, *spans[n][0])]) for n, p in zip(group["names"], group["params"])],
                 spans)
    sent, received = [0] * world, [0] * world
    for bucket in opt._plan(group["params"]):
        for e in bucket:
            for r, (_, n) in enumerate(e.spans):
                if r != e.owner:  # r's piece to the owner in fp32, its part of the result back
                    sent[r] += 4 * n
                    received[e.owner] += 4 * n
                    sent[e.owner] += ns_bytes * n
                    received[r] += ns_bytes * n
    return sum(p.numel() for p in group["params"]), max(sent), max(received)


def extrapolate(args: argparse.Namespace) -> None:
    """Muon's bytes per rank per step at --world ranks for a config, against the all-reduce that
    made every matrix whole on every rank before, and the gradient reduce-scatter."""
    w = args.world
    for layout, engine in (("rows", "fsdp"), ("flat", "zero3")):
        for ns_bytes, dtype in ((2, "bf16 NS (GPU)"), (4, "fp32 NS")):
            hidden, sent, received = muon_plan_bytes(args.extrapolate, args.set, w, layout, ns_bytes)
            scatter = 4 * hidden * (w - 1) // w
            print(f"{engine} x{w}, {dtype}: {hidden / 1e9:.3f}B hidden elements; Muon per rank per step, the most any "
                  f"rank: sent {sent / 1e9:.3f} GB, received {received / 1e9:.3f} GB; all-reduce of them in fp32 "
                  f"(before) {2 * scatter / 1e9:.2f} GB each way; gradient reduce-scatter of them {scatter / 1e9:.2f} "
                  f"GB fp32, {scatter / 2e9:.2f} GB bf16; Muon / fp32 reduce-scatter {max(sent, received) / scatter:.4f}")


def parse_engines(text: str) -> list[tuple[str, int, int]]:
    """`ddpx2,zero3x8,fsdpx4` -> [(kind, stage, world)]; empty: ENGINES."""
    out = []
    for item in filter(None, text.split(",")):
        name, _, world = item.partition("x")
        kind, stage = ("zero", int(name[4:])) if name.startswith("zero") else (name, 1)
        out.append((kind, stage, int(world)))
    return out or ENGINES


def print_wire(name: str, world: int, ranks: list[dict], args: argparse.Namespace) -> None:
    """Bytes per rank per step: every collective, and Muon's own against the yardstick."""
    mib = 2 ** 20
    total = [max(sum(v[i] for v in r["wire"].values()) for r in ranks) for i in (0, 1)]
    muon = [max(sum(v[i] for k, v in r["wire"].items() if k.startswith("muon ")) for r in ranks) for i in (0, 1)]
    hidden = ranks[0]["hidden"]
    scatter = 4 * hidden * (world - 1) / world
    line = (f"  {name:<6} x{world}: all collectives sent {total[0] / mib:.3f} / received {total[1] / mib:.3f} MiB "
            f"(the most of any rank)")
    if args.optim == "muon":
        line += (f"; Muon's sent {muon[0] / mib:.3f} / received {muon[1] / mib:.3f} MiB = "
                 f"{max(muon) / scatter:.3f}x the hidden matrices' fp32 reduce-scatter ({scatter / mib:.3f} MiB); "
                 f"Muon's buffers at most {max(r['muon_peak'] for r in ranks) / mib:.3f} MiB")
        layout = {"fsdp": "rows", "zero3": "flat"}.get(name)
        if layout and not args.set:
            shape = [f"model.d_model={args.d_model}", f"model.n_layers={args.layers}", f"model.n_heads={args.heads}",
                     f"model.seq_len={args.seq}", "model.vocab_size=256", "optim.muon_ns_dtype=float32"]
            _, sent, received = muon_plan_bytes(None, shape, world, layout, 4)
            line += f"; the plan predicts {sent / mib:.3f} / {received / mib:.3f}"
    print(line, flush=True)


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
                        help="muon: Muon's collectives (FSDP, ZeRO, DDP's shared work) show apart")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                        help="a config override for every engine (e.g. optim.muon_distribute=false)")
    parser.add_argument("--engines", default="", help="comma-separated engine x ranks to run (e.g. ddpx2,zero3x8,fsdpx4); "
                                                      "default ddp x1 and every engine x2")
    parser.add_argument("--extrapolate", metavar="CONFIG", help="print Muon's bytes per rank per step for CONFIG at "
                                                                "--world ranks, from its plan, and exit")
    parser.add_argument("--world", type=int, default=64)
    args = parser.parse_args()
    if args.extrapolate:
        extrapolate(args)
        return
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    tokens = args.batch * args.seq
    header = (f"{'engine':<8} {'ranks':>5} {'step ms':>8} {'tok/s':>8} {'RSS base':>9} {'RSS peak':>9} "
              f"{'params':>9} {'master':>9} {'grads':>9} {'optim':>9}   (MiB; per rank, rank 0)")
    rows, calls = [], []
    for kind, stage, world_size in parse_engines(args.engines):
        ranks = run(kind, stage, world_size, args)
        r0 = ranks[0]
        name = f"zero{stage}" if kind == "zero" else kind
        mem = {k: v / 2**20 for k, v in r0["memory"].items()}
        rows.append(f"{name:<8} {world_size:>5} {1000 * r0['step_s']:>8.1f} {tokens / r0['step_s']:>8.0f} "
                    f"{r0['base_rss']:>9.0f} {max(r['peak_rss'] for r in ranks):>9.0f} {mem['param_bytes']:>9.2f} "
                    f"{mem.get('master_bytes', 0):>9.2f} {mem['grad_bytes']:>9.2f} {mem['optim_bytes']:>9.2f}")
        print(rows[-1] if len(rows) > 1 else f"{ranks[0]['n_params']:,} parameters, {tokens} tokens/step\n"
              f"{header}\n{rows[-1]}", flush=True)
        calls.append((name, world_size, ranks))
    print("\ncollectives per optimizer step (rank 0; the timed steps include engine.step and a barrier):")
    for name, world_size, ranks in calls:
        if world_size > 1:
            listed = ", ".join(f"{k} {v:g}" for k, v in sorted(ranks[0]["collectives"].items()))
            print(f"  {name:<6} x{world_size}: {listed}")
    print("\nbytes on the wire per rank per step:")
    for name, world_size, ranks in calls:
        if world_size > 1:
            print_wire(name, world_size, ranks, args)


if __name__ == "__main__":
    main()
