"""Framework overhead: train() against a bare loop of the same model, in one process, alternating.

The bare loop does forward, backward, clip, AdamW step on pre-built batches and nothing else.
train() adds the loader, token-weighted accumulation, the monitor, metrics.jsonl and the
checkpoint checks. Shape: nanoGPT's CPU recipe (4 layers, 4 heads, d 128, context 64, batch 12,
fp32, one process).

Then the watchdog's share of it: the progress reports a train() step makes (counted in a run),
each timed alone (a million calls), as a fraction of train()'s step (goal < 0.5%).

Then the nodes' (docs/nodes.md): the straggler report's cost a step at the default interval (50)
on 2 gloo ranks of this machine, its every-step part (a step counted, the engine's update timed)
and a report (the all-gather, rank 0's verdict and metrics line) timed apart, as a fraction of
train()'s step (goal < 0.5%); and the check before the first step (run.preflight) on one process
and on 2 ranks (goal < 10 s).

    .venv/bin/python bench/bench_overhead.py [--steps 300] [--rounds 3] [--only-nodes]
"""
from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # this checkout, not an installed dsslm
sys.path.insert(0, str(Path(__file__).resolve().parent))  # _ranks
from _ranks import rank_env, run_ranks  # noqa: E402
from dsslm.config import load  # noqa: E402
from dsslm.data.corpus import default_data_dir  # noqa: E402
from dsslm.data.loader import Loader  # noqa: E402
from dsslm.model import build_model  # noqa: E402
from dsslm.observe.sinks import Sinks  # noqa: E402
from dsslm.health.stragglers import Stragglers  # noqa: E402
from dsslm.health.progress import COLLECTIVE, DATA, FORWARD_BACKWARD, OPTIMIZER, Progress  # noqa: E402
from dsslm.optim import build_adamw  # noqa: E402
from dsslm.train import train  # noqa: E402

SHAPE = ["model.d_model=128", "model.n_layers=4", "model.n_heads=4", "model.seq_len=64",
         "train.micro_batch_size=12", "train.grad_accum=1", "train.precision=fp32", "train.device=cpu",
         "run.val_every=0", "run.tensorboard=false", "train.z_loss=0"]


def bare_loop(cfg, steps: int) -> tuple[float, float]:
    """Wall and CPU seconds per step of the minimal loop."""
    torch.manual_seed(cfg.run.seed)
    model = build_model(cfg.model)
    opt = build_adamw(model, cfg.optim, torch.device("cpu"))
    loader = Loader(default_data_dir(), cfg.model.seq_len, cfg.run.seed)
    size = cfg.train.micro_batch_size
    batches = [loader.step(s * size, [], size, 0, 1, 1)[1][0] for s in range(steps)]
    started, cpu = time.perf_counter(), time.process_time()
    for inputs, targets in batches:
        logits = model(inputs)
        loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), targets.flatten())
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.optim.clip)
        opt.step()
        opt.zero_grad(set_to_none=True)
        loss.item()  # the loss a loop logs: one host read, as train() makes
    return (time.perf_counter() - started) / steps, (time.process_time() - cpu) / steps


def framework_loop(overrides: list[str], steps: int, monkeypatch_emit) -> tuple[float, float]:
    """Wall and CPU seconds per step of train(), from its start event to its end event (setup
    excluded); the clocks are read by a wrapper around Sinks.emit, here in the benchmark."""
    marks: dict[str, tuple[float, float]] = {}
    with tempfile.TemporaryDirectory() as tmp, monkeypatch_emit(marks):
        cfg = load(None, overrides + [f"run.dir={tmp}", f"train.total_steps={steps}",
                                      f"ckpt.every={steps}", "optim.warmup_steps=10"])
        train(cfg)
    (wall0, cpu0), (wall1, cpu1) = marks["start"], marks["end"]
    return (wall1 - wall0) / steps, (cpu1 - cpu0) / steps


class emit_clocks:
    """Context manager: Sinks.emit also records (wall, CPU) clocks at the start and end events."""

    def __init__(self, marks: dict):
        self.marks, self.original = marks, Sinks.emit

    def __enter__(self):
        original, marks = self.original, self.marks

        def emit(sinks, event, **fields):
            if event in ("start", "end"):
                marks[event] = (time.perf_counter(), time.process_time())
            return original(sinks, event, **fields)
        Sinks.emit = emit
        return self

    def __exit__(self, *exc):
        Sinks.emit = self.original


def report_ns(calls: int = 1_000_000) -> float:
    """Nanoseconds per Progress.report, a step's four phases in turn (timed steps: the learning path)."""
    progress = Progress()
    progress.first_step = -5
    phases = (DATA, FORWARD_BACKWARD, COLLECTIVE, OPTIMIZER)
    started = time.perf_counter()
    for step in range(calls // len(phases)):
        for phase in phases:
            progress.report(step, phase)
    return (time.perf_counter() - started) / calls * 1e9


def reports_per_step(steps: int) -> float:
    """Progress.report calls per train() step, counted in a run (setup's and the end's included)."""
    calls, original = [0], Progress.report

    def counted(self, step, phase, work=None):
        calls[0] += 1
        return original(self, step, phase, work)
    Progress.report = counted
    try:
        with tempfile.TemporaryDirectory() as tmp:
            train(load(None, SHAPE + [f"run.dir={tmp}", f"train.total_steps={steps}", f"ckpt.every={steps}",
                                      "optim.warmup_steps=5"]))
    finally:
        Progress.report = original
    return calls[0] / steps


def every_step_ns(calls: int = 200_000) -> float:
    """Nanoseconds a step of the straggler report between reports: after_step counting the step and
    the timing wrapper around the engine's update (an update that does nothing)."""
    class Engine:
        world_size, is_main = 2, True

        def step(self, lr):
            pass
    engine = Engine()
    report = Stragglers(load(None, []).observe.stragglers, engine, Progress(), None, Path("."), None)
    report.after_step(1)  # the job's first step: the window starts
    started = time.perf_counter()
    for step in range(2, calls + 2):
        engine.step(0.1)
        report.after_step(step * 50 + 1)  # never a report step
    return (time.perf_counter() - started) / calls * 1e9


def _ranks(rank: int, world: int, port: int, every: int, reports: int, out) -> None:
    """One rank: the check before the first step, then `reports` straggler reports (their time)."""
    rank_env(rank, world, port)
    import torch.distributed as dist
    from dsslm.data.corpus import default_data_dir
    from dsslm.data.manifest import load_manifest
    from dsslm.engine import build_engine
    from dsslm.health.nodecheck import check_nodes
    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory() as tmp:
        cfg = load(None, SHAPE + [f"run.dir={tmp}"])
        cfg.model.vocab_size = 257
        engine = build_engine(cfg, build_model(cfg.model))
        data_dir = default_data_dir()
        started = time.perf_counter()
        check_nodes(cfg, engine, data_dir, load_manifest(data_dir, verify=False))
        preflight_s = time.perf_counter() - started
        sinks = Sinks(Path(tmp), engine.is_main, 100, False)
        progress = Progress()
        report = Stragglers(cfg.observe.stragglers, engine, progress, sinks, Path(tmp), None)
        report.after_step(0)
        took = []
        for step in range(1, reports * every + 1):
            progress.report(step, DATA)
            progress.report(step, OPTIMIZER)
            if step % every == 0:
                engine.barrier()
                began = time.perf_counter()
                report.after_step(step)
                took.append(time.perf_counter() - began)
            else:
                report.after_step(step)
        sinks.close()
        engine.close()
        if dist.is_initialized():
            dist.destroy_process_group()
    out.put({"rank": rank, "preflight_s": preflight_s, "report_s": statistics.median(took)})


def nodes_figures(step_s: float | None) -> None:
    every = load(None, []).observe.stragglers.every
    ns = every_step_ns()
    with tempfile.TemporaryDirectory() as tmp:
        cfg = load(None, SHAPE + [f"run.dir={tmp}"])
        cfg.model.vocab_size = 257
        from dsslm.data.corpus import default_data_dir
        from dsslm.data.manifest import load_manifest
        from dsslm.engine import build_engine
        from dsslm.health.nodecheck import check_nodes
        engine = build_engine(cfg, build_model(cfg.model))
        started = time.perf_counter()
        check_nodes(cfg, engine, default_data_dir(), load_manifest(default_data_dir(), verify=False))
        one = time.perf_counter() - started
        engine.close()
    ranks = run_ranks(_ranks, 2, (every, 20))
    report_s = max(r["report_s"] for r in ranks)
    print(f"preflight : {one:.3f} s on one process, {max(r['preflight_s'] for r in ranks):.3f} s on 2 ranks "
          f"(goal < 10 s)")
    per_step = ns * 1e-9 + report_s / every
    line = (f"stragglers: {ns:.0f} ns every step + a report of {report_s * 1e3:.2f} ms (2 gloo ranks, median of 20) "
            f"every {every} steps = {per_step * 1e6:.1f} us a step")
    if step_s:
        line += f", {100 * per_step / step_s:.4f}% of train()'s step of {step_s * 1e3:.1f} ms (goal < 0.5%)"
    print(line)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--only-nodes", action="store_true", help="only the nodes' figures (no step time)")
    args = parser.parse_args()
    if args.only_nodes:
        nodes_figures(None)
        return
    cfg = load(None, SHAPE)
    cfg.model.vocab_size = 257
    tokens_per_step = cfg.train.micro_batch_size * cfg.model.seq_len
    bare, framework = [], []
    for _ in range(args.rounds):
        bare.append(bare_loop(cfg, args.steps))
        framework.append(framework_loop(SHAPE, args.steps, emit_clocks))
    print(f"torch threads {torch.get_num_threads()}, {args.steps} steps x {args.rounds} rounds, "
          f"{tokens_per_step} tokens/step")
    for name, rounds in (("bare loop", bare), ("train()", framework)):
        wall, cpu = statistics.median(r[0] for r in rounds), statistics.median(r[1] for r in rounds)
        print(f"{name:10s}: {wall * 1e3:7.2f} ms/step wall  {tokens_per_step / wall:9,.0f} tokens/s  "
              f"{cpu * 1e3:7.2f} ms CPU  (all wall: {', '.join(f'{r[0] * 1e3:.2f}' for r in rounds)})")
    over_wall = statistics.median(f[0] / b[0] - 1 for f, b in zip(framework, bare))
    over_cpu = statistics.median(f[1] / b[1] - 1 for f, b in zip(framework, bare))
    print(f"overhead  : {100 * over_wall:+.2f}% wall, {100 * over_cpu:+.2f}% CPU (median of per-round ratios; "
          f"target <= 3%)")
    per_step, ns = reports_per_step(min(args.steps, 50)), report_ns()
    step_s = statistics.median(r[0] for r in framework)
    print(f"watchdog  : {per_step:.2f} progress reports per step x {ns:.0f} ns = {per_step * ns / 1e3:.2f} us, "
          f"{100 * per_step * ns * 1e-9 / step_s:.4f}% of train()'s step (goal < 0.5%)")
    nodes_figures(step_s)


if __name__ == "__main__":
    main()
