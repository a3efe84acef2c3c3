"""The one interface `train()` talks to, and the pieces every engine shares.

Ranks live here and nowhere else: the loop asks `engine.is_main`, never the environment.
"""
from __future__ import annotations

import abc
import contextlib
import gc
import math
import os
import pickle
import secrets
import sys
import threading
import time
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any, Callable, Protocol, TypeVar

import torch
import torch.distributed as dist
from torch import nn

from dsslm.clip import ClipBound
from dsslm.config import Config, ConfigError, accumulation_for
from dsslm.engine.blocks import set_matmul_precision
from dsslm.optim import MuonAdamW, adamw_impl, set_lr
from dsslm.precision import LossScaler

T = TypeVar("T")
MOMENTS = ("exp_avg", "exp_avg_sq")
# Every per-parameter tensor of the optimizer state: AdamW's moments, and Muon's momentum buffer
# (optim.name=muon, hidden matrices only; torch's state key "momentum_buffer").
STATE_KINDS = MOMENTS + ("momentum",)
TORCH_KEYS = {"exp_avg": "exp_avg", "exp_avg_sq": "exp_avg_sq", "momentum": "momentum_buffer"}
STATE_KIND_OF = {torch_key: kind for kind, torch_key in TORCH_KEYS.items()}  # torch's name -> the checkpoint's
# The collectives' timeout. Nothing waits in a collective for longer than a step, a checkpoint
# gather or rank 0 hashing the one checkpoint it loads (a 16 GB folder hashes in ~10-30 s); the
# one wait that grows with the corpus (hashing its shards) goes through `gather_long` instead.
COLLECTIVE_TIMEOUT_S = 1800
# gather_long fails when no rank has reported progress for this long: a rank stuck on I/O, not
# one that is slow (progress arrives every READ_BYTES hashed, many times a second).
STALL_TIMEOUT_S = 600
PROGRESS_EVERY_S = 30


@dataclass
class OptimState:
    """AdamW's state by parameter name (of the unwrapped model): the one layout every engine hands
    over and takes back, and the one a checkpoint stores, so a ZeRO run resumes under FSDP.

    `step` is Adam's own step count per parameter (bias correction), `exp_avg` and `exp_avg_sq`
    the fp32 moments at full (unsharded) shape. Under optim.name=muon the hidden matrices have
    `momentum` (Muon's buffer, full shape) and a step count instead of the two moments. Empty
    before the first optimizer step.
    """
    step: dict[str, float] = field(default_factory=dict)
    exp_avg: dict[str, torch.Tensor] = field(default_factory=dict)
    exp_avg_sq: dict[str, torch.Tensor] = field(default_factory=dict)
    momentum: dict[str, torch.Tensor] = field(default_factory=dict)

    def to_tensors(self) -> dict[str, torch.Tensor]:
        """One flat table for safetensors: `exp_avg/NAME`, `exp_avg_sq/NAME`, `momentum/NAME`, `step/NAME`."""
        flat = {f"{kind}/{name}": t for kind in STATE_KINDS for name, t in getattr(self, kind).items()}
        # fp64 so step counts past 2^24 stay exact.
        flat.update({f"step/{name}": torch.tensor([s], dtype=torch.float64) for name, s in self.step.items()})
        return flat

    @classmethod
    def from_tensors(cls, flat: dict[str, torch.Tensor]) -> "OptimState":
        out = cls()
        for key, tensor in flat.items():
            kind, _, name = key.partition("/")
            if kind == "step":
                out.step[name] = float(tensor.item())
            elif kind in STATE_KINDS:
                getattr(out, kind)[name] = tensor
            else:
                raise ValueError(f"optimizer tensor {key!r} is not step/, exp_avg/, exp_avg_sq/ or momentum/")
        return out

@dataclass
class Shard:
    """One rank's part of one checkpoint tensor: elements [start, end) of the row-major flattening
    of a tensor of `shape` (a span of whole rows under DDP and FSDP; ZeRO's flat partitions cut
    through rows). `tensor` holds those end - start elements, contiguous, on any device.

    Keys name what the tensor is: `model/NAME` (fp32 weights), `optim/STATE/NAME` (an optimizer
    state tensor of the parameter's shape: AdamW's exp_avg and exp_avg_sq, Muon's
    momentum_buffer, whatever the optimizer keeps per parameter) and `optim/step/NAME` (the
    optimizer's step count for the parameter, shape (1,) float64: written by rank 0 alone)."""
    key: str
    shape: tuple[int, ...]
    start: int
    end: int
    tensor: torch.Tensor


class StateReader(Protocol):
    """What a restore reads from: `keys()` the checkpoint's tensor keys (see Shard), `shape(key)`,
    `read(key, start, end)` elements [start, end) of that tensor's flattening, on the CPU."""

    def keys(self) -> list[str]: ...

    def shape(self, key: str) -> tuple[int, ...]: ...

    def read(self, key: str, start: int = 0, end: int | None = None) -> torch.Tensor: ...


def rows_of(shape: tuple[int, ...], rank: int, world_size: int) -> tuple[int, int]:
    """The element span of the rows rank `rank` owns when `world_size` ranks split a replicated
    tensor by rows (torch.chunk's split: ceil(rows / W) each, the last ranks fewer or none)."""
    rows = shape[0] if shape else 1
    row_len = math.prod(shape[1:]) if shape else 1
    per = -(-rows // world_size)
    first, last = min(rows, rank * per), min(rows, (rank + 1) * per)
    return first * row_len, last * row_len


def optim_kinds(reader: StateReader) -> dict[str, set[str]]:
    """{state name: parameter names} of the optimizer tensors in a checkpoint (`step` included)."""
    out: dict[str, set[str]] = {}
    for key in reader.keys():
        group, _, rest = key.partition("/")
        if group == "optim":
            kind, _, name = rest.partition("/")
            out.setdefault(kind, set()).add(name)
    return out


def adam_step_tensor(step: float, param: torch.Tensor, group: dict) -> torch.Tensor:
    """Adam's `step` as torch's AdamW makes it itself (torch/optim/adam.py `_init_group`): float32,
    on the parameter's device when the group runs fused or capturable (the CUDA kernels read it
    as a device pointer), a CPU scalar otherwise. A restore must put it back the same way."""
    if group.get("fused") or group.get("capturable"):
        return torch.tensor(float(step), dtype=torch.float32, device=param.device)
    return torch.tensor(float(step), dtype=torch.float32)


def state_tensor_like(value: torch.Tensor, param: torch.Tensor) -> torch.Tensor:
    """An optimizer state tensor for `param` from checkpoint values: the parameter's device, dtype
    and shape, a fresh tensor (no reference into the reader's buffers)."""
    return value.reshape(param.shape).to(device=param.device, dtype=param.dtype).clone()


def derive_grad_accum(cfg: Config, world_size: int) -> None:
    """Set train.grad_accum from train.global_batch_size at this world size (no-op when unset).

    The global batch is the setting and the accumulation its consequence, as in torchtitan and
    Megatron: a resume on another GPU count keeps the global batch, so the fingerprint matches and
    the learning-rate plan, defined per optimizer step, stays the plan."""
    if cfg.train.global_batch_size:
        cfg.train.grad_accum = accumulation_for(cfg.train, world_size)


def share_orthogonalisations(optimizer: torch.optim.Optimizer, cfg: Config) -> None:
    """optim.muon_distribute, on an engine where every rank holds every whole matrix (DDP, FSDP2,
    ZeRO-3): Muon gives each matrix to one rank and all-gathers the results (`MuonAdamW.share`)."""
    if not (isinstance(optimizer, MuonAdamW) and cfg.optim.muon_distribute and dist.is_initialized()
            and dist.get_world_size() > 1):
        return

    def gather(t: torch.Tensor) -> list[torch.Tensor]:
        out = [torch.empty_like(t) for _ in range(dist.get_world_size())]
        dist.all_gather(out, t)  # looked up per call: a wrapper (a profiler) sees it
        return out
    optimizer.share = (dist.get_rank(), dist.get_world_size(), gather)


def pick_device(cfg: Config) -> torch.device:
    want = cfg.train.device
    if want == "cuda" and not torch.cuda.is_available():  # torch's own error is an AttributeError deep inside
        raise ConfigError(f"train.device=cuda: no GPU is visible here (torch {torch.__version__}); use "
                          "train.device=auto or cpu, or a torch build with CUDA")
    if want == "cuda" or (want == "auto" and torch.cuda.is_available()):
        local_rank = int(os.environ.get("LOCAL_RANK", 0))
        if local_rank >= torch.cuda.device_count():
            raise ConfigError(f"LOCAL_RANK={local_rank} but {torch.cuda.device_count()} GPU(s) are visible; "
                              "launch at most one rank per GPU (--nproc_per_node)")
        torch.cuda.set_device(local_rank)
        return torch.device("cuda", local_rank)
    return torch.device("cpu")


def init_distributed(device: torch.device, timeout_s: int = COLLECTIVE_TIMEOUT_S) -> None:
    """Join the process group that torchrun / accelerate launch / srun described in the environment.

    Plain `python -m dsslm.train` (no WORLD_SIZE) stays a single process with no group at all.
    """
    if dist.is_initialized() or int(os.environ.get("WORLD_SIZE", "1")) <= 1:
        return
    # nccl only moves CUDA tensors; gloo is the CPU path (the one the tests exercise).
    backend = "nccl" if device.type == "cuda" else "gloo"
    dist.init_process_group(backend=backend, timeout=timedelta(seconds=timeout_s))


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
        init_distributed(self.device)
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
                outcome = ("raise", _picklable(exc))
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
        worker = _Worker(fn)
        self._wait_for_ranks(store, worker, what, total_units, stall_timeout_s)
        outcomes = self.all_gather(worker.outcome)
        for kind, value in outcomes:
            if kind == "raise":
                raise value
        return [value for _, value in outcomes]

    def _wait_for_ranks(self, store: Any, worker: "_Worker", what: str, total_units: int, stall_s: float) -> None:
        published, announced, poll_s = 0, False, 0.01
        last_seen, last_change = (-1, -1), time.monotonic()
        last_print = last_change
        while True:
            worker.thread.join(timeout=poll_s)
            poll_s = min(1.0, poll_s * 2)  # a quick job returns at once; a long one polls once a second
            done_units = worker.units
            if done_units > published:
                store.add("units", done_units - published)
                published = done_units
            if not worker.thread.is_alive() and not announced:
                store.add("ranks_done", 1)
                announced = True
            seen = (store.add("ranks_done", 0), store.add("units", 0))
            now = time.monotonic()
            if seen != last_seen:
                last_seen, last_change = seen, now
            if seen[0] >= self.world_size:
                return
            if now - last_change > stall_s:
                raise RuntimeError(f"{what}: no rank made progress for {stall_s:.0f} s ({seen[0]} of "
                                   f"{self.world_size} ranks done); a rank may be stuck reading its files")
            if self.is_main and now - last_print >= PROGRESS_EVERY_S:
                share = f" of {total_units / 1e9:.1f} GB" if total_units else ""
                print(f"dsslm: {what}: {seen[1] / 1e9:.1f}{share}, {seen[0]} of {self.world_size} ranks done",
                      flush=True)
                last_print = now

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


class Exchange:
    """Ranks' writer threads meet here, in the process group's key-value store, never inside a
    collective: a save may take longer than any collective timeout, and the training threads
    go on meanwhile. A rank posts progress (bytes written) as it goes and one value when done;
    `wait_all` fails only when no rank has made progress for `stall_s`."""

    def __init__(self, store: Any, world_size: int):
        self.store, self.world_size = store, world_size
        self.local: dict[int, str] = {}

    def progress(self, units: int) -> None:
        if self.store is not None and units:
            self.store.add("units", units)

    def post(self, rank: int, value: str) -> None:
        if self.store is None:
            self.local[rank] = value
        else:
            self.store.set(f"rank{rank}", value)

    def wait_all(self, stall_s: float = STALL_TIMEOUT_S, poll_s: float = 0.01) -> list[str]:
        if self.store is None:
            return [self.local[r] for r in range(self.world_size)]
        keys = [f"rank{r}" for r in range(self.world_size)]
        last_seen, last_change = None, time.monotonic()
        while True:
            done = sum(self.store.check([k]) for k in keys)
            seen = (done, self.store.add("units", 0))
            now = time.monotonic()
            if seen != last_seen:
                last_seen, last_change = seen, now
            if done == self.world_size:
                return [self.store.get(k).decode() for k in keys]
            if now - last_change > stall_s:
                raise RuntimeError(f"checkpoint save: no rank made progress for {stall_s:.0f} s ({done} of "
                                   f"{self.world_size} ranks done); a rank may be stuck writing its files")
            time.sleep(poll_s)
            poll_s = min(0.5, poll_s * 2)


class _Worker:
    """`fn(progress)` in a daemon thread (a rank stuck in I/O must not keep the process alive),
    counting the units it reports and keeping its result or exception."""

    def __init__(self, fn: Callable[[Callable[[int], None]], Any]):
        self.units = 0
        self.outcome: tuple[str, Any] = ("raise", RuntimeError("the work did not finish"))
        self._lock = threading.Lock()
        self._fn = fn
        self.thread = threading.Thread(target=self._run, name="dsslm-long-work", daemon=True)
        self.thread.start()

    def _progress(self, units: int) -> None:
        with self._lock:  # called from the work's own threads (hash_shards hashes several files at once)
            self.units += units

    def _run(self) -> None:
        try:
            self.outcome = ("ok", self._fn(self._progress))
        except Exception as exc:  # noqa: BLE001 - re-raised on every rank by gather_long
            self.outcome = ("raise", _picklable(exc))


def _picklable(exc: BaseException) -> BaseException:
    """`exc` itself if it survives the trip to the other ranks, else a RuntimeError saying what it was."""
    try:
        pickle.loads(pickle.dumps(exc))
        return exc
    except Exception:  # noqa: BLE001 - any failure to round-trip means: send a plain copy
        return RuntimeError(f"{type(exc).__name__}: {exc}")


def check_names(params: dict, model_sd: dict) -> None:
    """A checkpoint must name exactly this model's parameters."""
    missing = sorted(set(params) - set(model_sd))
    unexpected = sorted(set(model_sd) - set(params))
    if missing or unexpected:
        raise ValueError(f"checkpoint does not fit this model: missing {missing[:5]}, "
                         f"unexpected {unexpected[:5]}; check model.* against the checkpoint's config")


def adam_state_by_name(optimizer: torch.optim.Optimizer, names: dict[int, str]) -> OptimState:
    """torch AdamW state re-keyed by parameter name, in the engine-agnostic layout."""
    out = OptimState()
    for group in optimizer.param_groups:
        for param in group["params"]:
            state = optimizer.state.get(param)
            if not state:
                continue
            name = names[id(param)]
            out.step[name] = float(state["step"])
            for kind in STATE_KINDS:
                if TORCH_KEYS[kind] in state:
                    getattr(out, kind)[name] = state[TORCH_KEYS[kind]].detach().float()
    return out


def group_of(optimizer: torch.optim.Optimizer) -> dict[int, dict]:
    """id(param) -> its param group."""
    return {id(p): g for g in optimizer.param_groups for p in g["params"]}


def load_adam_state(optimizer: torch.optim.Optimizer, params: dict[str, nn.Parameter], optim: OptimState) -> None:
    """Write the named moments back into torch AdamW state (fresh tensors: no stale references),
    each on its parameter's device, Adam's step as torch's own kernels expect it."""
    optimizer.state.clear()
    groups = group_of(optimizer)
    for name, step in optim.step.items():
        param = params[name]
        optimizer.state[param] = {"step": adam_step_tensor(step, param, groups[id(param)]),
                                  **{TORCH_KEYS[kind]: state_tensor_like(getattr(optim, kind)[name], param)
                                     for kind in STATE_KINDS if name in getattr(optim, kind)}}


def replica_local_state(params: dict[str, nn.Parameter], optimizer: torch.optim.Optimizer, rank: int,
                        world_size: int) -> list[Shard]:
    """Shards of a replicated model (DDP, one process): each rank the rows `rows_of` gives it of
    every weight and every per-parameter optimizer tensor; rank 0 the step counts."""
    out = []
    for name, param in params.items():
        shape = tuple(param.shape)
        start, end = rows_of(shape, rank, world_size)
        tensors = {f"model/{name}": param.detach()}
        state = optimizer.state.get(param) or {}
        for kind, value in state.items():
            if kind == "step":
                if rank == 0:
                    out.append(Shard(f"optim/step/{name}", (1,), 0, 1,
                                     torch.tensor([float(value)], dtype=torch.float64)))
            elif torch.is_tensor(value) and tuple(value.shape) == shape:
                tensors[f"optim/{STATE_KIND_OF.get(kind, kind)}/{name}"] = value.detach()
        if end > start:
            out += [Shard(key, shape, start, end, t.float().reshape(-1)[start:end]) for key, t in tensors.items()]
    return out


def load_replica_state(params: dict[str, nn.Parameter], optimizer: torch.optim.Optimizer,
                       reader: StateReader) -> None:
    """A replica reads every tensor whole, one at a time (peak host memory: one tensor)."""
    with torch.no_grad():
        for name, param in params.items():
            param.copy_(reader.read(f"model/{name}").reshape(param.shape).to(param.dtype))
    optimizer.state.clear()
    kinds = optim_kinds(reader)
    groups = group_of(optimizer)
    for name in sorted(kinds.get("step", ())):
        param = params[name]
        state = {"step": adam_step_tensor(float(reader.read(f"optim/step/{name}")[0]), param, groups[id(param)])}
        for kind, names in kinds.items():
            if kind != "step" and name in names:
                state[TORCH_KEYS.get(kind, kind)] = state_tensor_like(reader.read(f"optim/{kind}/{name}"), param)
        optimizer.state[param] = state


def storage_bytes(tensors: list[torch.Tensor]) -> int:
    """Bytes of the distinct storages behind `tensors`: views into one flat buffer count once."""
    seen: dict[int, int] = {}
    for t in tensors:
        if t is None or t.numel() == 0:
            continue
        t = t.to_local() if hasattr(t, "to_local") else t  # a DTensor's shard on this rank
        storage = t.untyped_storage()
        seen[storage.data_ptr()] = storage.nbytes()
    return sum(seen.values())
