"""prepare's throughput at 1, 2 and 4 worker processes (`--workers N`), byte and BPE, on a corpus of
several input files; and that the DATA_DIR is the same bytes at every worker count.

    .venv/bin/python bench/bench_prepare.py                         # 8 files x 4 MiB, workers 1 2 4
    .venv/bin/python bench/bench_prepare.py --files 16 --mb 8 --workers 1 4 16 --kinds bpe

The corpus is real text: this machine's Python sources, one file a JSONL record, cycled into each
input file (a file of at least parts.UNIT_BYTES is one unit, so 8 files are 8 units to share out).
The tokenizer is made once, before the timings (as the tokenizer step makes it); each timing is a
whole prepare into a fresh DATA_DIR as a user runs it, in its two halves, timed apart: `--part 0/1
--workers N` (the interpreter's start, the workers' (one forkserver that imports datasets and torch
once), the units) then `--merge` (one process: the split, the shards, their hashes). MB/s is input
bytes over wall seconds. Benchmarks, not tests: nothing asserts; the DATA_DIRs are compared.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from dsslm.data.prepare import prepare_tokenizer, quiet_datasets  # noqa: E402


def write_corpus(folder: Path, n_files: int, file_bytes: int) -> int:
    """`n_files` JSONL files of at least `file_bytes` each, of Python source text; returns bytes."""
    folder.mkdir(parents=True)
    sources = sorted(p for p in Path(os.__file__).parent.rglob("*.py") if "test" not in p.parts)
    texts = iter(())
    total = 0
    for i in range(n_files):
        with open(folder / f"part-{i:03d}.jsonl", "w") as out:
            while out.tell() < file_bytes:
                text = next(texts, None)
                if text is None:
                    texts = (t for t in (_read(p) for p in sources) if t)
                    continue
                out.write(json.dumps({"text": text}) + "\n")
            total += out.tell()
    return total


def _read(path: Path) -> str:
    try:
        return path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError):
        return ""


def load() -> str:
    return "load " + "/".join(f"{x:.1f}" for x in os.getloadavg())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--files", type=int, default=8)
    parser.add_argument("--mb", type=float, default=4, help="MiB per input file")
    parser.add_argument("--workers", type=int, nargs="+", default=[1, 2, 4])
    parser.add_argument("--kinds", nargs="+", default=["byte", "bpe"], choices=["byte", "bpe"])
    parser.add_argument("--vocab-size", type=int, default=8192)
    parser.add_argument("--rounds", type=int, default=1, help="timings per worker count (the median is shown)")
    parser.add_argument("--dir", default=None, help="where the corpus and DATA_DIRs go (deleted after)")
    args = parser.parse_args()
    quiet_datasets()
    root = Path(tempfile.mkdtemp(prefix="dsslm-bench-prepare-", dir=args.dir))
    try:
        total = write_corpus(root / "corpus", args.files, int(args.mb * (1 << 20)))
        mb = total / 1e6
        inputs = [root / "corpus"]
        print(f"corpus: {args.files} files, {mb:.1f} MB; {len(os.sched_getaffinity(0))} cores; {load()}", flush=True)
        for kind in args.kinds:
            template = root / f"{kind}-tokenizer"
            started = time.perf_counter()
            prepare_tokenizer(inputs, template, tokenizer=kind, vocab_size=args.vocab_size if kind == "bpe" else None,
                              tokenizer_sample=4 << 20)
            print(f"{kind}: tokenizer step {time.perf_counter() - started:.1f}s (BPE: on the first 4 MiB)", flush=True)
            rates: dict[int, float] = {}
            manifests = set()
            for workers in args.workers:
                times = []
                for _ in range(args.rounds):
                    out = root / f"{kind}-{workers}"
                    shutil.rmtree(out, ignore_errors=True)
                    shutil.copytree(template, out)  # the tokenizer and its recipe: reused, not trained
                    command = [sys.executable, "-m", "dsslm.data", "prepare", "--input", *map(str, inputs),
                               "--out", str(out), "--tokenizer", kind]
                    started = time.perf_counter()  # the two halves of the one command, timed apart
                    subprocess.run([*command, "--workers", str(workers), "--part", "0/1"], cwd=ROOT, check=True,
                                   stdout=subprocess.DEVNULL)
                    units_s = time.perf_counter() - started
                    subprocess.run([*command, "--merge"], cwd=ROOT, check=True, stdout=subprocess.DEVNULL)
                    times.append((time.perf_counter() - started, units_s))
                    manifest = json.loads((out / "manifest.json").read_text())
                    manifests.add(json.dumps(manifest["domains"]["default"], sort_keys=True))
                total_s, units_s = (statistics.median(t[i] for t in times) for i in (0, 1))
                rates[workers] = mb / total_s
                print(f"{kind} --workers {workers}: {rates[workers]:.2f} MB/s ({total_s:.1f}s: units {units_s:.1f}s, "
                      f"{mb / units_s:.2f} MB/s, merge {total_s - units_s:.1f}s), "
                      f"{rates[workers] / rates[args.workers[0]]:.2f}x --workers {args.workers[0]}; {load()}", flush=True)
            same = "the same bytes at every worker count" if len(manifests) == 1 else "DIFFERENT bytes"
            print(f"{kind}: " + ", ".join(f"{w}: {r:.2f} MB/s" for w, r in rates.items()) + f"; {same}", flush=True)
    finally:
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
