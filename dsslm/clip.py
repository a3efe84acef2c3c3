"""Gradient clipping policies: a fixed global-norm bound, or ZClip's adaptive one.

`optim.clip_mode=fixed` clips every step's global gradient norm to `optim.clip`.

`optim.clip_mode=zclip` (Kumar et al., "ZClip: Adaptive Spike Mitigation for LLM Pre-Training",
2025) keeps an exponential moving average of the grad norm's mean and variance. A norm whose
z-score z = (g - mean) / std exceeds `optim.zclip_z` is clipped to mean + zclip_z^2 * std / z
(the larger the outlier, the harder it is cut), and the EMA then learns the clipped value, not
the outlier. The first `optim.zclip_warmup_steps` norms only seed the mean and variance.
`optim.clip` stays an absolute ceiling on top (set it very high for ZClip alone).

The EMA learns a step only when its update is applied (`commit()` after `engine.step`): a step
the spike policy skips, rewinds or re-runs in place teaches it nothing, so a re-run computes the
same bound as a run that never had the fault. The state (mean, variance, warm-up norms) is a
part of every checkpoint and resumes exactly (floats round-trip through JSON).
"""
from __future__ import annotations

import math
from typing import Any, Callable, Union

from dsslm.config import OptimCfg
from dsslm.fields import Fields, Float, Int, ListOf, Optional, Spec, StateError

# A clipping bound: a number, or a function of the pre-clip global norm that returns it (ZClip).
ClipBound = Union[float, Callable[[float], float]]

STATE_FORMAT = 1
STD_EPS = 1e-6  # ZClip's: a constant norm (std 0) is not infinitely far from its mean


class Clipper:
    """The bound `accumulate` clips with, and what the policy learns once a step is applied."""

    def __init__(self, cfg: OptimCfg):
        self.cfg = cfg
        self.last_bound = cfg.clip  # the bound of the step computed last: clip_frac counts norms above it

    @property
    def limit(self) -> ClipBound:
        return self.cfg.clip

    def commit(self) -> None:
        """The step's update was applied."""


class ZClip(Clipper):
    def __init__(self, cfg: OptimCfg):
        super().__init__(cfg)
        self.mean: float | None = None
        self.var: float | None = None
        self.warmup_norms: list[float] = []
        self._pending: float | None = None  # what commit() teaches the EMA: this step's clipped norm
        self.state_spec = _ZClipState(cfg.zclip_warmup_steps)

    @property
    def limit(self) -> ClipBound:
        return self.bound

    def bound(self, norm: float) -> float:
        """The clip bound for a step whose pre-clip global norm is `norm` (every rank computes the
        same one from the same norm and state). Learns nothing until commit()."""
        self.last_bound = self._bound(norm)
        return self.last_bound

    def _bound(self, norm: float) -> float:
        self._pending = None
        if not math.isfinite(norm):
            return self.cfg.clip  # the spike policy refuses this step; nothing to learn from it
        if self.mean is None:
            self._pending = norm
            return self.cfg.clip
        std = math.sqrt(self.var)
        z = (norm - self.mean) / (std + STD_EPS)
        if z <= self.cfg.zclip_z:
            self._pending = norm
            return self.cfg.clip
        adaptive = self.mean + self.cfg.zclip_z ** 2 * std / z
        self._pending = adaptive
        return min(adaptive, self.cfg.clip)

    def commit(self) -> None:
        g, self._pending = self._pending, None
        if g is None:
            return
        if self.mean is None:
            self.warmup_norms.append(g)
            if len(self.warmup_norms) >= self.cfg.zclip_warmup_steps:
                n = len(self.warmup_norms)
                self.mean = sum(self.warmup_norms) / n
                self.var = sum((x - self.mean) ** 2 for x in self.warmup_norms) / n
                self.warmup_norms = []
            return
        a = self.cfg.zclip_alpha
        self.mean = a * self.mean + (1 - a) * g
        self.var = a * self.var + (1 - a) * (g - self.mean) ** 2

    def state_dict(self) -> dict:
        return {"format": STATE_FORMAT, "mean": self.mean, "var": self.var, "warmup_norms": list(self.warmup_norms)}

    def load_state_dict(self, state: dict) -> None:
        self.mean, self.var = state["mean"], state["var"]
        self.warmup_norms = [float(x) for x in state["warmup_norms"]]
        self._pending = None


class _ZClipState(Spec):
    def __init__(self, warmup_steps: int):
        self.fields = Fields(format=Int(STATE_FORMAT, STATE_FORMAT), mean=Optional(Float(0.0)),
                             var=Optional(Float(0.0)), warmup_norms=ListOf(Float(0.0), max_len=warmup_steps))

    def validate(self, value: Any, path: str) -> None:
        self.fields.validate(value, path)
        if (value["mean"] is None) != (value["var"] is None):
            raise StateError(f"{path}.var: a mean without a variance (or the reverse)")
        if value["mean"] is not None and value["warmup_norms"]:
            raise StateError(f"{path}.warmup_norms: still warming up, yet the EMA is seeded")


def build_clipper(cfg: OptimCfg) -> Clipper:
    return ZClip(cfg) if cfg.clip_mode == "zclip" else Clipper(cfg)
