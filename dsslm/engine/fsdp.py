"""FSDP2: torch `fully_shard` on every transformer block and on the root, from outside the model.

Parameters, gradients and AdamW moments are DTensors sharded on dim 0 across ranks. The same
code runs on gloo (CPU tests) and nccl (GPU): only the device differs.

- Mixed precision: under bf16 the blocks compute with bf16 copies of the fp32 shards and reduce
  gradients in fp32 (`MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32)`); otherwise
  params stay fp32 and autocast (the loop's) casts per op, as under DDP. fp16 uses the loop's
  LossScaler exactly as DDP does.
- The tied embedding (tok_emb.weight is lm_head.weight) lives in the root's parameter group, so
  one shard serves both uses.
- Gradient accumulation, `engine.fsdp_grad_reduce`:
  `step` (default): `no_sync()` = `set_requires_gradient_sync(False)`: every rank holds the
  full unsharded gradients (in the reduce dtype, fp32: 4 B/param, not 4/W) until the final
  micro-batch reduce-scatters their sum once per step.
  `micro_batch`: every micro-batch reduce-scatters at once and the sum accumulates in the fp32
  shards: 4/W B/param held, grad_accum times the reduce-scatter traffic.
  `memory_report()["grad_bytes"]` is what was really held: the largest, over the step, of the
  unsharded gradients FSDP keeps between micro-batches plus the sharded ones.
- full_state / load_full_state go through torch.distributed.checkpoint.state_dict with
  full_state_dict=True: fully_shard keeps parameter names, so keys are the unwrapped model's.
"""
from __future__ import annotations

import contextlib
import math

import torch
from torch import nn
from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_model_state_dict,
                                                     get_optimizer_state_dict, set_model_state_dict,
                                                     set_optimizer_state_dict)
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DTensor
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

from dsslm.clip import ClipBound
from dsslm.config import Config
from dsslm.engine.base import TorchAdamWEngine, connect_muon, whole
from dsslm.engine.state import (STATE_KIND_OF, STATE_KINDS, TORCH_KEYS, OptimState, Shard, StateReader,
                                adam_step_tensor, check_names, group_of, optim_kinds, storage_bytes)
from dsslm.engine.launch import ensure_process_group
from dsslm.engine.blocks import prepare_model
from dsslm.muon import Fragment
from dsslm.optim import build_optimizer


def shard_model(model: nn.Module, precision: str) -> None:
    """fully_shard each block, then the root (embedding, final norm, tied head)."""
    if precision == "bf16":
        mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    else:
        mp = MixedPrecisionPolicy()
    for block in model.blocks:
        fully_shard(block, mp_policy=mp)
    # The root's parameters are needed again at the start of backward: keep them gathered.
    fully_shard(model, mp_policy=mp, reshard_after_forward=False)


class FSDPEngine(TorchAdamWEngine):
    name = "fsdp"

    def __init__(self, cfg: Config, model: nn.Module):
        super().__init__(cfg, model)
        ensure_process_group(self.device)  # fully_shard needs a group, even for one process
        self.distributed = True
        model.to(self.device)
        prepare_model(model, cfg.train)
        shard_model(model, cfg.train.precision)
        self.fsdp_modules = [m for m in model.modules() if isinstance(m, FSDPModule)]
        self.hold_grads = cfg.engine.fsdp_grad_reduce == "step"
        self.params = dict(model.named_parameters())  # fully_shard keeps the names
        # Tied weights have two names (tok_emb.weight, lm_head.weight); checkpoints use the first.
        canonical = {id(p): n for n, p in self.params.items()}
        self.aliases = {n: canonical[id(p)] for n, p in model.named_parameters(remove_duplicate=False)}
        self.optimizer = build_optimizer(model, cfg.optim, self.device)
        # Muon orthogonalises whole matrices: each is assembled from the ranks' dim-0 shards on the
        # one rank that orthogonalises it, which sends each rank back its own rows (muon.MuonAdamW).
        connect_muon(self.optimizer, cfg, [(self.params[n], [Fragment(n, tuple(self.params[n].shape), 0,
                                                                      *self._span(self.params[n]))])
                                           for n in getattr(self.optimizer, "matrices", [])])
        self._grad_bytes = 0

    # --- the training step -------------------------------------------------------------------
    def forward(self, inputs: torch.Tensor) -> torch.Tensor:
        return self.module(inputs)

    @contextlib.contextmanager
    def no_sync(self):
        if not self.hold_grads:  # fsdp_grad_reduce=micro_batch: reduce-scatter every backward
            yield
            return
        self.module.set_requires_gradient_sync(False)
        try:
            yield
        finally:
            self.module.set_requires_gradient_sync(True)

    def backward(self, loss: torch.Tensor) -> None:
        super().backward(loss)
        self._grad_bytes = max(self._grad_bytes, self._held_grad_bytes())

    def _held_grad_bytes(self) -> int:
        """Gradient bytes this rank holds between micro-batches: FSDP's unsharded gradients (the
        parameter's own, or the reduce-dtype copy it accumulates into) and the sharded ones."""
        held = [p.grad for p in self.params.values()]
        for module in self.fsdp_modules:
            group = module._get_fsdp_state()._fsdp_param_group
            for fsdp_param in group.fsdp_params if group is not None else ():
                unsharded = getattr(fsdp_param, "_unsharded_param", None)
                held += [getattr(unsharded, "grad", None), fsdp_param.unsharded_accumulated_grad]
        return storage_bytes(held)

    def clip_grad_norm(self, max_norm: ClipBound) -> torch.Tensor:
        params = self.unscaled_grads()
        self._grad_bytes = max(self._grad_bytes, self._held_grad_bytes())
        # Each rank's shard norm is combined across ranks inside the DTensor: the global norm.
        norm = self.clip_params(params, max_norm)
        return whole(norm)

    @torch.no_grad()
    def grad_norms(self) -> dict[str, float]:
        """Squares of each rank's dim-0 shards summed over ranks: one all-reduce of a small vector."""
        names = [n for n, p in self.params.items() if p.grad is not None]
        local = [self.params[n].grad for n in names]
        local = [g.to_local() if isinstance(g, DTensor) else g for g in local]
        squares = torch.stack([torch.linalg.vector_norm(g, dtype=torch.float64) ** 2 for g in local])
        total = self.all_reduce_sum(squares).cpu()
        return self.pre_clip({n: float(v) ** 0.5 for n, v in zip(names, total)})

    # --- state -------------------------------------------------------------------------------
    def full_state(self, with_optim: bool = True) -> tuple[dict[str, torch.Tensor], OptimState]:
        """Gathered on every rank's call (collectives); rank 0 gets the tensors, others empty tables."""
        options = StateDictOptions(full_state_dict=True, cpu_offload=True)
        model_sd = get_model_state_dict(self.module, options=options)
        # Before the first step there is no AdamW state, and get_optimizer_state_dict would make
        # one by stepping with zero gradients: Adam's step count 1, every later update changed.
        with_optim = with_optim and bool(self.optimizer.state)
        optim_full = get_optimizer_state_dict(self.module, self.optimizer, options=options) if with_optim else {}
        optim = OptimState()
        if not self.is_main:
            return {}, optim
        for name, state in optim_full.get("state", {}).items():
            if not state:
                continue
            optim.step[name] = float(state["step"])
            for key in STATE_KINDS:
                if TORCH_KEYS[key] in state:
                    getattr(optim, key)[name] = state[TORCH_KEYS[key]].detach().float()
        return {n: t.detach().float() for n, t in model_sd.items() if n in self.params}, optim

    def _reshard(self) -> None:
        """Drop every gathered copy before a restore writes the shards. The root is wrapped with
        reshard_after_forward=False, so after a forward with no backward (a validation, a probe,
        a downstream eval) it stays gathered and its module attributes are the gathered copies:
        the next forward's unshard() is then a no-op and used the abandoned trajectory's
        embedding, head and final norm (load_local_state), or set_model_state_dict mixed plain
        and DTensor copies and raised (load_full_state). reshard() does not recurse."""
        for module in self.fsdp_modules:
            module.reshard()

    def load_full_state(self, model_sd: dict[str, torch.Tensor], optim: OptimState) -> None:
        """Every rank passes the full tensors (each loads the checkpoint); each keeps its shard."""
        check_names(self.params, model_sd)
        self._reshard()
        options = StateDictOptions(full_state_dict=True)
        full = {alias: model_sd[name].float() for alias, name in self.aliases.items()}
        set_model_state_dict(self.module, full, options=options)
        self.optimizer.state.clear()
        if not optim.step:
            return
        names = {id(p): n for n, p in self.params.items()}
        groups = [{**{k: v for k, v in g.items() if k != "params"}, "params": [names[id(p)] for p in g["params"]]}
                  for g in self.optimizer.param_groups]
        state = {name: {"step": torch.tensor(float(step)),
                        **{TORCH_KEYS[key]: getattr(optim, key)[name].float() for key in STATE_KINDS
                           if name in getattr(optim, key)}}
                 for name, step in optim.step.items()}
        set_optimizer_state_dict(self.module, self.optimizer, {"state": state, "param_groups": groups},
                                 options=options)

    def _rows(self, param: DTensor) -> tuple[int, int]:
        """The element span of this rank's dim-0 shard of `param`."""
        shape, offset = compute_local_shape_and_global_offset(param.shape, param.device_mesh, param.placements)
        # From the global shape: param[0] of a dim-0 sharded DTensor redistributes it to a
        # replica first, a gather of the whole matrix at every save, rewind point and restore.
        row_len = math.prod(param.shape[1:])
        first = offset[0] if shape[0] else 0
        return first * row_len, (first + shape[0]) * row_len

    def _span(self, param: DTensor) -> tuple[int, int]:
        """(start, numel) of this rank's dim-0 shard in the parameter's flattening: Muon's Fragment."""
        start, end = self._rows(param)
        return start, end - start

    def local_state(self) -> list[Shard]:
        """Each rank's own dim-0 shard of every weight and optimizer tensor: no gather."""
        out = []
        for name, param in self.params.items():
            shape = tuple(param.shape)
            start, end = self._rows(param)
            tensors = {f"model/{name}": param.to_local()}
            for kind, value in (self.optimizer.state.get(param) or {}).items():
                if kind == "step":
                    if self.is_main:
                        out.append(Shard(f"optim/step/{name}", (1,), 0, 1,
                                         torch.tensor([float(value)], dtype=torch.float64)))
                elif isinstance(value, DTensor) and tuple(value.shape) == shape:
                    tensors[f"optim/{STATE_KIND_OF.get(kind, kind)}/{name}"] = value.to_local()
            if end > start:
                out += [Shard(key, shape, start, end, t.detach().float().reshape(-1)) for key, t in tensors.items()]
        return out

    def load_local_state(self, reader: StateReader) -> None:
        """Each rank reads the rows of its own shard, whatever wrote the checkpoint."""
        self._reshard()
        kinds = optim_kinds(reader)
        groups = group_of(self.optimizer)
        self.optimizer.state.clear()
        with torch.no_grad():
            for name, param in self.params.items():
                start, end = self._rows(param)
                local = param.to_local()
                if end > start:
                    local.copy_(reader.read(f"model/{name}", start, end).reshape(local.shape).to(local.dtype))
                if name not in kinds.get("step", ()):
                    continue
                state = {"step": adam_step_tensor(float(reader.read(f"optim/step/{name}")[0]), local,
                                                  groups[id(param)])}
                for kind, names in kinds.items():
                    if kind == "step" or name not in names:
                        continue
                    mine = torch.zeros_like(local)
                    if end > start:
                        mine.copy_(reader.read(f"optim/{kind}/{name}", start, end).reshape(local.shape))
                    state[TORCH_KEYS.get(kind, kind)] = DTensor.from_local(mine, param.device_mesh, param.placements,
                                                                           run_check=False, shape=param.shape,
                                                                           stride=param.stride())
                self.optimizer.state[param] = state

    def memory_report(self) -> dict[str, int]:
        """Bytes of this rank's shards, measured from the local tensors."""
        param_bytes = storage_bytes(list(self.params.values()))
        optim_bytes = storage_bytes([t for state in self.optimizer.state.values() for t in state.values()
                                     if torch.is_tensor(t)])
        return {"param_bytes": param_bytes, "grad_bytes": self._grad_bytes, "optim_bytes": optim_bytes}


