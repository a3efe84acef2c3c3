"""What every engine applies to the model's blocks before it wraps or shards them: activation
checkpointing, then torch.compile (torchtitan's order: checkpoint, compile, shard).

Both leave parameter names alone, so checkpoints, the optimizer-state layout and the name
checks see the model as built: checkpointing replaces a block's `forward` on the instance (no
`_checkpoint_wrapped_module.` wrapper) and `nn.Module.compile()` compiles in place (no
`_orig_mod.` wrapper). The model class never learns about either.
"""
from __future__ import annotations

import functools
import warnings

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from dsslm.config import TrainCfg


def checkpointed_blocks(n_blocks: int, mode: str, every: int) -> list[int]:
    """Indices of the blocks whose activations are recomputed in backward: all of them (`full`),
    every `every`-th one (`every_n`: blocks every-1, 2*every-1, ...) or none."""
    if mode == "full":
        return list(range(n_blocks))
    if mode == "every_n":
        return [i for i in range(n_blocks) if (i + 1) % every == 0]
    return []


def checkpoint_blocks(model: nn.Module, indices: list[int]) -> None:
    """Keep only each chosen block's input in forward; recompute the rest in backward.

    Non-reentrant checkpointing: it works under DDP, FSDP2, ZeRO and torch.compile, and it
    restores the RNG state before recomputing, so dropout draws the same mask twice.
    """
    for i in indices:
        block = model.blocks[i]
        block.forward = functools.partial(checkpoint, block.forward, use_reentrant=False)


def prepare_model(model: nn.Module, cfg: TrainCfg, whole_model: bool = False) -> None:
    """Apply `train.activation_checkpointing` and `train.compile` to `model`, in place.

    Sharding engines compile per block: FSDP2 and ZeRO-3 hook every block to gather its
    parameters, and every block shares one compiled graph (the parameters are its inputs).
    DDP (`whole_model`) compiles the model in one graph, embedding and head included: on a CPU
    at d 128 that is 23% off a step where per-block compilation takes 19%.
    """
    checkpoint_blocks(model, checkpointed_blocks(len(model.blocks), cfg.activation_checkpointing,
                                                 cfg.activation_checkpointing_every))
    if not cfg.compile:
        return
    # The rope table is complex (so no bf16 cast of buffers can touch it); compiled code only
    # views it as real, which inductor warns about on every graph though nothing falls back.
    warnings.filterwarnings("ignore", message="Torchinductor does not support code generation for complex")
    for module in [model] if whole_model else model.blocks:
        module.compile()


def set_matmul_precision(device: torch.device, tf32: bool) -> None:
    """TF32 tensor cores for fp32 matmuls on CUDA (`train.tf32`); CPUs have no such mode."""
    if device.type == "cuda":
        torch.set_float32_matmul_precision("high" if tf32 else "highest")
        torch.backends.cudnn.allow_tf32 = tf32
