"""`python -m dsslm.drill resume [--config FILE] [--nproc N] [--kill-at STEP] [dotted.key=value ...]`

The resume self-test for a new setup: train a short job uninterrupted, train it again killed
part-way and resumed, and compare every step's loss. On CPU in fp32 with the same world size the
two must agree to the bit; on GPUs (non-deterministic kernels) small differences are expected and
the verdict says so.

Run plainly, each job is a subprocess (`--nproc N` launches it with torchrun) and the kill is a
real SIGKILL. Run under `accelerate launch` or `torchrun`, every rank runs the jobs in-process
and the kill is an abort at the same step on every rank (no torn writes: the crash-in-save drill,
`faults.crash_in_save`, covers those).
"""
from __future__ import annotations

import argparse
import subprocess
import sys
import tempfile
from pathlib import Path

from dsslm.config import ConfigError, load
from dsslm.engine.ranks import init_distributed, pick_device
from dsslm.engine.launch import in_launcher, is_first_process, leave_process_group
from dsslm.observe.sinks import read_jsonl
from dsslm.recovery.faults import DrillAbort

DEFAULT_STEPS = 40
EXACT, CLOSE = 0.0, 1e-3  # max |loss difference| for the PASS and the "close" verdicts


def losses(run_dir: Path) -> dict[int, float]:
    """Each step's loss as finally trained: a resumed step's last record wins (a torn last line,
    left by the kill, is skipped)."""
    records, _ = read_jsonl(run_dir / "metrics.jsonl")
    return {r["step"]: r["loss"] for r in records if "loss" in r and "step" in r}


def run_subprocess(config: str | None, overrides: list[str], nproc: int) -> int:
    launcher = [sys.executable, "-m", "dsslm.train"] if nproc == 1 else [
        sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(nproc), "-m", "dsslm.train"]
    cmd = launcher + (["--config", config] if config else []) + overrides
    return subprocess.run(cmd).returncode


def run_inprocess(config: str | None, overrides: list[str]) -> int:
    from dsslm.train import train
    cfg = load(config, overrides)
    # One process group for all three jobs: re-creating a destroyed one on torchrun's store hangs.
    init_distributed(pick_device(cfg), cfg.engine.collective_timeout_s)
    try:
        return train(cfg)
    except DrillAbort:
        return 137


def verdict(reference: dict[int, float], resumed: dict[int, float]) -> tuple[str, float]:
    missing = sorted(set(reference) - set(resumed))
    if missing or not reference:
        return f"FAIL: steps missing after resume: {missing[:5]}", float("inf")
    worst = max(abs(reference[s] - resumed[s]) for s in reference)
    if worst <= EXACT:
        return "PASS: the resumed run equals the uninterrupted one to the bit", worst
    if worst <= CLOSE:
        return (f"CLOSE: max difference {worst:.3g} (expected on GPUs with non-deterministic "
                f"kernels; on CPU fp32 it is a bug)"), worst
    return f"FAIL: max difference {worst:.3g}: resume does not reproduce the run", worst


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m dsslm.drill", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("drill", choices=["resume"])
    parser.add_argument("--config", default=None)
    parser.add_argument("--nproc", type=int, default=1, help="ranks per job when run plainly")
    parser.add_argument("--kill-at", type=int, default=0, help="step to kill at (default: 60%% of the run)")
    parser.add_argument("--workdir", default="", help="where to put the two runs (default: a temp dir)")
    args, overrides = parser.parse_known_args(argv)
    launched = in_launcher()
    try:
        cfg = load(args.config, overrides)
    except ConfigError as err:
        print(f"dsslm: {err}", file=sys.stderr)
        return 2
    steps = min(cfg.train.total_steps, DEFAULT_STEPS) if "train.total_steps" not in " ".join(overrides) \
        else cfg.train.total_steps
    kill_at = args.kill_at or max(1, int(steps * 0.6))
    every = max(1, min(cfg.ckpt.every, kill_at // 2))
    workdir = Path(args.workdir or tempfile.mkdtemp(prefix="dsslm-drill-"))
    # A drill that cannot kill anything must not pass: a step outside the run, or run folders of
    # an earlier drill (finished runs, whose crash step had already fired once).
    problem = (f"--nproc {args.nproc} must be >= 1" if args.nproc < 1 else
               f"--kill-at {kill_at} must be a step inside the run, 1 to {steps - 1}" if not 1 <= kill_at < steps else
               f"--workdir {workdir} holds an earlier drill's runs; name a new or empty folder"
               if any(d.exists() for d in (workdir / "uninterrupted", workdir / "killed-and-resumed")) else "")
    if problem:
        print(f"dsslm drill: {problem}", file=sys.stderr)
        return 2
    common = [*overrides, f"train.total_steps={steps}", f"ckpt.every={every}"]
    run = (lambda o: run_inprocess(args.config, o)) if launched else \
        (lambda o: run_subprocess(args.config, o, args.nproc))
    ref_dir, cut_dir = workdir / "uninterrupted", workdir / "killed-and-resumed"
    if run(common + [f"run.dir={ref_dir}"]) != 0:
        print("dsslm drill: the uninterrupted run failed; fix that first", file=sys.stderr)
        return 1
    mode = "raise" if launched else "sigkill"
    killed = run(common + [f"run.dir={cut_dir}", f"faults.crash_at_step={kill_at}", f"faults.crash_mode={mode}"])
    resumed = run(common + [f"run.dir={cut_dir}"])
    if launched:
        leave_process_group()
    text, worst = verdict(losses(ref_dir), losses(cut_dir))
    if killed == 0:  # the job finished: no kill happened, and the comparison would prove nothing
        text = f"FAIL: the job to be killed at step {kill_at} finished (exit 0): nothing was killed or resumed"
    if is_first_process():
        print(f"dsslm drill resume: {steps} steps, checkpoint every {every}, killed at step {kill_at} "
              f"(exit {killed}), resumed (exit {resumed}); runs in {workdir}")
        print(f"largest per-step loss difference: {worst:.3g}")
        print(text)
    return 0 if text.startswith(("PASS", "CLOSE")) and resumed == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
