"""A data verdict's reach: which sequences of a spike stand out, and how far naming them goes.

Data means data (docs/spikes.md, "What a data verdict names"). A sequence of a spike step is a
**candidate** when its own text stands out:

- its loss, against the run's history of sequence losses (`SpikeMonitor.standing_out`: beyond
  4 robust sigmas of the history, in a step whose loss is an outlier), or
- its text is one short n-gram repeated (`repeated`): the OLMo 2 spike signature. Its loss need
  not stand out (a repeated 4-gram sat at z 0.2 against the history on the project's drill, and
  its own gradient at 2x a clean sequence's, within the clean spread: what surges is a batch of
  them, all pointing one way), so its text is read instead.

Nothing else is named: a step whose sequences do not stand out names nothing, whatever a replay
without its window showed (that is a pass's skip of positions, `batch`, not text).

What a candidate's verdict **reaches** is earned:

- proven text is named for good, by its chunk: a repeated n-gram; a sequence of a step bad
  throughout (at least half its sequences stand out: a poisoned batch); a chunk standing out for
  the second time, in another pass than the first (the `suspects` the forensics keep, in the
  checkpoint: a corrupted chunk comes back each epoch, a clean one that stood out once rarely);
- any other candidate is named for good only when its document's own text stands out: up to
  DOCUMENT_SAMPLES of the document's other chunks, read and evaluated at the current weights,
  have a median loss beyond the history's REFERENCE_Z on the same side. Otherwise it is ordinary
  text that stood out once: it is left out of this pass only (its position), becomes a suspect,
  and comes back in the next epoch. Two clean but unusual sequences of one step (a base32
  alphabet and a row of digits at z 4-6, on the long bench) are two such, not one proof;
- a document is named whole (`Loader.data_entries(..., documents)`) only when its own other
  chunks stand out so, never for one sequence's loss. Measured before this rule, a 30,000-step run
  named three clean documents of ~121K tokens each for one sequence at z 6.2-7.5 apiece.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

# A sequence is a repeated n-gram when, for some period p <= MAX_PERIOD, at least REPEAT_SHARE of
# its tokens equal the token p before: one n-gram (n <= 64) repeated throughout. Clean prose and
# code sit far below (indentation and rules of '-' are runs within a line, not a whole sequence).
REPEAT_SHARE = 0.9
MAX_PERIOD = 64
# A row whose most common token is more than this share of it is a run (whitespace), not an n-gram.
MAX_RUN_SHARE = 0.8
# Runs of one token count as repeated text where they are at least this share of a step.
RUNS_OF_STEP = 0.25
# A sequence must hold at least this many periods of its n-gram: a 4-gram in 32 tokens repeats 8x.
MIN_REPEATS = 4
# The other chunks of a lone candidate's document read to judge the document.
DOCUMENT_SAMPLES = 8


def repeated(rows: torch.Tensor) -> np.ndarray:
    """Which rows (token ids [B, T]) are one n-gram repeated: 1 (an n-gram of two or more tokens),
    2 (a run of one token: its most common token over MAX_RUN_SHARE of the row), else 0 (int8).
    A run is told apart because indentation and blank lines fill whole chunks of clean code (3 of
    the 1,027 chunks of the stdlib test corpus are a run of spaces): `step_repeated` counts runs
    only where they fill a share of the step no clean corpus does."""
    x = rows.long()
    hit = torch.zeros(x.shape[0], dtype=torch.bool)
    length = x.shape[1]
    for p in range(1, min(MAX_PERIOD, length // MIN_REPEATS) + 1):
        same = (x[:, p:] == x[:, :-p]).float().mean(1)
        hit |= same >= REPEAT_SHARE
    kind = hit.to(torch.int8)
    if hit.any():
        top = torch.stack([torch.bincount(row).max() for row in x[hit]]).float() / length
        kind[hit] = torch.where(top <= MAX_RUN_SHARE, 1, 2).to(torch.int8)
    return kind.numpy()


def step_repeated(kinds: np.ndarray) -> np.ndarray:
    """Which sequences of a whole step (every rank's `repeated` kinds) count as repeated text: the
    n-grams, and the runs where runs are at least RUNS_OF_STEP of the step (a batch of whitespace
    is no indentation; at 0.3% of a code corpus's chunks, a quarter of a step of 16 is 4 runs)."""
    kinds = np.asarray(kinds)
    runs = kinds == 2
    return (kinds == 1) | (runs if runs.mean() >= RUNS_OF_STEP else np.zeros_like(runs)) if len(kinds) else \
        np.zeros(0, dtype=bool)


@dataclass
class Candidate:
    """A sequence of a spike step that stands out: its global index (stream position), the chunk
    it read, the pass (its domain's epoch) it was read in, whether it is named for good without
    asking its document (`strong`), and the side of the history it stands on (+1 above, -1 below)."""
    index: int
    chunk: int
    epoch: int
    strong: bool
    side: float = 1.0


def candidates(captured: dict, steps, monitor, loader, suspects: dict) -> list[Candidate]:
    """The candidates of the spike steps whose sequences were captured (`Forensics.sequences`:
    step -> (indices, losses, repeated)), by `monitor.standing_out` and the repeated-text test.
    Strong: repeated text; a step bad throughout (at least half its sequences stand out: a
    poisoned batch; clean text never puts half a step beyond 4 sigmas); or a chunk that stood out
    before, in another pass (`suspects`: chunk -> the epoch it stood out in), its second strike."""
    found: list[tuple[int, bool, float]] = []
    for step in steps:
        if step not in captured:
            continue  # not captured (a step before a resume): its sequences name nothing
        indices, losses, rep = captured[step]
        stands = np.asarray(monitor.standing_out(losses), dtype=bool)
        throughout = 2 * int(stands.sum()) >= len(losses) > 0
        z = monitor.z_of(losses)  # signed, the history's reference taken once a step (None: too short)
        below = np.zeros(len(losses), dtype=bool) if z is None else np.isfinite(losses) & (z < 0)
        for i in np.flatnonzero(stands | np.asarray(rep, dtype=bool)):
            found.append((int(indices[i]), bool(rep[i]) or throughout, -1.0 if below[i] else 1.0))
    if not found:
        return []
    index = np.asarray([i for i, _, _ in found], dtype=np.int64)
    chunks, epochs = loader.chunk_ids(index), loader.epoch_of(index)
    out = []
    for (i, strong, side), c, e in zip(found, chunks, epochs):
        again = suspects.get(int(c)) not in (None, int(e))
        out.append(Candidate(i, int(c), int(e), strong or again, side))
    return out


def document_losses(engine, read_chunks, chunk_ids: list[np.ndarray], precision: str, micro: int) -> list[np.ndarray]:
    """Every rank, together: the mean loss per target token of each chunk in each list (one list
    per candidate), at the current weights, in eval mode, `micro` sequences a forward (the run's
    micro-batch: 128 chunks at once would hold 128 x seq_len x vocab fp32 logits). A forward of
    every engine is collective (FSDP and ZeRO-3 gather their shards), so every rank runs the same
    batches in the same order."""
    from dsslm.precision import autocast

    flat = np.concatenate(chunk_ids) if chunk_ids else np.empty(0, dtype=np.int64)
    if len(flat) == 0:
        return [np.empty(0) for _ in chunk_ids]
    parts = []
    engine.train_mode(False)
    try:
        with torch.no_grad(), torch.compiler.set_stance("force_eager"):
            for lo in range(0, len(flat), max(1, micro)):
                inputs, targets = read_chunks(flat[lo:lo + max(1, micro)])
                targets = targets.to(engine.device)
                with autocast(precision, engine.device):
                    logits = engine.forward(inputs.to(engine.device))
                ce = torch.nn.functional.cross_entropy(logits.float().flatten(0, 1), targets.flatten(),
                                                       reduction="none", ignore_index=-100).view(targets.shape)
                real = (targets != -100).sum(-1).clamp(min=1)
                parts.append((ce.sum(-1) / real).double().cpu().numpy())
    finally:
        engine.train_mode(True)
    losses = np.concatenate(parts)
    out, at = [], 0
    for ids in chunk_ids:
        out.append(losses[at:at + len(ids)])
        at += len(ids)
    return out


def stands_out(losses: np.ndarray, side: float, z_of) -> bool:
    """A document's other chunks stand out: their median loss is beyond the history's reference
    (`SpikeMonitor.z_of`) on the candidate's side. Fewer than two chunks say nothing."""
    finite = losses[np.isfinite(losses)]
    if len(finite) < 2:
        return False
    z = z_of(float(np.median(finite)))
    return z is not None and side * z > 0 and abs(z) > z_threshold()


def z_threshold() -> float:
    from dsslm.recovery.monitor import REFERENCE_Z
    return REFERENCE_Z
