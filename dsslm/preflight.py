"""`python -m dsslm.train`'s command line: its arguments, its --help, and the checks that need no
torch (the config, the data folder, the global batch at the launcher's world size). train.py runs
them before its imports, so a typo is answered in about a second, every problem in one line."""
from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

from dsslm.config import Config, ConfigError, accumulation_for, load
from dsslm.exits import (EXIT_BAD_INPUT, EXIT_BAD_NODE, EXIT_CRASH_LOOP, EXIT_ESCALATED, EXIT_INTERRUPTED,
                         EXIT_NOTHING_TO_RESUME, EXIT_OK, EXIT_OOM_AT_FLOOR, EXIT_OUT_OF_MEMORY, EXIT_REQUEUE,
                         EXIT_WRITE_FAILED)

USAGE = "python -m dsslm.train [--config FILE.yaml] [--allow-drift KEY] [dotted.key=value ...]"
DESCRIPTION = """\
Train a model, or resume the run in run.dir (run it again after any stop). The same command under
plain python, torchrun, accelerate launch and srun.

Every config key can be set as dotted.key=value. All keys, with their defaults and meanings:
dsslm/config/keys.py; how they work together, and the shipped configs: docs/configuration.md.
The keys most runs set:
  run.dir=runs/NAME              the run's folder; a start on an existing one resumes it
  data.dir=DATA_DIR              from python -m dsslm.data prepare (default: the embedded corpus)
  train.total_steps=N            optimizer steps
  train.global_batch_size=N      sequences per step, kept whatever the number of processes
  train.micro_batch_size=N       sequences per forward, per process
  train.precision=bf16           bf16 | fp16 | fp32
  optim.peak_lr=3e-4             with optim.warmup_steps=N and optim.schedule=cosine | wsd
  engine.kind=ddp                ddp | zero (with engine.zero_stage=1|2|3) | fsdp
  run.val_every=N ckpt.every=N   validation and checkpoint intervals, in steps
  eval.tasks=[hellaswag,arc_easy]  downstream tasks in the loop (docs/evals.md)
"""
EXIT_CODES = (  # the numbers are exits.py's; what each means, in full: docs/run-folder.md#exit-codes
    (EXIT_OK, "finished, or stopped by SIGTERM/SIGUSR1 (saved; run again to resume)"),
    (EXIT_BAD_INPUT, "bad input or config: one line says what to fix; nothing was written"),
    (EXIT_ESCALATED, "the spike policy escalated to a person"),
    (EXIT_WRITE_FAILED, "run.dir could not be written (disk full, lost mount, lock taken over); run again"),
    (EXIT_NOTHING_TO_RESUME, "a run past step 0 with no checkpoint that can be resumed"),
    (EXIT_CRASH_LOOP, "the same failure at the same step, start after start"),
    (EXIT_OOM_AT_FLOOR, "out of memory at one sequence a micro-batch: shrink the model or the batch"),
    (EXIT_REQUEUE, "a hang or a dead node was diagnosed: requeue the job"),
    (EXIT_BAD_NODE, "a node failed its check before the first step: requeue it elsewhere"),
    (EXIT_OUT_OF_MEMORY, "a step ran out of memory: requeue; it resumes at half the micro-batch"),
    (EXIT_INTERRUPTED, "Ctrl-C (saved at the end of the step in flight)"),
)


def parser() -> argparse.ArgumentParser:
    codes = "\n".join(f"  {code:<4}{meaning}" for code, meaning in EXIT_CODES)
    parser = argparse.ArgumentParser(
        prog="python -m dsslm.train", usage=USAGE, description=DESCRIPTION,
        epilog=f"exit codes (docs/run-folder.md#exit-codes; 1 is a crash, with its traceback):\n{codes}",
        formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", default=None, help="a YAML config (default: configs/tiny.yaml)")
    parser.add_argument("--allow-drift", action="append", default=[], metavar="KEY",
                        help="on a resume, accept this key's difference from the checkpoint (repeatable)")
    return parser


def parse_args(argv: list[str] | None) -> tuple[argparse.Namespace, list[str]]:
    return parser().parse_known_args(argv)


def data_dir_problems(cfg: Config) -> list[str]:
    """A data.dir that holds no prepared data (the embedded corpus, data.dir="", is built on use)."""
    data_dir = Path(cfg.data.dir) if cfg.data.dir else None
    if data_dir is None or (data_dir / "manifest.json").is_file():
        return []
    what = "no such folder" if not data_dir.exists() else "no manifest.json there"
    return [f"data.dir={data_dir}: {what}; build it with `python -m dsslm.data prepare --input PATH "
            f"--out {data_dir}`, or drop data.dir for the embedded corpus"]


def world_size_problems(cfg: Config, env: dict | None = None) -> list[str]:
    """train.global_batch_size at the launcher's world size (WORLD_SIZE; accelerate launch sets it
    too): the division every process would otherwise refuse after its imports."""
    env = os.environ if env is None else env
    try:
        if cfg.train.global_batch_size and cfg.train.micro_batch_size >= 1:
            accumulation_for(cfg.train, int(env.get("WORLD_SIZE") or 1))
    except (ConfigError, ValueError) as err:
        return [str(err)]
    return []


def load_checked(args: argparse.Namespace, overrides: list[str]) -> Config:
    """The config, checked with the data folder and the world size: ConfigError naming every
    problem at once. Each process of a launch finds the same problems and one says them (the
    others' errors are `echoed`): rank 0, or for a missing data.dir each node's first process
    (a node-local copy may be missing on one node only)."""
    paths: list[str] = []

    def data_dir(cfg: Config) -> list[str]:
        paths.extend(data_dir_problems(cfg))
        return paths
    try:
        return load(args.config, overrides, checks=(data_dir, world_size_problems))
    except ConfigError as err:
        first_on_node = bool(paths) and int(os.environ.get("LOCAL_RANK", "0")) == 0
        err.echoed = int(os.environ.get("RANK", "0")) != 0 and not first_on_node
        raise


def check_or_exit(argv: list[str] | None = None) -> None:
    """train.py's first act, before its imports: --help, or a bad config or data.dir, answered now."""
    args, overrides = parse_args(argv)
    try:
        load_checked(args, overrides)
    except ConfigError as err:
        if not getattr(err, "echoed", False):
            print(f"dsslm: {err}", file=sys.stderr)
        sys.exit(EXIT_BAD_INPUT)
