"""Fault drills: crashes, and spikes of the three kinds the spike policy tells apart.

Off by default; tests and the benchmark use them, and so can a user rehearsing a new cluster.
One `Drills` object is built from `cfg.faults` and asked by the loop where a fault would strike:

    drills.maybe_crash(step)                    # top of the loop, `step` steps completed
    lr = ... * drills.lr_multiplier(step)       # state: faults.lr_burst
    batches = drills.corrupt(batches, indices)  # data: poison_/repeat_batches, poison_/repeat_chunks
    drills.loss_multiplier(step), drills.grad_multiplier(step)  # transient: nan_steps, grad_fault_steps
    drills.arm(store)                           # once: the crash-in-save drill

The spikes, by cause:
- data: `repeat_batches=[[a, b]]` makes every sequence of data batches [a, b) one short n-gram
  of real text repeated (`repeat_ngram` tokens of the window's first sequence, 4 by default;
  0 repeats that whole sequence), the repeated-n-gram documents OLMo 2 traced spikes to.
  Measured on 64-wide byte-level models: a repeated 4-gram gives a grad norm 5-20x a normal
  batch's (the tokens' gradients all point one way instead of averaging out); a repeated
  document only 2-3x, which the default monitor does not call a spike.
  `poison_batches` (uniformly random tokens) is the blunt version. Both follow the data: a
  chunk fed in a window is corrupted there and whenever it is fed again (a replay of the same
  batch, a later epoch), as bad text in the corpus would be; a replay without it does not spike.
- state: `lr_burst=[[start, end, multiplier]]` multiplies the learning rate of steps
  [start, end); it follows the step, whatever the data, on every replay.
- transient: `grad_fault_steps=[s, ...]` corrupts one rank's gradients at step s once (scaled by
  `grad_fault_scale`, or non-finite with `grad_fault_mode=nan`) while its loss stays intact;
  `nan_steps` makes the loss itself non-finite once. A replay does not repeat them.

Steps are step counts, as in metrics.jsonl. A drill that models a one-off fault fires once per
`run.dir` (a marker file), so the step replayed after a rewind or a resume runs clean.
"""
from __future__ import annotations

import math

import os
import signal
from pathlib import Path

import numpy as np
import torch

from dsslm.ckpt.store import CheckpointStore
from dsslm.config import FaultsCfg
from dsslm.data.loader import Loader

Batch = tuple[torch.Tensor, torch.Tensor]


class DrillAbort(BaseException):
    """The in-process stand-in for a kill (BaseException: no `except Exception` swallows it)."""


class Drills:
    def __init__(self, cfg: FaultsCfg, run_dir: Path, rank: int, is_main: bool, seed: int, vocab_size: int,
                 batch_size: int, loader: Loader | None = None):
        self.cfg, self.run_dir, self.rank, self.is_main = cfg, run_dir, rank, is_main
        self.seed, self.vocab_size, self.batch_size, self.loader = seed, vocab_size, batch_size, loader
        self._repeated: dict[int, torch.Tensor] = {}  # window start -> the tokens its sequences repeat
        self._computations = 0  # faults.replay_noise: computations so far (the noise's sign)
        self._drilled: dict[tuple, tuple] = {}  # windows -> (chunk ids, sorted; each one's first position there)

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

    def maybe_oom(self, step: int) -> None:
        """Run out of memory in step `step`'s forward/backward (faults.oom_step), once per run.dir:
        the exception CUDA raises, so the whole path is drilled on CPU (health/oom.py)."""
        cfg = self.cfg
        if cfg.oom_step == step and cfg.oom_rank in (-1, self.rank) and self._once(f"oom-{step}-rank{self.rank}"):
            raise torch.OutOfMemoryError(f"drill: out of memory in step {step} (faults.oom_step)")

    def arm(self, store: CheckpointStore) -> None:
        """The save of step faults.crash_in_save dies half-written, once per run.dir, on the saving rank."""
        step = self.cfg.crash_in_save
        if step >= 0 and self.is_main and self._once(f"save-crash-{step}"):
            store.die_in_save(step)

    def corrupt(self, micro_batches: list[Batch], indices: np.ndarray) -> list[Batch]:
        """This rank's micro-batches after the data drills (the same batches when none hits)."""
        return self.chunks(self.repeat(self.poison(micro_batches, indices), indices), indices)

    def poison(self, micro_batches: list[Batch], indices: np.ndarray) -> list[Batch]:
        """Replace poisoned sequences with uniform random tokens: a data-borne spike.

        faults.poison_batches windows are in data batches of the run's full global batch B:
        window [a, b) poisons global sequences [a*B, b*B), whatever batch a step actually has.
        The noise of a sequence depends only on (seed, its index), not on the rank that reads it.
        """
        if not self.cfg.poison_batches or self.cfg.poison_rank not in (-1, self.rank):
            return micro_batches
        where = self._where(self.cfg.poison_batches, indices)
        hit = where >= 0
        if not hit.any():
            return micro_batches
        out, row = [], 0
        for inputs, targets in micro_batches:
            inputs, targets = inputs.clone(), targets.clone()
            for i in range(inputs.shape[0]):
                if hit[row + i]:
                    noise = self._noise_at(int(where[row + i]), inputs.shape[1] + 1)
                    inputs[i], targets[i] = noise[:-1], noise[1:]
            row += inputs.shape[0]
            out.append((inputs, targets))
        return out

    def repeat(self, micro_batches: list[Batch], indices: np.ndarray) -> list[Batch]:
        """Every sequence in a faults.repeat_batches window becomes one n-gram of real text
        repeated: the same for the whole window and every rank (read from the window's first
        global sequence), so the batch is a pure function of the stream as real data is."""
        if not self.cfg.repeat_batches:
            return micro_batches
        where = self._where(self.cfg.repeat_batches, indices)
        starts = np.full(len(where), -1)
        for start, end in self.cfg.repeat_batches:
            starts[(where >= start * self.batch_size) & (where < end * self.batch_size)] = start
        return self._replace(micro_batches, starts, self._repeated_tokens)

    def chunks(self, micro_batches: list[Batch], indices: np.ndarray) -> list[Batch]:
        """The drills that name chunks: every sequence reading a chunk of a faults.repeat_chunks
        range [first, end) becomes one n-gram of chunk `first`'s text repeated, of a
        faults.poison_chunks range the chunk's own random tokens. A pure function of the chunk,
        so the same in every batch, epoch, replay and rank that feeds it."""
        cfg = self.cfg
        if self.loader is None or not (cfg.repeat_chunks or cfg.poison_chunks):
            return micro_batches
        firsts, noisy = self._chunk_keys(self.loader.chunk_ids(np.asarray(indices, dtype=np.int64)))
        return self._replace(self._replace(micro_batches, firsts, self._chunk_ngram), noisy, self._chunk_noise)

    def _chunk_keys(self, ids: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """For chunks `ids`: the repeat_chunks range's first chunk each reads, and the poison_chunks
        chunk id each is (the keys `_chunk_ngram` and `_chunk_noise` take), else -1."""
        firsts, noisy = np.full(len(ids), -1), np.full(len(ids), -1)
        for first, end in self.cfg.repeat_chunks:
            firsts[(ids >= first) & (ids < end)] = first
        for first, end in self.cfg.poison_chunks:
            inside = (ids >= first) & (ids < end)
            noisy[inside] = ids[inside]
        return firsts, noisy

    def read_chunks(self, chunk_ids: np.ndarray) -> Batch:
        """Chunks by id as a batch, as the data drills would feed them wherever they are fed (a
        verdict reading a document's other chunks reads what training would read): a chunk a
        poison or repeat window fed is replaced as there, so are faults.*_chunks ranges."""
        ids = np.asarray(chunk_ids, dtype=np.int64)
        batch = [self.loader.read_chunks(ids)]
        cfg = self.cfg
        for windows, fill in ((cfg.poison_batches, self._noise_at), (cfg.repeat_batches, None)):
            if not windows or self.loader is None:
                continue
            where = self._first_fed(windows, ids)
            if fill is None:  # repeat: every chunk the window fed repeats the window's n-gram
                starts = np.full(len(where), -1)
                for start, end in windows:
                    starts[(where >= start * self.batch_size) & (where < end * self.batch_size)] = start
                batch = self._replace(batch, starts, self._repeated_tokens)
            elif cfg.poison_rank in (-1, self.rank):
                batch = self._replace(batch, where, fill)
        firsts, noisy = self._chunk_keys(ids)
        return self._replace(self._replace(batch, firsts, self._chunk_ngram), noisy, self._chunk_noise)[0]

    def _first_fed(self, windows: list, ids: np.ndarray) -> np.ndarray:
        """Each chunk's first position in `windows` (data batches), or -1: `_where` by chunk id."""
        self._where(windows, np.empty(0, dtype=np.int64))  # builds the table for these windows
        chunks, first = self._drilled[tuple(tuple(w) for w in windows)]
        if len(chunks) == 0:
            return np.full(len(ids), -1, dtype=np.int64)
        at = np.minimum(np.searchsorted(chunks, ids), len(chunks) - 1)
        return np.where(chunks[at] == ids, first[at], -1)

    def _noise_at(self, position: int, length: int) -> torch.Tensor:
        """poison_batches' random tokens for the chunk first fed at `position` (as `poison`)."""
        gen = torch.Generator().manual_seed(self.seed * 1_000_003 + position)
        return torch.randint(0, self.vocab_size, (length,), generator=gen)

    @staticmethod
    def _replace(micro_batches: list[Batch], keys: np.ndarray, tokens_of) -> list[Batch]:
        """Sequence i (across the micro-batches, in order) becomes tokens_of(keys[i], seq_len + 1)
        where keys[i] >= 0; the same batches when none is."""
        if (keys < 0).all():
            return micro_batches
        out, row = [], 0
        for inputs, targets in micro_batches:
            inputs, targets = inputs.clone(), targets.clone()
            for i in range(inputs.shape[0]):
                if keys[row + i] >= 0:
                    tokens = tokens_of(int(keys[row + i]), inputs.shape[1] + 1)
                    inputs[i], targets[i] = tokens[:-1], tokens[1:]
            row += inputs.shape[0]
            out.append((inputs, targets))
        return out

    def _where(self, windows: list, indices: np.ndarray) -> np.ndarray:
        """For each sequence, the position in `windows` (data batches) where the chunk it reads was
        first fed, or -1. A chunk is poisoned from that position on: at it (what a position drill
        always did) and whenever it is fed again later (another epoch; a replay), so the drill
        follows the data. By position alone without a loader."""
        indices = np.asarray(indices, dtype=np.int64)
        if self.loader is None:
            inside = np.zeros(len(indices), dtype=bool)
            for start, end in windows:
                inside |= (indices >= start * self.batch_size) & (indices < end * self.batch_size)
            return np.where(inside, indices, -1)
        key = tuple(tuple(w) for w in windows)
        if key not in self._drilled:
            positions = np.unique(np.concatenate([np.arange(a * self.batch_size, b * self.batch_size, dtype=np.int64)
                                                  for a, b in windows] or [np.empty(0, dtype=np.int64)]))
            chunks, first = np.unique(self.loader.chunk_ids(positions), return_index=True)  # earliest position
            self._drilled[key] = (chunks, positions[first])
        chunks, first = self._drilled[key]
        if len(chunks) == 0:
            return np.full(len(indices), -1, dtype=np.int64)
        mine = self.loader.chunk_ids(indices)
        at = np.minimum(np.searchsorted(chunks, mine), len(chunks) - 1)
        where = first[at]
        return np.where((chunks[at] == mine) & (where <= indices), where, -1)

    def _repeated_tokens(self, window_start: int, length: int) -> torch.Tensor:
        if window_start not in self._repeated:
            inputs, targets = self.loader.read(np.array([window_start * self.batch_size]))
            document = torch.cat([inputs[0], targets[0, -1:]])
            unit = document[:self.cfg.repeat_ngram] if self.cfg.repeat_ngram else document
            self._repeated[window_start] = unit.repeat(length // len(unit) + 1)[:length]
        return self._repeated[window_start]

    def _chunk_ngram(self, first: int, length: int) -> torch.Tensor:
        key = -1 - first  # apart from repeat_batches' window starts (>= 0) in one cache
        if key not in self._repeated:
            chunk = torch.from_numpy(self.loader._read_chunk(first).astype(np.int64))
            unit = chunk[:self.cfg.repeat_ngram] if self.cfg.repeat_ngram else chunk
            self._repeated[key] = unit.repeat(length // len(unit) + 1)[:length]
        return self._repeated[key]

    def _chunk_noise(self, chunk: int, length: int) -> torch.Tensor:
        gen = torch.Generator().manual_seed(self.seed * 1_000_003 + 2**40 + chunk)  # apart from poison's positions
        return torch.randint(0, self.vocab_size, (length,), generator=gen)

    def lr_multiplier(self, step: int) -> float:
        """faults.lr_burst: what the learning rate of step `step` is multiplied by (a state drill:
        it is the schedule's, so every replay of the step gets it too)."""
        factor = 1.0
        for start, end, multiplier in self.cfg.lr_burst:
            if start <= step < end:
                factor *= float(multiplier)
        return factor

    def surge_multiplier(self, step: int) -> float:
        """faults.grad_surge: what every gradient of step `step` is multiplied by, in every
        computation of it (its re-run, a held-out batch's probe, every replay), its loss
        untouched: a model-wide grad-norm surge with a normal loss, as when a run leaves its
        unigram plateau; else 1."""
        return math.prod(float(m) for start, end, m in self.cfg.grad_surge if start <= step < end)

    def grad_multiplier(self, step: int) -> float:
        """faults.grad_fault_steps: what this rank's gradients of step `step` are multiplied by,
        once per run.dir (a transient fault: a flipped bit, a bad reduction); else 1."""
        cfg = self.cfg
        surge = self.surge_multiplier(step)
        if step not in cfg.grad_fault_steps or cfg.grad_fault_rank not in (-1, self.rank):
            return surge
        if not self._once(f"grad-{step}-rank{self.rank}"):
            return surge
        return float("nan") if cfg.grad_fault_mode == "nan" else cfg.grad_fault_scale * surge

    def loss_multiplier(self, step: int) -> float:
        """What the last micro-batch's loss of step `step` is multiplied by: NaN for a transient
        non-finite loss (a flipped bit, a bad kernel) in faults.nan_steps, once; else 1, or with
        faults.replay_noise = e, 1 + e and 1 - e on alternate computations: kernels that are not
        bitwise deterministic, with a known spread (a re-run of a step differs by 2e relative)."""
        if step in self.cfg.nan_steps and self._once(f"nan-{step}-rank{self.rank}"):
            return float("nan")
        if self.cfg.replay_noise:
            self._computations += 1
            return 1.0 + self.cfg.replay_noise * (1 if self._computations % 2 else -1)
        return 1.0
