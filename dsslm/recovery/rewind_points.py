"""Rewind points: host snapshots of everything a checkpoint holds, kept in memory, so a rewind or
a triage replay goes back a few dozen steps without a durable checkpoint close by.

Every `monitor.rewind_every` steps (not while a triage replay is running: its base must stay)
the ring takes the engine's full state (weights, AdamW moments and step counts, by parameter
name) and every checkpoint part's `state_dict()` at the same place in the loop as a save, so a
restore from a point and from a checkpoint of the same step give bitwise equal runs. The newest
`monitor.rewind_points` points are kept.

Each rank keeps only its share: the parameters are dealt to the ranks by size (largest first, to
the least loaded), so a point costs about 16 bytes x parameters / world size per rank (fp32
weight and two moments; more with the parts' JSON, which only rank 0 keeps). Replicated engines
(DDP) hand every rank the full state and each keeps its share; sharded ones gather to rank 0,
which deals the shares out. A restore gathers the shares back on every rank and loads them as a
checkpoint's full tensors are loaded.

A point belongs to the trajectory that made it: a restore to step s drops the points after s,
and a point is never written to disk (after a restart a rewind loads a durable checkpoint).
"""
from __future__ import annotations

import copy
from dataclasses import dataclass, field
from pathlib import Path

import torch

from dsslm.ckpt.format import Checkpoint, step_name
from dsslm.ckpt.resume import Checkpointer
from dsslm.engine.base import MOMENTS, Engine, OptimState


@dataclass
class RewindPoint:
    step: int
    share: dict[str, torch.Tensor]      # this rank's tensors: "model/NAME", "exp_avg/NAME", ...
    parts: dict | None                   # every part's state_dict() (rank 0 only)
    state: dict = field(default_factory=dict)   # {"step": step}: what planners read, on every rank

    @property
    def path(self) -> Path:
        return Path(f"memory:{step_name(self.step)}")  # named in rewind events, never a folder


def deal(shapes: dict[str, tuple], world_size: int) -> dict[str, int]:
    """Parameter name -> the rank that keeps it: largest first, to the least loaded rank."""
    load, owner = [0] * world_size, {}
    for name, shape in sorted(shapes.items(), key=lambda item: (-_numel(item[1]), item[0])):
        rank = min(range(world_size), key=lambda r: (load[r], r))
        owner[name] = rank
        load[rank] += _numel(shape)
    return owner


def _numel(shape: tuple) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


class RewindRing:
    def __init__(self, engine: Engine, checkpointer: Checkpointer, every: int, capacity: int):
        self.engine, self.checkpointer, self.every, self.capacity = engine, checkpointer, every, capacity
        self.owner = deal(engine.param_shapes, engine.world_size)
        self.points: list[RewindPoint] = []  # oldest first; the same steps on every rank

    def due(self, step: int) -> bool:
        return bool(self.every) and step > 0 and step % self.every == 0

    def take(self, step: int) -> None:
        """Every rank, at `step` (after its save, if any)."""
        self.drop_after(step - 1)  # a point at or after `step` belongs to an abandoned trajectory
        model_sd, optim = self.engine.full_state()
        parts = {name: copy.deepcopy(part.state_dict()) for name, part in self.checkpointer.parts.items()}
        flat = {**{f"model/{k}": v for k, v in model_sd.items()}, **optim.to_tensors()}
        replicated = all(self.engine.all_gather(bool(model_sd) or not self.engine.param_shapes))
        if replicated:
            share = self._share_of(flat, self.engine.rank)
        else:  # rank 0 holds the gathered state: deal it out
            shares = [self._share_of(flat, r) for r in range(self.engine.world_size)] if self.engine.is_main else None
            share = self.engine.scatter(shares)
        self.points.append(RewindPoint(step, share, parts if self.engine.is_main else None, {"step": step}))
        del self.points[:-self.capacity]

    def _share_of(self, flat: dict[str, torch.Tensor], rank: int) -> dict[str, torch.Tensor]:
        # Copies on the host: the live tensors change with the next step.
        return {key: t.detach().to("cpu", copy=True) for key, t in flat.items()
                if self.owner[key.partition("/")[2]] == rank}

    def newest(self, at_or_before: int) -> RewindPoint | None:
        return next((p for p in reversed(self.points) if p.step <= at_or_before), None)

    def drop_after(self, step: int) -> None:
        self.points = [p for p in self.points if p.step <= step]

    def checkpoint(self, point: RewindPoint) -> Checkpoint:
        """Every rank: the point as a checkpoint the Checkpointer restores (shares gathered back)."""
        flat: dict[str, torch.Tensor] = {}
        for share in self.engine.all_gather(point.share):
            flat.update(share)
        parts = self.engine.broadcast(point.parts)
        model = {k.partition("/")[2]: t for k, t in flat.items() if k.startswith("model/")}
        optim = {k: t for k, t in flat.items() if not k.startswith("model/")}
        OptimState.from_tensors(optim)  # the layout a checkpoint's optim table has
        state = {**copy.deepcopy(parts), "step": point.step}
        return Checkpoint(point.step, point.path, {"model": model, "optim": optim}, state)

    def memory(self) -> dict[str, int]:
        """This rank's host bytes for one point (fp32 weight and moments, fp64 step) and the bound."""
        mine = sum(_numel(shape) * 4 * (1 + len(MOMENTS)) + 8 for name, shape in self.engine.param_shapes.items()
                   if self.owner[name] == self.engine.rank)
        return {"rewind_point_bytes": mine, "rewind_bytes": mine * self.capacity if self.every else 0}
