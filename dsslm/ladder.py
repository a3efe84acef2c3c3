"""`python -m dsslm.ladder [--config FILE.yaml] --widths 64,128,256 --lrs 1e-3,3e-3,1e-2 [--depths 2,4]
[--seeds 1,2] --out DIR [--local [--jobs N] | --slurm] [dotted.key=value ...]`, then
`python -m dsslm.ladder --collect --out DIR [--target-width N] [--target-depth N]`

A learning-rate ladder: one base config (a YAML and dotted overrides, as dsslm.train takes them),
trained at every point of a grid of widths (model.d_model; model.n_heads stays the base's, so the
head dimension grows with the width, as muP's attention rule expects: docs/mup.md), depths
(model.n_layers), peak rates (optim.peak_lr; optim.min_lr keeps the base's min_lr/peak_lr ratio, so
every rate runs the same schedule shape) and seeds (run.seed). Each point is an ordinary dsslm run
in DIR/runs/NAME (NAME like w128-d4-lr3e-3-s1): resumable, and a ladder run again skips the points
whose run finished (or escalated) and resumes the others. DIR/ladder.json, the plan, is written
first (atomically); a DIR holding another plan is refused.

--local (the default) runs the points here as `python -m dsslm.train` subprocesses, --jobs at a
time, then collects. --slurm submits them as one job array of slurm/ladder.sbatch (each task runs
its point through slurm/train.sbatch: the same signal handling and requeue, docs/ladder.md).
--collect reads each run's final validation loss, prints a markdown table, the best rate per width
and the fitted rule (log best rate against log width, and depth), writes ladder.md and ladder.png
and adds the results to ladder.json (dsslm/ladder_collect.py).

Two choices made for every point, before the user's overrides (which may undo them): the spike
policy is off (monitor.enabled=false: its rewinds and rate backoffs would train another rate than
the one measured, and a diverging rate is a result here, not an incident), and a base without
validation (run.val_every=0) validates at its last step. Bad input: one line, exit 2, nothing written.
"""
from __future__ import annotations

import argparse
import itertools
import json
import math
import os
import shlex
import signal
import subprocess
import sys
import time
from pathlib import Path

from dsslm.config import ConfigError, load
from dsslm.durable import write_json_atomic
from dsslm.ladder_collect import DONE, collect, fmt_lr, point_status
from dsslm.preflight import data_dir_problems

# dsslm.train's exits that are a point's outcome: finished (or a diverging run that still finished), escalated.
OUTCOMES = (0, 3)
ROOT = Path(__file__).resolve().parent.parent
LADDER_SBATCH = ROOT / "slurm" / "ladder.sbatch"
PLAN = "ladder.json"
# The keys a grid dimension sets; the same key in the base's overrides would be silently lost.
SWEPT = {"widths": "model.d_model", "depths": "model.n_layers", "lrs": "optim.peak_lr", "seeds": "run.seed"}


class LadderError(ValueError):
    """Bad input: one line, exit 2."""


def point_name(width: int, depth: int, lr: float, seed: int) -> str:
    return f"w{width}-d{depth}-lr{fmt_lr(lr)}-s{seed}"


def _list(text: str | None, kind, flag: str) -> list | None:
    if text is None:
        return None
    try:
        values = [kind(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise LadderError(f"{flag} {text!r} is not a comma-separated list of numbers, e.g. {flag} "
                          f"{'1e-3,3e-3' if kind is float else '64,128'}") from None
    if not values:
        raise LadderError(f"{flag} {text!r} is empty: the grid would have no point")
    if len(set(values)) != len(values):
        raise LadderError(f"{flag} {text!r} names a value twice")
    low, what = {"--lrs": (0, "> 0"), "--seeds": (-1, ">= 0")}.get(flag, (0, ">= 1"))
    bad = [v for v in values if not (low < v < math.inf)]
    if bad:
        raise LadderError(f"{flag}: {bad[0]} is not {what}")
    return values


def build_plan(args: argparse.Namespace, overrides: list[str], out: Path) -> dict:
    """The ladder's plan: every point's name, run.dir and dsslm.train arguments, each point's config
    loaded and checked here (ConfigError names the first bad point), before anything is written."""
    grid = {k: _list(getattr(args, k), float if k == "lrs" else int, f"--{k}") for k in SWEPT}
    for key, value in ((o.partition("=")[0], o) for o in overrides):
        if key == "run.dir":
            raise LadderError(f"{value}: the ladder sets each point's run.dir (DIR/runs/NAME under --out)")
        for dim, swept in SWEPT.items():
            if key == swept and grid[dim] is not None:
                raise LadderError(f"{value}: --{dim} sets {swept} at every point; drop the override")
    config = str(Path(args.config).resolve()) if args.config else None
    try:
        base = load(config, overrides)
    except ConfigError as err:
        raise LadderError(f"the base config: {err}") from None
    if grid["widths"] and base.model.ffn_hidden:
        raise LadderError(f"model.ffn_hidden={base.model.ffn_hidden} would stay fixed across --widths; leave it 0 "
                          "(8/3 d_model, rounded) for a width ladder")
    widths = grid["widths"] or [base.model.d_model]
    depths = grid["depths"] or [base.model.n_layers]
    lrs = grid["lrs"] or [base.optim.peak_lr]
    seeds = grid["seeds"] or [base.run.seed]
    ratio = base.optim.min_lr / base.optim.peak_lr if base.optim.peak_lr > 0 else 0.0
    chosen = [] if "monitor.enabled" in base.explicit else ["monitor.enabled=false"]
    forced = [] if base.run.val_every else [f"run.val_every={base.train.total_steps}"]
    head = ["--config", config] if config else []
    points = []
    for width, depth, lr, seed in itertools.product(widths, depths, lrs, seeds):
        name = point_name(width, depth, lr, seed)
        run_dir = out / "runs" / name
        swept = [f"model.d_model={width}", f"model.n_layers={depth}", f"optim.peak_lr={lr!r}",
                 f"optim.min_lr={float(f'{lr * ratio:.12g}')!r}", f"run.seed={seed}", f"run.dir={run_dir}"]
        point_overrides = [*chosen, *overrides, *forced, *swept]
        try:
            load(config, point_overrides, checks=(data_dir_problems,))
        except ConfigError as err:
            raise LadderError(f"point {name}: {err}") from None
        points.append({"name": name, "width": width, "depth": depth, "lr": lr, "seed": seed,
                       "run_dir": str(run_dir), "steps": base.train.total_steps, "args": head + point_overrides})
    return {"version": 1, "base": {"config": config, "overrides": overrides},
            "grid": {"widths": widths, "depths": depths, "lrs": lrs, "seeds": seeds},
            "rules": {"n_heads": base.model.n_heads, "min_lr_ratio": ratio, "mup_base_width": base.model.mup_base_width,
                      "mup_base_depth": base.model.mup_base_depth, "ladder_overrides": chosen + forced},
            "points": points}


def read_plan(out: Path) -> dict | None:
    path = out / PLAN
    if not path.is_file():
        return None
    try:
        plan = json.loads(path.read_text())
        if not isinstance(plan, dict) or not isinstance(plan.get("points"), list):
            raise ValueError("no points")
        return plan
    except (OSError, ValueError) as err:
        raise LadderError(f"{path}: not a ladder plan ({err}); give another --out") from None


def settle_plan(plan: dict, out: Path) -> dict:
    """The plan on disk: written now (atomically) for a new DIR, or the same plan's, with its results
    and submissions, for a DIR that holds it. A DIR holding another plan, or other files, is refused."""
    old = read_plan(out)
    if old is None:
        if out.exists() and (not out.is_dir() or any(out.iterdir())):
            raise LadderError(f"--out {out} exists and holds no {PLAN}: give a new or empty folder")
        out.mkdir(parents=True, exist_ok=True)
        (out / "logs").mkdir(exist_ok=True)
        write_json_atomic(out / PLAN, plan, indent=1)
        return plan
    same = [(p["name"], p["args"]) for p in old["points"]] == [(p["name"], p["args"]) for p in plan["points"]]
    if not same:
        had = old.get("grid", {})
        raise LadderError(f"--out {out} holds another ladder ({PLAN}: {len(old['points'])} points, grid {had}); "
                          "give another --out, or the same arguments to resume it")
    (out / "logs").mkdir(exist_ok=True)
    return old


def pending(plan: dict, out: Path) -> list[int]:
    """The points still to train: every one whose run neither finished nor escalated."""
    return [i for i, p in enumerate(plan["points"]) if point_status(p, out)["status"] not in DONE]


def run_local(plan: dict, out: Path, jobs: int) -> int:
    """Train the pending points as `python -m dsslm.train` subprocesses, `jobs` at a time. Each in a
    session of its own: a Ctrl-C here is passed on once (a second would stop a run without its save)."""
    todo = pending(plan, out)
    points = plan["points"]
    print(f"ladder: {len(points) - len(todo)} of {len(points)} points done; running {len(todo)}, {jobs} at a time",
          flush=True)
    env = dict(os.environ)
    # Without this each of `jobs` runs would take every core's thread pool and they would fight.
    env.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // jobs)))
    running: dict[subprocess.Popen, tuple[dict, float]] = {}
    stop: list[int] = []

    def on_term(signum, _frame):
        stop.append(signum)
    # Signals only set a flag: the loop then passes each on once and waits for the runs' saves.
    previous = {sig: signal.signal(sig, on_term) for sig in (signal.SIGTERM, signal.SIGINT)}
    done, failed = 0, []
    try:
        while (todo and not stop) or running:
            while todo and not stop and len(running) < jobs:
                point = points[todo.pop(0)]
                (out / "logs" / f"{point['name']}.exit").unlink(missing_ok=True)  # an earlier start's
                log = open(out / "logs" / f"{point['name']}.log", "ab")
                with log:
                    proc = subprocess.Popen([sys.executable, "-m", "dsslm.train", *point["args"]], env=env,
                                            stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                            start_new_session=True)
                running[proc] = (point, time.monotonic())
            time.sleep(0.2)
            if stop and stop[-1] is not None:
                for proc in running:
                    proc.send_signal(stop[-1])  # once each: every run saves at the end of its step
                stop.append(None)
            for proc in [p for p in running if p.poll() is not None]:
                point, began = running.pop(proc)
                done += 1
                (out / "logs" / f"{point['name']}.exit").write_text(f"{proc.returncode}\n")
                if proc.returncode not in OUTCOMES:
                    failed.append(point["name"])
                print(f"ladder: {point['name']}: exit {proc.returncode} in {time.monotonic() - began:.1f} s "
                      f"[{done}/{done + len(running) + len(todo)}]", flush=True)
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    if stop:
        print(f"ladder: stopped; {len(todo)} points not started; run the same command again to resume", flush=True)
        return 130 if stop[0] == signal.SIGINT else 143
    if failed:
        print(f"ladder: {len(failed)} points failed ({', '.join(failed[:4])}{', ...' if len(failed) > 4 else ''}): "
              f"their logs are in {out}/logs; run the same command again to retry them", flush=True)
    return 1 if failed else 0


def array_spec(indices: list[int]) -> str:
    """0-7, or 1,3,5-7: sbatch --array's ranges."""
    ranges = []
    for _, group in itertools.groupby(enumerate(indices), lambda t: t[1] - t[0]):
        run = [i for _, i in group]
        ranges.append(str(run[0]) if len(run) == 1 else f"{run[0]}-{run[-1]}")
    return ",".join(ranges)


def submit(plan: dict, out: Path, sbatch_flags: list[str], max_running: int) -> int:
    """One job array of slurm/ladder.sbatch over the pending points, submitted from the repository
    root (train.sbatch, which each task sources, and its slurm/logs/ status files are found there)."""
    todo = pending(plan, out)
    if not todo:
        print(f"ladder: all {len(plan['points'])} points done; nothing to submit")
        return 0
    array = array_spec(todo) + (f"%{max_running}" if max_running else "")
    argv = ["sbatch", "--parsable", f"--array={array}", f"--output={out}/logs/%x-%A_%a.out", *sbatch_flags,
            str(LADDER_SBATCH), str(out)]
    env = dict(os.environ)
    # sbatch runs from the repository root (train.sbatch is found there); the ranks from here, where
    # the plan was made, so a relative path among the overrides (data.dir=...) means what it meant.
    env.setdefault("DSSLM_ROOT", os.getcwd())
    if not env.get("DSSLM_VENV"):  # the tasks run this interpreter unless told otherwise (train.sbatch's variables)
        env.setdefault("DSSLM_PYTHON", sys.executable)
    try:
        done = subprocess.run(argv, cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    except (OSError, subprocess.TimeoutExpired) as err:
        print(f"dsslm.ladder: sbatch: {err}", file=sys.stderr)
        return 1
    if done.returncode != 0:
        print(f"dsslm.ladder: sbatch exited {done.returncode}: {' '.join(done.stderr.split())}", file=sys.stderr)
        return 1
    job = done.stdout.strip().split(";")[0]
    plan.setdefault("submissions", []).append({"job": job, "array": array, "time": time.time()})
    write_json_atomic(out / PLAN, plan, indent=1)
    print(f"ladder: submitted job array {job} ({len(todo)} points, --array={array}); logs in {out}/logs; "
          f"when it is done: python -m dsslm.ladder --collect --out {out}")
    print(job)
    return 0


class OneLineParser(argparse.ArgumentParser):
    def error(self, message):  # one line on stderr and exit 2, as every dsslm CLI
        self.exit(2, f"{self.prog}: error: {message}; see --help\n")


def parser() -> argparse.ArgumentParser:
    p = OneLineParser(prog="python -m dsslm.ladder", description=__doc__.split("\n\n")[1],
                      usage="python -m dsslm.ladder [--config FILE.yaml] [--widths W,..] [--depths L,..] [--lrs R,..] "
                            "[--seeds S,..] --out DIR [--local [--jobs N] | --slurm] [dotted.key=value ...]")
    p.add_argument("--config", default=None, help="the base YAML (default: configs/tiny.yaml)")
    p.add_argument("--widths", help="model.d_model values, e.g. 64,128,256 (model.n_heads stays the base's)")
    p.add_argument("--depths", help="model.n_layers values, e.g. 2,4")
    p.add_argument("--lrs", help="optim.peak_lr values, e.g. 1e-3,3e-3,1e-2 (min_lr keeps the base's ratio)")
    p.add_argument("--seeds", help="run.seed values, e.g. 1,2")
    p.add_argument("--out", required=True, metavar="DIR", help="the ladder's folder: ladder.json, runs/, logs/")
    mode = p.add_mutually_exclusive_group()
    mode.add_argument("--local", action="store_true", help="train the points here (the default)")
    mode.add_argument("--slurm", action="store_true", help="submit the points as a job array of slurm/ladder.sbatch")
    mode.add_argument("--collect", action="store_true", help="read the runs' results: table, rule, ladder.png")
    p.add_argument("--jobs", type=int, default=1, help="--local: points trained at once (1)")
    p.add_argument("--sbatch", default="", metavar="FLAGS", help="--slurm: more sbatch flags, one string")
    p.add_argument("--max-running", type=int, default=0, metavar="N", help="--slurm: array tasks at once (0: no cap)")
    p.add_argument("--target-width", type=int, default=0, metavar="N", help="predict the best rate at this width")
    p.add_argument("--target-depth", type=int, default=0, metavar="N", help="... and this depth")
    p.add_argument("--domain", default="", help="the validation domain ranked (default: the mean of every domain)")
    return p


def main(argv: list[str] | None = None) -> int:
    args, overrides = parser().parse_known_args(argv)
    out = Path(args.out).resolve()
    try:
        flags = [o for o in overrides if o.startswith("-")]
        if flags:
            raise LadderError(f"unknown flag {flags[0]}")
        if args.jobs < 1 or args.max_running < 0 or args.target_width < 0 or args.target_depth < 0:
            raise LadderError("--jobs must be >= 1; --max-running, --target-width and --target-depth >= 0")
        sbatch_flags = shlex.split(args.sbatch)
        if args.collect:
            if overrides or any(getattr(args, k) for k in (*SWEPT, "config")):
                raise LadderError("--collect reads the plan in --out; give it no grid, config or overrides")
            plan = read_plan(out)
            if plan is None:
                raise LadderError(f"--out {out}: no {PLAN}; run the ladder first")
            return collect(plan, out, args.target_width, args.target_depth, args.domain)
        if args.slurm and not LADDER_SBATCH.is_file():
            raise LadderError(f"--slurm needs {LADDER_SBATCH} (a dsslm checkout), not found")
        plan = settle_plan(build_plan(args, overrides, out), out)
    except (LadderError, ValueError) as err:
        print(f"dsslm.ladder: {' '.join(str(err).split())}", file=sys.stderr)
        return 2
    if args.slurm:
        return submit(plan, out, sbatch_flags, args.max_running)
    code = run_local(plan, out, args.jobs)
    if code in (0, 1):  # what trained is collected, failures or not; a stopped ladder is not
        collect(plan, out, args.target_width, args.target_depth, args.domain)
    return code


if __name__ == "__main__":
    sys.exit(main())
