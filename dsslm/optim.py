"""AdamW with decay / no-decay groups, Muon for the hidden matrices (`optim.name=muon`), and the
learning rate as a pure function of the step."""
from __future__ import annotations

import collections
import itertools
import math
from dataclasses import dataclass
from typing import Callable

import torch
from torch import nn
from torch.optim._muon import DEFAULT_A, DEFAULT_B, DEFAULT_C, DEFAULT_NS_STEPS, EPS, _adjust_lr

from dsslm.config import Config, OptimCfg


def param_groups(model: nn.Module, cfg: OptimCfg) -> list[dict]:
    """Two groups: matrices decay; norm gains, biases and (unless configured) embeddings do not.

    Decaying a norm gain pulls it towards 0, which fights the normalisation it exists for; the
    embedding is a lookup table whose rows see few updates, so decay mostly erases rare tokens.
    """
    decay, no_decay, decay_names, no_decay_names = [], [], [], []
    embedding_params = {id(m.weight) for m in model.modules() if isinstance(m, nn.Embedding)}
    for name, param in model.named_parameters():
        if not param.requires_grad:
            continue
        is_embedding = id(param) in embedding_params
        if param.dim() < 2 or (is_embedding and not cfg.decay_embeddings):
            no_decay.append(param)
            no_decay_names.append(name)
        else:
            decay.append(param)
            decay_names.append(name)
    assert_partition(model, [decay, no_decay])
    return [
        {"params": decay, "weight_decay": cfg.weight_decay, "names": decay_names},
        {"params": no_decay, "weight_decay": 0.0, "names": no_decay_names},
    ]


def assert_partition(model: nn.Module, groups: list[list[torch.Tensor]]) -> None:
    """Every trainable parameter in exactly one group: a missed one would silently never train."""
    seen: dict[int, int] = {}
    for group in groups:
        for param in group:
            seen[id(param)] = seen.get(id(param), 0) + 1
    wanted = {id(p): n for n, p in model.named_parameters() if p.requires_grad}
    missing = [n for i, n in wanted.items() if i not in seen]
    doubled = [wanted.get(i, "?") for i, count in seen.items() if count > 1]
    extra = [i for i in seen if i not in wanted]
    if missing or doubled or extra:
        raise AssertionError(f"parameter groups are not a partition: missing={missing} "
                             f"in_two_groups={doubled} unknown={len(extra)}")


def adamw_impl(impl: str, device: torch.device) -> str:
    """The AdamW kernel `optim.impl` means on `device`. `auto` is fused on CUDA and on CPU: one
    pass over each tensor instead of one per op. Measured on a 2-core CPU at d 128 (0.83M
    parameters): fused 0.92 ms a step, single-tensor 2.6 ms, foreach 2.9 ms (torch's CPU foreach
    ops loop over tensors in C++ but still make a pass per op). Elsewhere (MPS, XPU), foreach."""
    if impl != "auto":
        return impl
    return "fused" if device.type in ("cuda", "cpu") else "foreach"


def build_adamw(model: nn.Module, cfg: OptimCfg, device: torch.device) -> torch.optim.AdamW:
    """AdamW over the two groups. Every kernel is elementwise per tensor, so its result does not
    depend on how tensors are grouped or flattened (DDP, ZeRO's flat partitions, FSDP's shards):
    a resume with the same kernel continues to the bit; another kernel, within rounding."""
    groups = [{k: v for k, v in g.items() if k != "names"} for g in param_groups(model, cfg)]
    impl = adamw_impl(cfg.impl, device)
    kernel = {"single": {"foreach": False}, "foreach": {"foreach": True}, "fused": {"fused": True}}[impl]
    return torch.optim.AdamW(groups, lr=cfg.peak_lr, betas=(cfg.beta1, cfg.beta2), eps=cfg.eps,
                             weight_decay=cfg.weight_decay, **kernel)


def lr_at(step: int, config: Config) -> float:
    """The planned learning rate of optimizer step `step` (0-based), before lr_scale.

    Pure: the same (step, config) gives the same value in any order of calls, so a resumed run
    follows the plan with no warmup restart.
    """
    cfg, total_steps = config.optim, config.train.total_steps
    if cfg.warmup_steps > 0 and step < cfg.warmup_steps:
        return cfg.peak_lr * (step + 1) / cfg.warmup_steps
    if cfg.schedule == "cosine":
        span = max(1, total_steps - cfg.warmup_steps)
        progress = min(1.0, (step - cfg.warmup_steps) / span)
        return cfg.min_lr + (cfg.peak_lr - cfg.min_lr) * 0.5 * (1.0 + math.cos(math.pi * progress))
    decay_start = total_steps - cfg.decay_steps
    if step < decay_start:
        return cfg.peak_lr
    progress = min(1.0, (step - decay_start + 1) / cfg.decay_steps)
    fraction = 1.0 - progress if cfg.decay_shape == "linear" else 1.0 - math.sqrt(progress)
    return cfg.min_lr + (cfg.peak_lr - cfg.min_lr) * fraction


def decay_start_step(config: Config) -> int | None:
    """First step of the WSD decay phase (the checkpoint before it is kept for cooldown branches)."""
    cfg = config.optim
    return config.train.total_steps - cfg.decay_steps if cfg.schedule == "wsd" else None


def set_lr(optimizer: torch.optim.Optimizer, lr: float) -> None:
    """The planned rate to every group; Muon's group runs at optim.muon_lr / optim.peak_lr of it."""
    for group in optimizer.param_groups:
        group["lr"] = lr * group.get("lr_ratio", 1.0)


# --- Muon ----------------------------------------------------------------------------------------
def muon_groups(model: nn.Module, cfg: OptimCfg) -> list[dict]:
    """Three groups: Muon for the hidden 2-D matrices (attention and MLP projections); AdamW for
    the embedding, an untied head (decayed like today's matrices), norm gains and biases. The
    embedding is a lookup, not a linear map of its input, and the head's rows are scored one by
    one: Muon's orthogonalised update fits neither (Keller Jordan; Moonlight; torch's docs)."""
    adamw = param_groups(model, cfg)
    outer = {id(m.weight) for m in model.modules() if isinstance(m, nn.Embedding)}
    outer |= {id(p) for n, p in model.named_parameters() if n.split(".")[0] in ("lm_head", "tok_emb")}
    hidden, hidden_names = [], []
    for group in adamw:
        keep = [(p, n) for p, n in zip(group["params"], group["names"]) if p.dim() != 2 or id(p) in outer]
        hidden += [p for p in group["params"] if p.dim() == 2 and id(p) not in outer]
        hidden_names += [n for p, n in zip(group["params"], group["names"]) if p.dim() == 2 and id(p) not in outer]
        group["params"], group["names"] = [p for p, _ in keep], [n for _, n in keep]
    assert_partition(model, [hidden] + [g["params"] for g in adamw])
    bad = [n for p, n in zip(hidden, hidden_names) if p.dim() != 2 or id(p) in outer]
    assert not bad and hidden, f"Muon's group must be the hidden 2-D matrices only: {bad or 'none found'}"
    muon = {"params": hidden, "names": hidden_names, "muon": True, "weight_decay": cfg.weight_decay,
            "momentum": cfg.muon_momentum, "lr_ratio": cfg.muon_lr / cfg.peak_lr}
    return [muon] + [g for g in adamw if g["params"]]


def muon_momentum(grad: torch.Tensor, buf: torch.Tensor, momentum: float) -> torch.Tensor:
    """Muon's elementwise half (torch.optim.Muon's, Nesterov): the buffer's EMA and the update it
    gives. Elementwise, so a shard of the gradient gives the same shard of the update."""
    buf.lerp_(grad, 1 - momentum)
    return grad.lerp(buf, momentum)


def orthogonalise(update: torch.Tensor, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """Muon's matrix half, on a WHOLE matrix: the quintic Newton-Schulz torch.optim.Muon runs (its
    coefficients, 5 steps, the same operations, so bf16 gives its bits), in `dtype`. The one
    definition every engine feeds (a shard's orthogonalisation is not the matrix's)."""
    a, b, c = DEFAULT_A, DEFAULT_B, DEFAULT_C
    x = update.to(dtype)
    tall = x.size(0) > x.size(1)
    if tall:  # iterate on the wide side: the Gram matrix is then the smaller one
        x = x.T
    x = x / x.norm().clamp(min=EPS)  # spectral norm <= Frobenius norm <= 1: inside NS's basin
    for _ in range(DEFAULT_NS_STEPS):
        gram = x @ x.T
        x = torch.addmm(x, torch.addmm(gram, gram, gram, beta=b, alpha=c), x, beta=a)
    return x.T if tall else x


NS_DTYPES = {"bfloat16": torch.bfloat16, "float32": torch.float32}


def ns_dtype(name: str, device: torch.device) -> torch.dtype:
    """optim.muon_ns_dtype. auto: bf16 on CUDA (tensor cores; what torch and modded-nanogpt run),
    fp32 elsewhere: a CPU without bf16 units runs bf16 matmuls 14-40x slower than fp32 (measured
    on this project's 2-core VM, one thread: Newton-Schulz on 768x768, 8.7 s against 0.25 s)."""
    if name == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    return NS_DTYPES[name]


def owners(shapes: list[tuple[int, ...]], world: int, load: list[int] | None = None) -> list[int]:
    """Which rank orthogonalises each matrix when the work is shared: largest first (NS costs
    about rows x cols x min(rows, cols)), each to the least-loaded rank, lowest rank on ties.
    `load`: each rank's work already given out this step (updated in place), so a step's buckets
    are spread together: alone, each bucket of one or two large matrices would go to rank 0 (and
    1), every bucket, and the other ranks would wait for them. A pure function of the shapes and
    the order of the calls, so every rank computes the same assignment."""
    load = [0] * world if load is None else load
    out = [0] * len(shapes)
    for i in sorted(range(len(shapes)), key=lambda i: -math.prod(shapes[i]) * min(shapes[i])):
        out[i] = min(range(world), key=lambda r: (load[r], r))
        load[out[i]] += math.prod(shapes[i]) * min(shapes[i])
    return out


def _same(t: torch.Tensor, *_) -> torch.Tensor:
    return t


@dataclass(frozen=True)
class Fragment:
    """The part of one hidden matrix a rank holds inside a flat partition (ZeRO): elements
    [start, start + numel) of the matrix's row-major flattening sit at [flat_start, flat_start +
    numel) of the partition. numel 0: the rank holds none of it (it still joins the collective)."""
    name: str
    shape: tuple[int, int]
    flat_start: int
    start: int
    numel: int


# Matrices are made whole a bucket at a time: the transient buffer stays at most this many fp32
# elements (128 MiB) beyond the largest matrix, whatever the model's size.
WHOLE_BUCKET_ELEMENTS = 1 << 25


def _buckets(items: list) -> list[list]:
    """Consecutive runs of matrices (fragments or parameters: anything with the matrix's full
    `shape`) of at most WHOLE_BUCKET_ELEMENTS elements together (a larger matrix alone)."""
    out: list[list] = [[]]
    size = 0
    for item in items:
        if out[-1] and size + math.prod(item.shape) > WHOLE_BUCKET_ELEMENTS:
            out.append([])
            size = 0
        out[-1].append(item)
        size += math.prod(item.shape)
    return out


class MuonAdamW(torch.optim.AdamW):
    """Muon on the group marked `muon`, torch AdamW (same kernel, same bits) on the others, in one
    optimizer, so engines drive, clip, skip and checkpoint it as they do AdamW.

    `whole(t)` gives the full matrix of a (possibly sharded) tensor and `part(full, param)` this
    rank's part of a full update; the engine supplies them (FSDP2: DTensor gather and local slice;
    DDP: identity), so the orthogonalisation always sees whole matrices. The update is torch's:
    p <- p (1 - lr wd) - lr sqrt(max(1, rows / cols)) NS(nesterov momentum) (`_adjust_lr`,
    adjust_lr_fn=None). `orthogonalised` counts the orthogonalisations per matrix name, this rank's.

    ZeRO hands the optimizer flat partitions that cut through matrices, never a matrix: the engine
    registers each partition's `fragments` and a `sum_ranks` (an all-reduce), and the step runs the
    same two halves on them: the momentum on the partition (elementwise), then each matrix made
    whole (every rank writes its fragment into a zero buffer, the sum over ranks is the matrix),
    orthogonalised by every rank that holds part of it, and each rank applies its own part.

    `share` (rank, world, all-gather), set by the engine under optim.muon_distribute where every
    rank holds every whole matrix (DDP, FSDP2, ZeRO-3), gives each matrix to one rank (`owners`),
    which orthogonalises it; one all-gather per bucket hands every rank the results (torchtitan's
    DistMuon, modded-nanogpt's split). NS is a pure function of the matrix, so the bits are those
    every rank would have computed alone."""

    def __init__(self, groups: list[dict], whole: Callable = _same, part: Callable = _same,
                 ns: torch.dtype = torch.bfloat16, **adamw):
        self.names = {id(p): n for g in groups for p, n in zip(g["params"], g["names"])}
        self.matrices = [n for g in groups if g.get("muon") for n in g["names"]]  # Muon's, by name
        super().__init__([{k: v for k, v in g.items() if k != "names"} for g in groups], **adamw)
        self.whole, self.part, self.ns = whole, part, ns
        self.orthogonalised: collections.Counter = collections.Counter()
        self.fragments: dict[int, list[Fragment]] = {}  # id(flat partition) -> its matrices' parts
        self.sum_ranks: Callable[[torch.Tensor], None] = lambda t: None
        self.share: tuple[int, int, Callable[[torch.Tensor], list[torch.Tensor]]] | None = None
        self.share_load: list[int] = []  # owners' running load per rank, over one step's buckets

    def _state_of(self, p: torch.Tensor) -> dict:
        state = self.state[p]
        if not state:  # a step count too, so checkpoints name it like AdamW's
            state["step"] = torch.tensor(0.0)
            state["momentum_buffer"] = torch.zeros_like(p.grad)
        state["step"] += 1
        return state

    def _orthogonalise_all(self, names: list[str], fulls: list[torch.Tensor | None]) -> list[torch.Tensor | None]:
        """NS of each whole matrix (None: this rank holds none of it and does not share, skip it):
        computed here, or, sharing, by its owner and all-gathered (every rank passes the same list)."""
        if self.share is None or not fulls:
            self.orthogonalised.update(n for n, f in zip(names, fulls) if f is not None)
            return [None if f is None else orthogonalise(f, self.ns) for f in fulls]
        rank, world, gather = self.share
        owner = owners([tuple(f.shape) for f in fulls], world, self.share_load)
        mine = [orthogonalise(f, self.ns).reshape(-1) for f, o in zip(fulls, owner) if o == rank]
        self.orthogonalised.update(n for n, o in zip(names, owner) if o == rank)
        sizes = [sum(f.numel() for f, o in zip(fulls, owner) if o == r) for r in range(world)]
        send = torch.zeros(max(sizes), dtype=self.ns, device=fulls[0].device)  # all_gather: equal sizes
        if mine:
            torch.cat(mine, out=send[:sizes[rank]])
        received = gather(send)
        at = [0] * world
        out = []
        for f, o in zip(fulls, owner):
            out.append(received[o][at[o]:at[o] + f.numel()].view(f.shape))
            at[o] += f.numel()
        return out

    def _step_partition(self, flat: torch.Tensor, group: dict) -> None:
        """Muon on a ZeRO flat partition, through its registered fragments (see the class)."""
        update = muon_momentum(flat.grad, self._state_of(flat)["momentum_buffer"], group["momentum"])
        for bucket in _buckets(self.fragments[id(flat)]):
            sizes = [math.prod(f.shape) for f in bucket]
            offsets = [0, *itertools.accumulate(sizes)][:-1]
            buffer = torch.zeros(sum(sizes), dtype=update.dtype, device=update.device)
            for f, at in zip(bucket, offsets):
                buffer[at + f.start:at + f.start + f.numel] = update[f.flat_start:f.flat_start + f.numel]
            self.sum_ranks(buffer)  # disjoint parts over zeros: the sum is each matrix, exactly
            fulls = [buffer[at:at + size].view(f.shape) if f.numel or self.share is not None else None
                     for f, at, size in zip(bucket, offsets, sizes)]
            for f, full in zip(bucket, self._orthogonalise_all([f.name for f in bucket], fulls)):
                if not f.numel:
                    continue
                mine = flat[f.flat_start:f.flat_start + f.numel]
                mine.mul_(1 - group["lr"] * group["weight_decay"])
                mine.add_(full.reshape(-1)[f.start:f.start + f.numel], alpha=-_adjust_lr(group["lr"], None, full.shape))

    @torch.no_grad()
    def step(self, closure=None):
        everything = self.param_groups
        self.share_load = [0] * self.share[1] if self.share is not None else []
        for group in (g for g in everything if g.get("muon")):
            params = [p for p in group["params"] if p.grad is not None]
            for flat in (p for p in params if id(p) in self.fragments):
                self._step_partition(flat, group)
            # A bucket of whole matrices at a time (DDP, FSDP2, whose DTensor shape is the full
            # matrix's): the transient copies stay bounded.
            for these in _buckets([p for p in params if id(p) not in self.fragments]):
                fulls = [self.whole(muon_momentum(p.grad, self._state_of(p)["momentum_buffer"], group["momentum"]))
                         for p in these]
                for p, full in zip(these, self._orthogonalise_all([self.names[id(p)] for p in these], fulls)):
                    p.mul_(1 - group["lr"] * group["weight_decay"])
                    p.add_(self.part(full, p), alpha=-_adjust_lr(group["lr"], None, full.shape))
        self.param_groups = [g for g in everything if not g.get("muon")]
        try:
            return super().step(closure)
        finally:
            self.param_groups = everything


def build_optimizer(model: nn.Module, cfg: OptimCfg, device: torch.device, whole: Callable = _same,
                    part: Callable = _same) -> torch.optim.AdamW:
    """optim.name: AdamW over its two groups, or MuonAdamW (Muon's group and AdamW's)."""
    if cfg.name != "muon":
        return build_adamw(model, cfg, device)
    impl = adamw_impl(cfg.impl, device)
    kernel = {"single": {"foreach": False}, "foreach": {"foreach": True}, "fused": {"fused": True}}[impl]
    return MuonAdamW(muon_groups(model, cfg), whole, part, ns=ns_dtype(cfg.muon_ns_dtype, device), lr=cfg.peak_lr,
                     betas=(cfg.beta1, cfg.beta2),
                     eps=cfg.eps, weight_decay=cfg.weight_decay, **kernel)
