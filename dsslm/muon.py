"""Muon for the hidden matrices (`optim.name=muon`): torch.optim.Muon's update, each stacked
projection (Q, K, V; gate, up) orthogonalised as its own matrix, and the exchange that makes a
sharded matrix whole on one rank only (`MuonAdamW`). The groups are built in `dsslm.optim`."""
from __future__ import annotations

import collections
import itertools
import math
from dataclasses import dataclass, replace
from typing import Callable

import torch
from torch.optim._muon import DEFAULT_A, DEFAULT_B, DEFAULT_C, DEFAULT_NS_STEPS, EPS, _adjust_lr


def muon_momentum(grad: torch.Tensor, buf: torch.Tensor, momentum: float,
                  out: torch.Tensor | None = None) -> torch.Tensor:
    """Muon's elementwise half (torch.optim.Muon's, Nesterov): the buffer's EMA and the update it
    gives. Elementwise, so a shard of the gradient gives the same shard of the update."""
    buf.lerp_(grad, 1 - momentum)
    return grad.lerp(buf, momentum) if out is None else torch.lerp(grad, buf, momentum, out=out)


def orthogonalise(update: torch.Tensor, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """Muon's matrix half on a matrix [rows, cols] or a batch of them [n, rows, cols]: the quintic
    Newton-Schulz torch.optim.Muon runs (its coefficients, 5 steps, the same operations: in bf16
    a matrix gets torch's bits, and each matrix of a batch the bits it gets alone), in `dtype`.
    The one definition every engine feeds whole matrices (a shard's is not the matrix's)."""
    a, b, c = DEFAULT_A, DEFAULT_B, DEFAULT_C
    mm = torch.addmm if update.dim() == 2 else torch.baddbmm
    x = update.to(dtype)
    tall = x.size(-2) > x.size(-1)
    if tall:  # iterate on the wide side: the Gram matrix is then the smaller one
        x = x.mT
    x = x / x.norm(dim=(-2, -1), keepdim=True).clamp(min=EPS)  # spectral <= Frobenius <= 1: NS's basin
    for _ in range(DEFAULT_NS_STEPS):
        gram = x @ x.mT
        x = mm(x, mm(gram, gram, gram, beta=b, alpha=c), x, beta=a)
    return x.mT if tall else x


def orthogonalise_blocks(full: torch.Tensor, blocks: int, dtype: torch.dtype) -> torch.Tensor:
    """NS of each of the `blocks` equal row blocks of `full` on its own, in one batched NS: the
    polar factor of a stack is not the stack of its blocks' (the block with the largest gradient
    takes the spectrum), and Q, K, V (gate, up) are separate maps that only share a matmul."""
    rows, cols = full.shape
    return orthogonalise(full.reshape(blocks, rows // blocks, cols), dtype).reshape(rows, cols)


def block_names(name: str, labels: tuple[str, ...]) -> list[str]:
    """What `MuonAdamW.orthogonalised` counts: `qkv.weight[q]` per block, or the matrix's name."""
    return [f"{name}[{label}]" for label in labels] or [name]


NS_DTYPES = {"bfloat16": torch.bfloat16, "float32": torch.float32}


def ns_dtype(name: str, device: torch.device) -> torch.dtype:
    """optim.muon_ns_dtype. auto: bf16 on CUDA (tensor cores; what torch and modded-nanogpt run),
    fp32 elsewhere: a CPU without bf16 units runs bf16 matmuls 14-40x slower than fp32 (measured
    on this project's 2-core VM, one thread: Newton-Schulz on 768x768, 8.7 s against 0.25 s)."""
    if name == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    return NS_DTYPES[name]


def owners(costs: list[int], world: int, load: list[int] | None = None,
           held: list[int | None] | None = None) -> list[int]:
    """Which rank orthogonalises each matrix (NS costs `costs`): a rank holding more than half of
    a matrix (`held`; ZeRO-1/2, whose partitions hold most matrices whole) keeps it, so little
    moves; the others, largest first, each to the least-loaded rank, lowest rank on ties. `load`:
    each rank's work already given out (updated in place), so one step's buckets are spread
    together: alone, every bucket's first pick would be rank 0. A pure function of its arguments,
    so every rank computes the same assignment."""
    load = [0] * world if load is None else load
    held = held or [None] * len(costs)
    out = [0] * len(costs)
    for i in (i for i in range(len(costs)) if held[i] is not None):
        out[i] = held[i]
        load[out[i]] += costs[i]
    for i in sorted((i for i in range(len(costs)) if held[i] is None), key=lambda i: -costs[i]):
        out[i] = min(range(world), key=lambda r: (load[r], r))
        load[out[i]] += costs[i]
    return out


@dataclass(frozen=True)
class Fragment:
    """The part of one hidden matrix a rank holds: elements [start, start + numel) of the matrix's
    row-major flattening, at [flat_start, flat_start + numel) of the tensor it lives in (a ZeRO
    flat partition; FSDP's dim-0 shard, at 0). numel 0: the rank holds none of it (it still joins
    the collectives)."""
    name: str
    shape: tuple[int, int]
    flat_start: int
    start: int
    numel: int


@dataclass(frozen=True)
class Ranks:
    """The process group as Muon sees it (the engine supplies the collectives: dsslm.optim imports
    nothing distributed). `all_gather(t)` -> every rank's t; `all_to_all(send, send_sizes,
    recv_sizes)` -> what the other ranks sent this one, by rank. `distribute`: optim.muon_distribute."""
    rank: int
    world: int
    all_gather: Callable[[torch.Tensor], list[torch.Tensor]]
    all_to_all: Callable[[torch.Tensor, list[int], list[int]], torch.Tensor]
    distribute: bool = True


@dataclass(frozen=True)
class _Entry:
    """One matrix of a step's plan: the holder it lives in (its index), this rank's piece, every
    rank's (start, numel), and its owner (None: every rank, optim.muon_distribute=false)."""
    holder: int
    piece: Fragment
    spans: tuple[tuple[int, int], ...]
    owner: int | None = None

    @property
    def shape(self) -> tuple[int, int]:
        return self.piece.shape


# Matrices are made whole a bucket at a time: the transient buffers stay at most this many fp32
# elements (128 MiB) beyond the largest matrix, whatever the model's size.
WHOLE_BUCKET_ELEMENTS = 1 << 25


def _buckets(items: list) -> list[list]:
    """Consecutive runs of matrices (anything with the matrix's full `shape`) of at most
    WHOLE_BUCKET_ELEMENTS elements together (a larger matrix alone)."""
    out: list[list] = [[]]
    size = 0
    for item in items:
        if out[-1] and size + math.prod(item.shape) > WHOLE_BUCKET_ELEMENTS:
            out.append([])
            size = 0
        out[-1].append(item)
        size += math.prod(item.shape)
    return out


def _offsets(sizes: list[int]) -> list[int]:
    return [0, *itertools.accumulate(sizes)][:-1]


def _local(t: torch.Tensor) -> torch.Tensor:
    """A DTensor's local shard (FSDP2), or the tensor: flat, sharing its storage."""
    return (t.to_local() if hasattr(t, "to_local") else t).view(-1)


class MuonAdamW(torch.optim.AdamW):
    """Muon on the group marked `muon`, torch AdamW (same kernel, same bits) on the others, in one
    optimizer, so engines drive, clip, skip and checkpoint it as they do AdamW.

    The update is torch's, per block: p <- p (1 - lr wd) - lr sqrt(max(1, rows / cols)) NS(nesterov
    momentum), where a stacked matrix (the group's `blocks`: qkv's q, k, v; gate_up's gate, up)
    is orthogonalised and scaled block by block. `orthogonalised` counts the orthogonalisations
    per block name (`block_names`), this rank's. The momentum buffer is per matrix, as before.

    Whole matrices (DDP, one process) are stepped as they are; with `ranks` set (optim.muon_distribute),
    each matrix goes to one rank (`owners`), which orthogonalises it, and one all-gather per bucket
    hands every rank every result (torchtitan's DistMuon, modded-nanogpt's split).

    Sharded matrices (ZeRO 1/2/3's flat partitions, FSDP2's dim-0 shards) are registered by the
    engine (`register`): the tensors it steps, the `Fragment`s of matrices each holds, every
    rank's span of every matrix. A step sends each piece's momentum-updated values to the matrix's
    owner only (one all-to-all per bucket), the owner assembles and orthogonalises it, and sends
    each rank back its own part only (a second all-to-all, in NS's dtype): per rank about 2/W of
    the matrices' bytes, where an all-reduce of them moves 2 (W-1)/W. NS is a pure function of
    the matrix, so the bits are those of a rank that held every matrix whole."""

    def __init__(self, groups: list[dict], ns: torch.dtype = torch.bfloat16, **adamw):
        self.names = {id(p): n for g in groups for p, n in zip(g["params"], g["names"])}
        self.matrices = [n for g in groups if g.get("muon") for n in g["names"]]  # Muon's, by name
        self.labels = {n: tuple(b) for g in groups if g.get("muon") for n, b in zip(g["names"], g["blocks"])}
        super().__init__([{k: v for k, v in g.items() if k not in ("names", "blocks")} for g in groups], **adamw)
        self.ns = ns
        self.orthogonalised: collections.Counter = collections.Counter()
        self.ranks: Ranks | None = None
        self.pieces: dict[int, list[Fragment]] = {}  # id(tensor stepped) -> the pieces of matrices it holds
        self.spans: dict[str, tuple[tuple[int, int], ...]] = {}  # matrix -> every rank's (start, numel)
        self.buffer_peak = 0  # bytes: the most Muon's exchange buffers held at once, over all steps
        self._plans: dict[tuple[int, ...], list[list[_Entry]]] = {}

    def register(self, held: list[tuple[torch.Tensor, list[Fragment]]],
                 spans: dict[str, tuple[tuple[int, int], ...]]) -> None:
        """The sharded layout (see the class): `held` this rank's tensors and their fragments, in
        the same order on every rank; `spans` every rank's part of every matrix, which must tile it."""
        for name, parts in spans.items():
            cover = sorted((s, n) for s, n in parts if n)
            ends = [0] + [s + n for s, n in cover]
            size = math.prod(next(f.shape for _, fs in held for f in fs if f.name == name))
            if [s for s, _ in cover] != ends[:-1] or ends[-1] != size:
                raise AssertionError(f"the ranks' parts of {name} do not tile it: {parts}")
        if sorted(f.name for _, fs in held for f in fs) != sorted(self.matrices):
            raise AssertionError("Muon's matrices and the engine's pieces of them do not match")
        self.pieces = {id(t): fs for t, fs in held}
        self.spans = dict(spans)
        self._plans = {}

    def _state_of(self, p: torch.Tensor) -> dict:
        state = self.state[p]
        if not state:  # a step count too, so checkpoints name it like AdamW's
            state["step"] = torch.tensor(0.0)
            state["momentum_buffer"] = torch.zeros_like(p.grad)
        state["step"] += 1
        return state

    def _blocks(self, name: str) -> int:
        return max(1, len(self.labels[name]))

    def _cost(self, name: str, shape: tuple[int, int]) -> int:
        """Newton-Schulz's work on the matrix: about rows x cols x min(rows, cols) per block."""
        rows, cols = shape[0] // self._blocks(name), shape[1]
        return self._blocks(name) * rows * cols * min(rows, cols)

    def _ns(self, name: str, full: torch.Tensor) -> torch.Tensor:
        self.orthogonalised.update(block_names(name, self.labels[name]))
        return orthogonalise_blocks(full, self._blocks(name), self.ns)

    def _apply(self, name: str, shape: tuple[int, int], param: torch.Tensor, update: torch.Tensor, group: dict) -> None:
        """torch's decoupled decay, then the update at the rate scaled by the BLOCK's shape."""
        param.mul_(1 - group["lr"] * group["weight_decay"])
        param.add_(update, alpha=-_adjust_lr(group["lr"], None, (shape[0] // self._blocks(name), shape[1])))

    def _note(self, *live: torch.Tensor) -> None:
        """Keep the most bytes Muon's own buffers held at once (each tensor counted once)."""
        distinct = {id(t): t for t in live}.values()
        self.buffer_peak = max(self.buffer_peak, sum(t.numel() * t.element_size() for t in distinct))

    # --- whole matrices (DDP, one process) -------------------------------------------------------
    def _orthogonalise_all(self, names: list[str], fulls: list[torch.Tensor], load: list[int]) -> list[torch.Tensor]:
        """NS of each whole matrix: computed here, or, sharing, by its owner and all-gathered."""
        ranks = self.ranks
        if ranks is None or ranks.world == 1 or not ranks.distribute or not fulls:
            return [self._ns(n, f) for n, f in zip(names, fulls)]
        owner = owners([self._cost(n, tuple(f.shape)) for n, f in zip(names, fulls)], ranks.world, load)
        mine = [self._ns(n, f).reshape(-1) for n, f, o in zip(names, fulls, owner) if o == ranks.rank]
        sizes = [sum(f.numel() for f, o in zip(fulls, owner) if o == r) for r in range(ranks.world)]
        send = torch.zeros(max(sizes), dtype=self.ns, device=fulls[0].device)  # all_gather: equal sizes
        if mine:
            torch.cat(mine, out=send[:sizes[ranks.rank]])
        received = ranks.all_gather(send)
        at = [0] * ranks.world
        out = []
        for f, o in zip(fulls, owner):
            out.append(received[o][at[o]:at[o] + f.numel()].view(f.shape))
            at[o] += f.numel()
        return out

    def _step_whole(self, params: list[torch.Tensor], group: dict) -> None:
        load = [0] * (self.ranks.world if self.ranks is not None else 1)
        for these in _buckets(params):  # a bucket at a time: the transient copies stay bounded
            fulls = [muon_momentum(p.grad, self._state_of(p)["momentum_buffer"], group["momentum"]) for p in these]
            names = [self.names[id(p)] for p in these]
            for p, name, out in zip(these, names, self._orthogonalise_all(names, fulls, load)):
                self._apply(name, tuple(p.shape), p, out, group)

    # --- sharded matrices (ZeRO, FSDP2) ----------------------------------------------------------
    def _plan(self, holders: list[torch.Tensor]) -> list[list[_Entry]]:
        """The step's buckets of matrices with their owners: static, so computed once per set of
        holders (DeepSpeed's stage 3 may step its sub-groups one call at a time)."""
        key = tuple(id(h) for h in holders)
        if key not in self._plans:
            world = self.ranks.world if self.ranks is not None else 1
            distribute = self.ranks is None or self.ranks.distribute
            entries = [_Entry(i, f, self.spans[f.name]) for i, h in enumerate(holders) for f in self.pieces[id(h)]]
            load = [0] * world
            plan = []
            for bucket in _buckets(entries):
                if distribute:
                    costs = [self._cost(e.piece.name, e.shape) for e in bucket]
                    held = [next((r for r, (_, n) in enumerate(e.spans) if 2 * n > math.prod(e.shape)), None)
                            for e in bucket]
                    bucket = [replace(e, owner=o) for e, o in zip(bucket, owners(costs, world, load, held))]
                plan.append(bucket)
            self._plans[key] = plan
        return self._plans[key]

    def _all_to_all(self, send: torch.Tensor, send_sizes: list[int], recv_sizes: list[int]) -> torch.Tensor:
        if self.ranks is None or self.ranks.world == 1:
            return send
        return self.ranks.all_to_all(send, send_sizes, recv_sizes)

    def _step_pieces(self, holders: list[torch.Tensor], group: dict) -> None:
        views = []
        for h in holders:
            buf = self._state_of(h)["momentum_buffer"]
            views.append((_local(h.grad), _local(buf), _local(h)))
        for bucket in self._plan(holders):
            self._exchange(bucket, views, group)

    def _exchange(self, bucket: list[_Entry], views: list[tuple], group: dict) -> None:
        """One bucket: pieces to their owners, NS there, each rank's part back (see the class)."""
        rank, world = (self.ranks.rank, self.ranks.world) if self.ranks is not None else (0, 1)
        dests = [range(world) if e.owner is None else (e.owner,) for e in bucket]
        sizes = [sum(e.piece.numel for e, ds in zip(bucket, dests) if d in ds) for d in range(world)]
        grad_dtype = views[0][0].dtype
        send = torch.empty(sum(sizes), dtype=grad_dtype, device=views[0][0].device)
        at = _offsets(sizes)
        for e, ds in zip(bucket, dests):
            p = e.piece
            if not p.numel:
                continue
            grad, buf, _ = (v[p.flat_start:p.flat_start + p.numel] for v in views[e.holder])
            for k, d in enumerate(ds):  # the update computed once, copied to any further rank
                out = send[at[d]:at[d] + p.numel]
                at[d] += p.numel
                if k == 0:
                    first = muon_momentum(grad, buf, group["momentum"], out=out)
                else:
                    out.copy_(first)
        mine = [i for i, ds in enumerate(dests) if rank in ds]
        recv_sizes = [sum(bucket[i].spans[s][1] for i in mine) for s in range(world)]
        recv = self._all_to_all(send, sizes, recv_sizes)
        self._note(send, recv)
        del send
        at = _offsets(recv_sizes)
        results = {}
        for i in mine:  # assembled and orthogonalised one matrix at a time
            full = torch.empty(bucket[i].shape, dtype=recv.dtype, device=recv.device)
            for s, (start, n) in enumerate(bucket[i].spans):
                full.view(-1)[start:start + n] = recv[at[s]:at[s] + n]
                at[s] += n
            self._note(recv, full, *results.values())
            results[i] = self._ns(bucket[i].piece.name, full).reshape(-1)
        recv_device = recv.device
        del recv
        if any(e.owner is None for e in bucket):  # every rank orthogonalised every matrix: keep its own part
            parts = {i: results[i][e.piece.start:e.piece.start + e.piece.numel] for i, e in enumerate(bucket)}
        else:
            parts = self._return_parts(bucket, mine, results, recv_device)
        for i, e in enumerate(bucket):
            if e.piece.numel:
                p = e.piece
                self._apply(p.name, p.shape, views[e.holder][2][p.flat_start:p.flat_start + p.numel], parts[i], group)

    def _return_parts(self, bucket: list[_Entry], mine: list[int], results: dict,
                      device: torch.device) -> dict[int, torch.Tensor]:
        """Each owner sends every rank its part of the results, and only that."""
        world = self.ranks.world if self.ranks is not None else 1
        sizes = [sum(bucket[i].spans[d][1] for i in mine) for d in range(world)]
        send = torch.empty(sum(sizes), dtype=self.ns, device=device)
        at = _offsets(sizes)
        for i in mine:
            for d, (start, n) in enumerate(bucket[i].spans):
                send[at[d]:at[d] + n] = results[i][start:start + n]
                at[d] += n
        self._note(send, *results.values())
        results.clear()
        recv_sizes = [sum(e.piece.numel for e in bucket if e.owner == s) for s in range(world)]
        recv = self._all_to_all(send, sizes, recv_sizes)
        self._note(send, recv)
        at = _offsets(recv_sizes)
        parts = {}
        for i, e in enumerate(bucket):
            parts[i] = recv[at[e.owner]:at[e.owner] + e.piece.numel]
            at[e.owner] += e.piece.numel
        return parts

    @torch.no_grad()
    def step(self, closure=None):
        everything = self.param_groups
        for group in (g for g in everything if g.get("muon")):
            params = [p for p in group["params"] if p.grad is not None]
            held = [p for p in params if id(p) in self.pieces]
            if held:
                self._step_pieces(held, group)
            self._step_whole([p for p in params if id(p) not in self.pieces], group)
        self.param_groups = [g for g in everything if not g.get("muon")]
        try:
            return super().step(closure)
        finally:
            self.param_groups = everything
