"""Fault drills: crash at a step or inside a save, poison data batches, make a step's loss non-finite.

Off by default; tests use them, and so can a user rehearsing a new cluster. One `Drills` object is
built from `cfg.faults` and asked by the loop at the points where a fault would strike:

    drills.maybe_crash(step)               # top of the loop, `step` steps completed
    batches = drills.poison(batches, indices)   # the rank's global sequence indices
    multiplier = drills.loss_multiplier(step)   # the step count being computed
    drills.arm(store)                      # once: the crash-in-save drill

Steps are step counts, as in metrics.jsonl. A drill that models a one-off fault fires once per
`run.dir` (a marker file), so the step replayed after a rewind or a resume runs clean.
"""
from __future__ import annotations

import os
import signal
from pathlib import Path

import numpy as np
import torch

from dsslm.ckpt.store import CheckpointStore
from dsslm.config import FaultsCfg

Batch = tuple[torch.Tensor, torch.Tensor]


class DrillAbort(BaseException):
    """The in-process stand-in for a kill (BaseException: no `except Exception` swallows it)."""


class Drills:
    def __init__(self, cfg: FaultsCfg, run_dir: Path, rank: int, is_main: bool, seed: int, vocab_size: int,
                 batch_size: int):
        self.cfg, self.run_dir, self.rank, self.is_main = cfg, run_dir, rank, is_main
        self.seed, self.vocab_size, self.batch_size = seed, vocab_size, batch_size

    def _once(self, name: str) -> bool:
        """True the first time `name` fires in this run.dir: a drill fires once, not on every resume."""
        marker = self.run_dir / f".fault-{name}"
        if marker.exists():
            return False
        self.run_dir.mkdir(parents=True, exist_ok=True)
        marker.touch()
        return True

    def maybe_crash(self, step: int) -> None:
        """Die on reaching `step` completed steps (faults.crash_at_step), once per run.dir."""
        cfg = self.cfg
        if cfg.crash_at_step != step or cfg.crash_rank not in (-1, self.rank):
            return
        if self._once(f"crash-{step}-rank{self.rank}"):
            if cfg.crash_mode == "raise":
                raise DrillAbort(f"drill: abort at step {step}")
            os.kill(os.getpid(), signal.SIGKILL)  # as abrupt as a node failure: no cleanup runs

    def arm(self, store: CheckpointStore) -> None:
        """The save of step faults.crash_in_save dies half-written, once per run.dir, on the saving rank."""
        step = self.cfg.crash_in_save
        if step >= 0 and self.is_main and self._once(f"save-crash-{step}"):
            store.die_in_save(step)

    def poison(self, micro_batches: list[Batch], indices: np.ndarray) -> list[Batch]:
        """Replace poisoned sequences with uniform random tokens: a data-borne spike.

        faults.poison_batches windows are in data batches of the run's full global batch B:
        window [a, b) poisons global sequences [a*B, b*B), whatever batch a step actually has.
        The noise of a sequence depends only on (seed, its index), not on the rank that reads it.
        """
        if not self.cfg.poison_batches or self.cfg.poison_rank not in (-1, self.rank):
            return micro_batches
        batch_of = np.asarray(indices) // self.batch_size
        hit = np.zeros(len(batch_of), dtype=bool)
        for start, end in self.cfg.poison_batches:
            hit |= (batch_of >= start) & (batch_of < end)
        if not hit.any():
            return micro_batches
        out, row = [], 0
        for inputs, targets in micro_batches:
            inputs, targets = inputs.clone(), targets.clone()
            for i in range(inputs.shape[0]):
                if hit[row + i]:
                    gen = torch.Generator().manual_seed(self.seed * 1_000_003 + int(indices[row + i]))
                    noise = torch.randint(0, self.vocab_size, (inputs.shape[1] + 1,), generator=gen)
                    inputs[i], targets[i] = noise[:-1], noise[1:]
            row += inputs.shape[0]
            out.append((inputs, targets))
        return out

    def loss_multiplier(self, step: int) -> float:
        """What the last micro-batch's loss of step `step` is multiplied by: NaN for a transient
        non-finite loss (a flipped bit, a bad kernel) in faults.nan_steps, once; else 1."""
        if step in self.cfg.nan_steps and self._once(f"nan-{step}-rank{self.rank}"):
            return float("nan")
        return 1.0
