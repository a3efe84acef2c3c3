"""The straggler report: every `observe.stragglers.every` steps, which rank holds the others back,
and in which phase of the step.

Each rank's progress reports (health/watchdog.py's `Progress`) add up the seconds it spends in each
phase. At a report step every rank's time per step in each phase since the last report is
gathered (each rank fills its row of a ranks x phases table, and one all-reduce sums it; the hosts
are gathered once); rank 0 judges, writes the record to metrics.jsonl and says what it found.

In lockstep training a rank that is slow makes the others wait at the next collective, so wall
time alone blames the waiting rank as much as the slow one. What is a rank's own work:
- `data` (its loader) and `optimizer` (the engine's update, timed alone: no collective in it under
  DDP) are its own, and the phases a rank is blamed in;
- `checkpoint` and `evaluation` begin with collectives (the save's plan, DDP's buffers in a
  forward) where a rank waits for one still in its last update, and a gathered checkpoint is rank
  0's work by design; `loop`, the bookkeeping after the update, is rank 0's more than the others'
  (it writes the logs): all reported, never blamed;
- `forward_backward` ends in the step's collectives (the gradients' reduction, the loss's sum),
  where every rank leaves at one moment; the rank that came in last waited least. So each rank's
  own forward/backward is the smallest any rank took (the last to arrive) and the rest of its time
  there is `collective_wait`, with the step's decision (`collective`) and the report's own
  exchange. A rank slow in its own forward/backward (a slow GPU) holds every rank in that
  collective alike: the time is the same everywhere and nobody is blamed for it; the check before
  the first step times each GPU against the median instead (health/nodecheck.py);
- `stalled` is the time the rank's process did not run at all: stopped (SIGSTOP, a debugger, a
  cgroup freezer) or starved of a CPU. A thread (`Stalls`) sleeps STALL_TICK_S at a time and adds
  up how late it wakes beyond STALL_NOISE_S; wherever the stop falls in the step (a forward or
  backward too), it is the rank's own and it is blamed. Wakes in a save or an evaluation are not
  counted: a gathered save holds rank 0's interpreter by design.

A rank is a straggler in a phase where its own time, smoothed over reports (half the new window,
half the past), is `factor` times the other ranks' median and at least `min_share` of a step more,
and the newest window alone says so too (one noisy window names nobody; a rank that caught up is
cleared at the next report), by WINDOW_NOISE_S in all: on a machine with more runnable threads
than cores the OS takes a rank off its core for a slice in whatever phase it is in, and in a short
window one slice in a phase of a fraction of a millisecond is many times the others' time and
several percent of a step (a clean 2-rank run on 2 busy cores, 5-step windows: rank 0 named in
`data`, 15.6 ms over the window, and in `optimizer`, 6.5 ms).
The verdict (rank, host, phase, factor) is in every report's metrics record; the console says when
a rank is first named, and when it no longer is; named `persist` reports in a row it becomes a
`straggler` event (the alert command runs) and an entry in run.dir/nodes.json, which a requeue
reads (health/exclude.py). One process, or `every=0`: no report. Rank 0 also publishes the check
before the first step here (nodes.json, its `node_check` event) once the first step is done.
"""
from __future__ import annotations

import logging
import socket
import statistics
import sys
import threading
import time
from pathlib import Path
from typing import Any

import torch

from dsslm.config import FaultsCfg, StragglersCfg
from dsslm.health.nodes import empty, slurm_node, write_nodes
from dsslm.health.progress import (CHECKPOINT, CHECKPOINT_WRITE, COLLECTIVE, DATA, DOWNSTREAM, EVALUATION,
                                   FORWARD_BACKWARD, LOAD, OPTIMIZER, PHASES)

WAIT, LOOP, STALLED = "collective_wait", "loop", "stalled"
REPORTED = (DATA, FORWARD_BACKWARD, WAIT, OPTIMIZER, LOOP, CHECKPOINT, EVALUATION, STALLED)
BLAMED = (DATA, OPTIMIZER, STALLED)  # the phases that are a rank's own work whatever the others do
# What a rank sends: seconds a step in each Progress phase, in the update, and not running at all.
KEYS = (*PHASES, "step", STALLED)
SMOOTHING = 0.5  # the newest window's weight in the smoothed times
# The stall sampler's sleep, and the lateness of a wake that is noise, not a stall: the interpreter
# hands its lock to a waking thread within its switch interval (5 ms), and a loaded machine's
# scheduler runs every runnable thread within its latency (24 ms by default): a rank merely sharing
# cores is not named. A stop shorter than the noise goes unseen. A wake costs about 80 us of CPU on
# a virtual machine (time.sleep; Event.wait twice that): 20 a second are 0.17% of one core.
STALL_TICK_S, STALL_NOISE_S = 0.05, 0.03
UNCOUNTED = (CHECKPOINT, EVALUATION, CHECKPOINT_WRITE, DOWNSTREAM)  # phases whose stalls are not counted (module docstring)
# A verdict's least excess over a whole window: a few of a loaded machine's scheduling slices
# (its scheduler runs every runnable thread within 24 ms), which a rank's phase can lose to
# preemption alone. A straggler at the default 50-step window needs 1 ms a step more.
WINDOW_NOISE_S = 0.05


class Stalls:
    """A daemon thread that sleeps `tick_s` at a time and adds up the time beyond each sleep when
    it woke more than `noise_s` late (`total`, seconds): how long this process did not run."""

    def __init__(self, progress: Any, tick_s: float = STALL_TICK_S, noise_s: float = STALL_NOISE_S):
        self.progress, self.tick_s, self.noise_s = progress, tick_s, noise_s
        self.total = 0.0
        self._closed = False
        self._thread = threading.Thread(target=self._run, name="dsslm-stalls", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        last = time.monotonic()
        while not self._closed:
            time.sleep(self.tick_s)
            now = time.monotonic()
            late = now - last - self.tick_s
            if late > self.noise_s and self.progress.now[1] not in UNCOUNTED:
                self.total += late
            last = now

    def close(self) -> None:
        self._closed = True  # the thread ends within a tick


def own_times(windows: list[dict[str, float]]) -> list[dict[str, float]]:
    """Each rank's own seconds a step per phase (REPORTED) from its wall seconds a step per phase
    (the Progress phases, and `step`: the time in the engine's update): forward/backward is the
    smallest any rank took, the rest is waiting; the optimizer phase is the update and the loop's
    bookkeeping after it (rank 0's logs)."""
    fb = min(w.get(FORWARD_BACKWARD, 0.0) for w in windows)
    return [{DATA: w.get(DATA, 0.0), FORWARD_BACKWARD: fb,
             WAIT: w.get(COLLECTIVE, 0.0) + w.get(FORWARD_BACKWARD, 0.0) - fb,
             OPTIMIZER: w.get("step", 0.0), LOOP: max(0.0, w.get(OPTIMIZER, 0.0) - w.get("step", 0.0)),
             CHECKPOINT: w.get(CHECKPOINT, 0.0) + w.get(CHECKPOINT_WRITE, 0.0) + w.get(LOAD, 0.0),
             EVALUATION: w.get(EVALUATION, 0.0) + w.get(DOWNSTREAM, 0.0), STALLED: w.get(STALLED, 0.0)}
            for w in windows]


def verdicts(times: list[dict[str, float]], blamed: tuple[str, ...], factor: float,
             min_share: float, floor_s: float = 0.0) -> list[dict]:
    """The stragglers in `times` (each rank's smoothed own seconds a step): per rank at most one,
    its phase with the largest excess over the other ranks' median, and that excess at least
    `floor_s` a step. Pure."""
    if len(times) < 2:
        return []
    step_s = statistics.median(sum(t.values()) for t in times)
    found = []
    for rank, mine in enumerate(times):
        best = None
        for phase in blamed:
            others = statistics.median(t[phase] for q, t in enumerate(times) if q != rank)
            excess = mine[phase] - others
            ratio = mine[phase] / others if others > 0 else float("inf")
            if ratio >= factor and excess >= max(min_share * step_s, floor_s) and (best is None or excess > best["excess_s"]):
                best = {"rank": rank, "phase": phase, "factor": round(min(ratio, 1e6), 2),
                        "excess_s": round(excess, 6), "own_s": round(mine[phase], 6),
                        "median_s": round(others, 6), "step_s": round(step_s, 6)}
        if best is not None:
            found.append(best)
    return found


class Stragglers:
    """One rank's side of the report; rank 0 judges and records. `after_step(step)` at the end of
    every step of the loop (every rank: the report is a collective)."""

    def __init__(self, cfg: StragglersCfg, engine: Any, progress: Any, sinks: Any, run_dir: Path,
                 nodes_doc: dict | None):
        self.cfg, self.engine, self.progress, self.sinks, self.run_dir = cfg, engine, progress, sinks, Path(run_dir)
        self.enabled = cfg.every > 0 and engine.world_size > 1
        self.blamed = BLAMED
        self.nodes_doc = nodes_doc  # the check before the first step's (rank 0), published after the first step
        self.unpublished = True
        self.me = (socket.gethostname(), slurm_node())
        self.names: list | None = None  # every rank's (host, Slurm node), gathered at the first report
        self.base: dict[str, float] | None = None  # the phase totals at the window's start
        self.steps = 0                              # steps in the window
        self.smoothed: list[dict[str, float]] | None = None
        self.named: dict[int, tuple[str, int]] = {}  # rank -> (phase, reports in a row)
        self.said_write_failure = False
        self.update_s = 0.0  # seconds in the engine's update (engine.step), timed apart from the loop's logs
        self.stalls: Stalls | None = None
        if self.enabled:
            self.stalls = Stalls(progress)
            real = engine.step

            def timed(*args, **kwargs):
                started = time.perf_counter()
                try:
                    return real(*args, **kwargs)
                finally:
                    self.update_s += time.perf_counter() - started
            engine.step = timed

    @classmethod
    def off(cls) -> "Stragglers":
        report = cls.__new__(cls)
        report.enabled = report.unpublished = False
        report.stalls = None
        return report

    def close(self) -> None:
        if self.stalls is not None:
            self.stalls.close()

    def totals(self) -> dict[str, float]:
        return {**self.progress.spent, "step": self.update_s, STALLED: self.stalls.total if self.stalls else 0.0}

    def publish(self) -> None:
        """Rank 0, once: the check before the first step's nodes.json and its `node_check` event."""
        self.unpublished = False
        if not self.engine.is_main or self.nodes_doc is None:
            return
        self.write_nodes()
        self.sinks.emit("node_check", **{k: self.nodes_doc[k] for k in ("seconds", "verdict", "exit_code")},
                        nodes={h: n["verdict"] for h, n in self.nodes_doc["nodes"].items()})

    def write_nodes(self) -> None:
        try:
            write_nodes(self.run_dir, self.nodes_doc)
        except OSError as exc:
            if not self.said_write_failure:
                self.said_write_failure = True
                print(f"dsslm: cannot write {self.run_dir / 'nodes.json'} ({exc.strerror or exc})", file=sys.stderr,
                      flush=True)

    def after_step(self, step: int) -> None:
        if self.unpublished:  # the job's first step is done: the check's record can no longer be refused
            self.publish()
        if not self.enabled:
            return
        if self.base is None:  # the job's first step (compilation, warm-up, a cold cache) is left out
            self.base = self.totals()
            return
        self.steps += 1
        if step % self.cfg.every or 2 * self.steps < self.cfg.every:  # a window too short to judge grows on
            return
        self.progress.report(step, COLLECTIVE)  # the exchange waits for the others: not the optimizer's time
        now = self.totals()
        steps = self.steps
        window = [(now[key] - self.base[key]) / steps for key in KEYS]
        self.base, self.steps = now, 0
        if self.names is None:  # once: every rank's host and Slurm node name
            self.names = self.engine.all_gather(self.me)
        # Every rank's row of a ranks x phases table, summed: one small all-reduce, nothing pickled.
        table = torch.zeros(self.engine.world_size, len(KEYS), dtype=torch.float64)
        table[self.engine.rank] = torch.tensor(window, dtype=torch.float64)
        rows = self.engine.all_reduce_sum(table).cpu().tolist()
        if self.engine.is_main:
            self.judge(step, [(host, node, dict(zip(KEYS, row))) for (host, node), row in zip(self.names, rows)],
                       steps)

    # --- rank 0 ---------------------------------------------------------------------------

    def judge(self, step: int, everyone: list[tuple[str, str | None, dict]], steps: int | None = None) -> list[dict]:
        """`everyone`: each rank's (host, Slurm node, seconds a step per KEYS) over the newest
        window of `steps` steps (default: `every`)."""
        floor_s = WINDOW_NOISE_S / (steps or self.cfg.every)
        hosts = [host for host, _, _ in everyone]
        own = own_times([window for _, _, window in everyone])
        if self.smoothed is None or len(self.smoothed) != len(own):
            self.smoothed = own
        else:
            self.smoothed = [{p: SMOOTHING * new[p] + (1 - SMOOTHING) * old[p] for p in REPORTED}
                             for new, old in zip(own, self.smoothed)]
        # Named where the smoothed times say so and the newest window agrees, by more than a few
        # slices of preemption: one noisy window names nobody, and a rank that caught up is cleared at once.
        now = {(v["rank"], v["phase"])
               for v in verdicts(own, self.blamed, self.cfg.factor, self.cfg.min_share, floor_s)}
        found = [v for v in verdicts(self.smoothed, self.blamed, self.cfg.factor, self.cfg.min_share)
                 if (v["rank"], v["phase"]) in now]
        named = {}
        for v in found:
            phase, row = self.named.get(v["rank"], ("", 0))
            v.update(host=hosts[v["rank"]], reports=row + 1 if phase == v["phase"] else 1)
            named[v["rank"]] = (v["phase"], v["reports"])
        self.sinks.log_phases({"step": step, "phase_s": {p: [round(t[p], 6) for t in own] for p in REPORTED},
                               "hosts": hosts, "stragglers": found})
        for v in found:
            if v["reports"] == 1:
                self.sinks.say(f"step {step}: {describe(v)}")
            if v["reports"] == self.cfg.persist:
                self.persists(step, v, everyone[v["rank"]][1])
        for rank, (phase, _) in self.named.items():
            if rank not in named:
                self.sinks.say(f"step {step}: rank {rank} ({hosts[rank]}) is no longer a straggler (was: {phase})",
                               logging.INFO)
        self.named = named
        return found

    def persists(self, step: int, v: dict, node: str | None) -> None:
        """Named `persist` reports in a row: an event (the alert command) and nodes.json."""
        entry = {"rank": v["rank"], "host": v["host"], "slurm_node": node, "phase": v["phase"],
                 "factor": v["factor"], "step": step, "reports": v["reports"], "time": time.time()}
        self.sinks.emit("straggler", step=step, **{k: entry[k] for k in ("rank", "host", "phase", "factor", "reports")},
                        own_s=v["own_s"], median_s=v["median_s"], line=describe(v))
        if self.nodes_doc is None:
            self.nodes_doc = empty()
        self.nodes_doc.setdefault("stragglers", []).append(entry)
        self.write_nodes()


def describe(v: dict) -> str:
    """The line: what the straggler costs each step, as a share of the step (a ratio alone read
    '468.03x the other ranks' median (20.2 ms against 0.0 ms a step)')."""
    persists = f" for {v['reports']} reports in a row" if v.get("reports", 1) > 1 else ""
    phase = f"{v['phase']} (its process stopped or starved of a CPU)" if v["phase"] == STALLED else v["phase"]
    ratio = (f"{v['factor']:g}x the other ranks' median" if v["median_s"] >= 1e-4 else
             "where the other ranks spend none")
    excess = v.get("excess_s", v["own_s"] - v["median_s"])
    share = f", {excess / v['step_s']:.0%} of a {1e3 * v['step_s']:.1f} ms step" if v.get("step_s") else ""
    return (f"rank {v['rank']} ({v.get('host', '?')}) is a straggler in {phase}{persists}: {1e3 * v['own_s']:.1f} ms "
            f"a step against {1e3 * v['median_s']:.1f} ms ({ratio}): it holds every rank back "
            f"{1e3 * excess:.1f} ms a step{share}")


def arm_slow_drill(f: FaultsCfg, rank: int, feed: Any, engine: Any) -> None:
    """The straggler drill (faults.slow_rank, slow_phase, slow_s): that rank sleeps slow_s in its
    loader (`data`) or in its optimizer step (`optimizer`), every step."""
    if f.slow_rank != rank or f.slow_s <= 0:
        return
    owner, name = (feed, "step") if f.slow_phase == DATA else (engine, "step")
    real = getattr(owner, name)

    def slowed(*args, **kwargs):
        time.sleep(f.slow_s)
        return real(*args, **kwargs)
    setattr(owner, name, slowed)
