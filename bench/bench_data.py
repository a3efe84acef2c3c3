"""The data path's figures: bytes read per rank per step, prefetch, startup verification, prepare.

    .venv/bin/python bench/bench_data.py reads                            # W = 1, 8, 64; seconds
    .venv/bin/python bench/bench_data.py prefetch --steps 100 --rounds 5  # loader wait per step, on / off
    .venv/bin/python bench/bench_data.py startup --gb 10 --dir /tmp       # writes, then deletes, a 10 GB corpus
    .venv/bin/python bench/bench_data.py prepare --mb 200 --rounds 2      # byte and BPE against raw encode_batch

Benchmarks, not tests: nothing asserts. Each prints the load average before and after; A/B pairs
alternate round by round and report medians. `startup` and `--cold` evict only their own files
from the page cache (posix_fadvise DONTNEED), so reads come from the disk without touching
anyone else's cache.
"""
from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from dsslm.data import sources  # noqa: E402
from dsslm.data.loader import Loader  # noqa: E402
from dsslm.data.manifest import load_manifest  # noqa: E402
from dsslm.data.prefetch import Prefetcher  # noqa: E402
from dsslm.data.stream import merge_windows, take  # noqa: E402
from dsslm.data.tokenizer import ByteTokenizer  # noqa: E402


def load() -> str:
    return "load average " + " ".join(f"{x:.2f}" for x in os.getloadavg())


def synthetic_corpus(out: Path, total_bytes: int, shard_bytes: int, seed: int = 0) -> Path:
    """A byte-tokenizer DATA_DIR of random uint16 tokens, written and hashed in 64 MiB pieces."""
    (out / "synth").mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(seed)
    entries, left, i = [], total_bytes, 0
    while left > 0:
        size = min(shard_bytes, left) // 2 * 2
        path, digest = out / "synth" / f"train-{i:05d}.bin", hashlib.sha256()
        with open(path, "wb") as f:
            for start in range(0, size, 64 << 20):
                piece = rng.integers(0, 257, min(64 << 20, size - start) // 2, dtype=np.uint16).tobytes()
                f.write(piece)
                digest.update(piece)
            f.flush()
            os.fsync(f.fileno())
        entries.append({"path": f"synth/{path.name}", "tokens": size // 2, "sha256": digest.hexdigest()})
        left, i = left - size, i + 1
    tok = ByteTokenizer()
    manifest = {"format": 1, "dtype": "uint16", "domains": {"synth": {"train": entries, "val": []}},
                "tokenizer": {"kind": "byte", "vocab_size": tok.vocab_size, "eos_id": tok.eos_id, "sha256": tok.sha256}}
    (out / "manifest.json").write_text(json.dumps(manifest))
    return out


def evict(data_dir: Path) -> None:
    """Drop this corpus's pages (and only them) from the page cache."""
    for path in sorted(data_dir.rglob("*.bin")):
        fd = os.open(path, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def bench_reads(args) -> None:
    """Chunks and bytes one rank reads per step, before (every rank built the whole global
    batch, then sliced it) and after (rank-local reads), and the time that takes."""
    seq_len, per_rank = 2048, args.micro_batch * args.grad_accum
    with tempfile.TemporaryDirectory(dir=args.dir) as tmp:
        data_dir = synthetic_corpus(Path(tmp), 1 << 30, 256 << 20)
        lo = Loader(data_dir, seq_len, seed=0)
        chunk_bytes = (seq_len + 1) * 2
        print(f"reads: seq_len {seq_len}, {per_rank} sequences per rank per step, chunk {chunk_bytes} B; {load()}")
        print("W | global batch | before: chunks, MB, ms per rank-step | after: chunks, MB, ms | ratio")
        for world_size in (1, 8, 64):
            batch = per_rank * world_size
            before_ms, after_ms = [], []
            for step in range(args.steps):
                # Inside epoch 0 (one permutation), at positions no earlier step or the other side read.
                position = (step * 2 * batch) % (lo.n_chunks - 2 * batch)
                lo.chunks_read = 0
                started = time.perf_counter()
                lo.read(take(position + batch, batch, merge_windows([])))  # what each rank used to read
                before_ms.append((time.perf_counter() - started) * 1e3)
                before = lo.chunks_read
                lo.chunks_read = 0
                started = time.perf_counter()
                lo.step(position, [], batch, world_size - 1, world_size, args.grad_accum)
                after_ms.append((time.perf_counter() - started) * 1e3)
                after = lo.chunks_read
            print(f"{world_size:>3} | {batch:>5} | {before:>5}, {before * chunk_bytes / 1e6:7.2f}, "
                  f"{statistics.median(before_ms):7.2f} | {after:>3}, {after * chunk_bytes / 1e6:5.2f}, "
                  f"{statistics.median(after_ms):6.2f} | {before // after}x")
    print(f"reads done; {load()}")


def busy(ms: float, x: torch.Tensor) -> None:
    """A stand-in for a step's compute: torch kernels (which release the GIL) for about `ms`."""
    end = time.perf_counter() + ms / 1e3
    while time.perf_counter() < end:
        x = torch.tanh(x @ x)


def bench_prefetch(args) -> None:
    """Time a step waits for its batch with the prefetch on and off, alternating rounds. Every
    round reads sequences no earlier round read; `--cold` also evicts the corpus first, so its
    reads come from the disk."""
    seq_len, rank_batch = args.seq_len, args.micro_batch * args.grad_accum
    with tempfile.TemporaryDirectory(dir=args.dir) as tmp:
        data_dir = synthetic_corpus(Path(tmp), 2 << 30, 256 << 20)
        x = torch.randn(256, 256) / 16
        waits = {True: [], False: []}
        steps = {True: [], False: []}
        print(f"prefetch: seq_len {seq_len}, {rank_batch} sequences per rank (rank 3 of 8), compute "
              f"{args.compute_ms} ms a step, {'cold' if args.cold else 'warm'} page cache; {load()}")
        for r in range(args.rounds):
            for enabled in (True, False):
                lo = Loader(data_dir, seq_len, seed=0)  # fresh maps: evicted pages are not held mapped
                if args.cold:
                    evict(data_dir)
                feed = Prefetcher(lo, 3, 8, args.grad_accum, lambda p: 8 * rank_batch, enabled=enabled)
                position = (2 * r + enabled) * args.steps * 8 * rank_batch
                wait, started = [], time.perf_counter()
                for _ in range(args.steps):
                    fed, _ = feed.step(position, [])
                    wait.append(feed.wait_s * 1e3)
                    busy(args.compute_ms, x)
                    position = fed.end  # consecutive sequences are random chunks: no page is read twice
                steps[enabled].append((time.perf_counter() - started) / args.steps * 1e3)
                feed.close()
                waits[enabled].append(statistics.median(wait[1:]))  # the first step is always a miss
        for enabled in (False, True):
            rounds = ", ".join(f"{w:.3f}" for w in waits[enabled])
            print(f"prefetch {'on ' if enabled else 'off'}: loader wait per step median "
                  f"{statistics.median(waits[enabled]):.3f} ms (rounds {rounds}), "
                  f"step {statistics.median(steps[enabled]):.2f} ms")
    print(f"prefetch done; {load()}")


def run_start(data_dir: Path, run_dir: Path, verify: str) -> tuple[float, dict]:
    cmd = [sys.executable, "-m", "dsslm.train", f"run.dir={run_dir}", f"data.dir={data_dir}", f"data.verify={verify}",
           "model.d_model=32", "model.n_layers=1", "model.n_heads=2", "model.seq_len=64", "train.total_steps=1",
           "optim.warmup_steps=0", "ckpt.every=1", "run.val_every=0", "run.tensorboard=false", "train.device=cpu"]
    started = time.perf_counter()
    subprocess.run(cmd, cwd=ROOT, check=True, capture_output=True, env={**os.environ, "DS_ACCELERATOR": "cpu"})
    wall = time.perf_counter() - started
    event = [json.loads(line) for line in (run_dir / "events.jsonl").read_text().splitlines()
             if '"data_verified"' in line][-1]
    return wall, event


def bench_startup(args) -> None:
    """A run's start on a `--gb` corpus: before (rank 0 hashed every shard in one thread, every
    start), a first start (no cache), a restart (cache), each from a cold page cache."""
    root = Path(tempfile.mkdtemp(prefix="dsslm-startup-", dir=args.dir))
    try:
        started = time.perf_counter()
        data_dir = synthetic_corpus(root / "data", int(args.gb * 1e9), 512 << 20)
        n = len(list(data_dir.rglob("*.bin")))
        print(f"startup: wrote {args.gb} GB in {n} shards in {time.perf_counter() - started:.0f} s; {load()}")
        for r in range(args.rounds):
            evict(data_dir)
            started = time.perf_counter()
            load_manifest(data_dir, verify=True)
            print(f"round {r}: before (one thread, every start): {time.perf_counter() - started:.1f} s to hash")
            (data_dir / ".dsslm-verified.json").unlink(missing_ok=True)
            evict(data_dir)
            wall, event = run_start(data_dir, root / f"run-{r}", "true")
            print(f"round {r}: first start: hashed {event['hashed_shards']} shards in {event['seconds']:.1f} s; "
                  f"the whole run (1 step) {wall:.1f} s")
            evict(data_dir)
            wall, event = run_start(data_dir, root / f"run-{r}", "true")
            print(f"round {r}: restart: hashed {event['hashed_shards']}, {event['cached_shards']} cached, "
                  f"{event['seconds']:.2f} s; the whole run {wall:.1f} s; {load()}")
    finally:
        shutil.rmtree(root, ignore_errors=True)
    print(f"startup done (corpus deleted); {load()}")


def bench_prepare(args) -> None:
    """prepare's MB/s for byte and BPE against the tokenizer's raw encode_batch over the same
    batches of the same text on the same cores; BPE's tokenizer trained on the first 5%."""
    root = Path(tempfile.mkdtemp(prefix="dsslm-prepare-", dir=args.dir))
    try:
        text = write_text_corpus(root / "corpus.jsonl", int(args.mb * 1e6))
        mb = text / 1e6
        from dsslm.data.prepare import prepare, quiet_datasets
        from dsslm.data.tokenizer import load_tokenizer
        quiet_datasets()
        head = root / "head.jsonl"
        with open(root / "corpus.jsonl") as f, open(head, "w") as out:
            out.writelines(line for _, line in zip(range(args.train_docs), f))
        for kind in ("byte", "bpe"):
            data_dir = root / kind
            prepare([head], data_dir, domain="head", tokenizer=kind, vocab_size=8192)
            tok = load_tokenizer(data_dir, load_manifest(data_dir))
            batches = [[p for p in b if p] for b in sources._piece_batches(sources.find_sources([root / "corpus.jsonl"]),
                                                                           "text")]
            raw, ours, inline = [], [], []
            for r in range(args.rounds):
                started = time.perf_counter()
                for b in batches:
                    tok.encode_batch(b)
                raw.append(time.perf_counter() - started)
                for times, in_flight in ((ours, sources.encode_in_flight), (inline, lambda tok: 1)):
                    shutil.rmtree(data_dir / "body", ignore_errors=True)
                    _drop_domain(data_dir, "body")
                    real = sources.encode_in_flight
                    sources.encode_in_flight = in_flight
                    started = time.perf_counter()
                    prepare([root / "corpus.jsonl"], data_dir, domain="body")
                    times.append(time.perf_counter() - started)
                    sources.encode_in_flight = real
                print(f"{kind} round {r}: raw {mb / raw[-1]:.2f} MB/s, prepare {mb / ours[-1]:.2f} MB/s "
                      f"(ratio {raw[-1] / ours[-1]:.2f}), one batch at a time {mb / inline[-1]:.2f} MB/s; {load()}",
                      flush=True)
            print(f"{kind}: {mb:.0f} MB, medians: raw encode_batch {mb / statistics.median(raw):.2f} MB/s, prepare "
                  f"{mb / statistics.median(ours):.2f} MB/s, ratio {statistics.median(raw) / statistics.median(ours):.2f}; "
                  f"before (one batch at a time) {mb / statistics.median(inline):.2f} MB/s")
    finally:
        shutil.rmtree(root, ignore_errors=True)


def write_text_corpus(path: Path, want_bytes: int) -> int:
    """JSONL of real text: this machine's Python sources, one file a record, cycled to `want_bytes`."""
    files = sorted(p for base in {Path(os.__file__).parent, Path(torch.__file__).parent.parent}
                   for p in base.rglob("*.py"))
    total = 0
    with open(path, "w") as out:
        while total < want_bytes:
            for p in files:
                try:
                    text = p.read_text(encoding="utf-8")
                except (OSError, UnicodeDecodeError):
                    continue
                if text:
                    out.write(json.dumps({"text": text}) + "\n")
                    total += len(text.encode())
                if total >= want_bytes:
                    break
    return total


def _drop_domain(data_dir: Path, domain: str) -> None:
    manifest = json.loads((data_dir / "manifest.json").read_text())
    manifest["domains"].pop(domain, None)
    (data_dir / "manifest.json").write_text(json.dumps(manifest))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("what", choices=["reads", "prefetch", "startup", "prepare"])
    parser.add_argument("--dir", default="/tmp", help="where the temporary corpora go")
    parser.add_argument("--steps", type=int, default=50)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--micro-batch", type=int, default=8)
    parser.add_argument("--grad-accum", type=int, default=4)
    parser.add_argument("--seq-len", type=int, default=2048)
    parser.add_argument("--compute-ms", type=float, default=50.0)
    parser.add_argument("--cold", action="store_true", help="prefetch: evict the corpus before every step")
    parser.add_argument("--gb", type=float, default=10.0)
    parser.add_argument("--mb", type=float, default=200.0)
    parser.add_argument("--train-docs", type=int, default=2000, help="prepare: records the BPE is trained on")
    args = parser.parse_args()
    torch.set_num_threads(1)
    {"reads": bench_reads, "prefetch": bench_prefetch, "startup": bench_startup, "prepare": bench_prepare}[args.what](args)


if __name__ == "__main__":
    main()
