"""Fault drills: crash at a step, poison data batches, make a step's loss non-finite.

Off by default; tests use them, and so can a user rehearsing a new cluster.
"""
from __future__ import annotations

import os
import signal
from pathlib import Path

import torch

from dsslm.config import FaultsCfg


def _once(run_dir: Path, name: str) -> bool:
    """True the first time `name` is armed in this run.dir: a drill fires once, not on every resume."""
    marker = run_dir / f".fault-{name}"
    if marker.exists():
        return False
    run_dir.mkdir(parents=True, exist_ok=True)
    marker.touch()
    return True


class DrillAbort(BaseException):
    """The in-process stand-in for a kill (BaseException: no `except Exception` swallows it)."""


def maybe_crash(cfg: FaultsCfg, step: int, rank: int, run_dir: Path) -> None:
    if cfg.crash_at_step != step or cfg.crash_rank not in (-1, rank):
        return
    if _once(run_dir, f"crash-{step}-rank{rank}"):
        if cfg.crash_mode == "raise":
            raise DrillAbort(f"drill: abort at step {step}")
        os.kill(os.getpid(), signal.SIGKILL)  # as abrupt as a node failure: no cleanup runs


def crash_in_save_step(cfg: FaultsCfg, run_dir: Path, is_main: bool) -> int:
    """The step whose save dies half-written, or -1 (armed once per run.dir, on the saving rank)."""
    if cfg.crash_in_save < 0 or not is_main or not _once(run_dir, f"save-crash-{cfg.crash_in_save}"):
        return -1
    return cfg.crash_in_save


def poison(micro_batches: list[tuple[torch.Tensor, torch.Tensor]], data_batch: int, cfg: FaultsCfg,
           seed: int, vocab_size: int, rank: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Replace a poisoned data batch's tokens with uniform random ones: a real data-borne spike."""
    hit = any(start <= data_batch < end for start, end in cfg.poison_batches)
    if not hit or cfg.poison_rank not in (-1, rank):
        return micro_batches
    gen = torch.Generator().manual_seed(seed * 1_000_003 + data_batch * 101 + rank)
    out = []
    for inputs, targets in micro_batches:
        noise = torch.randint(0, vocab_size, (inputs.shape[0], inputs.shape[1] + 1), generator=gen)
        out.append((noise[:, :-1].contiguous(), noise[:, 1:].contiguous()))
    return out


def is_nan_step(cfg: FaultsCfg, step: int, rank: int, run_dir: Path) -> bool:
    """A transient non-finite loss (a flipped bit, a bad kernel): it fires once, so the step
    replayed after the rewind it causes runs clean."""
    return step in cfg.nan_steps and _once(run_dir, f"nan-{step}-rank{rank}")
