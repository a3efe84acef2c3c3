"""The optimizer-state layout every engine hands over and takes back, and the one a checkpoint
stores: OptimState (whole tensors by parameter name), Shard and StateReader (one rank's spans), and
the helpers that move torch AdamW / Muon state in and out of them."""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Protocol

import torch
from torch import nn

MOMENTS = ("exp_avg", "exp_avg_sq")
# Every per-parameter tensor of the optimizer state: AdamW's moments, and Muon's momentum buffer
# (optim.name=muon, hidden matrices only; torch's state key "momentum_buffer").
STATE_KINDS = MOMENTS + ("momentum",)
TORCH_KEYS = {"exp_avg": "exp_avg", "exp_avg_sq": "exp_avg_sq", "momentum": "momentum_buffer"}
STATE_KIND_OF = {torch_key: kind for kind, torch_key in TORCH_KEYS.items()}  # torch's name -> the checkpoint's


@dataclass
class OptimState:
    """AdamW's state by parameter name (of the unwrapped model): the one layout every engine hands
    over and takes back, and the one a checkpoint stores, so a ZeRO run resumes under FSDP.

    `step` is Adam's own step count per parameter (bias correction), `exp_avg` and `exp_avg_sq`
    the fp32 moments at full (unsharded) shape. Under optim.name=muon the hidden matrices have
    `momentum` (Muon's buffer, full shape) and a step count instead of the two moments. Empty
    before the first optimizer step.
    """
    step: dict[str, float] = field(default_factory=dict)
    exp_avg: dict[str, torch.Tensor] = field(default_factory=dict)
    exp_avg_sq: dict[str, torch.Tensor] = field(default_factory=dict)
    momentum: dict[str, torch.Tensor] = field(default_factory=dict)

    def to_tensors(self) -> dict[str, torch.Tensor]:
        """One flat table for safetensors: `exp_avg/NAME`, `exp_avg_sq/NAME`, `momentum/NAME`, `step/NAME`."""
        flat = {f"{kind}/{name}": t for kind in STATE_KINDS for name, t in getattr(self, kind).items()}
        # fp64 so step counts past 2^24 stay exact.
        flat.update({f"step/{name}": torch.tensor([s], dtype=torch.float64) for name, s in self.step.items()})
        return flat

    @classmethod
    def from_tensors(cls, flat: dict[str, torch.Tensor]) -> "OptimState":
        out = cls()
        for key, tensor in flat.items():
            kind, _, name = key.partition("/")
            if kind == "step":
                out.step[name] = float(tensor.item())
            elif kind in STATE_KINDS:
                getattr(out, kind)[name] = tensor
            else:
                raise ValueError(f"optimizer tensor {key!r} is not step/, exp_avg/, exp_avg_sq/ or momentum/")
        return out

@dataclass
class Shard:
    """One rank's part of one checkpoint tensor: elements [start, end) of the row-major flattening
    of a tensor of `shape` (a span of whole rows under DDP and FSDP; ZeRO's flat partitions cut
    through rows). `tensor` holds those end - start elements, contiguous, on any device.

    Keys name what the tensor is: `model/NAME` (fp32 weights), `optim/STATE/NAME` (an optimizer
    state tensor of the parameter's shape: AdamW's exp_avg and exp_avg_sq, Muon's
    momentum_buffer, whatever the optimizer keeps per parameter) and `optim/step/NAME` (the
    optimizer's step count for the parameter, shape (1,) float64: written by rank 0 alone)."""
    key: str
    shape: tuple[int, ...]
    start: int
    end: int
    tensor: torch.Tensor


class StateReader(Protocol):
    """What a restore reads from: `keys()` the checkpoint's tensor keys (see Shard), `shape(key)`,
    `read(key, start, end)` elements [start, end) of that tensor's flattening, on the CPU."""

    def keys(self) -> list[str]: ...

    def shape(self, key: str) -> tuple[int, ...]: ...

    def read(self, key: str, start: int = 0, end: int | None = None) -> torch.Tensor: ...


def rows_of(shape: tuple[int, ...], rank: int, world_size: int) -> tuple[int, int]:
    """The element span of the rows rank `rank` owns when `world_size` ranks split a replicated
    tensor by rows (torch.chunk's split: ceil(rows / W) each, the last ranks fewer or none)."""
    rows = shape[0] if shape else 1
    row_len = math.prod(shape[1:]) if shape else 1
    per = -(-rows // world_size)
    first, last = min(rows, rank * per), min(rows, (rank + 1) * per)
    return first * row_len, last * row_len


def optim_kinds(reader: StateReader) -> dict[str, set[str]]:
    """{state name: parameter names} of the optimizer tensors in a checkpoint (`step` included)."""
    out: dict[str, set[str]] = {}
    for key in reader.keys():
        group, _, rest = key.partition("/")
        if group == "optim":
            kind, _, name = rest.partition("/")
            out.setdefault(kind, set()).add(name)
    return out


def adam_step_tensor(step: float, param: torch.Tensor, group: dict) -> torch.Tensor:
    """Adam's `step` as torch's AdamW makes it itself (torch/optim/adam.py `_init_group`): float32,
    on the parameter's device when the group runs fused or capturable (the CUDA kernels read it
    as a device pointer), a CPU scalar otherwise. A restore must put it back the same way."""
    if group.get("fused") or group.get("capturable"):
        return torch.tensor(float(step), dtype=torch.float32, device=param.device)
    return torch.tensor(float(step), dtype=torch.float32)


def state_tensor_like(value: torch.Tensor, param: torch.Tensor) -> torch.Tensor:
    """An optimizer state tensor for `param` from checkpoint values: the parameter's device, dtype
    and shape, a fresh tensor (no reference into the reader's buffers)."""
    return value.reshape(param.shape).to(device=param.device, dtype=param.dtype).clone()


def check_names(params: dict, model_sd: dict) -> None:
    """A checkpoint must name exactly this model's parameters."""
    missing = sorted(set(params) - set(model_sd))
    unexpected = sorted(set(model_sd) - set(params))
    if missing or unexpected:
        raise ValueError(f"checkpoint does not fit this model: missing {missing[:5]}, "
                         f"unexpected {unexpected[:5]}; check model.* against the checkpoint's config")


def adam_state_by_name(optimizer: torch.optim.Optimizer, names: dict[int, str]) -> OptimState:
    """torch AdamW state re-keyed by parameter name, in the engine-agnostic layout."""
    out = OptimState()
    for group in optimizer.param_groups:
        for param in group["params"]:
            state = optimizer.state.get(param)
            if not state:
                continue
            name = names[id(param)]
            out.step[name] = float(state["step"])
            for kind in STATE_KINDS:
                if TORCH_KEYS[kind] in state:
                    getattr(out, kind)[name] = state[TORCH_KEYS[kind]].detach().float()
    return out


def group_of(optimizer: torch.optim.Optimizer) -> dict[int, dict]:
    """id(param) -> its param group."""
    return {id(p): g for g in optimizer.param_groups for p in g["params"]}


def load_adam_state(optimizer: torch.optim.Optimizer, params: dict[str, nn.Parameter], optim: OptimState) -> None:
    """Write the named moments back into torch AdamW state (fresh tensors: no stale references),
    each on its parameter's device, Adam's step as torch's own kernels expect it."""
    optimizer.state.clear()
    groups = group_of(optimizer)
    for name, step in optim.step.items():
        param = params[name]
        optimizer.state[param] = {"step": adam_step_tensor(step, param, groups[id(param)]),
                                  **{TORCH_KEYS[kind]: state_tensor_like(getattr(optim, kind)[name], param)
                                     for kind in STATE_KINDS if name in getattr(optim, kind)}}


def replica_local_state(params: dict[str, nn.Parameter], optimizer: torch.optim.Optimizer, rank: int,
                        world_size: int) -> list[Shard]:
    """Shards of a replicated model (DDP, one process): each rank the rows `rows_of` gives it of
    every weight and every per-parameter optimizer tensor; rank 0 the step counts."""
    out = []
    for name, param in params.items():
        shape = tuple(param.shape)
        start, end = rows_of(shape, rank, world_size)
        tensors = {f"model/{name}": param.detach()}
        state = optimizer.state.get(param) or {}
        for kind, value in state.items():
            if kind == "step":
                if rank == 0:
                    out.append(Shard(f"optim/step/{name}", (1,), 0, 1,
                                     torch.tensor([float(value)], dtype=torch.float64)))
            elif torch.is_tensor(value) and tuple(value.shape) == shape:
                tensors[f"optim/{STATE_KIND_OF.get(kind, kind)}/{name}"] = value.detach()
        if end > start:
            out += [Shard(key, shape, start, end, t.float().reshape(-1)[start:end]) for key, t in tensors.items()]
    return out


def load_replica_state(params: dict[str, nn.Parameter], optimizer: torch.optim.Optimizer,
                       reader: StateReader) -> None:
    """A replica reads every tensor whole, one at a time (peak host memory: one tensor)."""
    with torch.no_grad():
        for name, param in params.items():
            param.copy_(reader.read(f"model/{name}").reshape(param.shape).to(param.dtype))
    optimizer.state.clear()
    kinds = optim_kinds(reader)
    groups = group_of(optimizer)
    for name in sorted(kinds.get("step", ())):
        param = params[name]
        state = {"step": adam_step_tensor(float(reader.read(f"optim/step/{name}")[0]), param, groups[id(param)])}
        for kind, names in kinds.items():
            if kind != "step" and name in names:
                state[TORCH_KEYS.get(kind, kind)] = state_tensor_like(reader.read(f"optim/{kind}/{name}"), param)
        optimizer.state[param] = state


def storage_bytes(tensors: list[torch.Tensor]) -> int:
    """Bytes of the distinct storages behind `tensors`: views into one flat buffer count once."""
    seen: dict[int, int] = {}
    for t in tensors:
        if t is None or t.numel() == 0:
            continue
        t = t.to_local() if hasattr(t, "to_local") else t  # a DTensor's shard on this rank
        storage = t.untyped_storage()
        seen[storage.data_ptr()] = storage.nbytes()
    return sum(seen.values())
