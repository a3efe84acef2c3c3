"""Out of memory: a record, one code for the job, and a retry at half the micro-batch.

An out-of-memory error in a step (torch.OutOfMemoryError: CUDA's, or the `faults.oom_step`
drill's on CPU) ends the job with EXIT_OUT_OF_MEMORY (77), which slurm/train.sbatch requeues:

- each rank that ran out writes `run.dir/oom/<time>-<job>/rank-N.json` (the step, phase,
  micro-batch, accumulation, the error; on CUDA the allocator's summary and its snapshot beside
  it), the first claims the job (`oom/.called-<job>`) and writes the `oom` event, the console
  line and `oom/state.json` (the micro-batch that ran out, for the next start);
- a rank that did not run out but waits for one that did sees a lost peer: its watchdog finds the
  claim and leaves with 77 too, no hang recorded and no node blamed (health/watchdog.py `call`);
- the next start (`retry`) halves the micro-batch (the largest that splits the global batch, at
  most half the one that ran out) and multiplies the accumulation to keep the global batch, so the
  stream of data is the same: a batch is a pure function of position (docs/run-folder.md). At
  one sequence a micro-batch there is nothing left to halve: EXIT_OOM_AT_FLOOR (7), a person's.
"""
from __future__ import annotations

import json
import os
import sys
import time
import traceback
from dataclasses import dataclass
from pathlib import Path

from dsslm.config import Config, micro_batch_for
from dsslm.durable import write_json_atomic
from dsslm.exits import EXIT_OOM_AT_FLOOR, EXIT_OUT_OF_MEMORY
from dsslm.fields import MAX_STEP, Fields, Float, Int
from dsslm.health.hangs import read_json

OOM = "oom"
STATE = "state.json"
STATE_SPEC = Fields(open=True, schema=Int(1, 1), step=Int(0, MAX_STEP), micro_batch_size=Int(1),
                    grad_accum=Int(1), global_batch=Int(1), time=Float(0))


class OutOfMemory(Exception):
    """A step ran out of memory on this rank: recorded; the job exits `code`."""

    def __init__(self, line: str, code: int):
        super().__init__(line)
        self.code = code


@dataclass
class Retry:
    """What a start after an out-of-memory error trains with."""
    micro_batch_size: int
    grad_accum: int
    line: str


def claimed(run_dir: Path, token: str) -> bool:
    """Did a rank of this job run out of memory (its claim exists)?"""
    return (Path(run_dir) / OOM / f".called-{token}").exists()


def caught(run_dir: Path, token: str, rank: int, step: int, phase: str, cfg: Config, world_size: int,
           exc: BaseException, emit_line) -> OutOfMemory:
    """This rank ran out of memory in `phase` of step `step`: its record, the job's claim (the
    first rank's event and line), rank 0's state for the next start. Returns the exception to
    raise (its code: 77, or 7 at one sequence a micro-batch)."""
    t = cfg.train
    at_floor = t.micro_batch_size <= 1
    code = EXIT_OOM_AT_FLOOR if at_floor else EXIT_OUT_OF_MEMORY
    folder = Path(run_dir) / OOM / f"{time.strftime('%Y%m%d-%H%M%S')}-{token[:6]}"
    record = {"schema": 1, "rank": rank, "step": step, "phase": phase, "micro_batch_size": t.micro_batch_size,
              "grad_accum": t.grad_accum, "world_size": world_size, "error": f"{type(exc).__name__}: {exc}"[:2000],
              "traceback": "".join(traceback.format_exception(exc))[-8000:], "time": time.time(),
              "exit_code": code, **memory_now()}
    first = False
    try:
        folder.mkdir(parents=True, exist_ok=True)
        write_json_atomic(folder / f"rank-{rank}.json", record, indent=1)
        cuda_snapshot(folder, rank)
        try:
            fd = os.open(Path(run_dir) / OOM / f".called-{token}", os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
            os.close(fd)
            first = True
        except FileExistsError:
            pass
        if first:  # the job's first rank to run out: the next start's micro-batch
            write_json_atomic(Path(run_dir) / OOM / STATE, {
                "schema": 1, "step": step, "micro_batch_size": t.micro_batch_size, "grad_accum": t.grad_accum,
                "global_batch": t.micro_batch_size * t.grad_accum * world_size, "time": time.time()}, indent=1)
    except OSError as exc_write:
        print(f"dsslm: cannot write the out-of-memory record into {folder} ({exc_write})", file=sys.stderr, flush=True)
    then = ("one sequence a micro-batch is the floor: shrink the model, the sequence length or the precision's "
            f"memory (exit {code}, not requeued)") if at_floor else \
        f"exit {code}: the requeued job trains at half the micro-batch with the same global batch"
    line = (f"out of memory at step {step} in {phase} on rank {rank} (micro-batch {t.micro_batch_size}, "
            f"accumulation {t.grad_accum}): record in {folder}; {then}")
    if first:
        print(f"dsslm: {line}", file=sys.stderr, flush=True)
        emit_line(line, folder, code, record)
    return OutOfMemory(line, code)


def memory_now() -> dict:
    """What memory looked like as it ran out: the CUDA allocator's figures where there is one,
    this process's resident set on every machine."""
    out: dict = {}
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(("VmRSS:", "VmHWM:")):
                    key, value = line.split(":", 1)
                    out[f"host_{key.lower()}_kb"] = int(value.split()[0])
    except (OSError, ValueError):
        pass
    import torch
    if torch.cuda.is_available():
        out["cuda_allocated"] = torch.cuda.memory_allocated()
        out["cuda_reserved"] = torch.cuda.memory_reserved()
        out["cuda_max_allocated"] = torch.cuda.max_memory_allocated()
        out["cuda_summary"] = torch.cuda.memory_summary()
    return out


def cuda_snapshot(folder: Path, rank: int) -> None:
    """The allocator's snapshot (torch.cuda.memory._snapshot: every segment and block), as JSON."""
    import torch
    if not torch.cuda.is_available():
        return
    try:
        snapshot = torch.cuda.memory._snapshot()
        (folder / f"snapshot-rank{rank}.json").write_text(json.dumps(snapshot, default=str))
    except Exception as exc:  # noqa: BLE001 - the record is worth more than the snapshot
        print(f"dsslm: no allocator snapshot ({exc})", file=sys.stderr, flush=True)


def retry(run_dir: Path, cfg: Config, world_size: int) -> Retry | None:
    """At a start: the micro-batch and accumulation after an out-of-memory error (None: none, or
    the config already asks for less than what ran out). OutOfMemory(EXIT_OOM_AT_FLOOR) where no
    smaller micro-batch splits the global batch."""
    path = Path(run_dir) / OOM / STATE
    # Not there (the usual case; run.dir a file is refused later, in its own words): nothing to do.
    state = read_json(path, STATE_SPEC, "out-of-memory record") if path.is_file() else None
    t = cfg.train
    if state is None or t.micro_batch_size < state["micro_batch_size"]:
        return None
    global_batch = t.micro_batch_size * t.grad_accum * world_size
    micro = micro_batch_for(global_batch, world_size, state["micro_batch_size"] // 2) if \
        state["micro_batch_size"] > 1 else None
    if micro is None:
        line = (f"out of memory at step {state['step']} at micro-batch {state['micro_batch_size']}, and no smaller "
                f"micro-batch splits the global batch of {global_batch} over {world_size} rank(s): shrink the model, "
                f"model.seq_len or the global batch, then remove {Path(run_dir) / OOM / STATE}")
        raise OutOfMemory(line, EXIT_OOM_AT_FLOOR)
    accum = global_batch // (micro * world_size)
    line = (f"out of memory at step {state['step']} last time at micro-batch {state['micro_batch_size']}: training at "
            f"micro-batch {micro} x accumulation {accum} (was {t.micro_batch_size} x {t.grad_accum}), the global "
            f"batch of {global_batch} kept; the data and the losses are those of this micro-batch from the start "
            f"(within rounding)")
    return Retry(micro, accum, line)
