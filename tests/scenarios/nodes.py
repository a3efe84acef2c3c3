"""Jobs as a launcher starts them, on this machine or on two "nodes" made on it, for the hang
drills and the multi-node tests (`from nodes import ...`).

`TwoNodes` makes two nodes as network namespaces joined by a veth pair: each its own address
(10.77.K.1, .2) and, through a UTS and a mount namespace per command, its own hostname (nodea,
nodeb) and an /etc/hosts that names both. The filesystem is shared (run.dir, the data), as a
cluster's shared filesystem is; `Node.binds` mounts a node-local path over a shared one (a node's
own copy of DATA_DIR). `launch` starts `python -m dsslm.engine.agent` (torchrun that exits with
the ranks' own code) on each node given: c10d rendezvous on node A's hostname, gloo over the veth
(each hostname resolves to its node's address). `HOST` is this machine as one node, for
single-node drills. `slurm_cluster.TwoNodeSlurm` runs a slurmd in each node.

`Node.kill()` SIGKILLs every process of a node (`ip netns pids`); `Node.link(False)` takes its
link down; `Node.throttle("8mbit")` caps what it sends (`tc ... tbf`). The `two_nodes` fixture
(module scope: the namespaces are shared by a file's tests) skips with the reason where namespaces
cannot be made (not root, no `ip`, no CAP_SYS_ADMIN) and removes them, and every process in them,
even when a test fails.

A `Job` keeps when it started and when each node's launcher ended (`started`, `ended`), and
`wait_for` polls a run's files, so a test or a benchmark can time the phases of a drill (start to
first step, a fault to the last process gone).
"""
from __future__ import annotations

import itertools
import os
import shutil
import signal
import subprocess
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from helpers import PYTHON, ROOT, TINY

PREFIX = "dsslm"
_ports = itertools.count(29600 + os.getpid() % 1000)


class NodesUnavailable(RuntimeError):
    """This machine cannot have namespaces for nodes; the message says why."""


def _sh(*argv: str, check: bool = True) -> subprocess.CompletedProcess:
    done = subprocess.run(argv, capture_output=True, text=True, timeout=30)
    if check and done.returncode != 0:
        raise RuntimeError(f"{' '.join(argv)} exited {done.returncode}: {done.stderr.strip()}")
    return done


@dataclass
class Node:
    """One node: a network namespace (None: this machine itself), its hostname, address, interface."""
    name: str
    netns: str | None = None
    address: str = "127.0.0.1"
    ifname: str | None = None
    hosts: Path | None = None                 # its /etc/hosts
    binds: dict[str, str] = field(default_factory=dict)  # shared path -> this node's own

    def wrap(self, argv: list[str]) -> list[str]:
        """`argv` as run on this node: in its namespaces, under its hostname, with its mounts."""
        if self.netns is None:
            return argv
        mounts = [f"mount --bind {self.hosts} /etc/hosts"] + [f"mount --bind {own} {shared}"
                                                                for shared, own in self.binds.items()]
        script = f"hostname {self.name} && " + " && ".join(mounts) + ' && exec "$@"'
        # nsenter, not `ip netns exec`: that one remounts /sys, which hides the host's cgroups (slurmd needs them).
        return ["nsenter", f"--net=/run/netns/{self.netns}", "unshare", "--uts", "--mount", "--propagation",
                "private", "sh", "-c", script, "sh", *argv]

    def popen(self, argv: list[str], env: dict, log: Path) -> subprocess.Popen:
        # No GLOO_SOCKET_IFNAME: gloo binds to the address its hostname resolves to, as on a cluster.
        full = {**os.environ, "DS_ACCELERATOR": "cpu", "OMP_NUM_THREADS": "1", **env}
        with open(log, "ab") as out:
            return subprocess.Popen(self.wrap(argv), cwd=ROOT, env=full, stdout=out, stderr=subprocess.STDOUT,
                                    stdin=subprocess.DEVNULL, start_new_session=True)

    def pids(self) -> list[int]:
        if self.netns is None:
            return []
        return [int(p) for p in _sh("ip", "netns", "pids", self.netns, check=False).stdout.split()]

    def kill(self, keep: frozenset[int] = frozenset()) -> None:
        """Every process of this node (but `keep`), at once: a node that dies."""
        for pid in set(self.pids()) - keep:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass

    def link(self, up: bool) -> None:
        _sh("ip", "-n", self.netns, "link", "set", self.ifname, "up" if up else "down")

    def throttle(self, rate: str | None) -> None:
        """What this node sends, capped at `rate` (a token bucket, `tc ... tbf`: a link at a fraction of
        its peers' speed); None lifts it. NodesUnavailable where this machine has no `tc`."""
        if not (shutil.which("tc") or shutil.which("tc", path="/usr/sbin:/sbin")):
            if rate is None:
                return
            raise NodesUnavailable("no `tc` on this machine")
        _sh("tc", "-n", self.netns, "qdisc", "del", "dev", self.ifname, "root", check=False)
        if rate is not None:
            _sh("tc", "-n", self.netns, "qdisc", "add", "dev", self.ifname, "root", "tbf", "rate", rate,
                "burst", "32kbit", "latency", "200ms")


HOST = Node(name=os.uname().nodename)


@dataclass
class Job:
    """One launch: a launcher per node, each with its log."""
    procs: dict[str, subprocess.Popen]
    logs: dict[str, Path]
    started: float = field(default_factory=time.monotonic)
    ended: dict[str, float] = field(default_factory=dict)

    def wait(self, timeout_s: float = 240) -> dict[str, int]:
        """Each node's exit code (its launcher's: the ranks' own through dsslm.engine.agent)."""
        deadline = time.monotonic() + timeout_s
        for name, proc in self.procs.items():
            try:
                proc.wait(timeout=max(1.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                self.kill()
                raise AssertionError(f"{name} still running after {timeout_s:.0f} s:\n{self.output()}") from None
            self.ended.setdefault(name, time.monotonic())
        return {name: proc.returncode for name, proc in self.procs.items()}

    def kill(self) -> None:
        for proc in self.procs.values():
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            proc.wait()

    def output(self, node: str | None = None) -> str:
        names = [node] if node else list(self.logs)
        return "\n".join(f"--- {n}\n{self.logs[n].read_text(errors='replace')[-6000:]}" for n in names)


def launch(nodes: list[Node], run_dir: Path, *overrides: str, nproc: int = 1, log_dir: Path | None = None,
           env: dict | None = None) -> Job:
    """`python -m dsslm.train` with TINY and `overrides` on `nodes` (the first hosts the rendezvous),
    `nproc` ranks each."""
    log_dir = log_dir or run_dir.parent
    log_dir.mkdir(parents=True, exist_ok=True)
    port, run_id = next(_ports), f"j{next(_ports)}"
    procs, logs = {}, {}
    for node in nodes:
        rdzv = ["--standalone"] if len(nodes) == 1 and node.netns is None else [
            "--rdzv_backend", "c10d", "--rdzv_endpoint", f"{nodes[0].name}:{port}", "--rdzv_id", run_id,
            "--rdzv_conf", "join_timeout=60"]
        argv = [PYTHON, "-m", "dsslm.engine.agent", "--nnodes", str(len(nodes)), "--nproc_per_node", str(nproc), *rdzv,
                "--signals-to-handle", "SIGINT,SIGHUP,SIGQUIT",
                "-m", "dsslm.train", f"run.dir={run_dir}", *TINY, *overrides]
        logs[node.name] = log_dir / f"{run_dir.name}-{node.name}-{len(list(log_dir.glob('*.log')))}.log"
        procs[node.name] = node.popen(argv, env or {}, logs[node.name])
    return Job(procs, logs)


def wait_for(predicate, timeout_s: float, what: str, job: Job | None = None, poll_s: float = 0.05):
    """Poll until `predicate()` is true (returns it); AssertionError naming `what` otherwise, or at
    once when `job` ended first."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        if job is not None and all(p.poll() is not None for p in job.procs.values()):
            raise AssertionError(f"the job ended before {what}:\n{job.output()}")
        time.sleep(poll_s)
    raise AssertionError(f"no {what} within {timeout_s:.0f} s" + (f":\n{job.output()}" if job else ""))


class TwoNodes:
    """nodea and nodeb, namespaces `dsslm-<tag>-a/b`, joined by a veth pair on 10.77.K.0/24."""

    def __init__(self, root: Path):
        tag = f"{os.getpid() % 10000}"
        subnet = 10 + os.getpid() % 200
        self.hosts = root / "hosts"
        self.hosts.write_text(f"127.0.0.1 localhost\n10.77.{subnet}.1 nodea\n10.77.{subnet}.2 nodeb\n")
        self.a = Node("nodea", f"{PREFIX}-{tag}-a", f"10.77.{subnet}.1", f"{PREFIX}{tag}a", self.hosts)
        self.b = Node("nodeb", f"{PREFIX}-{tag}-b", f"10.77.{subnet}.2", f"{PREFIX}{tag}b", self.hosts)
        self.keep: set[int] = set()

    def up(self) -> None:
        a, b = self.a, self.b
        _sh("ip", "netns", "add", a.netns)
        _sh("ip", "netns", "add", b.netns)
        _sh("ip", "link", "add", a.ifname, "type", "veth", "peer", "name", b.ifname)
        for node in (a, b):
            _sh("ip", "link", "set", node.ifname, "netns", node.netns)
            _sh("ip", "-n", node.netns, "addr", "add", f"{node.address}/24", "dev", node.ifname)
            _sh("ip", "-n", node.netns, "link", "set", node.ifname, "up")
            _sh("ip", "-n", node.netns, "link", "set", "lo", "up")

    def down(self) -> None:
        """Every process in either namespace, then the namespaces (the veth pair goes with them)."""
        for node in (self.a, self.b):
            for _ in range(3):
                node.kill()
                if not node.pids():
                    break
                time.sleep(0.2)
            _sh("ip", "netns", "del", node.netns, check=False)

    def reset(self) -> None:
        """Between tests: no process left (but the daemons in `keep`: a Slurm cluster's), the links up
        and unthrottled, no node-local mounts."""
        for node in (self.a, self.b):
            node.kill(frozenset(self.keep))
            node.link(True)
            node.throttle(None)
            node.binds = {}


def make_nodes(root: Path) -> TwoNodes:
    if os.geteuid() != 0:
        raise NodesUnavailable("network namespaces need root")
    for tool in ("ip", "nsenter", "unshare", "mount"):
        if shutil.which(tool) is None and shutil.which(tool, path="/usr/sbin:/sbin") is None:
            raise NodesUnavailable(f"no `{tool}` on this machine")
    nodes = TwoNodes(root)
    try:
        nodes.up()
        probe = subprocess.run(nodes.b.wrap(["hostname"]), capture_output=True, text=True, timeout=30)
    except (RuntimeError, OSError, subprocess.TimeoutExpired) as exc:
        nodes.down()
        raise NodesUnavailable(f"cannot make the namespaces: {exc}") from exc
    if probe.stdout.strip() != "nodeb":
        nodes.down()
        raise NodesUnavailable(f"a UTS and mount namespace per node failed: {probe.stderr.strip()[-300:]}")
    return nodes


@pytest.fixture(scope="module")
def two_nodes():
    root = Path(tempfile.mkdtemp(prefix="dsslm-nodes-"))
    try:
        nodes = make_nodes(root)
    except NodesUnavailable as exc:
        shutil.rmtree(root, ignore_errors=True)
        pytest.skip(f"no two-node harness: {exc}")
    try:
        yield nodes
    finally:
        nodes.down()
        shutil.rmtree(root, ignore_errors=True)
