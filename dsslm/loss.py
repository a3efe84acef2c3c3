"""Token-weighted loss over all micro-batches and ranks of one optimizer step."""
from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from typing import Callable

import torch

from dsslm.engine.base import Engine
from dsslm.precision import autocast

IGNORE_INDEX = -100


def token_losses(logits: torch.Tensor, targets: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Sums over the real (non-ignored) targets of cross-entropy and of z = logsumexp(logits)^2.

    Both in fp32. The z-loss (PaLM) pulls log Z towards 0 so the logits cannot drift upwards
    until the softmax saturates, a common source of late spikes.
    """
    ce, z = per_token_losses(logits, targets)
    return ce.sum(), z.sum()


def per_token_losses(logits: torch.Tensor, targets: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Cross-entropy and z = logsumexp(logits)^2 of every target, flat, 0 where ignored (fp32)."""
    logits = logits.float().flatten(0, 1)
    targets = targets.flatten()
    real = targets != IGNORE_INDEX
    # One logsumexp serves both terms: cross-entropy is log Z minus the target's logit.
    log_z = torch.logsumexp(logits, dim=-1)
    target_logit = logits.gather(-1, targets.clamp(min=0).unsqueeze(-1)).squeeze(-1)
    return torch.where(real, log_z - target_logit, 0.0), torch.where(real, log_z.pow(2), 0.0)


@dataclass
class StepResult:
    loss: float         # mean cross-entropy per real target token, over every rank
    gnorm: float        # global gradient norm before clipping
    batch_tokens: int   # real target tokens in the step, over every rank
    stop_requested: bool  # any rank received SIGTERM/SIGUSR1
    # This rank's cross-entropy sum of each sequence, one detached tensor per micro-batch, left
    # on the device: read only when the step is a spike (forensics), so no host sync otherwise.
    sequence_ce: list[torch.Tensor] = field(default_factory=list)


def accumulate(engine: Engine, micro_batches: list[tuple[torch.Tensor, torch.Tensor]], precision: str,
               z_loss: float, clip: float | Callable[[float], float], stop_requested: bool = False,
               loss_multiplier: float = 1.0, grad_multiplier: float = 1.0) -> StepResult:
    """Forward and backward every micro-batch, then clip: the gradient is that of the step's
    summed token loss divided by its total real-token count, whatever the micro-batch split.

    A mean of per-micro-batch means would weight a token in a short micro-batch more than one
    in a long one; dividing every micro-batch's sum by the global count avoids that.
    `loss_multiplier` scales the last micro-batch's loss and reported sum on this rank: 1 in
    training, NaN (or a large factor) when a fault drill strikes. `grad_multiplier` scales only
    what is backpropagated, not the reported loss: a corrupted gradient (a flipped bit, a bad
    reduction) with an intact forward. `clip` is the bound, or a function of the pre-clip norm
    that gives it (`dsslm.clip.ZClip.bound`).
    """
    local_tokens = sum(int((t != IGNORE_INDEX).sum()) for _, t in micro_batches)
    tokens = int(engine.all_reduce_sum(torch.tensor([float(local_tokens)]))[0])
    # Every engine averages gradients over ranks, so scale by world_size to get the global sum.
    scale = engine.world_size / max(tokens, 1)
    ce_total = torch.zeros((), dtype=torch.float64)
    sequence_ce: list[torch.Tensor] = []
    last = len(micro_batches) - 1
    for i, (inputs, targets) in enumerate(micro_batches):
        inputs, targets = inputs.to(engine.device), targets.to(engine.device)
        sync = contextlib.nullcontext() if i == last else engine.no_sync()
        with sync:
            with autocast(precision, engine.device):
                logits = engine.forward(inputs)
            ce, z = per_token_losses(logits, targets)
            ce_sum, z_sum = ce.sum(), z.sum()
            loss = (ce_sum + z_loss * z_sum) * scale
            if loss_multiplier != 1.0 and i == last:
                loss, ce_sum = loss * loss_multiplier, ce_sum * loss_multiplier
            if grad_multiplier != 1.0 and i == last:
                loss = loss * grad_multiplier
            engine.backward(loss)
        sequence_ce.append(ce.detach().view(targets.shape).sum(-1))
        ce_total += ce_sum.detach().double().cpu()
    gnorm = engine.clip_grad_norm(clip)
    # One collective carries the loss sum and every rank's stop flag.
    reduced = engine.all_reduce_sum(torch.tensor([float(ce_total), float(stop_requested)],
                                                 dtype=torch.float64))
    return StepResult(loss=float(reduced[0]) / max(tokens, 1), gnorm=gnorm, batch_tokens=tokens,
                      stop_requested=bool(reduced[1] > 0), sequence_ce=sequence_ce)
