"""Healthy work at production durations under the DEFAULT watchdog limits (floor 60 s, ceiling
600 s), in real time: a 2-rank gloo job of the tests' tiny model whose checkpoint writes run at
a network filesystem's pace (faults.write_mb_s, set so each rank's shard takes --write-s) and
whose validation passes take --eval-s (faults.eval_batch_s), ckpt.every small enough that each
save waits for the write before it, as a 1B model's 14 GB on NFS at 200 MB/s does.

Before issue 51 the wait was judged by the snapshot's limit (the floor, 60 s): exit 75 at the
first wait past it, at every start, then 6. Printed: the exit code, whether a hang was recorded,
the longest time each phase took (watchdog.json), the "still ..." lines, and wall seconds.

    python bench/bench_slow_work.py [--write-s 75] [--eval-s 70]
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT), str(ROOT / "tests"), str(ROOT / "tests" / "scenarios")]
from nodes import HOST, launch  # noqa: E402

SHARD_MB = 0.26      # one rank's shard of the tiny model's checkpoint (2 ranks; measured in the test drill)
VAL_BATCHES = 8      # 2 domains x run.val_batches=4


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--write-s", type=float, default=75.0)
    parser.add_argument("--eval-s", type=float, default=70.0)
    args = parser.parse_args()
    print(f"load average before: {os.getloadavg()}")
    with tempfile.TemporaryDirectory(prefix="dsslm-bench-slow-") as tmp:
        run_dir = Path(tmp) / "run"
        started = time.monotonic()
        job = launch([HOST], run_dir, "train.total_steps=12", "ckpt.every=6", "train.micro_batch_size=2",
                     "run.val_every=6", "run.val_batches=4", f"faults.write_mb_s={SHARD_MB / args.write_s:.6f}",
                     f"faults.eval_batch_s={args.eval_s / VAL_BATCHES:.3f}", nproc=2)
        codes = job.wait(timeout_s=3000)
        wall = time.monotonic() - started
        log = job.output()
        learned = json.loads((run_dir / "watchdog.json").read_text())["longest"]
        saves = [json.loads(line) for line in (run_dir / "events.jsonl").read_text().splitlines()
                 if '"save"' in line]
        print(json.dumps({"codes": codes, "hang_recorded": (run_dir / "hangs").exists(), "wall_s": round(wall, 1),
                          "longest_s": {k: round(v, 1) for k, v in learned.items()},
                          "save_seconds": [s.get("seconds") for s in saves if s.get("event") == "save"]}, indent=1))
        for line in log.splitlines():
            if "still " in line or "hang at" in line:
                print(line)
    print(f"load average after: {os.getloadavg()}")


if __name__ == "__main__":
    main()
