"""The deterministic loader: a batch is a pure function of (manifest, seed, data_batch), and the
data batch of a step a pure function of (step, skip list).

Training reads the train shards of every domain as one virtual concatenation (domains in sorted
order). Each shard is cut into non-overlapping chunks of seq_len + 1 tokens (chunk i is tokens
[i*seq_len, i*seq_len + seq_len + 1): consecutive chunks share one token, so every token is a
target exactly once); chunks never cross a shard boundary. Global sequence g of the run is
chunk perm_e[g % n_chunks] with e = g // n_chunks and perm_e a permutation seeded by (seed, e).
There is no iterator state: step 10**6 costs what step 0 costs, and a resume needs only
(step, skip_list).
"""

from __future__ import annotations

from pathlib import Path
from typing import Iterable

import numpy as np
import torch

from dsslm.data.manifest import load_manifest

Batch = tuple[torch.Tensor, torch.Tensor]  # (inputs, targets), int64 [batch, seq_len]


def merge_windows(skip_list: Iterable[Iterable[int]]) -> list[list[int]]:
    """The skip list's canonical form: sorted, disjoint half-open [start, end) windows of data-batch
    indices covering the same indices; touching windows join, empty ones go."""
    merged: list[list[int]] = []
    for start, end in sorted((int(s), int(e)) for s, e in skip_list):
        if not 0 <= start <= end:
            raise ValueError(f"skip window [{start}, {end}) must have 0 <= start <= end; fix skip_list.json")
        if merged and start <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], end)
        elif start < end:
            merged.append([start, end])
    return merged


class Loader:
    def __init__(self, data_dir: str | Path, seq_len: int, seed: int, global_batch_size: int,
                 manifest: dict | None = None):
        """`manifest` None: read it, checking shard sizes only (pass a verified one to check hashes)."""
        if seq_len < 1 or global_batch_size < 1:
            raise ValueError(f"model.seq_len={seq_len} and the global batch {global_batch_size} must be >= 1")
        if seed < 0:
            raise ValueError(f"run.seed={seed} must be >= 0")
        self.data_dir = Path(data_dir)
        self.manifest = manifest if manifest is not None else load_manifest(data_dir, verify=False)
        self.seq_len, self.seed, self.global_batch_size = seq_len, seed, global_batch_size
        self.tokens_per_step = global_batch_size * seq_len
        self._dtype = np.dtype(self.manifest["dtype"])
        domains = self.manifest["domains"]
        self._train = [(e["path"], e["tokens"]) for name in sorted(domains) for e in domains[name]["train"]]
        chunks = [self._n_chunks(tokens) for _, tokens in self._train]
        self._first_chunk = np.concatenate([[0], np.cumsum(chunks)]).astype(np.int64)
        self.n_chunks = int(self._first_chunk[-1])
        if self.n_chunks == 0:
            raise ValueError(f"{data_dir} has no train shard of {seq_len + 1}+ tokens; "
                             "lower model.seq_len or prepare more text")
        self._maps: dict[str, np.memmap] = {}
        self._perm_epoch, self._perm = -1, np.empty(0, dtype=np.int64)

    @property
    def domains(self) -> list[str]:
        return sorted(self.manifest["domains"])

    def data_batch_index(self, step: int, skip_list: list) -> int:
        """The `step`-th data batch index outside every half-open [start, end) window."""
        index = step
        for start, end in merge_windows(skip_list):
            if start > index:
                break
            index += end - start  # windows are sorted and disjoint: each one passed shifts us on
        return index

    def global_batch(self, data_batch: int) -> Batch:
        """The whole batch every rank agrees on; callers may post-process it before split_batch."""
        g = data_batch * self.global_batch_size + np.arange(self.global_batch_size, dtype=np.int64)
        epochs, positions = np.divmod(g, self.n_chunks)
        chunk_ids = np.empty_like(g)
        for epoch in np.unique(epochs):  # a batch straddles at most a few epochs
            mask = epochs == epoch
            chunk_ids[mask] = self._permutation(int(epoch))[positions[mask]]
        rows = np.stack([self._read_chunk(int(c)) for c in chunk_ids])
        return _as_batch(rows)

    def micro_batches(self, step: int, skip_list: list, rank: int, world_size: int, grad_accum: int) -> list[Batch]:
        """This rank's slice of step `step`'s global batch, cut into `grad_accum` micro-batches."""
        batch = self.global_batch(self.data_batch_index(step, skip_list))
        return split_batch(batch, rank, world_size, grad_accum)

    def val_batches(self, domain: str, n_batches: int, batch_size: int) -> list[Batch]:
        """The first n_batches * batch_size chunks of `domain`'s val shards, in order (seed
        independent); fewer, and a short last batch, when the split is small."""
        if domain not in self.manifest["domains"]:
            raise ValueError(f"no domain {domain!r} in {self.data_dir}; domains are {', '.join(self.domains)}")
        wanted = n_batches * batch_size
        rows: list[np.ndarray] = []
        for entry in self.manifest["domains"][domain]["val"]:
            tokens = self._shard(entry["path"])
            for i in range(min(self._n_chunks(entry["tokens"]), wanted - len(rows))):
                rows.append(np.asarray(tokens[i * self.seq_len : (i + 1) * self.seq_len + 1]))
        return [_as_batch(np.stack(rows[i : i + batch_size])) for i in range(0, len(rows), batch_size)]

    def _n_chunks(self, tokens: int) -> int:
        return max(0, (tokens - 1) // self.seq_len)

    def _permutation(self, epoch: int) -> np.ndarray:
        # Only the latest epoch is cached: n_chunks int64s (80 MB per 10M chunks) is plenty to hold.
        if epoch != self._perm_epoch:
            rng = np.random.Generator(np.random.PCG64(np.random.SeedSequence([self.seed, epoch])))
            self._perm_epoch, self._perm = epoch, rng.permutation(self.n_chunks)
        return self._perm

    def _read_chunk(self, chunk_id: int) -> np.ndarray:
        shard = int(np.searchsorted(self._first_chunk, chunk_id, side="right")) - 1
        start = (chunk_id - int(self._first_chunk[shard])) * self.seq_len
        return np.asarray(self._shard(self._train[shard][0])[start : start + self.seq_len + 1])

    def _shard(self, path: str) -> np.memmap:
        if path not in self._maps:  # opened once, lazily: a rank touches only the shards it reads
            self._maps[path] = np.memmap(self.data_dir / path, dtype=self._dtype, mode="r")
        return self._maps[path]


def split_batch(batch: Batch, rank: int, world_size: int, grad_accum: int) -> list[Batch]:
    """Rank `rank`'s contiguous slice [r*B/W, (r+1)*B/W) of a global batch, in `grad_accum` pieces."""
    inputs, targets = batch
    size = inputs.shape[0]
    if size % world_size:
        raise ValueError(f"a global batch of {size} sequences does not split over {world_size} ranks; "
                         "the global batch must be train.micro_batch_size * train.grad_accum * world_size")
    per_rank = size // world_size
    if per_rank % grad_accum:
        raise ValueError(f"{per_rank} sequences per rank do not split into train.grad_accum={grad_accum} "
                         "micro-batches; make train.micro_batch_size * train.grad_accum the per-rank batch")
    micro = per_rank // grad_accum
    lo = rank * per_rank
    return [(inputs[lo + i * micro : lo + (i + 1) * micro], targets[lo + i * micro : lo + (i + 1) * micro])
            for i in range(grad_accum)]


def _as_batch(rows: np.ndarray) -> Batch:
    rows = torch.from_numpy(rows.astype(np.int64))
    return rows[:, :-1].contiguous(), rows[:, 1:].contiguous()
