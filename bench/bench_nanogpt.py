"""dsslm against nanoGPT on nanoGPT's own CPU recipe, side by side on this machine.

    .venv/bin/python bench/bench_nanogpt.py --nanogpt ~/src/nanoGPT [--text input.txt] [--pairs 3]

Shape (nanoGPT's README, "I only have a macbook"): 4 layers, 4 heads, d 128, context 64, batch 12,
fp32, one process, no compile, lr 1e-3 -> 1e-4 cosine over 2000 iterations, warmup 100, beta2
0.99, dropout 0; dsslm's SwiGLU 344 wide, nanoGPT's MLP parameter count (FFN_MATCHED). Both
trainers read the same tokens: the text as bytes, prepared once by
`dsslm.data prepare` (byte tokenizer, 10% validation), and nanoGPT's train.bin / val.bin /
meta.pkl written from those very shards (vocabulary 257 for both). Nothing of nanoGPT is
modified: its train.py runs from a scratch folder (bench/out/nanogpt/) holding its configurator
and the data, with its own config file and the recipe's flags.

1. Throughput: `--pairs` pairs of runs of `--iters` iterations, alternating nanoGPT and dsslm,
   each trainer as its user runs it (dsslm with its defaults: spike monitor, diagnostics every
   50 steps, metrics.jsonl, TensorBoard when installed, a checkpoint at the end). Per run:
   loop time per iteration (nanoGPT: the mean of its printed per-iteration times after the
   first; dsslm: from its start event to its end event, over the steps), and CPU time per
   iteration (the process's user + system time between iteration 1 and the last: with
   `--threads 1` it hardly moves with other processes' load, where wall time does). Medians
   over pairs.
2. Time to a validation loss of `--target` (1.88: nanoGPT's documented CPU result at 2000
   iterations): one full `--max-iters` run each, evaluating every `--eval-every` iterations
   (nanoGPT: its own estimate on 20 random batches of train and val; dsslm: its first 20 val
   batches). Reported: the first evaluation at or under the target, its wall time from the first
   training iteration (each trainer's own evaluations included) and steps x median step time
   (training only, the comparable figure). `--ds-max-iters N` gives dsslm a horizon of its own:
   its cosine reaches min_lr at N and the run ends there (nanoGPT keeps `--max-iters`; run
   nanoGPT at a shorter `--max-iters` too to see what the horizon alone buys it).
   `--ds-recipe defaults` runs dsslm with its own defaults (configs/tiny.yaml: its rates, warmup,
   beta2, init and QK-norm) in place of nanoGPT's optimizer settings, in nanoGPT's shape.

3. With `--muon-lr X`: a third time-to-loss run, dsslm with `optim.name=muon` (Muon at X for the
   hidden matrices, AdamW at the recipe's rate for the rest).
4. With `--sweep`: steps to the target for dsslm under AdamW and Muon at `--adamw-lrs` and
   `--muon-lrs`, `--seeds` seeds each; a run stops at its first evaluation at or under the target
   (steps do not depend on the machine's load, wall time does). `--pairs 0 --max-iters 0 --sweep`
   runs the sweep alone.

A benchmark, not a test: on a shared machine every figure moves with the load; the load
average is printed before and after each run.
"""
from __future__ import annotations

import argparse
import json
import os
import pickle
import re
import shutil
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
OUT = ROOT / "bench" / "out"
SHAPE = {"n_layer": 4, "n_head": 4, "n_embd": 128, "block_size": 64, "batch_size": 12}
# dsslm's SwiGLU at nanoGPT's MLP size: 3 x 128 x 344 = 132,096 weights a layer against nanoGPT's
# 2 x 128 x 512 = 131,072. dsslm's default width rounds 8d/3 up to a multiple of 64 (384 here:
# 12% more MLP weights and about 8% more FLOPs a step than nanoGPT's model). `--ds-set
# model.ffn_hidden=384` runs the default.
FFN_MATCHED = 344
RECIPE = {"lr": 1e-3, "min_lr": 1e-4, "warmup": 100, "beta2": 0.99}
NANOGPT_ITER = re.compile(r"^iter (\d+): loss ([\d.]+), time ([\d.]+)ms")
NANOGPT_EVAL = re.compile(r"^step (\d+): train loss ([\d.]+), val loss ([\d.]+)")


def load() -> str:
    return " ".join(f"{x:.2f}" for x in os.getloadavg())


def prepare_data(text: Path) -> tuple[Path, Path]:
    """dsslm's DATA_DIR for the text and nanoGPT's copy of the same tokens."""
    sys.path.insert(0, str(ROOT))
    from dsslm.data import prepare
    data_dir = OUT / "nanogpt_bench_data"
    if not (data_dir / "manifest.json").exists():
        prepare([text], data_dir, tokenizer="byte", val_fraction=0.1)
    manifest = json.loads((data_dir / "manifest.json").read_text())
    ng_data = OUT / "nanogpt" / "data" / "dsslm_bytes"
    ng_data.mkdir(parents=True, exist_ok=True)
    for split in ("train", "val"):
        shards = [np.fromfile(data_dir / e["path"], dtype=manifest["dtype"])
                  for e in manifest["domains"]["default"][split]]
        np.concatenate(shards).astype(np.uint16).tofile(ng_data / f"{split}.bin")
    with open(ng_data / "meta.pkl", "wb") as f:  # nanoGPT reads its vocabulary size from here
        pickle.dump({"vocab_size": manifest["tokenizer"]["vocab_size"]}, f)
    return data_dir, ng_data


def cpu_s(pid: int) -> float:
    """User + system CPU seconds of process `pid` so far (every thread): the load-robust measure."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def env(threads: int | None) -> dict:
    # Unbuffered, so each line arrives (and is timed) when printed, not when a pipe buffer fills.
    out = {**os.environ, "DS_ACCELERATOR": "cpu", "PYTHONUNBUFFERED": "1"}
    if threads:
        out["OMP_NUM_THREADS"] = str(threads)
    return out


def run_streaming(cmd: list[str], cwd: Path, env_vars: dict, on_line, started=None, stopped=None) -> None:
    """Run `cmd`, calling on_line(line, wall_time, pid) for each stdout line as it arrives. A run
    killed because `stopped()` says it reached what it ran for is not a failure."""
    proc = subprocess.Popen(cmd, cwd=cwd, env=env_vars, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    if started is not None:
        started(proc.pid)
    for line in proc.stdout:
        on_line(line.rstrip("\n"), time.time(), proc.pid)
    if proc.wait() != 0 and not (stopped and stopped()):
        raise SystemExit(f"{cmd[:3]} exited {proc.returncode}")


def nanogpt(nanogpt_dir: Path, iters: int, eval_every: int, eval_iters: int, threads: int | None,
            compile_on: bool = False) -> dict:
    scratch = OUT / "nanogpt"
    link = scratch / "configurator.py"
    if not link.exists():
        link.symlink_to(nanogpt_dir / "configurator.py")
    cmd = [sys.executable, str(nanogpt_dir / "train.py"), str(nanogpt_dir / "config" / "train_shakespeare_char.py"),
           "--device=cpu", f"--compile={compile_on}", f"--eval_iters={eval_iters}", "--log_interval=1",
           f"--block_size={SHAPE['block_size']}", f"--batch_size={SHAPE['batch_size']}",
           f"--n_layer={SHAPE['n_layer']}", f"--n_head={SHAPE['n_head']}", f"--n_embd={SHAPE['n_embd']}",
           f"--max_iters={iters}",
           f"--lr_decay_iters={iters}", "--dropout=0.0", "--dataset=dsslm_bytes", f"--eval_interval={eval_every}",
           f"--out_dir={scratch / 'out'}"]
    iter_ms, evals, first, cpu = {}, [], [], {}
    skip = 10 if compile_on else 1  # iterations left out of the timing (compiled: recompilations)

    def on_line(line: str, now: float, pid: int) -> None:
        if (m := NANOGPT_ITER.match(line)):
            iter_ms[int(m[1])] = float(m[3])
            if int(m[1]) in (skip - 1, iters):  # nanoGPT runs iterations 0..max_iters
                cpu[int(m[1])] = cpu_s(pid)
            if int(m[1]) == 0:
                first.append(now - float(m[3]) / 1000)  # the start of the first training iteration
        elif (m := NANOGPT_EVAL.match(line)):
            evals.append((int(m[1]), float(m[3]), now))
    run_streaming(cmd, scratch, env(threads), on_line)
    steady = [ms for i, ms in iter_ms.items() if i >= skip and not any(i == s for s, _, _ in evals)]
    return {"loop_ms": statistics.mean(steady), "median_ms": statistics.median(steady),
            "cpu_ms": 1000 * (cpu[iters] - cpu[skip - 1]) / (iters - skip + 1),
            "evals": [(s, v, t - first[0]) for s, v, t in evals if s > 0]}


def dsslm(data_dir: Path | str, run_dir: Path, iters: int, eval_every: int, threads: int | None,
          compile_on: bool = False, extra: tuple[str, ...] = (), stop_at: float | None = None) -> dict:
    """One dsslm run; `stop_at`: killed at its first validation loss at or under it (the sweep)."""
    overrides = [f"run.dir={run_dir}", "data.dir=" + (str(data_dir) or "''"), "model.d_model=128", "model.n_layers=4",
                 "model.n_heads=4", "model.seq_len=64", f"model.ffn_hidden={FFN_MATCHED}", "train.micro_batch_size=12",
                 "train.grad_accum=1",
                 "train.precision=fp32", "train.device=cpu", f"train.total_steps={iters}",
                 f"optim.peak_lr={RECIPE['lr']}", f"optim.min_lr={RECIPE['min_lr']}",
                 f"optim.warmup_steps={RECIPE['warmup']}", f"optim.beta2={RECIPE['beta2']}", "model.dropout=0.0",
                 f"run.val_every={eval_every}", "run.val_batches=20", f"ckpt.every={iters}",
                 f"train.compile={str(compile_on).lower()}", *extra]
    shutil.rmtree(run_dir, ignore_errors=True)  # a fresh run, not a resume of the last one
    evals: list[tuple[int, float, float]] = []
    seen: set[int] = set()
    metrics = run_dir / "metrics.jsonl"
    skip = 10 if compile_on else 1
    cpu: dict[int, float] = {}
    pids: list[int] = []

    def watch(stop: threading.Event) -> None:
        """dsslm prints no per-step line: follow metrics.jsonl as it is written (every 20 ms), for
        the val losses and the process's CPU time after steps `skip` and `iters`. Only the new
        complete lines are parsed: this thread shares the machine with the run it measures."""
        pos, partial = 0, ""
        while not stop.is_set():
            if metrics.exists():
                with open(metrics) as f:
                    f.seek(pos)
                    chunk = f.read()
                    pos = f.tell()
                *lines, partial = (partial + chunk).split("\n")
            else:
                lines = []
            for line in lines:
                record = json.loads(line) if line.strip() else {}
                if "step_time_s" in record:
                    for mark in (skip, iters):
                        if mark not in cpu and record["step"] == mark and pids:
                            cpu[mark] = cpu_s(pids[0])
                if "val_loss" in record and record["step"] not in seen:
                    seen.add(record["step"])
                    val = record["val_loss"]  # per domain; the embedded corpus has two (code, tests)
                    evals.append((record["step"], val.get("default", statistics.fmean(val.values())), time.time()))
                    if stop_at is not None and evals[-1][1] <= stop_at and pids:
                        os.kill(pids[0], 9)  # the sweep needs the step it got there, nothing after
                        return
            stop.wait(0.02)
    stop = threading.Event()
    watcher = threading.Thread(target=watch, args=(stop,), daemon=True)
    watcher.start()
    run_streaming([sys.executable, "-m", "dsslm.train", *overrides], ROOT, env(threads),
                  lambda line, now, pid: None, started=pids.append, stopped=lambda: stop_at is not None)
    stop.set()
    watcher.join()
    if stop_at is not None:
        return {"evals": evals}
    events = {e["event"]: e["time"] for e in map(json.loads, (run_dir / "events.jsonl").read_text().splitlines())}
    steps = [json.loads(line) for line in metrics.read_text().splitlines() if '"step_time_s"' in line]
    if compile_on:  # the compilation is in the first steps: time the loop from step 10 on
        loop_ms = 1000 * sum(r["step_time_s"] for r in steps[10:]) / len(steps[10:])
    else:
        loop_ms = 1000 * (events["end"] - events["start"]) / iters
    cpu_ms = 1000 * (cpu[iters] - cpu[skip]) / (iters - skip) if len(cpu) == 2 else float("nan")
    return {"loop_ms": loop_ms, "cpu_ms": cpu_ms,
            "median_ms": 1000 * statistics.median(r["step_time_s"] for r in steps),
            "evals": [(s, v, t - events["start"]) for s, v, t in evals]}


def own_recipe() -> list[str]:
    """configs/tiny.yaml's optimizer settings as overrides of the ones RECIPE sets (nanoGPT's)."""
    sys.path.insert(0, str(ROOT))
    from dsslm.config import load as load_config
    optim = load_config(None, []).optim
    return [f"optim.peak_lr={optim.peak_lr:g}", f"optim.min_lr={optim.min_lr:g}",
            f"optim.warmup_steps={optim.warmup_steps}", f"optim.beta2={optim.beta2:g}"]


def first_under(evals: list, target: float):
    return next(((s, v, t) for s, v, t in evals if v <= target), None)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--nanogpt", type=Path, help="a nanoGPT checkout (train.py, model.py, ...); not needed by "
                                                     "--pairs 0 --max-iters 0 --sweep")
    parser.add_argument("--text", type=Path, default=OUT / "shakespeare.txt",
                        help="tinyshakespeare's input.txt, or bench/shakespeare_text.py's stand-in")
    parser.add_argument("--pairs", type=int, default=3)
    parser.add_argument("--iters", type=int, default=300, help="iterations per throughput run")
    parser.add_argument("--max-iters", type=int, default=2000, help="the time-to-loss run (0: skip it)")
    parser.add_argument("--ds-max-iters", type=int, default=None,
                        help="dsslm's own horizon in the time-to-loss runs (its cosine ends there); default --max-iters")
    parser.add_argument("--ds-set", action="append", default=[], metavar="KEY=VALUE",
                        help="a dsslm override for the time-to-loss runs and the sweep (e.g. optim.peak_lr=2e-3)")
    parser.add_argument("--ds-recipe", choices=["nanogpt", "defaults"], default="nanogpt",
                        help="dsslm's optimizer settings in the time-to-loss runs and the sweep: nanoGPT's recipe "
                             "(lr 1e-3 -> 1e-4, warmup 100, beta2 0.99) or dsslm's own defaults (configs/tiny.yaml)")
    parser.add_argument("--eval-every", type=int, default=100)
    parser.add_argument("--target", type=float, default=1.88)
    parser.add_argument("--threads", type=int, default=None, help="OMP_NUM_THREADS for both (default: torch's)")
    parser.add_argument("--muon-lr", type=float, default=None, help="also time dsslm with Muon at this rate")
    parser.add_argument("--sweep", action="store_true", help="steps to the target over learning rates and seeds")
    parser.add_argument("--adamw-lrs", default="5e-4,1e-3,2e-3")
    parser.add_argument("--muon-lrs", default="0.01,0.02,0.04")
    parser.add_argument("--seeds", type=int, default=3)
    parser.add_argument("--corpus", choices=["text", "embedded"], default="text",
                        help="the sweep's data: --text, or dsslm's embedded stdlib corpus (val: the mean of its domains)")
    parser.add_argument("--compile", action="store_true",
                        help="both compiled (nanoGPT --compile=True, dsslm train.compile=true); the recipe is eager")
    args = parser.parse_args()
    needs_nanogpt = args.pairs > 0 or args.max_iters > 0
    if (needs_nanogpt and not (args.nanogpt and (args.nanogpt / "train.py").is_file())) or not args.text.is_file():
        raise SystemExit(f"need {args.nanogpt or '--nanogpt'}/train.py and {args.text}; see this script's docstring")
    data_dir, _ = prepare_data(args.text)
    if args.ds_recipe == "defaults":  # tiny.yaml's optimizer in place of nanoGPT's; its model settings apply anyway
        args.ds_set[:0] = own_recipe()
        print(f"dsslm: its own defaults {' '.join(args.ds_set)}")
    tokens = SHAPE["batch_size"] * SHAPE["block_size"]
    print(f"text {args.text} ({args.text.stat().st_size:,} bytes), {tokens} tokens/iteration, threads "
          f"{args.threads or 'default'}, {'compiled' if args.compile else 'eager (the recipe)'}")
    if args.sweep:
        sweep(data_dir if args.corpus == "text" else "", args)
    pairs = []
    for i in range(args.pairs):
        before = load()
        ng = nanogpt(args.nanogpt, args.iters, 10 ** 9, 1, args.threads, args.compile)
        ds = dsslm(data_dir, OUT / "runs" / f"throughput-{i}", args.iters, 0, args.threads, args.compile)
        pairs.append((ng, ds))
        print(f"pair {i}: nanoGPT {ng['loop_ms']:.2f} ms/iter wall (median step {ng['median_ms']:.2f}, CPU "
              f"{ng['cpu_ms']:.2f}), dsslm {ds['loop_ms']:.2f} ms/iter wall (median step {ds['median_ms']:.2f}, CPU "
              f"{ds['cpu_ms']:.2f}); ratio wall {ng['loop_ms'] / ds['loop_ms']:.3f}, CPU "
              f"{ng['cpu_ms'] / ds['cpu_ms']:.3f}; load {before} -> {load()}", flush=True)
    if not pairs:
        return to_loss(data_dir, args)
    ng_ms = statistics.median(p[0]["loop_ms"] for p in pairs)
    ds_ms = statistics.median(p[1]["loop_ms"] for p in pairs)
    ratios = [p[0]["loop_ms"] / p[1]["loop_ms"] for p in pairs]
    cpu_ratios = [p[0]["cpu_ms"] / p[1]["cpu_ms"] for p in pairs]
    print(f"throughput: nanoGPT {tokens / ng_ms * 1000:,.0f} tokens/s, dsslm {tokens / ds_ms * 1000:,.0f} tokens/s, "
          f"dsslm/nanoGPT {ng_ms / ds_ms:.3f} wall (median of {args.pairs} pairs; per pair "
          f"{', '.join(f'{r:.3f}' for r in ratios)})")
    print(f"by CPU time (robust to other processes' load when --threads 1): dsslm/nanoGPT "
          f"{statistics.median(cpu_ratios):.3f} (per pair {', '.join(f'{r:.3f}' for r in cpu_ratios)}); nanoGPT "
          f"{statistics.median(p[0]['cpu_ms'] for p in pairs):.2f} ms, dsslm "
          f"{statistics.median(p[1]['cpu_ms'] for p in pairs):.2f} ms of CPU per iteration")
    to_loss(data_dir, args)


def to_loss(data_dir: Path, args: argparse.Namespace) -> None:
    if not args.max_iters:
        return
    ds_iters = args.ds_max_iters or args.max_iters
    arms = [("nanoGPT", lambda: nanogpt(args.nanogpt, args.max_iters, args.eval_every, 20, args.threads, args.compile)),
            ("dsslm", lambda: dsslm(data_dir, OUT / "runs" / "to-loss", ds_iters, args.eval_every,
                                    args.threads, args.compile, tuple(args.ds_set)))]
    if args.muon_lr is not None:
        arms.append((f"dsslm Muon {args.muon_lr:g}", lambda: dsslm(
            data_dir, OUT / "runs" / "to-loss-muon", ds_iters, args.eval_every, args.threads, args.compile,
            (*args.ds_set, "optim.name=muon", f"optim.muon_lr={args.muon_lr}"))))
    for name, result in arms:
        before = load()
        run = result()
        hit = first_under(run["evals"], args.target)
        final = run["evals"][-1]
        if hit is None:
            print(f"{name}: val loss never <= {args.target} in {final[0]} iterations (last {final[1]:.4f} at "
                  f"{final[0]}); load {before} -> {load()}")
            continue
        print(f"{name}: val loss {hit[1]:.4f} <= {args.target} at step {hit[0]}: {hit[2]:.1f} s wall (own evals "
              f"included), {hit[0] * run['median_ms'] / 1000:.1f} s of training steps; final val {final[1]:.4f} at "
              f"{final[0]}; load {before} -> {load()}", flush=True)


def sweep(data_dir: Path | str, args: argparse.Namespace) -> None:
    """Steps to the target per optimizer and rate: each run stops at its first evaluation at or
    under it. The best rate is the one with the fewest mean steps over seeds (a run that never
    gets there counts as max-iters)."""
    arms = [("adamw", float(lr), ("optim.name=adamw", f"optim.peak_lr={lr}")) for lr in args.adamw_lrs.split(",") if lr]
    arms += [("muon", float(lr), ("optim.name=muon", f"optim.muon_lr={lr}")) for lr in args.muon_lrs.split(",") if lr]
    table: dict[tuple[str, float], list[int | None]] = {}
    cap = args.ds_max_iters or args.max_iters or 2000  # dsslm's horizon: its cosine reaches min_lr there
    tag = "-".join(s.replace("=", "") for s in args.ds_set)  # runs under other settings keep their own folders
    for name, lr, extra in arms:
        for seed in range(args.seeds):
            run = dsslm(data_dir, OUT / "runs" / f"sweep-{args.corpus}-{cap}-{name}-{lr:g}-{seed}{tag and '-' + tag}", cap,
                        args.eval_every, args.threads, False, (*args.ds_set, *extra, f"run.seed={seed}"),
                        stop_at=args.target)
            hit = first_under(run["evals"], args.target)
            table.setdefault((name, lr), []).append(hit[0] if hit else None)
            print(f"sweep {name} lr {lr:g} seed {seed}: "
                  f"{f'step {hit[0]} (val {hit[1]:.4f})' if hit else 'never'} <= {args.target}", flush=True)
    tokens = SHAPE["batch_size"] * SHAPE["block_size"]
    best = {}
    for (name, lr), steps in table.items():
        mean = statistics.mean(s if s is not None else cap for s in steps)
        print(f"{name} lr {lr:g}: steps to {args.target} {steps}, mean {mean:.0f} ({mean * tokens:,.0f} tokens)")
        if name not in best or mean < best[name][1]:
            best[name] = (lr, mean)
    if {"adamw", "muon"} <= set(best):
        (a_lr, a), (m_lr, m) = best["adamw"], best["muon"]
        print(f"best: AdamW lr {a_lr:g} {a:.0f} steps, Muon lr {m_lr:g} {m:.0f} steps: Muon needs {m / a:.2f}x "
              f"AdamW's tokens to {args.target}", flush=True)


if __name__ == "__main__":
    main()
