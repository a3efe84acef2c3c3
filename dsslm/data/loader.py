"""The deterministic loader: a sequence is a pure function of (manifest, seed, global index), and
the sequences of a step a pure function of (position, skip list, batch size) (`data.stream`).

Training reads the train shards of every domain as one virtual concatenation (domains in sorted
order). Each shard is cut into non-overlapping chunks of seq_len + 1 tokens (chunk i is tokens
[i*seq_len, i*seq_len + seq_len + 1): consecutive chunks share one token, so every token is a
target exactly once); chunks never cross a shard boundary. Global sequence g of the run is
chunk perm_e[g % n_chunks] with e = g // n_chunks and perm_e a permutation seeded by (seed, e).
There is no iterator state: position 10**9 costs what position 0 costs, and a resume needs only
(position, skip_list). Each rank reads only the chunks of its own sequences.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from dsslm.data.manifest import load_manifest
from dsslm.data.sources import DataError
from dsslm.data.stream import StepSlice, merge_windows, split_micro_batches, step_slice

__all__ = ["Batch", "Loader", "merge_windows"]

Batch = tuple[torch.Tensor, torch.Tensor]  # (inputs, targets), int64 [batch, seq_len]


class Loader:
    def __init__(self, data_dir: str | Path, seq_len: int, seed: int, manifest: dict | None = None):
        """`manifest` None: read it, checking shard sizes only (pass a verified one to check hashes)."""
        if seq_len < 1:
            raise DataError(f"model.seq_len={seq_len} must be >= 1")
        if seed < 0:
            raise DataError(f"run.seed={seed} must be >= 0")
        self.data_dir = Path(data_dir)
        self.manifest = manifest if manifest is not None else load_manifest(data_dir, verify=False)
        self.seq_len, self.seed = seq_len, seed
        self._dtype = np.dtype(self.manifest["dtype"])
        domains = self.manifest["domains"]
        self._train = [(e["path"], e["tokens"]) for name in sorted(domains) for e in domains[name]["train"]]
        chunks = [self._n_chunks(tokens) for _, tokens in self._train]
        self._first_chunk = np.concatenate([[0], np.cumsum(chunks)]).astype(np.int64)
        self.n_chunks = int(self._first_chunk[-1])
        if self.n_chunks == 0:
            longest = max((tokens for _, tokens in self._train), default=0)
            raise DataError(f"model.seq_len={seq_len} is longer than every train shard of {data_dir} "
                            f"(the longest holds {longest} tokens); lower model.seq_len or prepare more text")
        self._maps: dict[str, np.memmap] = {}
        self._perm_epoch, self._perm = -1, np.empty(0, dtype=np.int64)
        self.chunks_read = 0  # for the benchmarks and the rank-local reads test

    @property
    def domains(self) -> list[str]:
        return sorted(self.manifest["domains"])

    def step(self, position: int, skip_list: list, batch_size: int, rank: int, world_size: int,
             grad_accum: int) -> tuple[StepSlice, list[Batch]]:
        """The step starting at `position`: its bounds, and this rank's share in `grad_accum`
        micro-batches (reading only this rank's chunks)."""
        part = step_slice(position, skip_list, batch_size, rank, world_size)
        inputs, targets = self.read(part.indices)
        pieces = split_micro_batches(len(part.indices), grad_accum)
        return part, [(inputs[p], targets[p]) for p in pieces]

    def read(self, indices: np.ndarray) -> Batch:
        """The sequences with these global indices, in that order."""
        g = np.asarray(indices, dtype=np.int64)
        epochs, positions = np.divmod(g, self.n_chunks)
        chunk_ids = np.empty_like(g)
        for epoch in np.unique(epochs):  # a step straddles at most a few epochs
            mask = epochs == epoch
            chunk_ids[mask] = self._permutation(int(epoch))[positions[mask]]
        self.chunks_read += len(chunk_ids)
        return _as_batch(np.stack([self._read_chunk(int(c)) for c in chunk_ids]))

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


def _as_batch(rows: np.ndarray) -> Batch:
    rows = torch.from_numpy(rows.astype(np.int64))
    return rows[:, :-1].contiguous(), rows[:, 1:].contiguous()
