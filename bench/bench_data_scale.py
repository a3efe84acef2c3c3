"""The data stream at trillions of tokens: a run's peak memory and time to its first step, by the
corpus's size and shard count, and the epoch order's cost and read locality.

    .venv/bin/python bench/bench_data_scale.py start --tokens 2**40 --shards 4096 --shuffle feistel array
    .venv/bin/python bench/bench_data_scale.py start --tokens 2**36 --shards 100000
    .venv/bin/python bench/bench_data_scale.py order --n 2**30      # per-index cost, block-shuffle mixing

`start` writes a DATA_DIR of sparse shards (no disk used: every token is 0) under --dir, whose
manifest holds --tokens byte tokens in --shards files, then runs `python -m dsslm.train` on it
(data.verify=false: nobody hashes 2 TB to time a start) for 3 steps of the tiny model and
reports the child's peak RSS (ru_maxrss) and the wall time from launch to its first step's line,
against the same run on a one-shard corpus of 2^20 tokens. Benchmarks, not tests: nothing
asserts; the load average is printed before and after.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from dsslm.data.permute import order_of  # noqa: E402
from dsslm.data.tokenizer import ByteTokenizer  # noqa: E402

TINY = ["model.d_model=32", "model.n_layers=2", "model.n_heads=2", "model.seq_len=1024", "train.micro_batch_size=2",
        "train.total_steps=3", "optim.warmup_steps=1", "run.val_every=0", "run.tensorboard=false", "ckpt.every=1000",
        "train.device=cpu", "data.verify=false", "data.prefetch=false"]


def load() -> str:
    return "load average " + " ".join(f"{x:.2f}" for x in os.getloadavg())


def sparse_corpus(out: Path, tokens: int, shards: int) -> Path:
    """A byte DATA_DIR whose train shards are sparse files of `tokens` zeros in all (and one real
    val shard of 64 KiB): sizes are all a start checks with data.verify=false."""
    tok = ByteTokenizer()
    (out / "synth").mkdir(parents=True, exist_ok=True)
    per, extra = divmod(tokens, shards)
    train = []
    for i in range(shards):
        n = per + (i < extra)
        path = out / "synth" / f"train-{i:06d}.bin"
        with open(path, "wb") as f:
            f.truncate(2 * n)
        train.append({"path": f"synth/{path.name}", "tokens": n, "sha256": "0" * 64})
    (out / "synth" / "val-000000.bin").write_bytes(bytes(2 * 32768))
    val = [{"path": "synth/val-000000.bin", "tokens": 32768, "sha256": "0" * 64}]
    manifest = {"format": 1, "dtype": "uint16", "domains": {"synth": {"train": train, "val": val}},
                "tokenizer": {"kind": tok.kind, "vocab_size": tok.vocab_size, "eos_id": tok.eos_id,
                              "sha256": tok.sha256}}
    (out / "manifest.json").write_text(json.dumps(manifest))
    return out


def timed_run(data_dir: Path, run_dir: Path, shuffle: str) -> tuple[float, float, int]:
    """(seconds from launch to the first step's line, to the end, peak RSS bytes) of a 3-step run."""
    cmd = [sys.executable, "-m", "dsslm.train", f"run.dir={run_dir}", f"data.dir={data_dir}",
           f"data.shuffle={shuffle}", *TINY]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    started = time.perf_counter()
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    first = None
    for line in proc.stderr:
        if first is None and "step 1/" in line:
            first = time.perf_counter() - started
    _, status, usage = os.wait4(proc.pid, 0)
    proc.returncode = os.waitstatus_to_exitcode(status)
    if proc.returncode != 0:
        raise SystemExit(f"the run on {data_dir} exited {proc.returncode}")
    return first or float("nan"), time.perf_counter() - started, usage.ru_maxrss * 1024


def start(args) -> None:
    print(load())
    base = Path(tempfile.mkdtemp(prefix="dsslm-scale-", dir=args.dir))
    try:
        small = sparse_corpus(base / "small", 1 << 20, 1)
        t0 = time.perf_counter()
        big = sparse_corpus(base / "big", args.tokens, args.shards)
        print(f"corpus: {args.tokens:,} tokens (2^{np.log2(args.tokens):.1f}) in {args.shards:,} sparse shards, "
              f"written in {time.perf_counter() - t0:.1f} s; manifest {os.path.getsize(big / 'manifest.json') / 1e6:.1f} MB")
        print(f"{'corpus':>8} {'shuffle':>8} {'first step s':>13} {'3 steps s':>10} {'peak RSS GB':>12}")
        for shuffle in args.shuffle:
            for name, data in (("small", small), ("big", big)):
                first, total, rss = timed_run(data, base / f"run-{name}-{shuffle}", shuffle)
                print(f"{name:>8} {shuffle:>8} {first:13.2f} {total:10.2f} {rss / 1e9:12.2f}", flush=True)
    finally:
        shutil.rmtree(base, ignore_errors=True)
    print(load())


def order(args) -> None:
    """Per-index cost at n (a step's consecutive positions, and scattered ones), and each order's
    read locality (the distinct blocks of `--block` chunks a batch of 512 reads: a reader that
    fetches whole blocks does that many reads) against its mixing (the share of a batch's pairs
    that come from one block, and mean |p(i) - i| / n: 1/3 for a uniform permutation)."""
    print(load())
    n = args.n
    scattered = np.random.default_rng(0).integers(0, n, 100_000)
    step = np.arange(n // 3, n // 3 + 100_000)
    specs = ["feistel"] + [f"block/{args.block}/{w}" for w in args.windows]
    for spec in specs:
        o = order_of(spec, n, [1, 0])
        cost = []
        for x in (step, scattered[:2_000] if spec.startswith("block") else scattered):
            t0 = time.perf_counter()
            o.at(x)
            cost.append(1e9 * (time.perf_counter() - t0) / len(x))
        print(f"{spec:>16}: {cost[0]:,.0f} ns an index over a step's consecutive positions, {cost[1]:,.0f} scattered "
              f"(n = {n:,})")
    m, batch = 1 << 20, 512
    for spec in specs:
        p = order_of(spec, m, [1, 0]).at(np.arange(m))
        blocks = p // args.block
        distinct, same = [], []
        for i in range(0, m, batch):
            counts = np.unique(blocks[i:i + batch], return_counts=True)[1]
            distinct.append(len(counts))
            same.append(float((counts * (counts - 1)).sum()) / (batch * (batch - 1)))
        print(f"{spec:>16}: n = 2^20, a batch of {batch} reads {np.mean(distinct):.0f} blocks of {args.block} chunks "
              f"({np.mean(distinct) / batch:.3f} a sequence); {np.mean(same):.2%} of its pairs share a block; "
              f"displacement {np.abs(p - np.arange(m)).mean() / m:.3f}")
    print(load())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="cmd", required=True)
    s = sub.add_parser("start")
    s.add_argument("--tokens", type=lambda v: int(eval(v, {})), default=2**40)  # 2**40 as typed
    s.add_argument("--shards", type=int, default=4096)
    s.add_argument("--shuffle", nargs="+", default=["feistel"])
    s.add_argument("--dir", default=None)
    o = sub.add_parser("order")
    o.add_argument("--n", type=lambda v: int(eval(v, {})), default=2**30)
    o.add_argument("--block", type=int, default=64)
    o.add_argument("--windows", type=int, nargs="+", default=[8, 256])
    args = parser.parse_args()
    start(args) if args.cmd == "start" else order(args)


if __name__ == "__main__":
    main()
