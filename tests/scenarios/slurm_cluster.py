"""A real one-node Slurm cluster on loopback, for tests that submit `slurm/train.sbatch`.

`slurm_cluster` (a session-scoped pytest fixture) gives a running `SlurmCluster`: munged,
slurmctld and slurmd started from a slurm.conf written into a temp dir, clients pointed at it
through SLURM_CONF. Root only; Debian's `slurmctld slurmd slurm-client munge` are installed with
apt-get when missing (CI runs `.ci/slurm-deps` first so tests do not spend their time in apt).
A machine that cannot have the cluster (not root, packages neither there nor installable) is a
`pytest.skip` that names why; a daemon that does not come up is an error, with its log's tail.
Teardown cancels every job, then stops each process this module started, by pid: nothing is
left running.

`TwoNodeSlurm` is the same cluster on the two nodes of tests/scenarios/nodes.py: slurmctld and a
slurmd on node A, a slurmd on node B, each in its node's namespaces (entered with nsenter: `ip netns
exec` remounts /sys, and slurmd needs the host's cgroups there), a spool, pid and log file each.

Standalone check: `python tests/scenarios/slurm_cluster.py` starts the cluster, runs `srun hostname`
through sbatch, prints the timings and stops everything.
"""

from __future__ import annotations

import os
import pwd
import re
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from pathlib import Path

import pytest

APT_PACKAGES = ("slurmctld", "slurmd", "slurm-client", "munge")
BINARIES = ("slurmctld", "slurmd", "slurmstepd", "sbatch", "srun", "scontrol", "squeue", "sinfo", "munged")
MUNGE_KEY = Path("/etc/munge/munge.key")
APT_TIMEOUT_S = 300
START_TIMEOUT_S = 60
# Seconds between SIGTERM and SIGKILL when slurm ends a job (requeue, scancel, time limit):
# long enough for a tiny model's checkpoint, short enough that a hung test ends quickly.
KILL_WAIT_S = 20
# A requeued job waits cred_expire seconds before it may start again (120 by default).
CRED_EXPIRE_S = 5


class SlurmUnavailable(RuntimeError):
    """This machine cannot have the test cluster (not root, no packages); the message says why."""


def _tail(path: Path, n_lines: int = 20) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-n_lines:])
    except OSError:
        return f"(no {path})"


def _run(argv: list[str], timeout_s: float, **kwargs) -> subprocess.CompletedProcess:
    return subprocess.run(argv, capture_output=True, text=True, timeout=timeout_s, **kwargs)


def ensure_installed(timeout_s: float = APT_TIMEOUT_S) -> None:
    """Install Debian's slurm and munge packages unless every binary is already there."""
    missing = [b for b in BINARIES if not _which(b)]
    if not missing:
        return
    if os.geteuid() != 0:
        raise SlurmUnavailable(f"slurm binaries missing ({', '.join(missing)}) and not root to apt-get them")
    if not shutil.which("apt-get"):
        raise SlurmUnavailable(f"slurm binaries missing ({', '.join(missing)}) and no apt-get")
    deadline = time.monotonic() + timeout_s
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    try:
        for argv in (["apt-get", "update", "-qq"], ["apt-get", "install", "-y", "-qq", *APT_PACKAGES]):
            done = _run(argv, max(1.0, deadline - time.monotonic()), env=env)
            if done.returncode != 0:
                raise SlurmUnavailable(f"{' '.join(argv)} failed: {done.stderr.strip()[-500:]}")
    except subprocess.TimeoutExpired as exc:
        raise SlurmUnavailable(f"apt-get did not finish within {timeout_s:.0f}s") from exc
    missing = [b for b in BINARIES if not _which(b)]
    if missing:
        raise SlurmUnavailable(f"still missing after apt-get: {', '.join(missing)}")


def _which(name: str) -> str | None:
    # sbin is not on every PATH (CI's environment, sudo-less root shells)
    return shutil.which(name) or shutil.which(name, path="/usr/sbin:/sbin:/usr/local/sbin")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _munge_works() -> bool:
    try:
        cred = _run(["munge", "-n"], 10)
        return cred.returncode == 0 and _run(["unmunge"], 10, input=cred.stdout).returncode == 0
    except (OSError, subprocess.TimeoutExpired):
        return False


def start_munge(log_dir: Path) -> subprocess.Popen | None:
    """Start munged as user munge unless one already answers; return the process we started."""
    if _munge_works():
        return None
    munge = pwd.getpwnam("munge")
    for d in (Path("/run/munge"), Path("/var/lib/munge"), Path("/var/log/munge"), MUNGE_KEY.parent):
        d.mkdir(parents=True, exist_ok=True)
        os.chown(d, munge.pw_uid, munge.pw_gid)
    if not MUNGE_KEY.exists():
        fd = os.open(MUNGE_KEY, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o400)
        with os.fdopen(fd, "wb") as key:
            key.write(os.urandom(1024))
    os.chown(MUNGE_KEY, munge.pw_uid, munge.pw_gid)
    os.chmod(MUNGE_KEY, 0o400)  # munged refuses a key that group or others can read
    with open(log_dir / "munged.out", "ab") as log:
        proc = subprocess.Popen(
            [_which("munged"), "--foreground", "--force"],
            user="munge", group="munge", stdout=log, stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL, start_new_session=True,
        )
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        if _munge_works():
            return proc
        if proc.poll() is not None:
            break
        time.sleep(0.2)
    _stop_process(proc)
    raise RuntimeError(f"munged did not come up:\n{_tail(log_dir / 'munged.out')}")


def _stop_process(proc: subprocess.Popen, timeout_s: float = 10) -> None:
    if proc.poll() is not None:
        return
    proc.terminate()
    try:
        proc.wait(timeout_s)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(timeout_s)


def write_slurm_conf(root: Path, host: str, cpus: int, nodes: dict[str, str] | None = None) -> Path:
    """A one-node cluster: node `host` at 127.0.0.1, one partition `debug`, all state under root.
    `nodes` ({name: address}, the first hosting slurmctld): a cluster of those, one slurmd each
    (tests/scenarios/nodes.py's namespaces), with a spool, pid and log file per node (%n)."""
    nodes = nodes or {host: "127.0.0.1"}
    per_node = "-%n" if len(nodes) > 1 else ""
    for d in ("state", "log", *(f"spool-{n}" if per_node else "spool" for n in nodes)):
        (root / d).mkdir(parents=True, exist_ok=True)
    first, first_address = next(iter(nodes.items()))
    node_lines = "\n".join(f"NodeName={n} NodeAddr={a} CPUs={cpus} State=UNKNOWN" for n, a in nodes.items())
    conf = root / "slurm.conf"
    conf.write_text(f"""\
ClusterName=dsslmtest
SlurmctldHost={first}({first_address})
SlurmctldPort={_free_port()}
SlurmdPort={_free_port()}
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
AuthInfo=cred_expire={CRED_EXPIRE_S}
StateSaveLocation={root}/state
SlurmdSpoolDir={root}/spool{per_node}
SlurmctldPidFile={root}/slurmctld.pid
SlurmdPidFile={root}/slurmd{per_node}.pid
SlurmctldLogFile={root}/log/slurmctld.log
SlurmdLogFile={root}/log/slurmd{per_node}.log
SlurmctldDebug=info
SlurmdDebug=info
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
SchedulerType=sched/builtin
# Pending jobs are retried every 60 s by default; a requeued job would idle that long.
SchedulerParameters=sched_interval=1
MailProg=/bin/true
MpiDefault=none
SwitchType=switch/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
JobCompType=jobcomp/filetxt
JobCompLoc={root}/log/jobcomp.txt
JobRequeue=1
ReturnToService=2
SlurmdParameters=config_overrides
KillWait={KILL_WAIT_S}
MinJobAge=3600
InactiveLimit=0
MessageTimeout=10
SlurmctldTimeout=30
SlurmdTimeout=30
{node_lines}
PartitionName=debug Nodes={",".join(nodes)} Default=YES MaxTime=INFINITE State=UP
""")
    return conf


class SlurmCluster:
    """Daemons of one test cluster and the client calls tests need, all through `self.env`."""

    def __init__(self, root: Path):
        self.root = root
        self.host = socket.gethostname().split(".")[0]
        self.cpus = os.cpu_count() or 1
        self.conf = write_slurm_conf(root, self.host, self.cpus)
        self.env = {**os.environ, "SLURM_CONF": str(self.conf)}
        self.env["PATH"] = self.env.get("PATH", "/usr/bin:/bin") + ":/usr/sbin:/sbin"
        self.procs: dict[str, subprocess.Popen] = {}
        self.job_ids: list[int] = []
        self.wrap = lambda argv: argv  # where clients and daemons run (TwoNodeSlurm: in a node's namespaces)

    # daemons

    def start(self) -> None:
        started = time.monotonic()
        munged = start_munge(self.root / "log")
        if munged is not None:
            self.procs["munged"] = munged
        self._start_daemon("slurmctld", [_which("slurmctld"), "-D", "-i", "-f", str(self.conf)])
        self._start_daemon("slurmd", [_which("slurmd"), "-D", "-f", str(self.conf), "-N", self.host])
        self._wait_node_idle(START_TIMEOUT_S)
        self.start_s = time.monotonic() - started

    def _start_daemon(self, name: str, argv: list[str]) -> None:
        with open(self.root / "log" / f"{name}.out", "ab") as log:  # the daemon keeps its own copy
            self.procs[name] = subprocess.Popen(
                self.wrap(argv), env=self.env, stdout=log, stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL, start_new_session=True,
            )

    def _wait_node_idle(self, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        state = ""
        while time.monotonic() < deadline:
            for name, proc in self.procs.items():
                if proc.poll() is not None:
                    raise RuntimeError(f"{name} exited with {proc.returncode}:\n{self._log_tails()}")
            done = self.client(["sinfo", "-h", "-n", self.host, "-o", "%t"], check=False)
            state = done.stdout.strip()
            if done.returncode == 0 and state.startswith("idle"):
                return
            time.sleep(0.3)
        raise RuntimeError(f"node {self.host} not idle after {timeout_s:.0f}s (sinfo: {state!r}):\n"
                           f"{self._log_tails()}")

    def _log_tails(self) -> str:
        logs = self.root / "log"
        return "\n".join(f"--- {name}\n{_tail(logs / name)}"
                         for name in ("slurmctld.log", "slurmd.log", "slurmctld.out", "slurmd.out"))

    def stop(self) -> None:
        """Cancel every job, wait for its processes, stop the daemons we started, newest first."""
        try:
            if self.job_ids and self.procs.get("slurmctld") and self.procs["slurmctld"].poll() is None:
                self.client(["scancel", *map(str, self.job_ids)], check=False)
                self._wait_jobs_gone(KILL_WAIT_S + 15)
        finally:
            for name in reversed(list(self.procs)):  # slurmd(s), slurmctld, munged
                _stop_process(self.procs[name])
            self._kill_leftover_job_processes()

    def _wait_jobs_gone(self, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            daemons = {p.pid for p in self.procs.values()}
            if not [pid for pid, ppid in self._our_pids() if ppid not in daemons]:
                return
            time.sleep(0.5)

    def _our_pids(self) -> list[tuple[int, int]]:
        """(pid, ppid) of processes this cluster started, daemons aside: slurmstepd of our job ids,
        anything carrying our SLURM_CONF (job processes, slurmctld's slurmscriptd helper)."""
        ours = {str(j) for j in self.job_ids}
        marker = f"SLURM_CONF={self.conf}".encode()
        pids = []
        for entry in Path("/proc").iterdir():
            if not entry.name.isdigit() or int(entry.name) == os.getpid():
                continue
            try:
                cmdline = (entry / "cmdline").read_bytes()
                if cmdline.startswith(b"slurmstepd: ["):
                    job = cmdline[len(b"slurmstepd: ["):].split(b".")[0].split(b"]")[0].decode()
                    if job not in ours:
                        continue
                elif marker not in (entry / "environ").read_bytes().split(b"\0"):
                    continue
                ppid = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
                pids.append((int(entry.name), ppid))
            except (OSError, ValueError, IndexError):
                continue
        daemons = {p.pid for p in self.procs.values()}
        return [(pid, ppid) for pid, ppid in pids if pid not in daemons]

    def _kill_leftover_job_processes(self) -> None:
        for pid, _ in self._our_pids():
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass

    # clients

    def client(self, argv: list[str], check: bool = True, timeout_s: float = 30) -> subprocess.CompletedProcess:
        done = _run(self.wrap(argv), timeout_s, env=self.env)
        if check and done.returncode != 0:
            raise RuntimeError(f"{' '.join(argv)} exited {done.returncode}: {done.stderr.strip()}")
        return done

    def sbatch(self, script: str | Path, args: list[str] = (), flags: list[str] = (),
               env: dict[str, str] | None = None, cwd: str | Path | None = None) -> int:
        """Submit a batch script; return the job id. `env` is added to the submitting environment."""
        argv = [_which("sbatch"), "--parsable", *flags, str(script), *args]
        done = _run(self.wrap(argv), 30, env={**self.env, **(env or {})}, cwd=cwd)
        if done.returncode != 0:
            raise RuntimeError(f"sbatch exited {done.returncode}: {done.stderr.strip()}")
        job_id = int(done.stdout.strip().split(";")[0])
        self.job_ids.append(job_id)
        return job_id

    def job(self, job_id: int) -> dict[str, str]:
        """`scontrol show job` as a dict (JobState, Restarts, ExitCode, StdOut, ...)."""
        out = self.client(["scontrol", "-o", "show", "job", str(job_id)]).stdout
        return dict(re.findall(r"(\w+(?::\w+)?)=(\S*)", out))

    def wait_job(self, job_id: int, until, timeout_s: float, poll_s: float = 0.5) -> dict[str, str]:
        """Poll until `until(job_dict)` is true; raise TimeoutError with the last state."""
        deadline = time.monotonic() + timeout_s
        info: dict[str, str] = {}
        while time.monotonic() < deadline:
            info = self.job(job_id)
            if until(info):
                return info
            time.sleep(poll_s)
        raise TimeoutError(f"job {job_id} after {timeout_s:.0f}s: {info}")

    def wait_state(self, job_id: int, states: set[str] | str, timeout_s: float) -> dict[str, str]:
        states = {states} if isinstance(states, str) else set(states)
        return self.wait_job(job_id, lambda j: j.get("JobState") in states, timeout_s)


class TwoNodeSlurm(SlurmCluster):
    """slurmctld and a slurmd on node A, a slurmd on node B (tests/scenarios/nodes.py's TwoNodes:
    network namespaces, each its own hostname, so each slurmd finds its NodeName by it); clients run
    on node A. munged's socket is a path on the shared filesystem: one munged serves both."""

    def __init__(self, root: Path, nodes):
        super().__init__(root)
        self.nodes = nodes
        self.host = nodes.a.name
        self.cpus = max(1, self.cpus // 2)
        self.conf = write_slurm_conf(root, self.host, self.cpus, {n.name: n.address for n in (nodes.a, nodes.b)})
        self.env["SLURM_CONF"] = str(self.conf)
        self.wrap = nodes.a.wrap

    def start(self) -> None:
        started = time.monotonic()
        munged = start_munge(self.root / "log")
        if munged is not None:
            self.procs["munged"] = munged
        self._start_daemon("slurmctld", [_which("slurmctld"), "-D", "-i", "-f", str(self.conf)])
        for node in (self.nodes.a, self.nodes.b):
            self.wrap = node.wrap
            self._start_daemon(f"slurmd-{node.name}", [_which("slurmd"), "-D", "-f", str(self.conf)])
        self.wrap = self.nodes.a.wrap
        deadline = time.monotonic() + START_TIMEOUT_S
        while time.monotonic() < deadline:
            states = self.client(["sinfo", "-h", "-N", "-o", "%t"], check=False).stdout.split()
            if states == ["idle", "idle"]:
                self.start_s = time.monotonic() - started
                return
            time.sleep(0.3)
        raise RuntimeError(f"two nodes not idle after {START_TIMEOUT_S} s (sinfo: {states}):\n{self._log_tails()}")

    def _log_tails(self) -> str:
        logs = self.root / "log"
        return "\n".join(f"--- {name}\n{_tail(logs / name)}" for name in
                         ("slurmctld.log", "slurmd-nodea.log", "slurmd-nodeb.log", "slurmctld.out"))


FINISHED_STATES = {"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY", "BOOT_FAIL"}


def start_cluster(root: Path) -> SlurmCluster:
    if os.geteuid() != 0:
        raise SlurmUnavailable("the test cluster runs slurmd and munged, which need root")
    ensure_installed()
    cluster = SlurmCluster(root)
    try:
        cluster.start()
    except BaseException:
        cluster.stop()
        raise
    return cluster


@pytest.fixture(scope="session")
def slurm_cluster(tmp_path_factory):
    # Keep the root short: slurmd's unix sockets live under SlurmdSpoolDir (108-byte limit).
    root = tmp_path_factory.mktemp("slurm")
    try:
        cluster = start_cluster(root)
    except SlurmUnavailable as exc:
        pytest.skip(f"no test Slurm cluster: {exc}")
    try:
        yield cluster
    finally:
        cluster.stop()


if __name__ == "__main__":
    with tempfile.TemporaryDirectory(prefix="dsslm-slurm-") as tmp:
        c = start_cluster(Path(tmp))
        try:
            print(f"cluster up in {c.start_s:.1f}s; conf {c.conf}")
            script = Path(tmp) / "hello.sbatch"
            script.write_text(f"#!/bin/bash\n#SBATCH -o {tmp}/hello-%j.out\nsrun hostname\n")
            t0 = time.monotonic()
            jid = c.sbatch(script)
            info = c.wait_state(jid, FINISHED_STATES, 60)
            print(f"job {jid} {info['JobState']} exit {info['ExitCode']} in {time.monotonic() - t0:.1f}s:",
                  (Path(tmp) / f"hello-{jid}.out").read_text().strip())
        finally:
            c.stop()
