"""Rewind points: host snapshots of everything a checkpoint holds, kept in memory, so a rewind or
a triage replay goes back a few dozen steps without a durable checkpoint close by.

Every `monitor.rewind_every` steps (not while a triage replay is running: its base must stay)
each rank copies to the host the part of the state a sharded checkpoint would have it write
(`engine.local_state()`: its FSDP or ZeRO shard of the fp32 weights and optimizer tensors, a
DDP replica's rows; the step counts on rank 0), and rank 0 every checkpoint part's `state_dict()`,
at the same place in the loop as a save, so a restore from a point and from a checkpoint of the
same step give bitwise equal runs. The newest `monitor.rewind_points` points are kept.

No rank ever holds or reads the whole state for a point: taking one is a device-to-host copy of
what the rank holds, with no collective over tensors, so a point costs about 12 bytes x
parameters / world size per rank (fp32 weight and two moments, Muon's hidden matrices one
momentum; more with the parts' JSON, which only rank 0 keeps). A restore loads the copy back
through the engine's `load_local_state`, the path a sharded checkpoint of the same world size
takes, reading each rank's own copy. A DDP
replica reads every tensor whole; it is put together one tensor at a time from the ranks' rows
by a sum over the process group of their bit patterns (disjoint rows, the rest zero: exact,
including the sign of a zero), so a replica's restore holds one extra tensor at a time.

A point belongs to the trajectory that made it: a restore to step s drops the points after s,
and a point is never written to disk (after a restart a rewind loads a durable checkpoint).
"""
from __future__ import annotations

import copy
import math
from dataclasses import dataclass, field
from pathlib import Path

import torch

from dsslm.ckpt.format import Checkpoint, step_name
from dsslm.ckpt.resume import Checkpointer
from dsslm.engine.base import MOMENTS, Engine, Shard

# The integer type of the same width: a sum of bit patterns of which all but one are zero is exact.
_BITS = {torch.float32: torch.int32, torch.float64: torch.int64}


@dataclass
class RewindPoint:
    step: int
    shards: list[Shard]                  # this rank's part of the state (engine.local_state()), on the host
    parts: dict | None                   # every part's state_dict() (rank 0 only)
    state: dict = field(default_factory=dict)   # {"step": step}: what planners read, on every rank

    @property
    def path(self) -> Path:
        return Path(f"memory:{step_name(self.step)}")  # named in rewind events, never a folder


class PointReader:
    """A rewind point as the engine's StateReader. `keys()` and `shape()` are the whole state's
    (every rank's keys, gathered once when the point is restored). Sharded engines read only
    spans this rank holds (any other read is a bug, refused rather than answered with zeros);
    a replica's reads are collectives, every rank asking for the same tensors in the same order
    (load_replica_state's loop), each contributing the rows it keeps."""

    def __init__(self, engine: Engine, shards: list[Shard], table: dict[str, tuple], replicated: bool):
        self.engine, self.table, self.replicated = engine, table, replicated
        self.pieces: dict[str, list[Shard]] = {}
        for shard in sorted(shards, key=lambda s: s.start):  # each key's pieces in order, once
            self.pieces.setdefault(shard.key, []).append(shard)

    def keys(self) -> list[str]:
        return list(self.table)

    def shape(self, key: str) -> tuple[int, ...]:
        return self.table[key][0]

    def read(self, key: str, start: int = 0, end: int | None = None) -> torch.Tensor:
        shape, dtype = self.table[key]
        end = math.prod(shape) if end is None else end
        if start == end:
            return torch.empty(0, dtype=dtype)
        if self.replicated:
            return self._assemble(key, dtype, math.prod(shape))[start:end]
        out, at = [], start
        for piece in self.pieces.get(key, []):
            a, b = max(at, piece.start), min(end, piece.end)
            if a == at and a < b:
                out.append(piece.tensor[a - piece.start:b - piece.start])
                at = b
        if at < end:  # a bug in an engine's read plan (the other ranks then wait in its next collective)
            raise RuntimeError(f"rewind point: rank {self.engine.rank} does not hold elements [{at}, {end}) of {key}")
        return torch.cat(out) if len(out) != 1 else out[0]

    def _assemble(self, key: str, dtype: torch.dtype, numel: int) -> torch.Tensor:
        full = torch.zeros(numel, dtype=dtype)
        for piece in self.pieces.get(key, []):
            full[piece.start:piece.end] = piece.tensor
        bits = self.engine.all_reduce_sum(full.view(_BITS[dtype]))
        return bits.to("cpu").view(dtype)


class RewindRing:
    def __init__(self, engine: Engine, checkpointer: Checkpointer, every: int, capacity: int):
        self.engine, self.checkpointer, self.every, self.capacity = engine, checkpointer, every, capacity
        self.points: list[RewindPoint] = []  # oldest first; the same steps on every rank

    def due(self, step: int) -> bool:
        return bool(self.every) and step > 0 and step % self.every == 0

    def take(self, step: int) -> None:
        """Every rank, at `step` (after its save, if any)."""
        self.drop_after(step - 1)  # a point at or after `step` belongs to an abandoned trajectory
        # Copies on the host: the live tensors change with the next step.
        shards = [Shard(s.key, s.shape, s.start, s.end, s.tensor.detach().to("cpu", copy=True).contiguous())
                  for s in self.engine.local_state()]
        parts = {name: copy.deepcopy(part.state_dict()) for name, part in self.checkpointer.parts.items()}
        self.points.append(RewindPoint(step, shards, parts if self.engine.is_main else None, {"step": step}))
        del self.points[:-self.capacity]

    def newest(self, at_or_before: int) -> RewindPoint | None:
        return next((p for p in reversed(self.points) if p.step <= at_or_before), None)

    def drop_after(self, step: int) -> None:
        self.points = [p for p in self.points if p.step <= step]

    def checkpoint(self, point: RewindPoint) -> Checkpoint:
        """Every rank: the point as a checkpoint the Checkpointer restores through its reader."""
        mine = {s.key: (s.shape, s.tensor.dtype) for s in point.shards}
        table: dict[str, tuple] = {}
        for keys in self.engine.all_gather(mine):  # names and shapes only
            table.update(keys)
        shards = point.shards
        replicated = self.engine.replica_reads and self.engine.world_size > 1
        if not replicated:  # every rank needs the step counts, which rank 0 alone keeps
            steps = self.engine.broadcast([s for s in shards if s.key.startswith("optim/step/")]
                                          if self.engine.is_main else None)
            shards = [s for s in shards if not s.key.startswith("optim/step/")] + steps
        parts = self.engine.broadcast(point.parts)
        state = {**copy.deepcopy(parts), "step": point.step}
        return Checkpoint(point.step, point.path, {}, state, PointReader(self.engine, shards, table, replicated))

    def memory(self) -> dict[str, int]:
        """This rank's host bytes for one point, a bound (fp32 weight and two moments per element
        it holds, fp64 step counts on rank 0; Muon's hidden matrices hold one momentum), and the
        bound for the ring."""
        held = sum(s.end - s.start for s in self.engine.local_state() if s.key.startswith("model/"))
        mine = held * 4 * (1 + len(MOMENTS)) + (8 * len(self.engine.param_shapes) if self.engine.is_main else 0)
        return {"rewind_point_bytes": mine, "rewind_bytes": mine * self.capacity if self.every else 0}
