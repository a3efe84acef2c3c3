"""run.dir/nodes.json: what this job knows of its nodes, for a person and for the next requeue.

Rank 0 writes it whole (atomic replace): at the start, the check before the first step
(health/nodecheck.py) with every node's checks, figures and verdict; during the run, each
straggler the report found persisting (health/stragglers.py). `python -m dsslm.health.exclude`
(slurm/train.sbatch, on a requeue) reads it, validated: anyone who can write into run.dir can write
it too, and a file that is not what dsslm writes is ignored with one line.

    {"schema": 1, "time", "job", "seconds", "verdict": "ok" | "bad", "exit_code", "refused_in_a_row",
     "nodes": {host: {"host", "slurm_node", "ranks", "verdict": "ok" | "bad" | "shared", "why": [...],
                      "checks": {run_dir | data | memory | network | clock | gpu: {"ok", "why", figures...}}}},
     "stragglers": [{"rank", "host", "slurm_node", "phase", "factor", "step", "reports", "time"}]}

A node's verdict `shared`: it failed only what every node shares (run.dir, the data, the config's
memory: health/nodecheck.py's shared_failures), no fault of its own; the requeue excludes only `bad`.
"""
from __future__ import annotations

import os
import time
from pathlib import Path

from dsslm.durable import write_json_atomic
from dsslm.fields import MAX_STEP, Fields, Float, Int, ListOf, MapOf, Optional, Str
from dsslm.health.hangs import read_json

NODES = "nodes.json"
SLURM_NODE_ENV = "SLURMD_NODENAME"  # Slurm's name for the node a step runs on (sinfo's, ExcNodeList's)

NODE_SPEC = Fields(open=True, host=Str(255), verdict=Str(16), slurm_node=Optional(Str(255)),
                   ranks=ListOf(Int(0), max_len=100_000), why=ListOf(Str(2000), max_len=64))
STRAGGLER_SPEC = Fields(open=True, rank=Int(0), host=Str(255), slurm_node=Optional(Str(255)), phase=Str(64),
                        factor=Float(0), step=Int(-1, MAX_STEP), time=Float(0))
NODES_SPEC = Fields(open=True, schema=Int(1, 1), time=Float(0), nodes=MapOf(NODE_SPEC, max_len=100_000),
                    stragglers=ListOf(STRAGGLER_SPEC, max_len=10_000))


def slurm_node() -> str | None:
    return os.environ.get(SLURM_NODE_ENV) or None


def job_name() -> str:
    """This job as a person names it: Slurm's job id and restart, else torchrun's run id, else ""."""
    if os.environ.get("SLURM_JOB_ID"):
        return f"slurm {os.environ['SLURM_JOB_ID']} restart {os.environ.get('SLURM_RESTART_COUNT', '0')}"
    return os.environ.get("TORCHELASTIC_RUN_ID", "")


def empty(seconds: float = 0.0) -> dict:
    """A nodes.json with no check in it (run.preflight=false): stragglers only."""
    return {"schema": 1, "time": time.time(), "job": job_name(), "seconds": seconds, "verdict": "unchecked",
            "exit_code": 0, "refused_in_a_row": 0, "nodes": {}, "stragglers": []}


def read_nodes(run_dir: Path) -> dict | None:
    """run.dir/nodes.json, validated, or None (missing, or not what dsslm writes: said once)."""
    return read_json(Path(run_dir) / NODES, NODES_SPEC, "nodes record")


def write_nodes(run_dir: Path, doc: dict) -> None:
    write_json_atomic(Path(run_dir) / NODES, doc, indent=1)


def name_of(entry: dict) -> str:
    """The name Slurm knows a node by (what ExcNodeList takes): the step's SLURMD_NODENAME where it
    ran under Slurm, else its host name without the domain."""
    return entry.get("slurm_node") or str(entry["host"]).split(".")[0]
