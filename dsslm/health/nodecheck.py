"""The check before the first step, on every node (`run.preflight`, on by default): a node that
would fail the run later, or hold every rank back, is named before any rank trains, and the start
ends on every rank with exit 76 (`EXIT_BAD_NODE`: requeue elsewhere), which slurm/train.sbatch
requeues with that node excluded (health/exclude.py).

Each node's first rank checks what the node holds:
- `run_dir`: a probe file written, fsynced, read back and removed in run.dir (the node's view of
  it: a missing or read-only mount shows here), and room there for the next checkpoint (12 bytes
  a parameter, fp32 weights and two moments, every rank's share: run.dir is one shared folder);
- `data`: the first and last page of every shard in the manifest read, a few files at a time;
- `memory`: MemAvailable against what the node's ranks will hold on the host, the checkpoint
  snapshot and `monitor.rewind_points` rewind points (each rank its share of the state);
every rank on a GPU multiplies two matrices of small integers (the answer is exact, in TF32 too)
and times a bf16 matmul (`gpu`); and all ranks together time the links between nodes one at a
time (engine/probe.py: `network`) and read their clocks at one barrier (`clock`).

Every rank then judges the same table (`judge`): a node is bad when one of its own checks failed,
its links carry less than `observe.nodes.min_bandwidth` of the median node's, its clock is more
than `max_clock_skew_s` from the median node's (from rank 0's node's with two nodes: see
`judge`), or one of its GPUs computes a wrong answer or runs below `min_matmul` of the median
GPU's speed. For a bad node rank 0 writes run.dir/nodes.json (health/nodes.py), one console line
per bad node, a `node_check` and a `bad_node` event (the alert command runs) and `bad_node 76`
in $DSSLM_STATUS_FILE; a start that passes says one line and writes nothing until its first step
is done (then nodes.json and `node_check`: a refusal after the check, bad input or a resume
refused, leaves run.dir as it was). What fails for want of what every node shares is no node's
fault, and no requeue cures it: exit 4 (run.dir) or 2 (the data, the config), its nodes'
verdict `shared`, not `bad` (the requeue excludes none of them). That is a check failing on every
node of two or more (a full shared disk, data unreadable everywhere, a config too large for any
node's memory), and, on a one-node job, which has no other node to compare with, run.dir or the
data failing on a network filesystem (another node mounts the same one; on a node-local one, a
disk or a mount over it, the node is bad as before). And the crash_loop-th start in a row
refused (observe.watchdog.crash_loop) exits 6: no node the job lands on passes.
"""
from __future__ import annotations

import os
import re
import socket
import statistics
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import torch

from dsslm.config import Config, NodesCfg
from dsslm.data.verify import shard_entries
from dsslm.engine.probe import time_links, wall_clocks
from dsslm.exits import EXIT_BAD_INPUT, EXIT_BAD_NODE, EXIT_CRASH_LOOP, EXIT_OK, EXIT_WRITE_FAILED, note_status
from dsslm.health.nodes import job_name, read_nodes, slurm_node, write_nodes
from dsslm.observe.sinks import EventLog

STATE_BYTES_PER_PARAM = 12   # fp32 weight and two AdamW moments (Muon's hidden matrices hold one: a bound)
ROOM_MARGIN = 1.05           # ... plus 5% and LOG_ROOM for state.json, the index, the logs
LOG_ROOM = 256 << 10
PROBE_BYTES = 256 << 10      # the probe file written and fsynced in run.dir
PAGE = 4096                  # read at each end of every shard
READERS = 8                  # shards opened at once (a network filesystem answers each in a round trip)
EXACT_N = 512                # the matmul with a known answer: small integers, exact in fp32 and TF32
TIMED_N, TIMED_REPS = 4096, 10
# A check failing for want of what every node shares is the shared resource's, not a node's: the
# code that says so (no requeue cures it), and what to fix.
SHARED = {"run_dir": EXIT_WRITE_FAILED, "data": EXIT_BAD_INPUT, "memory": EXIT_BAD_INPUT}
FIX = {"run_dir": "free space in run.dir or make it writable",
       "data": "make the data dir's shards readable (their files, permissions, the mount)",
       "memory": "lower monitor.rewind_points or use ckpt.format=sharded"}
# Filesystems (/proc/self/mountinfo's types; fuse.* by subtype) that every node of a cluster mounts
# alike: on a one-node job, run.dir or the data failing there is the filesystem's (full, read-only,
# a file unreadable), and a requeue onto another node meets the same one. On any other type (a
# local disk, a tmpfs over the path) a failure may be the node's own, and it is refused as a node.
NETWORK_FS = {"nfs", "nfs4", "lustre", "gpfs", "beegfs", "fhgfs", "ceph", "cifs", "smb3", "smbfs", "panfs",
              "wekafs", "afs", "orangefs", "pvfs2", "gfs2", "ocfs2", "cvfs", "glusterfs", "fuse.glusterfs",
              "fuse.ceph-fuse", "fuse.cephfs", "fuse.juicefs", "fuse.quobyte", "fuse.mfs", "fuse.sshfs"}


class BadNode(RuntimeError):
    """A node failed its check before the first step: exit `code` (76, or 2, 4, 6: see the module)."""

    def __init__(self, message: str, code: int = EXIT_BAD_NODE):
        super().__init__(message)
        self.code = code


# --- what the run will need of a node ------------------------------------------------------------

def checkpoint_bytes(n_params: int) -> int:
    return STATE_BYTES_PER_PARAM * n_params


def host_bytes(cfg: Config, n_params: int, rank: int, world_size: int) -> int:
    """What rank `rank` will hold on the host beyond its model: its snapshot for the async save (a
    sharded checkpoint's 1/W, or the whole state on rank 0 for a gathered one) and its rewind points."""
    state = checkpoint_bytes(n_params)
    sharded = cfg.ckpt.format == "sharded" or (cfg.ckpt.format == "auto" and world_size > 1)
    snapshot = state // world_size if sharded else (state if rank == 0 else 0)
    m = cfg.monitor
    points = m.rewind_points * state // world_size if m.enabled and m.rewind_every else 0
    return snapshot + points


# --- one node's own checks --------------------------------------------------------------------

def fs_type(path: Path) -> str | None:
    """The type of the filesystem `path` lies on (the deepest mount over it in
    /proc/self/mountinfo, the last of those mounted on one point), or None where that is unknown."""
    try:
        target = os.path.realpath(path)
        lines = Path("/proc/self/mountinfo").read_text().splitlines()
    except (OSError, ValueError):
        return None
    best, kind = "", None
    for line in lines:
        left, _, right = line.partition(" - ")
        fields, types = left.split(), right.split()
        if len(fields) < 5 or not types:
            continue
        # mountinfo writes a space, a tab, a newline and a backslash in a path as octal escapes
        mount = re.sub(r"\\([0-7]{3})", lambda m: chr(int(m.group(1), 8)), fields[4])
        inside = target == mount or target.startswith(mount.rstrip("/") + "/")
        if inside and len(mount) >= len(best):
            best, kind = mount, types[0]
    return kind


def check_dir(path: Path, needed: int, probe_bytes: int = PROBE_BYTES) -> dict:
    """run.dir on this node: there, room for `needed` bytes, and a file written, fsynced, read back."""
    out: dict[str, Any] = {"ok": False, "path": str(path), "needed_bytes": needed, "fs": fs_type(path)}
    if not path.is_dir():
        out["why"] = f"run.dir {path} is not there (is the shared filesystem mounted on this node?)"
        return out
    try:
        st = os.statvfs(path)
        out["free_bytes"] = st.f_bavail * st.f_frsize
    except OSError as exc:
        out["why"] = f"run.dir {path}: {exc.strerror or exc}"
        return out
    probe = path / f".nodecheck-{socket.gethostname()}-{os.getpid()}"
    data = os.urandom(probe_bytes)
    started = time.perf_counter()
    try:
        fd = os.open(probe, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        try:
            view = memoryview(data)
            while view:
                view = view[os.write(fd, view):]
            os.fsync(fd)
        finally:
            os.close(fd)
        if probe.read_bytes() != data:
            out["why"] = f"run.dir {path}: a file written there reads back different"
            return out
        out["write_mb_s"] = round(probe_bytes / max(time.perf_counter() - started, 1e-9) / 1e6, 1)
    except OSError as exc:
        out["why"] = f"run.dir {path}: cannot write and fsync a file there ({exc.strerror or exc})"
        return out
    finally:
        try:
            probe.unlink(missing_ok=True)
        except OSError:
            pass
    if out["free_bytes"] < needed:
        out["why"] = (f"run.dir {path}: {out['free_bytes'] / 1e6:.1f} MB free, the next checkpoint needs "
                      f"{needed / 1e6:.1f} MB")
        return out
    out["ok"] = True
    return out


def check_data(data_dir: Path, paths: list[str]) -> dict:
    """Every shard's first and last page read (a missing mount, a file the node cannot read, an I/O
    error), a few at a time."""
    def read(rel: str) -> str | None:
        try:
            with open(data_dir / rel, "rb", buffering=0) as f:
                size = os.fstat(f.fileno()).st_size
                f.read(PAGE)
                f.seek(max(0, size - PAGE))
                f.read(PAGE)
        except OSError as exc:
            return f"cannot read {data_dir / rel}: {exc.strerror or exc}"
        return None
    def read_all(part: list[str]) -> list[str]:
        return [p for p in map(read, part) if p]

    started = time.perf_counter()
    # A slice of the shards a task, not one each: a future per shard cost 100 us of the pool's own
    # locking, 10.7 s of a start over 10^5 shards where the reads themselves take about one.
    size = max(1, -(-len(paths) // (4 * READERS)))
    with ThreadPoolExecutor(READERS) as pool:
        problems = [p for part in pool.map(read_all, [paths[i:i + size] for i in range(0, len(paths), size)])
                    for p in part]
    out: dict[str, Any] = {"ok": not problems, "path": str(data_dir), "shards": len(paths),
                           "seconds": round(time.perf_counter() - started, 3),
                           "writable": os.access(data_dir, os.W_OK), "fs": fs_type(data_dir)}
    if problems:
        more = f" (and {len(problems) - 1} more)" if len(problems) > 1 else ""
        out["why"] = problems[0] + more
    return out


def available_memory() -> int | None:
    """MemAvailable (bytes) from /proc/meminfo; None where there is none (not Linux)."""
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


def check_memory(needed: int) -> dict:
    free = available_memory()
    out: dict[str, Any] = {"ok": True, "needed_bytes": needed, "available_bytes": free}
    if free is not None and free < needed:
        out.update(ok=False, why=f"{free / 1e9:.2f} GB of host memory available, the rewind points and the "
                                 f"checkpoint snapshot of its ranks need {needed / 1e9:.2f} GB")
    return out


def check_gpu(device: torch.device, timed_n: int = TIMED_N, reps: int = TIMED_REPS) -> dict:
    """A matmul of small integers against its known answer (exact in fp32 and TF32), then a bf16
    matmul timed (fp32 off a GPU): a GPU that computes wrong, and its speed for the median."""
    i = torch.arange(EXACT_N)
    a = ((i[:, None] * 3 + i[None, :] * 7) % 17 - 8).float()
    b = ((i[:, None] * 5 + i[None, :] * 11) % 13 - 6).float()
    want = (a.long() @ b.long()).float()
    got = (a.to(device) @ b.to(device)).cpu()
    out: dict[str, Any] = {"ok": True, "device": str(device)}
    if not torch.equal(got, want):
        wrong = int((got != want).sum())
        out.update(ok=False, why=f"{device} computes a known matmul wrong ({wrong} of {want.numel()} entries)")
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    x = torch.randn(timed_n, timed_n, device=device, dtype=dtype)
    x @ x  # noqa: B018 - the warm-up
    sync = (lambda: torch.cuda.synchronize(device)) if device.type == "cuda" else (lambda: None)
    sync()
    started = time.perf_counter()
    for _ in range(reps):
        x @ x  # noqa: B018
    sync()
    out["tflops"] = round(2 * timed_n ** 3 * reps / max(time.perf_counter() - started, 1e-9) / 1e12, 3)
    return out


def guarded(check, *args) -> dict:
    """A check's result; a check that raises failed (a CUDA error in the matmul, anything else
    unforeseen), said with its error, rather than leaving the other ranks waiting for this one."""
    try:
        return check(*args)
    except Exception as exc:  # noqa: BLE001 - reported as the check's failure, on every rank
        return {"ok": False, "tflops": 0.0, "why": f"{check.__name__} raised {type(exc).__name__}: {exc}"[:500]}


# --- the verdict ----------------------------------------------------------------------------------

def median(values: list[float]) -> float:
    return statistics.median(values) if values else float("nan")


def judge(ranks: list[dict], clocks: list[float], links: dict, cfg: NodesCfg) -> dict[str, dict]:
    """Every node's checks and verdict from every rank's results (`ranks[r]`: rank, host,
    slurm_node, `local` (its node's own checks, the node's first rank only), `gpu`), the clocks
    read at one barrier, and the timed links {(src, dst): {latency_s, bytes, seconds}}. Pure: every
    rank reaches the same table."""
    nodes: dict[str, dict] = {}
    for r in ranks:
        node = nodes.setdefault(r["host"], {"host": r["host"], "slurm_node": r.get("slurm_node"), "ranks": [],
                                            "verdict": "ok", "why": [], "checks": {}})
        node["ranks"].append(r["rank"])
        for name, check in (r.get("local") or {}).items():
            node["checks"][name] = check
    first = {host: node["ranks"][0] for host, node in nodes.items()}
    _judge_network(nodes, first, links, cfg.min_bandwidth)
    if len(nodes) > 1:
        if len(nodes) > 2:
            reference, against = median([clocks[first[h]] for h in nodes]), "the median node's"
        else:
            # The median of two clocks is their midpoint, each node half the skew from it: a skew
            # up to twice the limit passed both, and one past it refused both (and the requeue
            # excluded both). Two clocks hold no majority to say which is wrong: rank 0's node
            # (the job's store, the records' times) is the reference, and only the other node can
            # be named; excluded, its stand-in is compared with rank 0's node at the next start.
            reference, against = clocks[min(first.values())], "rank 0's node's"
        for host in nodes:
            skew = clocks[first[host]] - reference
            check = {"ok": abs(skew) <= cfg.max_clock_skew_s, "skew_s": round(skew, 4)}
            if not check["ok"]:
                check["why"] = f"its clock is {skew:+.1f} s from {against} (at most {cfg.max_clock_skew_s:g} s)"
            nodes[host]["checks"]["clock"] = check
    gpus = [r for r in ranks if r.get("gpu")]
    if gpus:
        mid = median([r["gpu"]["tflops"] for r in gpus])
        for host, node in nodes.items():
            mine = [r for r in gpus if r["host"] == host]
            if not mine:
                continue
            check = {"ok": True, "tflops": [r["gpu"]["tflops"] for r in mine], "median_tflops": mid}
            wrong = [r for r in mine if not r["gpu"]["ok"]]
            slow = [r for r in mine if len(gpus) > 1 and r["gpu"]["tflops"] < cfg.min_matmul * mid]
            if wrong:
                check.update(ok=False, why=f"rank {wrong[0]['rank']}: {wrong[0]['gpu']['why']}")
            elif slow:
                check.update(ok=False, why=f"rank {slow[0]['rank']}'s GPU runs a matmul at {slow[0]['gpu']['tflops']:.1f} "
                                           f"TFLOP/s, the median GPU's at {mid:.1f}")
            node["checks"]["gpu"] = check
    shared = shared_failures(nodes)
    for node in nodes.values():
        node["why"] = [c["why"] for c in node["checks"].values() if failed(c)]
        own = [name for name, c in node["checks"].items() if failed(c) and name not in shared]
        # `shared`: refused only for what every node shares; no node to exclude (health/exclude.py)
        node["verdict"] = "bad" if own else "shared" if node["why"] else "ok"
    return nodes


def failed(check: dict) -> bool:
    return not check.get("ok", True) and bool(check.get("why"))


def shared_failures(nodes: dict[str, dict]) -> list[str]:
    """The checks (SHARED's, in its order) that fail for want of what every node shares, no node's
    fault: one failing on every node of two or more; on a one-node job, which has no other node to
    compare with, run.dir or the data failing on a network filesystem (NETWORK_FS). A one-node
    job's memory stays the node's: another node may have more free."""
    out = []
    for name in SHARED:
        checks = [n["checks"].get(name, {}) for n in nodes.values()]
        if not checks or not all(failed(c) for c in checks):
            continue
        if len(nodes) > 1 or (name != "memory" and all(c.get("fs") in NETWORK_FS for c in checks)):
            out.append(name)
    return out


def _judge_network(nodes: dict[str, dict], first: dict[str, int], links: dict, min_bandwidth: float) -> None:
    """A node whose every send runs below min_bandwidth x the median node's best send is bad; so is
    one whose every receive does, from 3 nodes up (with two, a slow link between them has two ends,
    and the sender is named: a throttle, a bad NIC queue, sits on the way out)."""
    if len(nodes) < 2 or not links:
        return
    rate = {link: m["bytes"] / m["seconds"] for link, m in links.items() if m.get("seconds")}
    host_of = {rank: host for host, rank in first.items()}
    sends, receives = {}, {}
    for (src, dst), value in rate.items():
        sends[host_of[src]] = max(sends.get(host_of[src], 0.0), value)
        receives[host_of[dst]] = max(receives.get(host_of[dst], 0.0), value)
    mid_send, mid_recv = median(list(sends.values())), median(list(receives.values()))
    for host in nodes:
        latency = [m["latency_s"] for (src, dst), m in links.items() if first[host] in (src, dst) and "latency_s" in m]
        check = {"ok": True, "send_mb_s": round(sends.get(host, 0.0) / 1e6, 2),
                 "recv_mb_s": round(receives.get(host, 0.0) / 1e6, 2),
                 "median_send_mb_s": round(mid_send / 1e6, 2),
                 "latency_ms": round(1e3 * min(latency), 3) if latency else None}
        if host in sends and sends[host] < min_bandwidth * mid_send:
            check.update(ok=False, why=f"its link sends {sends[host] / 1e6:.2f} MB/s, the median node's "
                                       f"{mid_send / 1e6:.1f} MB/s")
        elif len(nodes) > 2 and host in receives and receives[host] < min_bandwidth * mid_recv:
            check.update(ok=False, why=f"its link receives {receives[host] / 1e6:.2f} MB/s, the median node's "
                                       f"{mid_recv / 1e6:.1f} MB/s")
        nodes[host]["checks"]["network"] = check


def exit_code(nodes: dict[str, dict], refused_in_a_row: int, crash_loop: int) -> int:
    """0, or the code a refused start exits with (see the module docstring)."""
    if all(n["verdict"] == "ok" for n in nodes.values()):
        return EXIT_OK
    if crash_loop and refused_in_a_row >= crash_loop:
        return EXIT_CRASH_LOOP
    shared = shared_failures(nodes)
    return SHARED[shared[0]] if shared else EXIT_BAD_NODE


def line_of(node: dict) -> str:
    ranks = node["ranks"]
    who = f"rank {ranks[0]}" if len(ranks) == 1 else f"ranks {ranks[0]}-{ranks[-1]}"
    return f"node {node['host']} ({who}) failed its check before the first step: {'; '.join(node['why'])}"


def shared_line(nodes: dict[str, dict], name: str) -> str:
    """What failed for want of what every node shares (`name`, one of shared_failures), and what to fix."""
    check = next(iter(nodes.values()))["checks"][name]
    where = f"on every node ({len(nodes)})" if len(nodes) > 1 else f"on a {check.get('fs')} filesystem every node shares"
    return f"{check['why']} ({where}): not a node's fault; {FIX[name]}"


def ending(code: int, refused: int) -> str:
    if code == EXIT_CRASH_LOOP:
        return (f"{refused} starts in a row refused: not requeued (exit {code}); no node the job landed on "
                f"passed; fix them or the shared storage, then start the run again")
    if code == EXIT_BAD_NODE:
        return f"exit {code}: requeue elsewhere (slurm/train.sbatch excludes the node)"
    return f"exit {code}: no requeue cures it; fix it, then start the run again"


# --- the check, on every rank -----------------------------------------------------------------

def check_nodes(cfg: Config, engine: Any, data_dir: Path, manifest: dict) -> dict:
    """Run the checks on every rank, judge, and (rank 0) record: the table of nodes, or BadNode
    raised on every rank. Collectives: a few all-gathers, the links' rounds, one barrier."""
    started = time.perf_counter()
    run_dir = Path(cfg.run.dir)
    host = socket.gethostname()
    hosts = engine.all_gather(host)
    node_ranks = [r for r, h in enumerate(hosts) if h == host]
    leaders = sorted({hosts.index(h) for h in hosts})
    n_params, world = engine.n_params, engine.world_size
    mine: dict[str, Any] = {"rank": engine.rank, "host": host, "slurm_node": slurm_node()}
    if engine.rank == node_ranks[0]:
        mine["local"] = {
            "run_dir": guarded(check_dir, run_dir, int(checkpoint_bytes(n_params) * ROOM_MARGIN) + LOG_ROOM),
            "data": guarded(check_data, data_dir, [e["path"] for e in shard_entries(manifest)]),
            "memory": guarded(check_memory, sum(host_bytes(cfg, n_params, r, world) for r in node_ranks))}
    if engine.device.type == "cuda":
        mine["gpu"] = guarded(check_gpu, engine.device)
    links = time_links(engine.device, leaders) if engine.distributed and len(leaders) > 1 else {}
    clocks = wall_clocks() if engine.distributed else [time.time()]
    everyone = engine.all_gather(mine)
    nodes = judge(everyone, clocks, links, cfg.observe.nodes)
    seconds = round(time.perf_counter() - started, 3)
    code, doc = engine.decide(lambda: record(cfg, run_dir, nodes, seconds, links))
    if code != EXIT_OK:
        bad = [h for h, n in nodes.items() if n["verdict"] == "bad"]
        said = [shared_line(nodes, name) for name in shared_failures(nodes)]
        if bad:
            said.append(f"{len(bad)} node(s) failed the check before the first step: {', '.join(bad)}")
        error = BadNode(f"{'; '.join(said)} ({run_dir / 'nodes.json'}); {ending(code, doc['refused_in_a_row'])}",
                        code)
        error.echoed = not engine.is_main  # rank 0 says it (train.main)
        raise error
    return doc


def record(cfg: Config, run_dir: Path, nodes: dict[str, dict], seconds: float, links: dict) -> tuple[int, dict]:
    """Rank 0: the console lines and, for a refused start, nodes.json and the events; returns (exit
    code, the document). A start that passes writes nothing yet: a refusal after it (bad input, a
    resume refused) leaves run.dir as it was; the straggler report publishes the document and its
    `node_check` event once the first step is done (health/stragglers.py)."""
    before = (read_nodes(run_dir) or {}).get("refused_in_a_row")
    bad = [n for n in nodes.values() if n["verdict"] == "bad"]
    refusing = any(n["verdict"] != "ok" for n in nodes.values())  # bad, or `shared`
    refused = (before if isinstance(before, int) and before >= 0 else 0) + 1 if refusing else 0
    code = exit_code(nodes, refused, cfg.observe.watchdog.crash_loop)
    doc = {"schema": 1, "time": time.time(), "job": job_name(), "seconds": seconds,
           "verdict": "bad" if refusing else "ok", "exit_code": code, "refused_in_a_row": refused, "nodes": nodes,
           "links": [{"from": s, "to": d, **m} for (s, d), m in links.items()], "stragglers": []}
    if not refusing:
        names = ", ".join(nodes) if len(nodes) <= 4 else f"{len(nodes)} nodes"
        print(f"dsslm: nodes checked in {seconds:.2f} s: {names} ok ({run_dir / 'nodes.json'})", flush=True)
        return code, doc
    try:
        write_nodes(run_dir, doc)
    except OSError as exc:
        print(f"dsslm: cannot write {run_dir / 'nodes.json'} ({exc.strerror or exc})", file=sys.stderr, flush=True)
    lines = [shared_line(nodes, name) for name in shared_failures(nodes)] + [line_of(n) for n in bad]
    for line in lines:
        print(f"dsslm: {line}", file=sys.stderr, flush=True)
    events = EventLog(run_dir, True, cfg.run.alert_command)
    try:
        events.emit("node_check", **summary(doc))
        # `nodes`: only the bad ones (none where only what every node shares failed)
        events.emit("bad_node", nodes=[n["host"] for n in bad], why=lines, exit_code=code, refused_in_a_row=refused)
        note_status(f"bad_node {code}")
    finally:
        events.close()  # waits for the alert command (bounded)
    return code, doc


def summary(doc: dict) -> dict:
    """The `node_check` event's fields."""
    return {"seconds": doc["seconds"], "verdict": doc["verdict"], "exit_code": doc["exit_code"],
            "nodes": {h: n["verdict"] for h, n in doc["nodes"].items()}}
