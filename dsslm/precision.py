"""Mixed precision: autocast for matmuls, and the dynamic loss scaler fp16 needs.

bf16 has fp32's exponent range, so it needs no scaler; fp16 (max 65504) overflows without one.
Master weights and Adam moments stay fp32 in every mode: autocast casts copies per op.
"""
from __future__ import annotations

import contextlib
import math

import torch

from dsslm.fields import MAX_COUNT, Fields, Float, Int

# The fp16 loss scaler's checkpointed state. The ds_* fields are DeepSpeed's own counters (the ZeRO
# engine's view of its scaler); a LossScaler ignores them, so an fp16 checkpoint resumes under any engine.
SCALER_SPEC = Fields(optional=("ds_cur_iter", "ds_last_overflow_iter", "ds_cur_hysteresis"),
                       scale=Float(2.0**-24, 2.0**64), clean_steps=Int(0, MAX_COUNT), overflows=Int(0, MAX_COUNT),
                       ds_cur_iter=Int(-1, MAX_COUNT), ds_last_overflow_iter=Int(-1, MAX_COUNT),
                       ds_cur_hysteresis=Int(0, 1 << 20))
AUTOCAST_DTYPE = {"bf16": torch.bfloat16, "fp16": torch.float16}


def autocast(precision: str, device: torch.device) -> contextlib.AbstractContextManager:
    if precision == "fp32":
        return contextlib.nullcontext()
    return torch.autocast(device_type=device.type, dtype=AUTOCAST_DTYPE[precision])


class LossScaler:
    """Multiply the loss by `scale`; on a non-finite gradient skip the step and halve the scale,
    after `growth_interval` clean steps double it. Its state is checkpointed (JSON)."""

    state_spec = SCALER_SPEC

    def __init__(self, scale: float = 2.0 ** 16, growth_interval: int = 2000,
                 growth_factor: float = 2.0, backoff_factor: float = 0.5, min_scale: float = 1.0):
        self.scale = scale
        self.growth_interval = growth_interval
        self.growth_factor = growth_factor
        self.backoff_factor = backoff_factor
        self.min_scale = min_scale
        self.clean_steps = 0
        self.overflows = 0

    def update(self, grad_norm: float) -> bool:
        """Record this step's unscaled grad norm; True when it overflowed (the step must be skipped)."""
        if not math.isfinite(grad_norm):
            self.scale = max(self.min_scale, self.scale * self.backoff_factor)
            self.clean_steps = 0
            self.overflows += 1
            return True
        self.clean_steps += 1
        if self.clean_steps % self.growth_interval == 0:
            self.scale *= self.growth_factor
        return False

    def state_dict(self) -> dict:
        return {"scale": self.scale, "clean_steps": self.clean_steps, "overflows": self.overflows}

    def load_state_dict(self, state: dict) -> None:
        self.scale = float(state["scale"])
        self.clean_steps = int(state["clean_steps"])
        self.overflows = int(state["overflows"])
