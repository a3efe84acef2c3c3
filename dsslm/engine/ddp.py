"""Plain data parallel: one full replica per rank, gradients all-reduced (or one process, no group)."""
from __future__ import annotations

import contextlib
import warnings

import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from dsslm.clip import ClipBound
from dsslm.config import Config
from dsslm.engine.base import TorchAdamWEngine, connect_muon
from dsslm.engine.state import (OptimState, Shard, StateReader, adam_state_by_name, check_names, load_adam_state,
                                load_replica_state, replica_local_state)
from dsslm.engine.blocks import prepare_model
from dsslm.optim import build_optimizer


class DDPEngine(TorchAdamWEngine):
    name = "ddp"
    replica_reads = True

    def __init__(self, cfg: Config, model: nn.Module):
        super().__init__(cfg, model)
        model.to(self.device)
        prepare_model(model, cfg.train, whole_model=True)
        self.optimizer = build_optimizer(model, cfg.optim, self.device)  # DDP: whole matrices as they are
        connect_muon(self.optimizer, cfg)
        self.params = dict(model.named_parameters())
        self.names = {id(p): n for n, p in self.params.items()}
        if self.distributed:
            # Buffers here are RoPE tables computed from the config: nothing to broadcast, ever
            # (torch 2.13 deprecates the flag in favour of one that still syncs at init).
            with warnings.catch_warnings():
                warnings.filterwarnings("ignore", message=".*broadcast_buffers.*", category=FutureWarning)
                self.wrapped: nn.Module = DistributedDataParallel(
                    model, device_ids=[self.device.index] if self.device.type == "cuda" else None,
                    broadcast_buffers=False)
        else:
            self.wrapped = model

    def forward(self, inputs: torch.Tensor) -> torch.Tensor:
        return self.wrapped(inputs)

    def no_sync(self) -> contextlib.AbstractContextManager:
        return self.wrapped.no_sync() if self.distributed else contextlib.nullcontext()

    def clip_grad_norm(self, max_norm: ClipBound) -> torch.Tensor:
        return self.clip_params(self.unscaled_grads(), max_norm)

    @torch.no_grad()
    def grad_norms(self) -> dict[str, float]:
        # After the all-reduce every rank holds the full averaged gradient.
        norms = {name: float(torch.linalg.vector_norm(p.grad, dtype=torch.float64))
                 for name, p in self.params.items() if p.grad is not None}
        return self.pre_clip(norms)

    def full_state(self, with_optim: bool = True) -> tuple[dict[str, torch.Tensor], OptimState]:
        model_sd = {n: p.detach().float() for n, p in self.params.items()}
        if not with_optim:
            return model_sd, OptimState()
        return model_sd, adam_state_by_name(self.optimizer, self.names)

    def load_full_state(self, model_sd: dict[str, torch.Tensor], optim: OptimState) -> None:
        check_names(self.params, model_sd)
        with torch.no_grad():
            for name, param in self.params.items():
                param.copy_(model_sd[name].to(param.dtype))
        load_adam_state(self.optimizer, self.params, optim)

    def local_state(self) -> list[Shard]:
        return replica_local_state(self.params, self.optimizer, self.rank, self.world_size)

    def load_local_state(self, reader: StateReader) -> None:
        load_replica_state(self.params, self.optimizer, reader)

    def memory_report(self) -> dict[str, int]:
        param_bytes = sum(p.numel() * p.element_size() for p in self.params.values())
        optim_bytes = sum(t.numel() * t.element_size() for s in self.optimizer.state.values()
                          for t in s.values() if torch.is_tensor(t))
        return {"param_bytes": param_bytes, "grad_bytes": param_bytes, "optim_bytes": optim_bytes}
