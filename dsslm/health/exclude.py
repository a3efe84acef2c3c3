"""`python -m dsslm.health.exclude --job JOBID --nodes N [-- TRAIN ARGS]`: keep a bad node out of a job's requeue.

slurm/train.sbatch runs it with `--later FILE` just before `scontrol requeue`, with the arguments it
gave dsslm.train (for run.dir and observe.nodes), and sets the ExcNodeList it wrote into FILE with
one `scontrol update` right after: Slurm takes a job's ExcNodeList only once the job no longer runs
(measured on 22.05: a running job's update is refused, "Job is no longer pending execution"; a
requeued one's is taken while it completes), and a requeued job may start again within seconds
where cred_expire is short, so the deciding (a Python start, scontrol, sinfo: 6 s and more on a
loaded node) must not sit between the requeue and the update (a preemption's requeue is the
exception: it comes first, this after it, because its save has used the notice's time). A bad node is
- one that failed its check before the first step (run.dir/nodes.json, health/nodecheck.py);
- one that `observe.nodes.hang_blames` hang records (run.dir/hangs/*/hang.json) blamed within
  `exclude_hours`: the ranks a record proves stopped (its `blamed`; in an older record without
  it, the ranks that stopped first where their beats stopped), never a rank that merely reported
  first (a lockstep `stuck`, `store_silent`, `collective_timeout`);
- one that nodes.json names a persistent straggler (health/stragglers.py), with
  `observe.stragglers.exclude`.
It is added to the job's ExcNodeList for `exclude_hours` from when it was found bad
(run.dir/excluded_nodes.json keeps when; a later requeue lifts an exclusion past it, or of a node
`sinfo` no longer lists in the job's partition), only while `sinfo` still lists it in the job's
partition, and only while that partition keeps enough usable nodes for the job (its NumNodes).
What the user excluded stays excluded. One line per decision
(the script logs them); it exits 0 whatever happens: a requeue never fails because of it.
"""
from __future__ import annotations

import argparse
import math
import re
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from dsslm.config import Config, ConfigError, load
from dsslm.durable import write_json_atomic
from dsslm.fields import Fields, Float, Int, MapOf, StateError, Str, validate
from dsslm.health.hangs import HANG_SPEC, HANGS, read_json
from dsslm.health.nodes import name_of, read_nodes

EXCLUDED = "excluded_nodes.json"
EXCLUDED_SPEC = Fields(nodes=MapOf(Fields(since=Float(0), until=Float(0), why=Str(2000)), max_len=100_000))
# sinfo's short states (%t) of a node no job starts on; a `*` suffix is a node not responding.
UNUSABLE = ("down", "drain", "drng", "fail", "failg", "maint", "futr", "inval", "unk")
# A hang record's entries, checked one by one (anyone who can write into run.dir can write a
# record): one that does not fit is left out, it never stops the requeue.
BLAMED_SPEC = Fields(open=True, rank=Int(0), host=Str(255), pid=Int(0))
FIRST_SPEC = Fields(open=True, host=Str(255))
# The causes whose `first` ranks an older record (no `blamed`) proves stopped: their beats stopped.
# `stuck` may be lockstep (every rank in one phase, `first` merely the one that reported a few
# microseconds earlier); `store_silent` and `collective_timeout` prove no rank.
BEATS_STOPPED = ("stopped_beating", "peer_lost")

Run = Callable[[list[str]], str]  # a Slurm command's stdout (CalledProcessError where it fails)


@dataclass
class Candidate:
    name: str     # Slurm's node name
    why: str
    since: float  # when it was found bad


def candidates(run_dir: Path, cfg: Config, now: float) -> list[Candidate]:
    """Every node run.dir's records call bad, newest first, each once (its newest reason)."""
    expiry = 3600 * cfg.observe.nodes.exclude_hours
    found: list[Candidate] = []
    doc = read_nodes(run_dir)
    if doc is not None:
        for node in doc["nodes"].values():
            if node["verdict"] == "bad":
                found.append(Candidate(name_of(node), "failed its check before the first step: "
                                       + "; ".join(node["why"]), doc["time"]))
        if cfg.observe.stragglers.exclude:
            for s in doc["stragglers"]:
                found.append(Candidate(name_of(s), f"a straggler in {s['phase']} ({s['factor']:g}x the other ranks' "
                                                   f"median) from step {s['step']}", s["time"]))
    blames = cfg.observe.nodes.hang_blames
    if blames:
        named: dict[str, list[float]] = {}
        for record in hang_records(run_dir):
            if now - record["time"] <= expiry:
                for name in blamed_hosts(record):
                    named.setdefault(name, []).append(record["time"])
        for name, times in named.items():
            if len(times) >= blames and name != "?":
                found.append(Candidate(name, f"named by {len(times)} hang records (run.dir/hangs/) since "
                                             f"{stamp(min(times))}", sorted(times)[blames - 1]))
    newest: dict[str, Candidate] = {}
    for c in sorted(found, key=lambda c: -c.since):
        newest.setdefault(c.name, c)
    return [c for c in newest.values() if now - c.since <= expiry]


def hang_records(run_dir: Path) -> list[dict]:
    try:
        folders = sorted(p for p in (run_dir / HANGS).iterdir() if not p.name.startswith("."))
    except OSError:
        return []
    records = [read_json(folder / "hang.json", HANG_SPEC, "hang record") for folder in folders]
    # A time that is not a finite number would pass the expiry (inf) or break the line's date.
    return [r for r in records if r is not None and isinstance(r.get("time"), (int, float))
            and not isinstance(r["time"], bool) and math.isfinite(r["time"])]


def blamed_hosts(record: dict) -> set[str]:
    """The hosts (short names) a hang record proves stopped: its `blamed` entries; in an older
    record without the key, its `first` ranks where their beats stopped (BEATS_STOPPED). A rank
    that merely reported first is no proof against its node, and excluding it would leave the
    node that did stop in the job."""
    if "blamed" in record:
        entries, spec = record["blamed"], BLAMED_SPEC
    elif record.get("cause") in BEATS_STOPPED:
        entries, spec = record.get("first"), FIRST_SPEC
    else:
        return set()
    names = set()
    for entry in entries if isinstance(entries, list) else []:
        try:
            validate(entry, spec, "hang record entry")
        except StateError:
            continue
        name = entry["host"].split(".")[0]
        if name and name != "?":
            names.add(name)
    return names


def usable(state: str) -> bool:
    return not state.endswith("*") and state.rstrip("*~#!%$@^-+") not in UNUSABLE


@dataclass
class Plan:
    exclude: list[str]      # the job's new ExcNodeList
    kept: dict[str, dict]   # excluded_nodes.json's nodes
    lines: list[str]


def plan(found: list[Candidate], kept: dict[str, dict], listed: dict[str, str], needed: int, current: list[str],
         now: float, expiry_s: float) -> Plan:
    """The job's ExcNodeList after this requeue (pure): `current` less our expired exclusions and
    those of nodes sinfo no longer lists, plus every candidate sinfo lists (`listed`: node -> state)
    while enough usable nodes remain."""
    lines, kept = [], {name: entry for name, entry in kept.items()}
    exclude = list(current)
    for name, entry in list(kept.items()):
        if entry["until"] <= now:
            del kept[name]
            if name in exclude:
                exclude.remove(name)
                lines.append(f"{name} may run this job again: its exclusion ({entry['why']}) ended at "
                             f"{stamp(entry['until'])}")
        elif listed and name not in listed:
            # A node gone from the partition (renamed, retired) can run none of its jobs: an
            # exclusion of it only lengthens the ExcNodeList, and a node of that name added later
            # is another machine. An empty listing proves nothing (a wrong partition, sinfo's
            # hiccup): then every exclusion stays.
            del kept[name]
            if name in exclude:
                exclude.remove(name)
            lines.append(f"dropping the exclusion of {name} ({entry['why']}): sinfo no longer lists it in this "
                         f"job's partition")
    for c in found:
        until = c.since + expiry_s
        if c.name in exclude:
            if c.name in kept:
                kept[c.name] = {**kept[c.name], "until": max(kept[c.name]["until"], until)}
            continue
        if c.name not in listed:
            lines.append(f"not excluding {c.name} ({c.why}): sinfo does not list it in this job's partition")
            continue
        left = [n for n, state in listed.items() if usable(state) and n not in exclude and n != c.name]
        if len(left) < needed:
            lines.append(f"not excluding {c.name} ({c.why}): only {len(left)} usable node(s) of the partition "
                         f"would remain for this {needed}-node job")
            continue
        exclude.append(c.name)
        kept[c.name] = {"since": c.since, "until": until, "why": c.why}
        lines.append(f"excluding {c.name} from this job's requeues until {stamp(until)}: {c.why}")
    return Plan(exclude, kept, lines)


def stamp(t: float) -> str:
    return time.strftime("%Y-%m-%d %H:%M", time.localtime(t))


def slurm_run(argv: list[str]) -> str:
    return subprocess.run(argv, capture_output=True, text=True, timeout=30, check=True).stdout


def hostnames(expr: str, run: Run) -> list[str]:
    """A Slurm host list (`node[1-3],gpu7`) as names."""
    if not expr or expr == "(null)":
        return []
    if "[" not in expr:
        return [n for n in expr.split(",") if n]
    return run(["scontrol", "show", "hostnames", expr]).split()


def exclude(run_dir: Path, cfg: Config, job: str, run: Run = slurm_run, now: float | None = None,
            nodes: int = 1, partition: str = "", update: Callable[[str], None] | None = None) -> list[str]:
    """Do it for job `job` of `nodes` nodes (its allocation's: a completing job's NumNodes counts only
    the nodes still completing) in `partition`: the lines to log. `update(exc_node_list)` sets the
    new list (by default `scontrol update`, at once)."""
    now = time.time() if now is None else now
    expiry = 3600 * cfg.observe.nodes.exclude_hours
    if expiry <= 0:
        return []
    found = candidates(run_dir, cfg, now)
    previous = read_json(run_dir / EXCLUDED, EXCLUDED_SPEC, "excluded-nodes record")
    kept = previous["nodes"] if previous else {}
    if not found and not kept:
        return []
    info = dict(re.findall(r"(\w+)=(\S*)", run(["scontrol", "-o", "show", "job", job])))
    partition = info.get("Partition") or partition
    counted = info.get("NumNodes", "1").split("-")[0]
    needed = max(nodes, int(counted) if counted.isdigit() else 1)
    current = hostnames(info.get("ExcNodeList", ""), run)
    listed = {}
    for line in run(["sinfo", "-h", "-N", *(["-p", partition] if partition else []), "-o", "%N %t"]).splitlines():
        parts = line.split()
        if len(parts) == 2:
            listed[parts[0]] = parts[1]
    result = plan(found, kept, listed, needed, current, now, expiry)
    if result.exclude != current:
        if update is None:
            run(["scontrol", "update", f"job={job}", f"ExcNodeList={','.join(result.exclude)}"])
        else:
            update(",".join(result.exclude))
    if result.kept != kept:
        write_json_atomic(run_dir / EXCLUDED, {"nodes": result.kept}, indent=1)
    return result.lines


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m dsslm.health.exclude", description=__doc__.splitlines()[0])
    parser.add_argument("--job", required=True, help="the Slurm job id ($SLURM_JOB_ID)")
    parser.add_argument("--nodes", type=int, default=1, help="the job's node count ($SLURM_NNODES)")
    parser.add_argument("--partition", default="", help="its partition, where scontrol does not say")
    parser.add_argument("--later", type=Path, default=None,
                        help="write the ExcNodeList to set into this file instead of setting it (the job still runs)")
    parser.add_argument("train_args", nargs=argparse.REMAINDER, help="-- then dsslm.train's arguments")
    args = parser.parse_args(argv)
    # A newline after the list: an emptied list (every exclusion lifted) is a change too, and the
    # script applies the file only when it is not empty (`[[ -s ]]`).
    update = None if args.later is None else lambda exc_node_list: args.later.write_text(exc_node_list + "\n")
    from dsslm.preflight import parse_args
    train_args = args.train_args[1:] if args.train_args[:1] == ["--"] else args.train_args
    try:
        targs, overrides = parse_args(train_args)
        cfg = load(targs.config, overrides)
        for line in exclude(Path(cfg.run.dir), cfg, args.job, nodes=args.nodes, partition=args.partition,
                            update=update):
            print(line, flush=True)
    except (ConfigError, OSError, ValueError, subprocess.SubprocessError) as exc:
        detail = getattr(exc, "stderr", None) or exc
        print(f"could not exclude bad nodes: {' '.join(str(detail).split())[:300]}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
