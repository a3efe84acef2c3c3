"""How long a hang takes to become a diagnosis and an exit, at the default watchdog settings
(observe.watchdog: floor 60 s, beats every 2 s), and what the flight recorder costs a collective.

Drills, each a fresh 2-rank gloo job of the tiny test model, long enough that the step times are
learned (the fault comes at step 30 of 2000):

- `step`: rank 1 stopped (SIGSTOP, faults.hang_*) in forward/backward; goal: every process gone
  within 2 minutes of the stop;
- `save`: rank 1 stopped inside a checkpoint save; goal: within 5 minutes;
- `node`: two nodes (tests/scenarios/nodes.py, root), node B's processes all killed;
- `link`: two nodes, node B's link set down.

For each: seconds from the fault to the hang line (the record's time), to the launcher's exit, to
the last process of the job gone; the exit code and the cause. `--flight` times 2,000 gloo
all-reduces of 4 floats on 2 ranks with the flight recorder on (TORCH_FR_BUFFER_SIZE=2000, what
dsslm sets) and off.

    sudo .venv/bin/python bench/bench_hang.py [--drills step save node link] [--flight]
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT), str(ROOT / "tests"), str(ROOT / "tests" / "scenarios")]
from nodes import HOST, launch, make_nodes, wait_for  # noqa: E402

RUN = ["train.total_steps=2000", "ckpt.every=25", "train.micro_batch_size=2"]


def ranks_of(run_dir: Path) -> list[int]:
    """pids of the job's ranks (python -m dsslm.train processes with this run.dir)."""
    out = []
    for entry in Path("/proc").iterdir():
        try:
            cmd = (entry / "cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if b"dsslm.train" in cmd and f"run.dir={run_dir}".encode() in cmd and b"dsslm.engine.agent" not in cmd:
            out.append(int(entry.name))
    return out


def stopped(pids: list[int]) -> bool:
    for pid in pids:
        try:
            stat = Path(f"/proc/{pid}/stat").read_text()
        except OSError:
            continue
        if stat[stat.rindex(")") + 2] == "T":
            return True
    return False


def record_of(run_dir: Path) -> dict:
    folders = [p for p in (run_dir / "hangs").iterdir() if not p.name.startswith(".")] if (run_dir / "hangs").exists() else []
    return json.loads((folders[0] / "hang.json").read_text()) if folders else {}


def finish(job, run_dir: Path, pids: list[int], fault_wall: float, fault: float) -> dict:
    codes = job.wait(timeout_s=900)
    ended = time.monotonic()
    wait_for(lambda: not any(Path(f"/proc/{p}").exists() for p in pids), 120, "every rank gone")
    gone = time.monotonic()
    record = record_of(run_dir)
    return {"to_line_s": round(record.get("time", float("nan")) - fault_wall, 1), "to_exit_s": round(ended - fault, 1),
            "to_gone_s": round(gone - fault, 1), "codes": codes, "cause": record.get("cause"),
            "first": [(s["rank"], s["host"]) for s in record.get("first", [])]}


def drill_on_host(tmp: Path, phase: str) -> dict:
    run_dir = tmp / f"run-{phase}"
    step = 30 if phase == "forward_backward" else 50  # a save step (ckpt.every=25)
    job = launch([HOST], run_dir, *RUN, f"faults.hang_step={step}", "faults.hang_rank=1", f"faults.hang_phase={phase}",
                 nproc=2)
    pids = wait_for(lambda: (p if len(p := ranks_of(run_dir)) == 2 else None), 300, "both ranks", job)
    wait_for(lambda: stopped(pids), 600, "the stopped rank", job, poll_s=0.01)
    return finish(job, run_dir, pids, time.time(), time.monotonic())


def drill_on_nodes(tmp: Path, what: str) -> dict:
    tmp.mkdir(parents=True, exist_ok=True)
    nodes = make_nodes(tmp)
    try:
        run_dir = tmp / f"run-{what}"
        job = launch([nodes.a, nodes.b], run_dir, *RUN)
        pids = wait_for(lambda: (p if len(p := ranks_of(run_dir)) == 2 else None), 300, "both ranks", job)
        wait_for(lambda: sum("loss" in line for line in (run_dir / "metrics.jsonl").read_text().splitlines()) >= 30
                 if (run_dir / "metrics.jsonl").exists() else False, 600, "step 30", job)
        fault_wall, fault = time.time(), time.monotonic()
        nodes.b.kill() if what == "node" else nodes.b.link(False)
        return finish(job, run_dir, pids, fault_wall, fault)
    finally:
        nodes.down()


FLIGHT = '''
import os, sys, time, torch, torch.distributed as dist
dist.init_process_group("gloo")
t = torch.ones(4)
for _ in range(200):
    dist.all_reduce(t)
started = time.perf_counter()
for _ in range(2000):
    dist.all_reduce(t)
if dist.get_rank() == 0:
    print((time.perf_counter() - started) / 2000 * 1e6)
dist.destroy_process_group()
'''


def flight(tmp: Path, rounds: int = 7) -> dict:
    script = tmp / "flight.py"
    script.write_text(FLIGHT)
    out = {"on": [], "off": []}
    for _ in range(rounds):
        for name, size in (("on", "2000"), ("off", "0")):
            env = {**os.environ, "TORCH_FR_BUFFER_SIZE": size, "OMP_NUM_THREADS": "1"}
            done = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
                                   str(script)], env=env, capture_output=True, text=True, timeout=300)
            out[name].append(float(done.stdout.strip().splitlines()[-1]))
    return {k: sorted(v)[len(v) // 2] for k, v in out.items()} | {"rounds": out}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--drills", nargs="*", default=["step", "save", "node", "link"])
    parser.add_argument("--flight", action="store_true")
    args = parser.parse_args()
    print(f"load average before: {os.getloadavg()}")
    with tempfile.TemporaryDirectory(prefix="dsslm-bench-hang-") as tmp:
        tmp = Path(tmp)
        for drill in args.drills:
            if drill in ("step", "save"):
                result = drill_on_host(tmp, "forward_backward" if drill == "step" else "checkpoint")
            else:
                result = drill_on_nodes(tmp / drill, drill)
            print(f"{drill:5s}: fault -> hang line {result['to_line_s']} s, -> launcher exit {result['to_exit_s']} s, "
                  f"-> last process gone {result['to_gone_s']} s; exit {result['codes']}; {result['cause']}, "
                  f"first {result['first']}", flush=True)
        if args.flight:
            f = flight(tmp)
            print(f"flight recorder: all_reduce of 4 floats on 2 gloo ranks, {f['on']:.1f} us on, {f['off']:.1f} us off "
                  f"(median of {len(f['rounds']['on'])} rounds: {f['rounds']})")
    print(f"load average after: {os.getloadavg()}")


if __name__ == "__main__":
    main()
