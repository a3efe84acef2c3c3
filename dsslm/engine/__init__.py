"""Engines wrap the model from outside: DDP, DeepSpeed ZeRO or FSDP2, chosen by `engine.kind`."""
from __future__ import annotations

from torch import nn

from dsslm.config import Config
from dsslm.engine.base import Engine, init_distributed
from dsslm.engine.launch import announce, apply_launcher


def build_engine(cfg: Config, model: nn.Module) -> Engine:
    """Wrap `model` (already built, identical on every rank) in the configured engine."""
    announce(apply_launcher(cfg))  # accelerate launch --use_deepspeed / --use_fsdp pick the engine
    if cfg.engine.kind == "zero":
        from dsslm.engine.zero import ZeroEngine  # the only importer of deepspeed
        return ZeroEngine(cfg, model)
    if cfg.engine.kind == "fsdp":
        from dsslm.engine.fsdp import FSDPEngine
        return FSDPEngine(cfg, model)
    from dsslm.engine.ddp import DDPEngine
    return DDPEngine(cfg, model)


__all__ = ["Engine", "build_engine", "init_distributed"]
