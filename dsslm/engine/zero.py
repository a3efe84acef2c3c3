"""DeepSpeed ZeRO stage 1, 2 or 3 behind the Engine protocol. The only module importing deepspeed.

How the loop's step maps onto DeepSpeed:

- The DeepSpeed config (`ds_configs/zero{stage}.json` or engine.ds_config) is a template: batch
  size, gradient accumulation, clipping and precision are filled from dsslm's config; a value
  written in the file that disagrees with it is a ConfigError, not a silent override
  (`engine/ds_config.py`).
- Gradient accumulation: the loop already scales every micro-batch's loss by
  world_size / global_tokens, so `backward` passes `scale_wrt_gas=False` (DeepSpeed would
  otherwise divide by gradient_accumulation_steps again) and sets the accumulation boundary by
  hand: False inside `no_sync()`, True for the final micro-batch, whose backward reduces.
- `clip_grad_norm` reads the global norm the ZeRO optimizer will clip with, before `step()`,
  so rank 0's spike monitor can veto the step. DeepSpeed clips inside `step()` with
  `gradient_clipping` = optim.clip (same formula as torch's clip_grad_norm_).
- `skip_step` drops the reduced gradients the way the ZeRO optimizer's own overflow branch does
  (weights, moments and Adam's step untouched) and advances DeepSpeed's global/skipped counters
  as an overflow would.
- bf16: gradients accumulate and are reduced in fp32 (`data_types.grad_accum_dtype` and
  `communication_data_type`, filled in by `engine/ds_config.py`), as FSDP's fp32 reduce policy
  does. Stages 2 and 3 keep fp32 gradient partitions; stage 1 becomes DeepSpeed's
  BF16_Optimizer (fp32 master and moments sharded, a full fp32 gradient buffer per rank).
- `drop_gradients` (an in-place re-run of the same step) drops them too
  but takes back the micro-batches it counted, so after the re-run every counter reads as if
  the step had been computed once.
- fp16: DeepSpeed's dynamic loss scaler is the only scaler. `engine.scaler` is a read-only view
  of it (`DeepSpeedLossScale`): it tells the loop's judge() that a non-finite norm means "skip",
  and `skip_step` then lets DeepSpeed's own `step()` take its overflow branch, which backs the
  scale off once. No second scaler ever multiplies the loss, so nothing is skipped twice.
"""
from __future__ import annotations

import contextlib
import math
import os
import sys
import time
import warnings
from typing import Any

import torch
from torch import nn

if not torch.cuda.is_available():
    os.environ.setdefault("DS_ACCELERATOR", "cpu")  # else DeepSpeed probes for CUDA at import

import deepspeed  # noqa: E402
from deepspeed.runtime.bf16_optimizer import BF16_Optimizer  # noqa: E402
from deepspeed.runtime.utils import combine_grad_norm_groups, get_global_norm_of_tensors  # noqa: E402
from deepspeed.runtime.zero.stage3 import DeepSpeedZeroOptimizer_Stage3  # noqa: E402
from deepspeed.runtime.zero.stage_1_and_2 import INITIAL_MICRO_STEP_ID, DeepSpeedZeroOptimizer  # noqa: E402
from deepspeed.utils import (safe_get_full_fp32_param, safe_get_full_grad,  # noqa: E402
                             safe_get_full_optimizer_state, safe_set_full_fp32_param, safe_set_full_optimizer_state,
                             safe_get_local_fp32_param, safe_get_local_optimizer_state, safe_set_local_fp32_param,
                             safe_set_local_optimizer_state)

from dsslm.clip import ClipBound  # noqa: E402
from dsslm.config import Config, ConfigError  # noqa: E402
from dsslm.engine.base import Engine, connect_muon  # noqa: E402
from dsslm.engine.state import (STATE_KIND_OF, STATE_KINDS, TORCH_KEYS, OptimState, Shard, StateReader,  # noqa: E402
                                adam_step_tensor, check_names, optim_kinds, storage_bytes)
from dsslm.engine.ds_config import ds_config  # noqa: E402,F401  (re-exported: tests and tools import it here)
from dsslm.engine.launch import ensure_process_group  # noqa: E402
from dsslm.engine.blocks import prepare_model  # noqa: E402
from dsslm.muon import Fragment, MuonAdamW  # noqa: E402
from dsslm.optim import build_optimizer, set_lr  # noqa: E402
from dsslm.precision import SCALER_SPEC  # noqa: E402

# DeepSpeed calls the collectives torch renamed; torch warns on every call, flooding stderr.
warnings.filterwarnings("ignore", message=r".*torch\.distributed\.(all_gather_into_tensor|reduce_scatter_tensor)",
                        category=FutureWarning)


SHM_OP = "deepspeed_shm_comm"  # what DeepSpeed's TorchBackend JIT-builds on the CPU at its first start


def say_if_building(device: torch.device) -> str | None:
    """Say so before DeepSpeed spends a minute or two compiling its CPU extension in silence (the
    first start on a machine; later starts load it from torch's extension cache). Returns the line."""
    if device.type != "cpu":
        return None
    try:
        from torch.utils.cpp_extension import _get_build_directory
        if not deepspeed.ops.__compatible_ops__.get(SHM_OP, False):
            return None  # DeepSpeed will not build it here
        folder = _get_build_directory(SHM_OP, verbose=False)
        if any(name.endswith(".so") for name in os.listdir(folder)):
            return None
    except (ImportError, OSError, AttributeError):  # a private torch helper moved: say nothing, as before
        return None
    line = (f"dsslm: building DeepSpeed's CPU communication extension ({SHM_OP}) once for this machine; "
            f"this takes a minute or two (cached in {folder})")
    print(line, file=sys.stderr, flush=True)
    return line


@contextlib.contextmanager
def build_notice(device: torch.device | None):
    """A line before DeepSpeed's first build of its CPU extension (say_if_building) and one after
    it, with the time it took; nothing where it is cached, or for `None` (ranks other than 0)."""
    line = say_if_building(device) if device is not None else None
    started = time.perf_counter()
    yield
    if line:
        print(f"dsslm: built DeepSpeed's CPU communication extension in {time.perf_counter() - started:.0f} s; "
              f"later starts load it from the cache", file=sys.stderr, flush=True)


class DeepSpeedLossScale:
    """engine.scaler under fp16: a view of DeepSpeed's dynamic loss scaler, never a second one.

    `update()` only reports an overflow (a non-finite norm) so the loop skips the step; the scale
    itself moves inside DeepSpeed's `step()` (growth) and overflow branch (backoff).
    """

    state_spec = SCALER_SPEC

    def __init__(self, optimizer: Any):
        self._optimizer = optimizer
        self.overflows = 0

    @property
    def _ds(self) -> Any:
        return self._optimizer.loss_scaler

    @property
    def scale(self) -> float:
        return float(self._ds.cur_scale)

    def update(self, grad_norm: float) -> bool:
        overflow = not math.isfinite(grad_norm)
        self.overflows += int(overflow)
        return overflow

    def state_dict(self) -> dict:
        # The first three keys are LossScaler's, so an fp16 checkpoint resumes under any engine.
        clean = self._ds.cur_iter - self._ds.last_overflow_iter - 1
        return {"scale": self.scale, "clean_steps": int(clean), "overflows": self.overflows,
                "ds_cur_iter": int(self._ds.cur_iter), "ds_last_overflow_iter": int(self._ds.last_overflow_iter),
                "ds_cur_hysteresis": int(self._ds.cur_hysteresis)}

    def load_state_dict(self, state: dict) -> None:
        self._ds.cur_scale = float(state["scale"])
        self.overflows = int(state.get("overflows", 0))
        clean = int(state.get("clean_steps", 0))
        self._ds.cur_iter = int(state.get("ds_cur_iter", clean))
        self._ds.last_overflow_iter = int(state.get("ds_last_overflow_iter", self._ds.cur_iter - clean - 1))
        self._ds.cur_hysteresis = int(state.get("ds_cur_hysteresis", self._ds.delayed_shift))


class ZeroEngine(Engine):
    name = "zero"

    def __init__(self, cfg: Config, model: nn.Module):
        super().__init__(cfg, model)
        ensure_process_group(self.device)  # DeepSpeed needs a group, even for one process
        if self.world_size == 1:
            # ...and asserts a launcher set LOCAL_RANK: plain `python -m dsslm.train` is rank 0.
            os.environ.setdefault("LOCAL_RANK", "0")
        self.distributed = True
        self.stage = cfg.engine.zero_stage
        self.name = f"zero{self.stage}"
        self.params = dict(model.named_parameters())  # unwrapped names; DeepSpeed keeps the objects
        self._check_stage()
        model.to(self.device)
        prepare_model(model, cfg.train)
        # optim.name=muon: our MuonAdamW, never DeepSpeed's Muon (a second definition of the math,
        # switched on by a `use_muon` attribute dsslm never sets). DeepSpeed hands the client
        # optimizer flat partitions that cut through matrices; `_feed_muon` tells it where each
        # hidden matrix's part lies, so it makes every matrix whole before orthogonalising
        # (DeepSpeed issue 8441: Muon that never sees a matrix silently trains as SGD).
        optimizer = build_optimizer(model, cfg.optim, self.device)
        with build_notice(self.device if self.is_main else None):
            self.ds, self.optimizer, _, _ = deepspeed.initialize(
                model=model, optimizer=optimizer, config=ds_config(cfg, self.world_size), dist_init_required=False)
        self.layout = self._layout()
        if isinstance(optimizer, MuonAdamW):
            self._feed_muon(optimizer)
        self.scaler = DeepSpeedLossScale(self.optimizer) if cfg.train.precision == "fp16" else None
        self._in_no_sync = False
        self._micro_counted = 0  # micro_steps this step's no_sync backwards added (drop_gradients undoes them)
        self._last_norm = torch.zeros((), device=self.device)
        self._grad_bytes = 0
        self.ds.set_gradient_accumulation_boundary(True)

    def _layout(self) -> str:
        """Which DeepSpeed optimizer holds the state: `zero3`, `zero12` (stages 1 and 2) or `bf16`:
        DeepSpeed's BF16_Optimizer, what stage 1 becomes under bf16 with fp32 gradient
        accumulation (fp32 master and moments sharded, full fp32 gradients on every rank)."""
        if isinstance(self.optimizer, BF16_Optimizer):
            return "bf16"
        if isinstance(self.optimizer, DeepSpeedZeroOptimizer_Stage3):
            return "zero3"
        if isinstance(self.optimizer, DeepSpeedZeroOptimizer):
            return "zero12"
        raise ConfigError(f"the DeepSpeed config made a {type(self.optimizer).__name__}, which dsslm does "
                          f"not drive; remove offload settings from it")

    def _feed_muon(self, muon: MuonAdamW) -> None:
        """Register, for every flat partition DeepSpeed made of Muon's group, where each hidden
        matrix's part lies in it; the same list (every matrix of the partition, held or not) on
        every rank, so all ranks run the same collectives in the same order. Each matrix is then
        assembled on one rank only (a stage 1-2 partition usually holds it whole: nothing moves)."""
        names = {id(p): n for n, p in self.params.items()}
        opt = self.optimizer
        if self.layout == "zero3":
            parts = [(opt.fp32_partitioned_groups_flat[i], params) for i, params in enumerate(opt.fp16_groups)
                     if muon.param_groups[opt.sub_group_to_group_id[i]].get("muon")]
        else:
            groups = opt.bf16_groups if self.layout == "bf16" else opt.bit16_groups
            parts = [(self._flat_partitions()[i], params) for i, params in enumerate(groups)
                     if muon.param_groups[i].get("muon")]
        held = []
        for flat, params in parts:
            fragments = []
            for param in params:
                name = names[id(param)]
                span = self._fragment(param) or (0, 0)
                if self.layout == "zero3":
                    flat_start = opt.grad_position[opt.get_param_id(param)][1]
                else:
                    mapping = param._hp_mapping
                    flat_start = mapping.hp_fragment_address.start if mapping is not None else 0
                fragments.append(Fragment(name, tuple(self.param_shapes[name]), flat_start, span[0], span[1] - span[0]))
            held.append((flat, fragments))
        connect_muon(muon, self.cfg, held)

    def _check_stage(self) -> None:
        if self.cfg.train.precision == "fp16" and not deepspeed.get_accelerator().is_fp16_supported():
            raise ConfigError(f"train.precision=fp16 with engine.kind=zero needs fp16 support in DeepSpeed's "
                              f"{deepspeed.get_accelerator().device_name()} accelerator; use train.precision=bf16")

    # --- the training step -------------------------------------------------------------------
    def forward(self, inputs: torch.Tensor) -> torch.Tensor:
        return self.ds(inputs)

    @contextlib.contextmanager
    def no_sync(self):
        # Not DeepSpeed's no_sync(), which refuses stages 2 and 3: the accumulation boundary is
        # the switch every stage honours (stage 2/3 still reduce-scatter per bucket, into shards).
        self._in_no_sync = True
        self.ds.set_gradient_accumulation_boundary(False)
        try:
            yield
        finally:
            self._in_no_sync = False
            self.ds.set_gradient_accumulation_boundary(True)

    def backward(self, loss: torch.Tensor) -> None:
        # The loss is already divided by the step's global token count: no division by GAS.
        self.ds.backward(loss, scale_wrt_gas=False)
        # Stage 1 holds full gradients between micro-batches, only its shard after the boundary.
        self._grad_bytes = max(self._grad_bytes, self._measure_grad_bytes())
        if self._in_no_sync:
            self.ds.micro_steps += 1  # DeepSpeed counts micro-batches; step() counts the last one
            self._micro_counted += 1

    def clip_grad_norm(self, max_norm: ClipBound) -> torch.Tensor:
        """Global pre-clip norm of the reduced gradients (a collective); DeepSpeed clips in step()."""
        opt = self.optimizer
        if self.layout == "zero3":
            scaled = combine_grad_norm_groups(opt._get_norm_groups())
        elif self.layout == "bf16":
            # The fp32 sums, all-reduced in fp32: whole on every rank, so no collective here.
            scaled = get_global_norm_of_tensors(opt.get_grads_for_norm()[0], mpu=opt.mpu)
        else:
            scaled = opt.scaled_global_norm()
        norm = scaled.float() / float(getattr(opt, "loss_scale", 1.0))
        # DeepSpeed marks a non-finite norm as -1 or inf: the loop sees inf either way.
        self._last_norm = torch.where(torch.isfinite(norm) & (norm >= 0), norm, math.inf)
        # A bound that depends on the norm (ZClip) costs a host read; a fixed one none.
        opt.clip_grad = max_norm(float(self._last_norm)) if callable(max_norm) else max_norm
        self._grad_bytes = max(self._grad_bytes, self._measure_grad_bytes())
        return self._last_norm

    @torch.no_grad()
    def grad_norms(self) -> dict[str, float]:
        """DeepSpeed's full fp32 gradient of every parameter (collectives under stage 3); not yet
        clipped, since DeepSpeed clips inside step()."""
        norms = {}
        for name, param in self.params.items():
            grad = safe_get_full_grad(param)
            if grad is not None:
                norms[name] = (float(torch.linalg.vector_norm(grad, dtype=torch.float64))
                               / float(getattr(self.optimizer, "loss_scale", 1.0)))
        return norms

    def step(self, lr: float) -> None:
        set_lr(self.optimizer, lr)
        self.ds.step()
        self._micro_counted = 0

    def skip_step(self) -> None:
        self._micro_counted = 0
        if self.scaler is not None and not math.isfinite(float(self._last_norm)):
            # fp16 overflow: DeepSpeed's own step() sees it, drops the step and backs the scale off.
            self.ds.step()
            return
        self._drop_gradients()
        # What DeepSpeed's engine records for a step its optimizer dropped.
        self.ds.global_steps += 1
        self.ds.skipped_steps += 1
        self.ds.global_samples += self.ds.train_batch_size()
        self.ds.micro_steps += 1

    def drop_gradients(self) -> None:
        self._drop_gradients()
        self.ds.micro_steps -= self._micro_counted
        self._micro_counted = 0

    def _drop_gradients(self) -> None:
        """The ZeRO optimizer's overflow branch without the loss-scale update."""
        opt = self.optimizer
        if self.layout == "zero3":
            opt._pre_step()
            opt._partition_all_parameters()
            opt._overflow_clean_up(opt.loss_scale)
            return
        if self.layout == "bf16":  # BF16_Optimizer's own invalid-norm branch
            opt.clear_hp_grads()
            opt.clear_lp_grads(set_to_none=True)
            return
        opt.micro_step_id = INITIAL_MICRO_STEP_ID
        opt.zero_grad(set_to_none=True)
        opt._release_preflattened_grad_buffers()
        for key in list(opt.averaged_gradients):
            opt.averaged_gradients[key] = None
            opt.all_grad_tensors[key] = None

    def train_mode(self, training: bool) -> None:
        self.ds.train(training)

    # --- state -------------------------------------------------------------------------------
    def _flat_partitions(self) -> list[torch.Tensor]:
        """This rank's fp32 master partitions: the tensors the inner AdamW steps."""
        opt = self.optimizer
        if self.layout == "bf16":
            return list(opt.fp32_groups_flat_partition)
        return list(opt.fp32_partitioned_groups_flat if self.layout == "zero3" else opt.single_partition_of_fp32_groups)

    def _partition_of(self, param: nn.Parameter) -> torch.Tensor:
        opt = self.optimizer
        if self.layout == "zero3":
            return opt.fp32_partitioned_groups_flat[opt.grad_position[opt.get_param_id(param)][0]]
        groups = opt.bf16_groups if self.layout == "bf16" else opt.bit16_groups
        for i, group in enumerate(groups):
            if any(p is param for p in group):
                return self._flat_partitions()[i]
        raise KeyError("parameter not managed by the ZeRO optimizer")

    def _has_adam_state(self) -> bool:
        inner = self.optimizer.optimizer.state
        return all(len(inner.get(flat, {})) > 0 for flat in self._flat_partitions())

    def full_state(self, with_optim: bool = True) -> tuple[dict[str, torch.Tensor], OptimState]:
        """Full fp32 weights and moments; every rank must call (gathers), rank 0 keeps them."""
        keep = self.is_main
        model_sd: dict[str, torch.Tensor] = {}
        optim = OptimState()
        for name, param in self.params.items():
            full = safe_get_full_fp32_param(param)
            if keep:
                model_sd[name] = full.detach().float().cpu().clone()
        if not with_optim or not self._has_adam_state():
            return model_sd, optim
        self._link_moments()
        inner = self.optimizer.optimizer.state
        for name, param in self.params.items():
            for key in self._keys_of(param):
                full = safe_get_full_optimizer_state(param, key)
                if keep:
                    getattr(optim, STATE_KIND_OF[key])[name] = full.detach().float().cpu().clone()
            if keep:
                optim.step[name] = float(inner[self._partition_of(param)]["step"])
        return model_sd, optim

    def _link_moments(self) -> None:
        """Point every parameter's optimizer-state fragment at the current AdamW state (stage 1/2).

        DeepSpeed links lazily after its first optimizer step of group 0, when the later groups
        have no state yet, and never again: relink before reading or writing moments.
        """
        if self.layout != "zero3":
            self.optimizer._hp_optimizer_states_linked = False
            self.optimizer._lazy_init_hp_params_optimizer_state()

    def load_full_state(self, model_sd: dict[str, torch.Tensor], optim: OptimState) -> None:
        check_names(self.params, model_sd)
        self._load_weights(model_sd)
        self._load_moments(optim)

    @torch.no_grad()
    def _load_weights(self, model_sd: dict[str, torch.Tensor]) -> None:
        params = list(self.params.items())
        # The working (bf16/fp16/fp32) copies first; stage 3 holds only a shard, so gather,
        # write on every rank (identical values) and let rank 0's copy be re-partitioned.
        gathered = (deepspeed.zero.GatheredParameters([p for _, p in params], modifier_rank=0)
                    if self.layout == "zero3" else contextlib.nullcontext())
        with gathered:
            for name, param in params:
                param.data.copy_(model_sd[name].to(param.device, param.dtype))
        for name, param in params:  # then the fp32 master shards
            safe_set_full_fp32_param(param, model_sd[name].to(self.device, torch.float32))

    @torch.no_grad()
    def _load_moments(self, optim: OptimState) -> None:
        inner = self.optimizer.optimizer.state
        if not optim.step:
            for flat in self._flat_partitions():  # a checkpoint from before the first step
                inner.pop(flat, None)
            if self.layout != "zero3":
                self.optimizer._hp_optimizer_states_linked = False
            return
        steps = self._group_steps(optim.step)
        held = {kind: set(getattr(optim, kind)) for kind in STATE_KINDS}
        self._seed_state(steps, held)
        for name, param in self.params.items():
            for kind in (k for k in STATE_KINDS if name in held[k]):
                safe_set_full_optimizer_state(param, getattr(optim, kind)[name].to(self.device, torch.float32),
                                              TORCH_KEYS[kind])

    def _seed_state(self, steps: dict[int, float], held: dict[str, set[str]]) -> None:
        """Give every flat partition the optimizer's own state layout (AdamW's moments; Muon's
        buffer for Muon's partitions): the kinds the checkpoint `held` for its parameters, zeros
        until the parameters' values are written through the links."""
        inner = self.optimizer.optimizer.state
        names_in = {}
        for name, param in self.params.items():
            names_in.setdefault(id(self._partition_of(param)), set()).add(name)
        for flat in self._flat_partitions():
            # torch's own layout; the optimizer then finds the state and does not re-initialise it.
            inner[flat] = {"step": adam_step_tensor(steps[id(flat)], flat, self._inner_group(flat)),
                           **{TORCH_KEYS.get(kind, kind): torch.zeros_like(flat) for kind, names in held.items()
                              if kind != "step" and names & names_in.get(id(flat), set())}}
        self._link_moments()

    def _keys_of(self, param: nn.Parameter) -> list[str]:
        """The per-element state keys of the partition holding `param` (torch's names)."""
        flat = self._partition_of(param)
        return sorted(k for k, v in self.optimizer.optimizer.state.get(flat, {}).items()
                      if torch.is_tensor(v) and v.shape == flat.shape)

    def _group_steps(self, steps_by_name: dict[str, float]) -> dict[int, float]:
        """ZeRO keeps one Adam step count per flat group: every parameter in it must agree."""
        out: dict[int, float] = {}
        for name, param in self.params.items():
            if name not in steps_by_name:
                raise ValueError(f"checkpoint has no Adam step for {name}; it cannot seed a ZeRO optimizer")
            flat = self._partition_of(param)
            step = float(steps_by_name[name])
            if out.setdefault(id(flat), step) != step:
                raise ValueError(f"checkpoint's Adam step for {name} ({step}) differs from its group's "
                                 f"({out[id(flat)]}); ZeRO keeps one count per parameter group")
        return out

    # --- sharded checkpoints ------------------------------------------------------------------
    def _fragment(self, param: nn.Parameter) -> tuple[int, int] | None:
        """The element span of `param` whose fp32 master and moments this rank holds, or None."""
        if self.layout == "zero3":
            local = safe_get_local_fp32_param(param)
            per_rank = param.ds_tensor.ds_numel  # every rank's partition has this size (the last padded)
            start = min(param.ds_numel, self.rank * per_rank)
            end = min(param.ds_numel, start + local.numel())
            return (start, end) if end > start else None
        mapping = getattr(param, "_hp_mapping", None)
        if mapping is None:
            return None
        address = mapping.lp_fragment_address
        return address.start, address.start + address.numel

    def _local(self, param: nn.Parameter, key: str | None) -> torch.Tensor:
        """This rank's fp32 fragment of `param` (key None) or of one of its optimizer states: a view."""
        if self.layout == "zero3":
            return (safe_get_local_fp32_param(param) if key is None
                    else safe_get_local_optimizer_state(param, key))
        return param._hp_mapping.get_hp_fragment(key)

    def local_state(self) -> list[Shard]:
        """This rank's fp32 master and moment fragments, as DeepSpeed partitions them: no gather."""
        has_state = self._has_adam_state()
        if has_state:
            self._link_moments()
        inner = self.optimizer.optimizer.state
        out = []
        for name, param in self.params.items():
            shape = tuple(self.param_shapes[name])
            span = self._fragment(param)
            if span is not None:
                n = span[1] - span[0]
                out.append(Shard(f"model/{name}", shape, *span, self._local(param, None).reshape(-1)[:n].detach()))
                out += [Shard(f"optim/{STATE_KIND_OF[key]}/{name}", shape, *span,
                              self._local(param, key).reshape(-1)[:n].detach())
                        for key in (self._keys_of(param) if has_state else [])]
            if has_state and self.is_main:
                step = float(inner[self._partition_of(param)]["step"])
                out.append(Shard(f"optim/step/{name}", (1,), 0, 1, torch.tensor([step], dtype=torch.float64)))
        return out

    @torch.no_grad()
    def load_local_state(self, reader: StateReader) -> None:
        """Only this rank's fp32 master and moment fragments are read; the working copies follow
        from the masters as after a step (stages 1 and 2: DeepSpeed's copy-and-all-gather; stage
        3: each rank copies its master partitions into its working partitions, and the
        persistent parameters are gathered again, as at the end of DeepSpeed's step)."""
        kinds = optim_kinds(reader)
        steps = {name: float(reader.read(f"optim/step/{name}")[0]) for name in kinds.get("step", ())}
        inner = self.optimizer.optimizer.state
        for flat in self._flat_partitions():
            inner.pop(flat, None)
        if steps:
            self._seed_state(self._group_steps(steps), kinds)
        elif self.layout != "zero3":
            self.optimizer._hp_optimizer_states_linked = False
        for name, param in self.params.items():
            span = self._fragment(param)
            if span is None:
                continue
            held = [k for k, names in kinds.items() if k != "step" and name in names] if steps else []
            for kind in [None] + held:
                key = None if kind is None else TORCH_KEYS.get(kind, kind)
                value = reader.read(f"model/{name}" if kind is None else f"optim/{kind}/{name}", *span)
                value = value.to(self.device, torch.float32)
                if self.layout == "zero3":
                    local = self._local(param, key)
                    full = torch.zeros(local.numel(), dtype=torch.float32, device=self.device)
                    full[:value.numel()] = value
                    (safe_set_local_fp32_param(param, full) if key is None
                     else safe_set_local_optimizer_state(param, full, key))
                else:
                    self._local(param, key).copy_(value)
        if self.layout != "zero3":
            self.optimizer.update_lp_params()  # a collective: every rank's working copy from the masters
        else:
            # As DeepSpeed's own step does: release every gathered working copy first, then write
            # the partitions from the masters, then gather the persistent parameters again (those
            # under stage3_param_persistence_threshold, the norms at any size and everything in a
            # small model, stay whole between steps). In a live engine (a rewind) they were whole
            # with the values of the trajectory left, and the next forward used those.
            self.optimizer._partition_all_parameters()
            for group in range(len(self.optimizer.fp16_partitioned_groups_flat)):
                self.optimizer._reassign_or_swap_out_partitioned_parameters(group)
            persistent = self.optimizer.persistent_parameters
            if persistent:
                persistent[0].all_gather(persistent)
            self.optimizer.invalidate_secondary_tensor()  # hpZ's copies (zero_hpz_partition_size > 1)

    def _inner_group(self, flat: torch.Tensor) -> dict:
        for group in self.optimizer.optimizer.param_groups:
            if any(p is flat for p in group["params"]):
                return group
        # DeepSpeed's stage 3 empties its inner groups' parameter lists between steps (it swaps
        # the partitions in for step() only). The flags that place Adam's step, fused and
        # capturable, are the same in every group: the optimizer's defaults.
        return self.optimizer.optimizer.defaults

    # --- accounting --------------------------------------------------------------------------
    def _measure_grad_bytes(self) -> int:
        opt = self.optimizer
        tensors = [t for p in self.params.values() for t in (p.grad, getattr(p, "grad_accum", None))
                   if t is not None]
        for group in getattr(opt, "averaged_gradients", {}).values():
            if group is not None:
                tensors += [t for t in group if torch.is_tensor(t)]
        if self.layout == "zero12" and getattr(opt, "grads_in_partition", None) is not None:
            tensors.append(opt.grads_in_partition)
        if self.layout == "bf16":  # the fp32 accumulation buffers: full size on every rank
            tensors += list(opt.fp32_groups_gradients_flat)
        return storage_bytes(tensors)

    def memory_report(self) -> dict[str, int]:
        """Bytes this rank holds, measured from the tensors (shared storage counted once)."""
        if self.layout == "zero3":
            working = [p.ds_tensor for p in self.params.values()]
        elif self.layout == "bf16":
            working = list(self.optimizer.bf16_groups_flat)
        else:
            working = list(self.optimizer.bit16_groups_flat)
        inner = self.optimizer.optimizer.state
        optim = [t for flat in self._flat_partitions() for t in inner.get(flat, {}).values() if torch.is_tensor(t)]
        return {"param_bytes": storage_bytes(working), "master_bytes": storage_bytes(self._flat_partitions()),
                "grad_bytes": self._grad_bytes, "optim_bytes": storage_bytes(optim)}

    def close(self) -> None:
        self.ds.destroy()
        owned = self.owns_group
        super().close()
        if owned:
            forget_groups()


def forget_groups() -> None:
    """DeepSpeed caches the groups it cloned from the world group in module globals; once the
    group this engine made is destroyed they name a dead group, and the next ZeRO engine in this
    process (a second train() in a notebook or a test) fails in its first broadcast."""
    from deepspeed.utils import groups
    for name, value in list(vars(groups).items()):
        if name.startswith("_") and name.endswith(("_GROUP", "_GROUP_RANKS")) and not callable(value):
            setattr(groups, name, {} if isinstance(value, dict) else None)

