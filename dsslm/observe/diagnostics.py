"""Training diagnostics, measured from outside the model: MFU, logit maxima, norms, memory.

`Diagnostics` is the loop's one object for them. Every step it adds `mfu` (when the GPU's peak
is known) and feeds `observe.alerts.Alerts`. Every `observe.every` steps it also adds, to that step's
metrics record:

- `param_norm`, `update_norm`, `update_ratio`: `{group: float}` over the layer groups
  embeddings, attention, mlp, norms and head (head only when untied). The update is the change
  made by this step's optimizer step: a `full_state()` snapshot before it, one after. Both
  norms are of the weights before the update, so update_ratio = ||delta theta|| / ||theta||.
- `max_attn_logit` (and `max_attn_logit_by_layer`): the largest pre-softmax score q.k/sqrt(d) (muP: x its scale)
  over the causal positions of a fixed probe batch (the first val sequences), recomputed from
  each attention module's qkv output (a forward hook) with the module's own `split_heads`
  (QK-norm and RoPE as the model applies them). The probe runs eager under `train.compile`, so
  its hooks never cost a recompile.
- `max_logit`: the largest |output logit| on the probe batch.
- `peak_mem_bytes`: the largest over ranks of `torch.cuda.max_memory_allocated` on GPU, of the
  process's max RSS on CPU.
- `diagnostics_s`: what the measurement cost, outside `step_time_s`.

Cost of a measured step: two weights-only `full_state(with_optim=False)` calls (on sharded engines
each a full gather of the fp32 weights, 4 B/param, a third of a checkpoint's), one fp32 copy of the weights on the host, one
no-grad forward of the probe batch. Nothing consumes RNG or touches the weights, so a run with
diagnostics trains bit for bit like one without.
"""
from __future__ import annotations

import contextlib
import math
import os
import re
import resource
import sys
import time
from typing import Any, Iterator

import numpy as np
import torch
from torch import nn

from dsslm.config import Config
from dsslm.data.loader import Loader
from dsslm.engine.base import Engine
from dsslm.observe.alerts import Alerts, cpu_contention
from dsslm.observe.sinks import Sinks
from dsslm.model import LAYER_GROUPS as GROUPS, Attention, layer_group
from dsslm.precision import autocast

# Dense (no sparsity) bf16 tensor-core peak FLOP/s by torch.cuda.get_device_name(); first match
# wins, so a more specific pattern comes before one it contains (H100 PCIe before H100).
PEAK_BF16_FLOPS = (
    (r"H100.*PCIe", 756e12), (r"H100 NVL", 835e12), (r"H100|H200|H800", 989e12), (r"\bH20\b", 148e12),
    (r"B200", 2250e12), (r"B100", 1750e12), (r"A100|A800", 312e12),
    (r"L40S", 362e12), (r"L40\b", 181e12), (r"\bL4\b", 121e12), (r"\bA10\b", 125e12),
    (r"RTX A6000", 155e12), (r"RTX 4090", 165e12), (r"RTX 3090", 71e12),
    (r"MI300X", 1307e12), (r"MI250X", 383e12),
)
SCORE_ROWS = 256  # query rows per block: B*H*256*T fp32 scores at a time, not B*H*T*T


def peak_flops_of(device_name: str) -> float | None:
    """The bf16 dense peak of a GPU by name; None when it is not in the table (then no MFU)."""
    return next((flops for pattern, flops in PEAK_BF16_FLOPS if re.search(pattern, device_name)), None)


def peak_flops(device: torch.device) -> float | None:
    return peak_flops_of(torch.cuda.get_device_name(device)) if device.type == "cuda" else None


def flops_per_token(n_params: int, n_layers: int, d_model: int, seq_len: int) -> float:
    """Training FLOPs per token: 6N for the weight matmuls (2 forward, 4 backward per parameter)
    plus 12*L*d*T for the attention scores and their weighted sum (PaLM, appendix B)."""
    return 6 * n_params + 12 * n_layers * d_model * seq_len


def model_flops_utilization(flops_per_token: float, tokens_per_s: float, peak: float, world_size: int) -> float:
    """MFU: achieved model FLOP/s over the peak of every GPU in the job (tokens_per_s is global)."""
    return flops_per_token * tokens_per_s / (peak * world_size)


def peak_memory_bytes(device: torch.device) -> int:
    if device.type == "cuda":
        return int(torch.cuda.max_memory_allocated(device))
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return int(rss if sys.platform == "darwin" else rss * 1024)  # KiB on Linux, bytes on macOS


# --- parameter and update norms ------------------------------------------------------------------
def update_stats(before: dict[str, torch.Tensor], after: dict[str, torch.Tensor]) -> dict[str, dict[str, float]]:
    """Per layer group: L2 norm of the weights before, of the change, and their ratio (fp64 sums)."""
    param_sq: dict[str, float] = {}
    update_sq: dict[str, float] = {}
    for name, new in after.items():
        old = before[name].to(new.device)
        group = layer_group(name)
        param_sq[group] = param_sq.get(group, 0.0) + float(torch.linalg.vector_norm(old, dtype=torch.float64)) ** 2
        delta = torch.linalg.vector_norm(new.float() - old.float(), dtype=torch.float64)
        update_sq[group] = update_sq.get(group, 0.0) + float(delta) ** 2
    groups = [g for g in GROUPS if g in param_sq]
    param_norm = {g: math.sqrt(param_sq[g]) for g in groups}
    update_norm = {g: math.sqrt(update_sq[g]) for g in groups}
    ratio = {g: update_norm[g] / param_norm[g] if param_norm[g] > 0 else math.inf for g in groups}
    return {"param_norm": param_norm, "update_norm": update_norm, "update_ratio": ratio}


# --- attention logits ----------------------------------------------------------------------------
def causal_max_score(q: torch.Tensor, k: torch.Tensor, scale: float | None = None) -> float:
    """max over batch, heads and causal (key <= query) positions of q.k / sqrt(head_dim), or q.k x
    `scale` where the attention has its own (muP's, model.Attention.scale)."""
    q, k = q.float(), k.float()
    seq = q.shape[-2]
    keys = torch.arange(seq, device=q.device)
    best = -math.inf
    for start in range(0, seq, SCORE_ROWS):
        scores = q[..., start:start + SCORE_ROWS, :] @ k.transpose(-1, -2)
        scores = scores / math.sqrt(q.shape[-1]) if scale is None else scores * scale
        queries = torch.arange(start, start + scores.shape[-2], device=q.device)
        scores.masked_fill_(keys[None, :] > queries[:, None], -math.inf)
        best = max(best, float(scores.max()))
    return best


class _LayerProbe:
    """Forward hooks on one Attention module: its rope table (input) and qkv output; the score
    maximum once the module has run."""

    def __init__(self, attn: Attention):
        self.attn, self.seen, self.max_score = attn, {}, -math.inf
        self.handles = [attn.register_forward_pre_hook(self._inputs),
                        attn.qkv.register_forward_hook(self._qkv),
                        attn.register_forward_hook(self._done)]

    def _inputs(self, module: nn.Module, args: tuple) -> None:
        # Attention.forward(x, rope, mask): under model.document_mask the maximum is still over
        # every causal score, cross-document ones included: an upper bound of what softmax sees.
        self.seen["rope"] = args[1]

    def _qkv(self, module: nn.Module, args: tuple, out: torch.Tensor) -> None:
        self.seen["qkv"] = out.detach()

    def _done(self, module: nn.Module, args: tuple, out: torch.Tensor) -> None:
        q, k, _ = self.attn.split_heads(self.seen["qkv"], self.seen["rope"])
        self.max_score = max(self.max_score, causal_max_score(q, k, self.attn.scale))
        self.seen.clear()

    def remove(self) -> None:
        for handle in self.handles:
            handle.remove()


@contextlib.contextmanager
def attention_score_probe(model: nn.Module) -> Iterator[list[_LayerProbe]]:
    """Hooks every Attention module of `model` for the forward passes inside the block."""
    probes = [_LayerProbe(m) for m in model.modules() if isinstance(m, Attention)]
    try:
        yield probes
    finally:
        for probe in probes:
            probe.remove()


# --- the loop's object ---------------------------------------------------------------------------
class Diagnostics:
    """MFU and alerts every step, the measurements above every `observe.every` steps.

    `snapshot` and `observe` run on every rank (full_state, the probe forward and the memory
    gather are collectives); only rank 0's sinks write.
    """

    def __init__(self, cfg: Config, engine: Engine, sinks: Sinks, loader: Loader):
        self.cfg, self.engine, self.sinks = cfg, engine, sinks
        self.every = cfg.observe.every
        self.alerts = Alerts.from_config(cfg.observe)
        model = cfg.model
        self.flops_per_token = flops_per_token(self.engine.n_params, model.n_layers, model.d_model, model.seq_len)
        self.peak_flops = peak_flops(self.engine.device)
        self.probe = probe_batch(loader, cfg.observe.probe_sequences) if self.every else None
        self.snapshot_s = 0.0

    def snapshot(self, step: int) -> dict[str, torch.Tensor] | None:
        """The weights before the optimizer step that makes step `step + 1`, when it is measured."""
        if not self.every or (step + 1) % self.every:
            return None
        started = time.perf_counter()
        model_sd, _ = self.engine.full_state(with_optim=False)
        # A copy on the host: DDP hands back the live parameters (the step would change our
        # "before" in place), and a device copy would show up in peak memory.
        before = {name: t.detach().to("cpu", copy=True) for name, t in model_sd.items()}
        self.snapshot_s = time.perf_counter() - started
        return before

    def observe(self, record: dict, before: dict[str, torch.Tensor] | None) -> dict:
        """`record` plus this step's diagnostics; emits the alerts it raises."""
        record = dict(record)
        if self.peak_flops:
            record["mfu"] = model_flops_utilization(self.flops_per_token, record["tokens_per_s"],
                                                    self.peak_flops, self.engine.world_size)
        if before is not None and record["verdict"] == "ok":  # the verdict is the same on every rank
            record.update(self.measure(before))
        for alert in self.alerts.check_step(record["loss"], record["gnorm"], record["tokens_per_s"],
                                            applied=record["verdict"] == "ok"):
            if alert["reason"] == "slow_throughput":  # the machine's side of it: the usual cause on a CPU
                contention = cpu_contention(torch.get_num_threads(), int(os.environ.get("LOCAL_WORLD_SIZE", "1") or 1))
                if contention:
                    alert = {**alert, **contention, "message": f"{alert['message']}: {contention['cause']}"}
            self.sinks.emit("alert", step=record["step"], **alert)
        return record

    def check_val(self, step: int, val_loss: dict[str, float]) -> None:
        for alert in self.alerts.check_val(val_loss):
            self.sinks.emit("alert", step=step, **alert)

    def measure(self, before: dict[str, torch.Tensor]) -> dict:
        started = time.perf_counter()
        # First, before the probe forward and the comparison allocate anything.
        peak_mem = max(self.engine.all_gather(peak_memory_bytes(self.engine.device)))
        after, _ = self.engine.full_state(with_optim=False)
        out: dict[str, Any] = update_stats(before, after) if self.engine.is_main else {}
        del after
        scores, max_logit = self.probe_logits()
        out.update(max_attn_logit=max(scores), max_attn_logit_by_layer={str(i): s for i, s in enumerate(scores)},
                   max_logit=max_logit, peak_mem_bytes=peak_mem,
                   diagnostics_s=self.snapshot_s + time.perf_counter() - started)
        return out

    @torch.no_grad()
    def probe_logits(self) -> tuple[list[float], float]:
        """Per-layer max attention score and max |logit| on the probe batch (eval mode: no dropout)."""
        engine = self.engine
        engine.train_mode(False)
        try:
            # Eager even under train.compile: hooks inside a compiled block would force a recompile.
            with attention_score_probe(engine.module) as probes, torch.compiler.set_stance("force_eager"):
                with autocast(self.cfg.train.precision, engine.device):
                    logits = engine.forward(self.probe.to(engine.device))
            return [p.max_score for p in probes], float(logits.float().abs().max())
        finally:
            engine.train_mode(True)


def probe_batch(loader: Loader, sequences: int) -> torch.Tensor:
    """The first val sequences of the first domain (fixed, seed-independent), else the first
    training batch's, for a corpus prepared without a val split."""
    batches = loader.val_batches(loader.domains[0], 1, max(1, sequences))
    inputs = batches[0][0] if batches else loader.read(np.arange(max(1, sequences)))[0]
    return inputs[:max(1, sequences)]
