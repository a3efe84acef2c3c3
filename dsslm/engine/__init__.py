"""Engines wrap the model from outside: DDP, DeepSpeed ZeRO or FSDP2, chosen by `engine.kind`."""
from __future__ import annotations

import torch.distributed as dist
from torch import nn

from dsslm.config import Config, ConfigError
from dsslm.engine.base import Engine
from dsslm.engine.launch import announce, apply_launcher, is_first_process
from dsslm.engine.ranks import init_distributed


def build_engine(cfg: Config, model: nn.Module) -> Engine:
    """Wrap `model` (already built, identical on every rank) in the configured engine."""
    try:  # accelerate launch --use_deepspeed / --use_fsdp pick the engine
        announce(apply_launcher(cfg))
    except ConfigError as exc:  # the same flags and config in every process: the first one says so
        exc.echoed = not is_first_process()
        raise
    had_group = dist.is_initialized()
    try:
        return _construct(cfg, model)
    except BaseException:
        # An engine refused in its constructor (a config ZeRO cannot run, say) has no close() to
        # call: the group it made for itself goes with it, or train() called again in this process
        # (a test, a notebook) would join a group nobody owns.
        if not had_group and dist.is_initialized():
            dist.destroy_process_group()
        raise


def _construct(cfg: Config, model: nn.Module) -> Engine:
    if cfg.engine.kind == "zero":
        from dsslm.engine.zero import ZeroEngine  # the only importer of deepspeed
        return ZeroEngine(cfg, model)
    if cfg.engine.kind == "fsdp":
        from dsslm.engine.fsdp import FSDPEngine
        return FSDPEngine(cfg, model)
    from dsslm.engine.ddp import DDPEngine
    return DDPEngine(cfg, model)


__all__ = ["Engine", "build_engine", "init_distributed"]
