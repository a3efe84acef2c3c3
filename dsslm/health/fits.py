"""Will the model fit in this machine's memory? Asked before it is built (job.setup), so a model too
large is refused in one line (exit 2) instead of being OOM-killed in silence (exit 137) while its
parameters are allocated, the way a new user met a 1B config on a laptop.

On the CPU every rank of this machine holds its model's fp32 weights and gradients and AdamW's two
moments (16 bytes a parameter, each sharded engine its share), plus what the node check already
counts beyond the model (health.nodecheck.host_bytes: the checkpoint snapshot and the rewind
points). Activations are left out: they depend on the batch and are what the out-of-memory path
(health/oom.py) answers; this is the part that cannot shrink. On a GPU the model is the GPU's
business (torch says so at once); the node check measures the host's share.
"""
from __future__ import annotations

import os

from dsslm.config import Config, ConfigError
from dsslm.health.nodecheck import available_memory, host_bytes

WEIGHT, GRAD, MOMENTS = 4, 4, 8  # fp32 bytes a parameter


def model_bytes(cfg: Config, n_params: int, world_size: int) -> int:
    """One rank's weights, gradients and optimizer state on the host, under its engine's sharding."""
    e, w = cfg.engine, max(1, world_size)
    if e.kind == "fsdp" or (e.kind == "zero" and e.zero_stage == 3):
        per_param = (WEIGHT + GRAD + MOMENTS) / w
    elif e.kind == "zero":
        per_param = WEIGHT + (GRAD / w if e.zero_stage == 2 else GRAD) + MOMENTS / w
    else:
        per_param = WEIGHT + GRAD + MOMENTS
    return int(per_param * n_params)


def refuse_unfit(cfg: Config, n_params: int, device_type: str, world_size: int,
                 available: int | None = None) -> None:
    """ConfigError (exit 2) naming the estimate when this machine's ranks cannot hold the model."""
    if device_type != "cpu":
        return
    free = available_memory() if available is None else available
    if free is None:
        return
    local = int(os.environ.get("LOCAL_WORLD_SIZE", "1") or 1)
    first = int(os.environ.get("GROUP_RANK", "0") or 0) * local  # this machine's ranks: [first, first + local)
    model = model_bytes(cfg, n_params, world_size) * local
    beyond = sum(host_bytes(cfg, n_params, r, world_size) for r in range(first, first + local))
    if model + beyond > free:
        ranks = f" x {local} ranks" if local > 1 else ""
        raise ConfigError(
            f"a model of {n_params / 1e6:,.0f}M parameters needs {(model + beyond) / 1e9:.1f} GB of this machine's "
            f"memory before its first activation ({model / 1e9:.1f} GB of fp32 weights, gradients and AdamW "
            f"state{ranks}, {beyond / 1e9:.1f} GB of checkpoint snapshot and rewind points), and "
            f"{free / 1e9:.1f} GB is available; use a smaller model (configs/tiny.yaml), fewer ranks a "
            f"machine, engine.kind=fsdp, or a GPU")
