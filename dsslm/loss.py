"""Token-weighted loss over all micro-batches and ranks of one optimizer step."""
from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass, field
from typing import Callable, Iterable

import torch

from dsslm.engine.base import Engine
from dsslm.precision import autocast

IGNORE_INDEX = -100


class _TokenLossFn(torch.autograd.Function):
    """Both sums from one logsumexp, and one fused backward: softmax times each row's
    coefficient, minus the cross-entropy weight at the target (about 40% less time than
    autograd through logsumexp and gather on a CPU step)."""

    @staticmethod
    def forward(ctx, logits: torch.Tensor, targets: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        flat = logits.float().flatten(0, -2)
        targets = targets.flatten()
        real = targets != IGNORE_INDEX
        index = targets.clamp(min=0).unsqueeze(-1)
        # Cross-entropy is log Z minus the target's logit.
        log_z = torch.logsumexp(flat, dim=-1)
        ce = torch.where(real, log_z - flat.gather(-1, index).squeeze(-1), 0.0)
        z_sum = torch.where(real, log_z.square(), 0.0).sum()
        ctx.save_for_backward(flat, log_z, index, real)
        ctx.logits_shape, ctx.logits_dtype = logits.shape, logits.dtype
        # Each sequence's sum too, for spike forensics: left on the device, read only on a spike.
        of_sequences = ce.view(logits.shape[:-1]).sum(-1)
        ctx.mark_non_differentiable(of_sequences)
        return ce.sum(), z_sum, of_sequences

    @staticmethod
    def backward(ctx, grad_ce: torch.Tensor, grad_z: torch.Tensor, _grad_of_sequences: torch.Tensor):
        flat, log_z, index, real = ctx.saved_tensors
        # d(ce)/dx = softmax - onehot(target); d(log Z^2)/dx = 2 log Z softmax.
        coef = torch.where(real, grad_ce + 2.0 * grad_z * log_z, 0.0)
        grad = torch.sub(flat, log_z.unsqueeze(-1)).exp_().mul_(coef.unsqueeze(-1))
        at_target = torch.where(real, -grad_ce, 0.0).to(grad.dtype).unsqueeze(-1)
        grad.scatter_add_(-1, index, at_target)
        return grad.view(ctx.logits_shape).to(ctx.logits_dtype), None


def token_losses(logits: torch.Tensor, targets: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Sums over the real (non-ignored) targets of cross-entropy and of z = logsumexp(logits)^2.

    Both in fp32. The z-loss (PaLM) pulls log Z towards 0 so the logits cannot drift upwards
    until the softmax saturates, a common source of late spikes.
    """
    ce_sum, z_sum, _ = _TokenLossFn.apply(logits, targets)
    return ce_sum, z_sum


@dataclass
class StepResult:
    loss: float         # mean cross-entropy per real target token, over every rank
    gnorm: float        # global gradient norm before clipping
    batch_tokens: int   # real target tokens in the step, over every rank
    stop_requested: bool  # any rank received SIGTERM/SIGUSR1
    failed: bool = False  # some rank reported a failure it saw before the step (train.check_health)
    # This rank's cross-entropy sum of each sequence, one detached tensor per micro-batch, left
    # on the device: read only when the step is a spike (forensics), so no host sync otherwise.
    sequence_ce: list[torch.Tensor] = field(default_factory=list)
    # Every rank's mean loss per real token of each sequence (rank by rank, in batch order), read in
    # the step's one host sync: the whole global batch, whatever its split, goes into the monitor's
    # history of sequence losses (`SpikeMonitor.blame`), so a verdict sees the same evidence at any
    # micro-batch, accumulation and world size.
    sequence_losses: list[float] = field(default_factory=list)


def accumulate(engine: Engine, micro_batches: list[tuple[torch.Tensor, torch.Tensor]], precision: str,
               z_loss: float, clip: float | Callable[[float], float], tokens_global: int,
               stop_requested: bool | Callable[[], bool] = False, loss_multiplier: float = 1.0, grad_multiplier: float = 1.0,
               failed: bool = False) -> StepResult:
    """Forward and backward every micro-batch, then clip: the gradient is that of the step's
    summed token loss over its total real-token count `tokens_global` (every rank's), whatever the
    micro-batch split; a mean of micro-batch means would weight short micro-batches up.

    The caller knows `tokens_global` before the step (training batches are full), so no
    collective precedes the first forward; the step's one small all-reduce carries the count the
    batches really hold, and a mismatch fails the step before its update. `loss_multiplier`
    scales the last micro-batch's loss on this rank (a drill's NaN or spike); `grad_multiplier`
    only what is backpropagated (a corrupted gradient, intact forward). `clip` is the bound or a
    function of the pre-clip norm (`dsslm.clip.ZClip.bound`). `failed` rides in the same
    all-reduce as the stop flag: a failure this rank saw, for every rank to act on before the
    update. One host sync per step (one more for a norm-dependent bound).
    """
    if tokens_global < 1:
        raise ValueError(f"tokens_global={tokens_global}: a step needs at least one real target token")
    # Every engine averages gradients over ranks, so scale by world_size to get the global sum.
    scale = engine.world_size / tokens_global
    ce_total = torch.zeros((), dtype=torch.float64, device=engine.device)
    real_total = torch.zeros((), dtype=torch.float64, device=engine.device)
    sequence_ce: list[torch.Tensor] = []
    sequence_real: list[torch.Tensor] = []
    last = len(micro_batches) - 1
    for i, (inputs, targets) in enumerate(micro_batches):
        # non_blocking: the prefetcher pins host batches on CUDA, so the copy overlaps the host
        inputs, targets = inputs.to(engine.device, non_blocking=True), targets.to(engine.device, non_blocking=True)
        sync = contextlib.nullcontext() if i == last else engine.no_sync()
        with sync:
            with autocast(precision, engine.device):
                logits = engine.forward(inputs)
            ce_sum, z_sum, ce_of_sequences = _TokenLossFn.apply(logits, targets)
            loss = (ce_sum + z_loss * z_sum) * scale
            if loss_multiplier != 1.0 and i == last:
                loss, ce_sum = loss * loss_multiplier, ce_sum * loss_multiplier
            if grad_multiplier != 1.0 and i == last:
                loss = loss * grad_multiplier
            engine.backward(loss)
        sequence_ce.append(ce_of_sequences)
        sequence_real.append((targets != IGNORE_INDEX).sum(-1))
        ce_total += ce_sum.detach().double()
        real_total += (targets != IGNORE_INDEX).sum()
    gnorm = engine.clip_grad_norm(clip)
    # One collective carries the loss sum, every rank's stop and failure flags and its real-token count.
    # The stop flag as of now, after the backward: a signal during this step stops at its end.
    stop_now = stop_requested() if callable(stop_requested) else stop_requested
    flags = torch.tensor([float(stop_now), float(failed)], dtype=torch.float64, device=engine.device)
    per_sequence = (torch.cat(sequence_ce).detach().double() / torch.cat(sequence_real).clamp(min=1).double()
                    if sequence_ce else torch.zeros(0, dtype=torch.float64, device=engine.device))
    # Every rank's sequence losses ride in the same all-reduce, each rank's in its own slots (every
    # rank holds as many sequences: a step's batch is a multiple of accumulation x world size), so
    # the monitor sees the whole global batch, not rank 0's share: a few floats a sequence.
    n = per_sequence.numel()
    everyone = torch.zeros(n * engine.world_size, dtype=torch.float64, device=engine.device)
    everyone[engine.rank * n:(engine.rank + 1) * n] = per_sequence
    reduced = engine.all_reduce_sum(torch.cat((ce_total.reshape(1), flags, real_total.reshape(1), everyone)))
    # The one host sync of the step: everything the loop needs, read together.
    ce, stops, failures, real, norm, *sequence_losses = torch.cat(
        (reduced[:4], gnorm.detach().double().reshape(1).to(reduced.device), reduced[4:])).tolist()
    if real != tokens_global:
        raise RuntimeError(f"the step was scaled for tokens_global={tokens_global} real targets but its batches "
                           f"hold {int(real)}: the caller's count is wrong, so its gradient would be too")
    return StepResult(loss=ce / tokens_global, gnorm=norm, batch_tokens=tokens_global, stop_requested=stops > 0,
                      failed=failures > 0,
                      sequence_ce=sequence_ce, sequence_losses=sequence_losses)


@dataclass
class ValSums:
    """One domain's validation pass: summed cross-entropy (nats), real targets, their bytes of text."""
    nats: float = 0.0
    tokens: int = 0
    bytes: int | None = 0  # None: the tokenizer cannot count this domain's bytes exactly

    @property
    def loss(self) -> float:
        return self.nats / self.tokens

    @property
    def bits_per_byte(self) -> float | None:
        return bits_per_byte(self.nats, self.bytes)


def bits_per_byte(nats: float, n_bytes: int | None) -> float | None:
    """Summed cross-entropy in bits over the bytes of text it predicted: loss_bits * tokens / bytes."""
    return nats / math.log(2) / n_bytes if n_bytes else None


@torch.no_grad()
def validation_sums(forward: Callable[[torch.Tensor], torch.Tensor], batches: Iterable[tuple[torch.Tensor, torch.Tensor]],
                    precision: str, device: torch.device,
                    count_bytes: Callable[[torch.Tensor], int | None] = lambda targets: None) -> ValSums:
    """Forward every batch under the run's autocast; what training's val_loss and dsslm.eval share,
    so both give the same number for the same checkpoint."""
    sums = ValSums()
    for inputs, targets in batches:
        with autocast(precision, device):
            logits = forward(inputs.to(device))
        sums.nats += float(token_losses(logits, targets.to(device))[0])
        sums.tokens += int((targets != IGNORE_INDEX).sum())
        n_bytes = count_bytes(targets)
        sums.bytes = None if n_bytes is None or sums.bytes is None else sums.bytes + n_bytes
    return sums
