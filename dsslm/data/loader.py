"""The deterministic loader: a sequence is a pure function of (manifest, seed, global index), and
the sequences of a step a pure function of (position, skip list, batch size) (`data.stream`).

Training reads the train shards of every domain as one virtual concatenation (domains in sorted
order). Each shard is cut into non-overlapping chunks of seq_len + 1 tokens (chunk i is tokens
[i*seq_len, i*seq_len + seq_len + 1): consecutive chunks share one token, so every token is a
target exactly once); chunks never cross a shard boundary. Global sequence g of the run is
chunk perm_e[g % n_chunks] with e = g // n_chunks and perm_e a permutation seeded by (seed, e),
computed per index (`data.permute`: no array of n_chunks exists): domains are drawn in
proportion to their token counts. With `data.mix` (`mix`), the domain of
g is drawn by weight instead and each domain shuffles and repeats its own chunks
(`data.mixture`). There is no iterator state: position 10**9 costs what position 0 costs, and a
resume needs only (position, skip_list). Each rank reads only the chunks of its own sequences.

A skip list's windows take positions out of the stream; its data entries (`data.skips`) take
chunks out: a global sequence whose chunk a data entry names is not fed, and the step takes the
next one instead, so the batch stays a pure function of (seed, position, skip list) and a skipped
chunk never comes back in a later epoch.

One background thread (`data.prefetch`) may read while the training thread reads or counts:
the caches below are replaced whole, never mutated in place.
"""

from __future__ import annotations

import collections
import dataclasses
import json
import resource
import threading
from pathlib import Path

import numpy as np
import torch

from dsslm.data.bytecount import IGNORE_INDEX
from dsslm.data.manifest import load_manifest
from dsslm.data.mixture import Mixture, StagedMixture, domain_key, weight_units
from dsslm.data.permute import order_of, parse_shuffle
from dsslm.data.skips import DOCUMENT_TOKENS, chunk_range, document_bounds, entries_of, view_of
from dsslm.data.sources import DataError, NothingLeft
from dsslm.data.stream import StepSlice, merge_windows, slice_of_merged, split_micro_batches, take



def _open_shard_budget() -> int:
    """A quarter of this process's soft limit on open files (256 under the usual 1,024), the rest
    left to everything else a rank opens (NCCL's sockets, checkpoints, logs): an epoch over more
    shards reopens the least recently read (measured, 1,100 shards of 2 chunks: 40 us a chunk
    read against 7 with every map open)."""
    try:
        soft = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
    except (OSError, ValueError):
        soft = 1024
    return max(64, (1 << 16 if soft == resource.RLIM_INFINITY else soft) // 4)


MAX_OPEN_SHARDS = _open_shard_budget()
_COUNT_SPAN = 1 << 20  # positions mapped at once where a count walks the stream (8 MB of int64s each)

__all__ = ["Batch", "Loader", "merge_windows"]

Batch = tuple[torch.Tensor, torch.Tensor]  # (inputs, targets), int64 [batch, seq_len]


class Loader:
    def __init__(self, data_dir: str | Path, seq_len: int, seed: int, manifest: dict | None = None,
                 mix: dict[str, float] | list | None = None, shuffle: str = "feistel"):
        """`manifest` None: read it, checking shard sizes only (pass a verified one to check hashes).
        `mix` {domain: weight}, or [(start, {domain: weight})] stages (`data.mixture`): draw each
        sequence's domain by weight (None or {}: by token count). `shuffle`: the epoch order's kind (`data.permute`)."""
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
        # Domains are concatenated in sorted order: domain i owns chunks [_domain_first[i], _domain_first[i+1]).
        shards_per_domain = np.cumsum([0] + [len(domains[name]["train"]) for name in self.domains])
        self._domain_first = self._first_chunk[shards_per_domain]
        self._shard_domain = np.repeat(np.arange(len(self.domains)), np.diff(shards_per_domain))
        self.domain_chunks = np.diff(self._domain_first)
        self.mixture = self._mixture(mix) if mix else None
        # At most MAX_OPEN_SHARDS maps, least recently read first out: each holds a file descriptor,
        # and a shuffled epoch reads every shard (1,018 shards met the usual soft limit of 1,024).
        self._maps: collections.OrderedDict[str, np.memmap] = collections.OrderedDict()
        self._maps_lock = threading.Lock()  # the prefetcher's thread reads beside the loop's
        self.shuffle = ""
        self.set_shuffle(shuffle)
        self._shard_index = {path: i for i, (path, _) in enumerate(self._train)}
        # (the view's entries list, their JSON key, chunk ids): see skipped_chunks
        self._skipped: tuple[list | None, str, np.ndarray] = (None, "[]", np.empty(0, dtype=np.int64))
        self._count_lock = threading.Lock()
        self.chunks_read = 0  # for the benchmarks and the rank-local reads test

    def set_shuffle(self, spec: str) -> None:
        """Read epochs in the order of kind `spec` (`data.permute`): set once the run knows which
        kind its checkpoint was trained with, before the first read."""
        parse_shuffle(spec)  # ValueError for a kind this code does not know
        if spec != self.shuffle:
            self.shuffle = spec
            # (domain or -1, epoch) -> that epoch's order; replaced whole (the prefetcher reads beside)
            self._orders: dict[tuple[int, int], object] = {}

    @property
    def domains(self) -> list[str]:
        return sorted(self.manifest["domains"])

    def step(self, position: int, skip_list: list, batch_size: int, rank: int, world_size: int,
             grad_accum: int) -> tuple[StepSlice, list[Batch]]:
        """The step starting at `position`: its bounds and tokens per domain (of the whole step),
        and this rank's share in `grad_accum` micro-batches (reading only this rank's chunks)."""
        view = view_of(skip_list)  # merged once per change of the list, not once per use
        part = slice_of_merged(position, view.windows, batch_size, rank, world_size)
        if view.entries:
            # Which positions a data entry takes out needs each one's chunk: every rank maps the
            # whole step (arithmetic and a permutation lookup, no reads) and takes its share.
            whole = self.stream(position, batch_size, skip_list)
            per_rank = batch_size // world_size
            part = dataclasses.replace(part, first=int(whole[0]), end=int(whole[-1]) + 1,
                                       indices=whole[rank * per_rank:(rank + 1) * per_rank])
        else:
            whole = take(part.first, batch_size, view.windows)  # arithmetic: no reads
        inputs, targets = self.read(part.indices)
        pieces = split_micro_batches(len(part.indices), grad_accum)
        part = dataclasses.replace(part, domain_tokens=self.domain_tokens(whole))
        return part, [(inputs[p], targets[p]) for p in pieces]

    def stream(self, position: int, count: int, skip_list: list) -> np.ndarray:
        """The first `count` global sequences at or after `position` that the skip list lets
        through (outside every window, on no skipped chunk), ascending (int64)."""
        windows, skipped = view_of(skip_list).windows, self.skipped_chunks(skip_list)
        out, pos, need = [], position, count
        while need > 0:
            candidates = take(pos, 2 * need + 64, windows)
            kept = candidates[self._fed(candidates, skipped)][:need]
            out.append(kept)
            need -= len(kept)
            pos = int(candidates[-1]) + 1
        return np.concatenate(out) if out else np.empty(0, dtype=np.int64)

    def fed_between(self, first: int, end: int, skip_list: list) -> np.ndarray:
        """The global sequences in [first, end) that the skip list lets through."""
        g = np.arange(first, end, dtype=np.int64)
        for lo, hi in view_of(skip_list).windows:
            g = g[(g < lo) | (g >= hi)]
        return g[self._fed(g, self.skipped_chunks(skip_list))]

    def window_entries(self, first: int, end: int, skip_list: list) -> list[dict]:
        """Skip entries naming the data the global sequences [first, end) read, where the skip
        list let them through: a window of the stream, named as data."""
        return self.data_entries(self.fed_between(first, end, skip_list))

    def skipped_chunks(self, skip_list: list) -> np.ndarray:
        """The chunk ids the skip list's data entries name (sorted, unique int64); DataError when
        an entry names a shard this data does not have, tokens past its end, or every chunk."""
        # Keyed on the entries alone (a list that gains a window only maps to the same chunks),
        # as JSON made once per view: the same view's entries are the same list, so no new key.
        entries = view_of(skip_list).entries
        made_from, cached_key, chunks = self._skipped
        if entries is made_from:
            return chunks
        key = json.dumps(entries, separators=(",", ":"))
        if key == cached_key:
            self._skipped = (entries, key, chunks)
            return chunks
        ranges = []
        for e in entries:
            shard = self._shard_index.get(e["shard"])
            if shard is None:
                raise DataError(f"skip_list names shard {e['shard']!r}, which is not a train shard of "
                                f"{self.data_dir}; remove the entry from skip_list.json and the checkpoint")
            a, b = e["tokens"]
            if b > self._train[shard][1]:
                raise DataError(f"skip_list names tokens [{a}, {b}) of {e['shard']}, which holds "
                                f"{self._train[shard][1]}; remove the entry")
            lo, hi = chunk_range(a, b, self.seq_len, self._n_chunks(self._train[shard][1]))
            ranges.append(np.arange(lo, hi, dtype=np.int64) + self._first_chunk[shard])
        chunks = np.unique(np.concatenate(ranges)) if ranges else np.empty(0, dtype=np.int64)
        drawn, emptied = self._drawn_and_emptied(chunks)
        if drawn and len(emptied) == len(drawn):
            raise NothingLeft(f"the skip list names every chunk of {self.data_dir} that training draws from; "
                            "nothing is left to train on")
        self._skipped = (entries, key, chunks)  # one assignment: another thread sees the old triple or the new
        return chunks

    def skipped_share(self, skip_list: list) -> dict[str, float]:
        """Each domain's share of its train chunks that the skip list's data entries name (windows
        of positions are a pass's, not text: not counted)."""
        chunks = self.skipped_chunks(skip_list)
        per_domain = np.bincount(np.searchsorted(self._domain_first, chunks, side="right") - 1,
                                 minlength=len(self.domains))
        return {name: float(k) / int(n) for name, k, n in zip(self.domains, per_domain, self.domain_chunks) if n > 0}

    def emptied_domains(self, skip_list: list) -> list[str]:
        """The domains training draws from whose every chunk the skip list names (with the others
        left: else skipped_chunks raises). Their draws go to the next sequences of the stream, so
        the run trains on the other domains only, and data.mix's weights no longer hold."""
        return [self.domains[d] for d in self._drawn_and_emptied(self.skipped_chunks(skip_list))[1]]

    def _drawn_and_emptied(self, chunks: np.ndarray) -> tuple[list[int], list[int]]:
        """The domains training draws from (chunks, and weight in the mix), and those of them whose
        every chunk is in `chunks` (skipped chunk ids, sorted and unique)."""
        per_domain = np.bincount(np.searchsorted(self._domain_first, chunks, side="right") - 1,
                                 minlength=len(self.domains))
        drawn = [d for d in range(len(self.domains))
                 if self.domain_chunks[d] > 0 and (self.mixture is None or self.mixture.units[d] > 0)]
        return drawn, [d for d in drawn if per_domain[d] >= self.domain_chunks[d]]

    def data_entries(self, indices: np.ndarray, documents: np.ndarray | None = None) -> list[dict]:
        """Skip entries naming the data of these global sequences: each one's chunk and, where
        `documents` (a bool mask) says so, the documents its targets belong to (delimited by the
        tokenizer's EOS, at most DOCUMENT_TOKENS tokens beyond the chunk on either side, and into
        the domain's neighbouring shard where the document crosses a shard's edge)."""
        indices = np.asarray(indices, dtype=np.int64)
        documents = np.zeros(len(indices), dtype=bool) if documents is None else np.asarray(documents, dtype=bool)
        eos = self.manifest.get("tokenizer", {}).get("eos_id")
        entries = []
        for chunk_id, whole_document in zip(self._chunk_ids(indices), documents):
            shard = int(np.searchsorted(self._first_chunk, int(chunk_id), side="right")) - 1
            path = self._train[shard][0]
            start = (int(chunk_id) - int(self._first_chunk[shard])) * self.seq_len
            end = start + self.seq_len + 1
            entries.append({"shard": path, "tokens": [start, end]})
            if whole_document:
                tokens = self._shard(path)
                a, b = document_bounds(tokens, start + 1, end, eos, DOCUMENT_TOKENS)
                # From the EOS before the document: the prediction of its first token is its too.
                entries.append({"shard": path, "tokens": [max(0, a - 1), b]})
                entries += self._document_beyond(shard, tokens, a, b, eos)
        return entries_of(entries)

    def document_chunks(self, chunk_id: int, limit: int) -> np.ndarray:
        """Up to `limit` other chunks of the document chunk `chunk_id` reads (its shard's part of
        it, DOCUMENT_TOKENS either side at most), evenly spaced through it: what a verdict reads to
        ask whether the document's own text stands out (`recovery.reach`). Empty without an EOS."""
        eos = self.manifest.get("tokenizer", {}).get("eos_id")
        if eos is None:
            return np.empty(0, dtype=np.int64)
        shard = int(np.searchsorted(self._first_chunk, int(chunk_id), side="right")) - 1
        path, tokens = self._train[shard][0], self._train[shard][1]
        start = (int(chunk_id) - int(self._first_chunk[shard])) * self.seq_len
        a, b = document_bounds(self._shard(path), start + 1, start + self.seq_len + 1, eos, DOCUMENT_TOKENS)
        lo, hi = chunk_range(a, b, self.seq_len, self._n_chunks(tokens))
        # Chunks inside the document: not the ones that straddle its edges into its neighbours.
        inner = [c for c in range(lo, hi) if c * self.seq_len >= a - 1 and c * self.seq_len + self.seq_len < b]
        others = np.asarray([c for c in inner if c + int(self._first_chunk[shard]) != int(chunk_id)], dtype=np.int64)
        if len(others) > limit:
            others = others[np.linspace(0, len(others) - 1, limit).round().astype(np.int64)]
        return others + int(self._first_chunk[shard])

    def read_chunks(self, chunk_ids: np.ndarray) -> Batch:
        """The chunks with these ids as a batch (inputs, targets), in that order."""
        return _as_batch(np.stack([self._read_chunk(int(c)) for c in chunk_ids]))

    def _document_beyond(self, shard: int, tokens: np.ndarray, a: int, b: int, eos: int | None) -> list[dict]:
        """The parts of a document [a, b) of train shard `shard` in the shards before and after it:
        `prepare` cuts shards at token counts, so a document that reaches a shard's edge with no
        EOS there goes on in the domain's neighbouring shard (one shard each way)."""
        if eos is None:
            return []
        out = []
        n = len(tokens)
        if b == n and n and tokens[n - 1] != eos and self._same_domain(shard, shard + 1):
            path = self._train[shard + 1][0]
            _, end = document_bounds(self._shard(path), 0, 1, eos, DOCUMENT_TOKENS)
            out.append({"shard": path, "tokens": [0, end]})
        if a == 0 and self._same_domain(shard, shard - 1):
            path = self._train[shard - 1][0]
            before = self._shard(path)
            m = len(before)
            if m and before[m - 1] != eos:
                first, _ = document_bounds(before, m, m, eos, DOCUMENT_TOKENS)
                out.append({"shard": path, "tokens": [max(0, first - 1), m]})
        return out

    def _same_domain(self, shard: int, other: int) -> bool:
        return 0 <= other < len(self._train) and self._shard_domain[other] == self._shard_domain[shard]

    def read(self, indices: np.ndarray) -> Batch:
        """The sequences with these global indices, in that order."""
        chunk_ids = self._chunk_ids(np.asarray(indices, dtype=np.int64))
        with self._count_lock:
            self.chunks_read += len(chunk_ids)
        return _as_batch(np.stack([self._read_chunk(int(c)) for c in chunk_ids]))

    def domain_tokens(self, indices: np.ndarray) -> dict[str, int]:
        """Target tokens per domain in the sequences with these global indices (seq_len each)."""
        counts = np.bincount(self._domain_index(np.asarray(indices, dtype=np.int64)), minlength=len(self.domains))
        return {name: int(n) * self.seq_len for name, n in zip(self.domains, counts)}

    def domain_tokens_before(self, position: int, skip_list: list) -> dict[str, int]:
        """Tokens per domain in every sequence before `position` outside the skip windows: what a
        run trained up to there (for a checkpoint that did not record it)."""
        counts = self._count_before(position)
        # Windows only: a data entry's chunks were trained before its verdict, at least once.
        for lo, hi in view_of(skip_list).windows:
            if lo < position:
                counts -= self._count_before(min(hi, position)) - self._count_before(lo)
        return {name: int(n) * self.seq_len for name, n in zip(self.domains, counts)}

    def epochs_before(self, position: int) -> dict[str, int]:
        """Each drawn domain's epoch (0 = first pass over its chunks) at its last sequence before
        `position`: a domain whose epoch grows across a step started repeating in it."""
        if self.mixture is None:
            epoch = max(position - 1, 0) // self.n_chunks
            return {name: epoch for name in self.domains}
        counts = self.mixture.count_before(position)
        return {name: max(int(c) - 1, 0) // int(n)
                for name, c, n, u in zip(self.domains, counts, self.domain_chunks, self.mixture.units) if u > 0}

    def val_batches(self, domain: str, n_batches: int, batch_size: int) -> list[Batch]:
        """The first n_batches * batch_size chunks of `domain`'s val shards, in order (seed
        independent); fewer, and a short last batch, when the split is small."""
        if domain not in self.manifest["domains"]:
            raise ValueError(f"no domain {domain!r} in {self.data_dir}; domains are {', '.join(self.domains)}")
        wanted = n_batches * batch_size
        rows: list[np.ndarray] = []
        for entry in self.manifest["domains"][domain]["val"]:
            if self._n_chunks(entry["tokens"]) == 0:
                continue  # nothing to read (an empty file cannot even be mapped)
            tokens = self._shard(entry["path"])
            for i in range(min(self._n_chunks(entry["tokens"]), wanted - len(rows))):
                rows.append(np.asarray(tokens[i * self.seq_len : (i + 1) * self.seq_len + 1]))
        return [_as_batch(np.stack(rows[i : i + batch_size])) for i in range(0, len(rows), batch_size)]

    def held_out_share(self, global_batch: int, grad_accum: int, rank: int, world_size: int) -> tuple[list[Batch], int]:
        """A held-out batch laid out as a training step of `global_batch` sequences: the first
        domain's first validation chunks (fewer where its split is smaller, padded with rows whose
        targets count nothing), rank `rank`'s share in `grad_accum` micro-batches; and the real
        targets over every rank's share (the step's token weighting). The same sequences and
        weights at any split of the batch."""
        held = self.val_batches(self.domains[0], 1, global_batch)
        if not held:
            return [], 0
        inputs, targets = held[0]
        real = int((targets != IGNORE_INDEX).sum())
        missing = global_batch - len(inputs)
        inputs = torch.cat((inputs, torch.zeros(missing, inputs.shape[1], dtype=inputs.dtype)))
        targets = torch.cat((targets, torch.full((missing, targets.shape[1]), IGNORE_INDEX, dtype=targets.dtype)))
        per_micro = global_batch // (grad_accum * world_size)
        mine = slice(rank * grad_accum * per_micro, (rank + 1) * grad_accum * per_micro)
        return list(zip(inputs[mine].split(per_micro), targets[mine].split(per_micro))), real

    def _mixture(self, mix: dict[str, float] | list) -> Mixture | StagedMixture:
        if isinstance(mix, dict):
            return Mixture(self._units(mix, "data.mix"), self.seed)
        return StagedMixture([(start, self._units(weights, f"data.mix_stages[{i}].weights"))
                              for i, (start, weights) in enumerate(mix)], self.seed)

    def _units(self, mix: dict[str, float], key: str) -> list[int]:
        unknown = sorted(set(mix) - set(self.domains))
        if unknown:
            raise DataError(f"{key} names domain {unknown[0]!r}, which {self.data_dir} does not have; "
                            f"its domains are {', '.join(self.domains)}")
        units = weight_units(mix, self.domains)
        empty = [d for d, u, n in zip(self.domains, units, self.domain_chunks) if u > 0 and n == 0]
        if empty:
            raise DataError(f"{key}.{empty[0]} > 0, but domain {empty[0]} has no train shard longer than "
                            f"model.seq_len={self.seq_len}; drop it from {key} or lower model.seq_len")
        return units

    def _chunk_ids(self, g: np.ndarray) -> np.ndarray:
        chunk_ids = np.empty_like(g)
        if self.mixture is None:
            epochs, positions = np.divmod(g, self.n_chunks)
            for epoch in np.unique(epochs):  # a step straddles at most a few epochs
                mask = epochs == epoch
                chunk_ids[mask] = self._order(-1, int(epoch)).at(positions[mask])
            return chunk_ids
        domains, numbers = self.mixture.locate(g)
        for d in np.unique(domains):
            mask = domains == d
            epochs, positions = np.divmod(numbers[mask], self.domain_chunks[d])
            picked = np.empty_like(positions)
            for epoch in np.unique(epochs):
                sub = epochs == epoch
                picked[sub] = self._order(int(d), int(epoch)).at(positions[sub])
            chunk_ids[mask] = self._domain_first[d] + picked
        return chunk_ids

    def epoch_of(self, indices: np.ndarray) -> np.ndarray:
        """The pass each global sequence index is read in: its domain's epoch (int64)."""
        g = np.asarray(indices, dtype=np.int64)
        if self.mixture is None:
            return g // max(self.n_chunks, 1)
        domains, numbers = self.mixture.locate(g)
        return numbers // np.maximum(self.domain_chunks[domains], 1)

    def chunk_ids(self, indices: np.ndarray) -> np.ndarray:
        """The chunk each global sequence index reads (int64): a chunk's id names its text."""
        return self._chunk_ids(np.asarray(indices, dtype=np.int64))

    def _fed(self, g: np.ndarray, skipped: np.ndarray) -> np.ndarray:
        """A mask of the global sequences in `g` whose chunk is not in `skipped`."""
        if len(skipped) == 0:
            return np.ones(len(g), dtype=bool)
        # `skipped` is sorted and unique: a binary search per sequence, not a sort of both (np.isin).
        chunks = self._chunk_ids(g)
        at = np.minimum(np.searchsorted(skipped, chunks), len(skipped) - 1)
        return skipped[at] != chunks

    def _domain_index(self, g: np.ndarray) -> np.ndarray:
        if self.mixture is not None:
            return self.mixture.locate(g)[0]
        return np.searchsorted(self._domain_first, self._chunk_ids(g), side="right") - 1

    def _count_before(self, position: int) -> np.ndarray:
        """Sequences of each domain among global indices [0, position) (skip windows included)."""
        if self.mixture is not None:
            return self.mixture.count_before(position).astype(np.int64)
        epochs, rest = divmod(position, self.n_chunks)
        counts = self.domain_chunks.astype(np.int64) * epochs
        start = epochs * self.n_chunks
        for lo in range(start, position, _COUNT_SPAN):  # in spans: memory bounded at any position
            g = np.arange(lo, min(lo + _COUNT_SPAN, position), dtype=np.int64)
            counts += np.bincount(self._domain_index(g), minlength=len(self.domains))
        return counts

    def _n_chunks(self, tokens: int) -> int:
        return max(0, (tokens - 1) // self.seq_len)

    def _order(self, domain: int, epoch: int):
        """The order of an epoch of all chunks (domain -1) or of one domain's, seeded as dsslm
        always seeded them: (seed, epoch) and (seed, epoch, the domain's key)."""
        orders = self._orders
        order = orders.get((domain, epoch))
        if order is None:
            n = self.n_chunks if domain < 0 else int(self.domain_chunks[domain])
            entropy = [self.seed, epoch] if domain < 0 else [self.seed, epoch, domain_key(self.domains[domain])]
            order = order_of(self.shuffle, n, entropy)
            # The array kind holds n int64s an epoch: keep only the latest epoch of each. The
            # others hold a few keys: keep a few epochs (a step may straddle two).
            keep = {k: v for k, v in orders.items()
                    if k[0] != domain or (order.kind != "array" and abs(k[1] - epoch) <= 2)}
            self._orders = {**keep, (domain, epoch): order}  # one assignment: the other thread sees old or new
        return order

    def _read_chunk(self, chunk_id: int) -> np.ndarray:
        shard = int(np.searchsorted(self._first_chunk, chunk_id, side="right")) - 1
        start = (chunk_id - int(self._first_chunk[shard])) * self.seq_len
        return np.asarray(self._shard(self._train[shard][0])[start : start + self.seq_len + 1])

    def _shard(self, path: str) -> np.memmap:
        with self._maps_lock:  # opened lazily: a rank touches only the shards it reads
            shard = self._maps.get(path)
            if shard is None:
                shard = self._maps[path] = np.memmap(self.data_dir / path, dtype=self._dtype, mode="r")
                if len(self._maps) > MAX_OPEN_SHARDS:  # closed once the last view of it is gone
                    self._maps.popitem(last=False)
            self._maps.move_to_end(path)
            return shard


def _as_batch(rows: np.ndarray) -> Batch:
    rows = torch.from_numpy(rows.astype(np.int64))
    return rows[:, :-1].contiguous(), rows[:, 1:].contiguous()
