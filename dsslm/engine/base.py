"""The one interface `train()` talks to (Engine), and the verbs the engines that drive torch's
AdamW share (TorchAdamWEngine). The optimizer-state layout is in `state.py`, the rank helpers
(device, process group, gather_long's worker, the writers' Exchange) in `ranks.py`.

Ranks live in engine/ and nowhere else: the loop asks `engine.is_main`, never the environment.
"""
from __future__ import annotations

import abc
import contextlib
import gc
import math
import secrets
import sys
from typing import Any, Callable, TypeVar

import torch
import torch.distributed as dist
from torch import nn

from dsslm.clip import ClipBound
from dsslm.config import Config, accumulation_for
from dsslm.engine.blocks import set_matmul_precision
from dsslm.engine.ranks import STALL_TIMEOUT_S, Exchange, Worker, init_distributed, pick_device, picklable, wait_for_ranks
# MOMENTS, STATE_KINDS and optim_kinds: ckpt/resume.py and recovery/rewind_points.py import them from here.
from dsslm.engine.state import MOMENTS, STATE_KINDS, OptimState, Shard, StateReader, optim_kinds  # noqa: F401
from dsslm.muon import Fragment, MuonAdamW, Ranks
from dsslm.optim import adamw_impl, set_lr
from dsslm.precision import LossScaler

T = TypeVar("T")


def derive_grad_accum(cfg: Config, world_size: int) -> None:
    """Set train.grad_accum from train.global_batch_size at this world size (no-op when unset).

    The global batch is the setting and the accumulation its consequence, as in torchtitan and
    Megatron: a resume on another GPU count keeps the global batch, so the fingerprint matches and
    the learning-rate plan, defined per optimizer step, stays the plan."""
    if cfg.train.global_batch_size:
        cfg.train.grad_accum = accumulation_for(cfg.train, world_size)


def connect_muon(optimizer: torch.optim.Optimizer, cfg: Config,
                 held: list[tuple[torch.Tensor, list[Fragment]]] | None = None) -> None:
    """Give Muon the process group (`MuonAdamW.ranks`) and, on a sharded engine, its layout:
    `held` the tensors this rank steps and the `Fragment`s of matrices each holds (the same
    order on every rank); every rank's span of every matrix is gathered here, once."""
    if not isinstance(optimizer, MuonAdamW) or not dist.is_initialized():
        return
    world = dist.get_world_size()

    def all_gather(t: torch.Tensor) -> list[torch.Tensor]:
        out = [torch.empty_like(t) for _ in range(world)]
        dist.all_gather(out, t)  # looked up per call: a wrapper (a profiler, the bench) sees it
        return out

    def all_to_all(send: torch.Tensor, send_sizes: list[int], recv_sizes: list[int]) -> torch.Tensor:
        out = send.new_empty(sum(recv_sizes))
        dist.all_to_all_single(out, send, recv_sizes, send_sizes)
        return out
    optimizer.ranks = Ranks(dist.get_rank(), world, all_gather, all_to_all, cfg.optim.muon_distribute)
    if held is not None:
        mine = [(f.name, f.start, f.numel) for _, fragments in held for f in fragments]
        everyone: list = [None] * world
        dist.all_gather_object(everyone, mine)
        spans: dict[str, list[tuple[int, int]]] = {}
        for parts in everyone:
            for name, start, numel in parts:
                spans.setdefault(name, []).append((start, numel))
        if any(len(parts) != world for parts in spans.values()):
            raise AssertionError("every rank must name every hidden matrix once (numel 0 where it holds none)")
        optimizer.register(held, {name: tuple(parts) for name, parts in spans.items()})


class Engine(abc.ABC):
    """Shared state and collectives; subclasses implement wrap / backward / clip / step / state."""

    name = "base"
    # load_local_state reads every tensor whole (a replica on every rank), not only its own spans.
    replica_reads = False

    def __init__(self, cfg: Config, model: nn.Module):
        self.cfg = cfg
        self.device = pick_device(cfg)
        set_matmul_precision(self.device, cfg.train.tf32)
        self.optim_impl = adamw_impl(cfg.optim.impl, self.device)  # what optim.impl=auto resolved to
        # A group someone else made (the resume drill runs several jobs in one) outlives us.
        self.owns_group = not dist.is_initialized()
        init_distributed(self.device, cfg.engine.collective_timeout_s)
        self.distributed = dist.is_initialized()
        self.rank = dist.get_rank() if self.distributed else 0
        self.world_size = dist.get_world_size() if self.distributed else 1
        self.is_main = self.rank == 0
        derive_grad_accum(cfg, self.world_size)  # before DeepSpeed's config or the loader read it
        self.module = model  # the unwrapped model: parameter names for checkpoints come from it
        # Taken before any engine shards the model (ZeRO-3 replaces shapes with empty partitions):
        # what a checkpoint's tensors must match, name by name.
        self.param_shapes = {n: tuple(p.shape) for n, p in model.named_parameters()}
        self.n_params = sum(p.numel() for p in model.parameters())
        self.scaler = LossScaler(cfg.train.loss_scale_init) if cfg.train.precision == "fp16" else None

    # --- the training step -------------------------------------------------------------------
    @abc.abstractmethod
    def forward(self, inputs: torch.Tensor) -> torch.Tensor:
        ...

    def no_sync(self) -> contextlib.AbstractContextManager:
        return contextlib.nullcontext()

    @abc.abstractmethod
    def backward(self, loss: torch.Tensor) -> None:
        ...

    @abc.abstractmethod
    def clip_grad_norm(self, max_norm: ClipBound) -> torch.Tensor:
        """Clip to `max_norm` (or to what the function gives for the norm: ZClip), now or inside
        `step()`; return the global pre-clip norm as a 0-dim tensor on the device (not a float:
        the loop reads it with the step's other numbers, in one host sync)."""

    @abc.abstractmethod
    def step(self, lr: float) -> None:
        ...

    @abc.abstractmethod
    def skip_step(self) -> None:
        """Refuse this step's update: gradients dropped, weights and AdamW state untouched; the
        engine's own step counters record a skipped step."""

    def drop_gradients(self) -> None:
        """Forget this step's gradients as if the step had not been computed, counters included,
        so the same step can be computed again (an in-place re-run)."""
        self.skip_step()

    @abc.abstractmethod
    def grad_norms(self) -> dict[str, float]:
        """Each parameter's global L2 gradient norm before clipping, by name (every rank calls:
        sharded engines reduce; the same table on every rank). For forensics on spike steps."""

    def train_mode(self, training: bool) -> None:
        self.module.train(training)

    # --- state -------------------------------------------------------------------------------
    @abc.abstractmethod
    def full_state(self, with_optim: bool = True) -> tuple[dict[str, torch.Tensor], OptimState]:
        """Full fp32 weights and AdamW state by parameter name. Every rank calls (sharded engines
        gather); rank 0 gets the tensors, the others may get empty tables."""

    @abc.abstractmethod
    def load_full_state(self, model_sd: dict[str, torch.Tensor], optim: OptimState) -> None:
        """Every rank passes the full tensors; each keeps what it holds."""

    def local_state(self) -> list[Shard]:
        """This rank's part of the weights and optimizer state for a sharded checkpoint, without a
        collective and without materialising anything it does not hold: its FSDP or ZeRO
        shard; under DDP (a replica on every rank) the rows `rows_of` gives it. Every element of
        every tensor is in exactly one rank's list."""
        raise NotImplementedError(f"{self.name} cannot write sharded checkpoints; set ckpt.format=gathered")

    def load_local_state(self, reader: StateReader) -> None:
        """Take this rank's part of the weights and optimizer state from `reader`, reading only
        the spans it holds (a replica reads everything, tensor by tensor). No optimizer tensors
        in the checkpoint: the optimizer starts fresh."""
        raise NotImplementedError(f"{self.name} cannot read checkpoints through a reader")

    @abc.abstractmethod
    def memory_report(self) -> dict[str, int]:
        ...

    def exchange(self, name: str) -> "Exchange":
        """A channel for the ranks' checkpoint writers (threads, not the training thread) under
        `name`: each posts one value, rank 0 waits for all with a progress deadline."""
        if not self.distributed or self.world_size == 1:
            return Exchange(None, 1)
        store = dist.PrefixStore(f"dsslm/ckpt/{name}/", dist.distributed_c10d._get_default_store())
        return Exchange(store, self.world_size)

    # --- collectives -------------------------------------------------------------------------
    def all_reduce_sum(self, tensor: torch.Tensor) -> torch.Tensor:
        if self.distributed:
            tensor = tensor.to(self.device)
            dist.all_reduce(tensor, op=dist.ReduceOp.SUM)
        return tensor

    def broadcast(self, obj: Any) -> Any:
        """Rank 0's value of `obj` on every rank."""
        if not self.distributed:
            return obj
        box = [obj]
        dist.broadcast_object_list(box, src=0)
        return box[0]

    def decide(self, fn: Callable[[], T]) -> T:
        """`fn()` run on rank 0 alone, its result returned on every rank: how one decision (a
        verdict, a plan, which checkpoint) reaches all ranks, so none can take another branch.

        An exception `fn` raises on rank 0 is raised on every rank, so no rank is left waiting
        alone in the next collective; a BaseException too (a stop signal's Preempted, Ctrl-C), so
        every rank leaves the same way.
        """
        if not self.distributed:
            return fn()
        outcome: tuple[str, Any] = ("ok", None)
        if self.is_main:
            try:
                outcome = ("ok", fn())
            except BaseException as exc:  # noqa: BLE001 - re-raised below, on every rank
                outcome = ("raise", picklable(exc))
        kind, value = self.broadcast(outcome)
        if kind == "raise":
            if not self.is_main:
                # Rank 0 raised it and says so: the others' copies are not printed again
                # (train.main), so a refused resume on 64 ranks is one line, not 64.
                value.echoed = True
            raise value
        return value

    def raise_together(self, fn: Callable[[], None]) -> None:
        """`fn()` on rank 0 alone; what it raises is raised on every rank. decide() for a check that
        almost never fails, run at every step boundary: one all-reduce of a flag when nothing failed
        (half what decide's two broadcasts and pickling cost), the exception shipped only when
        there is one."""
        if not self.distributed:
            fn()
            return
        failure: BaseException | None = None
        if self.is_main:
            try:
                fn()
            except BaseException as exc:  # noqa: BLE001 - re-raised below, on every rank
                failure = exc
        if float(self.all_reduce_sum(torch.tensor([float(failure is not None)]))[0]) > 0:
            def reraise() -> None:
                raise failure
            self.decide(reraise)

    def gather_long(self, fn: Callable[[Callable[[int], None]], T], what: str, total_units: int = 0,
                    stall_timeout_s: float = STALL_TIMEOUT_S) -> list[T]:
        """[fn(progress) of every rank], for work that may outlast any collective timeout (hashing
        a corpus). `fn` runs in a thread and calls `progress(units)` as it goes. The ranks do not
        wait in a collective: each adds its progress and, when done, itself to counters in the
        process group's store and polls them there, failing only when no rank has made progress
        for `stall_timeout_s`. Once every rank is done, one all_gather (with everyone ready)
        carries the results. An exception `fn` raises on any rank is raised on every rank."""
        if not self.distributed:
            return [fn(lambda units: None)]
        # The default group's key-value store (what torch's own store-based barrier uses): every
        # launcher's group has one, and a get or add on it returns at once, whatever others do.
        # Keys under a name rank 0 draws: a group outlives a job (the drill runs several in one).
        name = self.decide(lambda: secrets.token_hex(8))
        store = dist.PrefixStore(f"dsslm/long/{name}/", dist.distributed_c10d._get_default_store())
        worker = Worker(fn)
        wait_for_ranks(store, worker, self.world_size, self.is_main, what, total_units, stall_timeout_s)
        outcomes = self.all_gather(worker.outcome)
        for kind, value in outcomes:
            if kind == "raise":
                raise value
        return [value for _, value in outcomes]


    def all_gather(self, obj: Any) -> list[Any]:
        if not self.distributed:
            return [obj]
        out: list[Any] = [None] * self.world_size
        dist.all_gather_object(out, obj)
        return out

    def scatter(self, objs: list[Any] | None) -> Any:
        """`objs[r]` on rank r; only rank 0's `objs` is read (the others pass None)."""
        if not self.distributed:
            return objs[0]
        out: list[Any] = [None]
        dist.scatter_object_list(out, objs if self.is_main else None, src=0)
        return out[0]

    def barrier(self) -> None:
        if self.distributed:
            dist.barrier()

    def close(self) -> None:
        if self.distributed and dist.is_initialized():
            if sys.exc_info()[0] is None:
                dist.barrier()  # leave together; not while an exception unwinds (the peer may not come)
            if self.owns_group:
                dist.destroy_process_group()
        # Free the model, optimizer and wrappers now, not at interpreter exit: gloo work objects
        # they keep alive hold tensors whose release at finalization aborts the process ("terminate
        # called without an active exception", ~1 run in 5 on the non-zero rank without this).
        for name, value in list(vars(self).items()):
            if not isinstance(value, (bool, int, float, str, torch.device, Config, type(None))):
                delattr(self, name)
        gc.collect()


class TorchAdamWEngine(Engine):
    """Shared verbs of the engines that drive a torch AdamW themselves (DDP, FSDP)."""

    optimizer: torch.optim.Optimizer
    params: dict[str, nn.Parameter]

    def backward(self, loss: torch.Tensor) -> None:
        if self.scaler is not None:
            loss = loss * self.scaler.scale
        loss.backward()

    def unscaled_grads(self) -> list[nn.Parameter]:
        """The parameters that have gradients, their gradients divided by the fp16 loss scale."""
        params = [p for p in self.params.values() if p.grad is not None]
        if self.scaler is not None:
            for p in params:
                p.grad.mul_(1.0 / self.scaler.scale)
        return params

    def step(self, lr: float) -> None:
        set_lr(self.optimizer, lr)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)

    def clip_params(self, params: list[nn.Parameter], max_norm: ClipBound) -> torch.Tensor:
        """torch's clip_grad_norm_ in its two halves (the same calls, so a fixed bound gives its
        bits), so the bound may depend on the norm. A fixed bound reads nothing back to the host;
        a function of the norm (ZClip) reads the norm once."""
        foreach = self.device.type == "cuda"
        norm = torch.nn.utils.get_total_norm([p.grad for p in params if p.grad is not None], foreach=foreach)
        bound = max_norm(float(whole(norm))) if callable(max_norm) else max_norm
        torch.nn.utils.clip_grads_with_norm_(params, bound, norm, foreach=foreach)
        self._clip = (norm, bound)  # so grad_norms() can report the norms before clipping
        return norm

    def pre_clip(self, norms: dict[str, float]) -> dict[str, float]:
        """Per-parameter norms read after clip_params, as they were before it."""
        clip = getattr(self, "_clip", None)
        if clip is None:
            return norms
        value = float(whole(clip[0]))
        coef = min(1.0, clip[1] / (value + 1e-6)) if math.isfinite(value) else 1.0
        return {name: v / coef if coef > 0 else v for name, v in norms.items()}

    def skip_step(self) -> None:
        # Dropping the gradients is the whole skip: AdamW's state (moments, step) is untouched.
        self.optimizer.zero_grad(set_to_none=True)


def whole(norm: torch.Tensor) -> torch.Tensor:
    """A norm FSDP returns as a DTensor, made whole."""
    return norm.full_tensor() if hasattr(norm, "full_tensor") else norm
