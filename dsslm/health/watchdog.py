"""The watchdog: a hung, stopped, dead or unreachable rank becomes a diagnosis and a requeue.

A stopped process stops every thread in it and a dead node takes its processes with it, so each
rank is judged by the others, from beats they can read whatever it does:

- the training thread reports `(step, phase)` to a `Progress`: one tuple stored, read by
- a thread per rank (`Watchdog`), which every observe.watchdog.beat_s posts the rank's beat (step,
  phase, time in it, its limit, host, pid) to the job's store (engine/board.py), reads every rank's
  back and judges (`judge`):
  - a rank whose beats stopped for floor_s is gone (stopped, dead, cut off); so is the store when
    it stops answering (its host is);
  - else the rank whose last report is the earliest (the one the others wait for) is stuck once
    past its phase's limit: factor x that phase's longest time in this run, clamped to
    [floor_s, ceiling_s]; ceiling_s for a phase not timed yet; first_s for the job's start and
    first step (checkpoint load, compilation);
  - a collective that failed in the training thread (`failed`): a peer whose connection closed and
    stopped beating for a few beats is gone; the collectives' timeout is past every limit.
- The first rank to call it claims `run.dir/hangs/.called-<job>` (health/hangs.py) and announces
  it in the store; every reachable rank dumps its stacks and flight record there; the caller writes
  hang.json, one console line and a `hang` event (the alert command runs); rank 0 releases
  run.dir's lock; every process exits EXIT_REQUEUE, or EXIT_CRASH_LOOP on the crash_loop-th hang
  in a row at the same step and phase. Each node's reaper (health/reaper.py) kills its stopped ranks.

The learned phase times are saved in run.dir/watchdog.json, so a requeued job starts with them;
after the first step the collectives' timeout becomes `Limits.bound()`, past every phase's limit,
so a hang the watchdog cannot see (its thread starved) still ends there, with the same record.
"""
from __future__ import annotations

import dataclasses
import faulthandler
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

from dsslm.config import WatchdogCfg
from dsslm.durable import write_json_atomic
from dsslm.exits import (EXIT_CRASH_LOOP, EXIT_INTERRUPTED, EXIT_OUT_OF_MEMORY, EXIT_REQUEUE, note_status,
                         stop_waiting, tell_agent)
from dsslm.health import hangs, oom, reaper
from dsslm.health.progress import (CHECKPOINT, CHECKPOINT_WRITE, COLLECTIVE, DATA, DOWNSTREAM, EVALUATION,  # noqa: F401
                                   FORWARD_BACKWARD, LOAD, OPTIMIZER, ORDER, PHASES, Limits, Progress, Work)
from dsslm.observe.sinks import EventLog

from dsslm.health.verdict import Seen, Verdict, describe, judge  # noqa: F401 (re-exported: the tests' names)

GAP_BEATS = 4  # the watchdog's own loop late by this many beats: this process was stopped or starved
SILENT_SAY = 0.25  # a peer silent this share of floor_s is named on the console (the verdict comes at 1)


class LocalBoard:
    """One process: no store, no peers."""

    def __init__(self) -> None:
        self.source: Callable[[], dict] | None = None

    def post(self, beat: dict) -> None:
        pass

    def view(self) -> tuple[float, list[Any], str | None]:
        return time.monotonic(), [None], None

    def announce(self, verdict: str) -> None:
        pass

    def close(self, beat: dict, wait_s: float) -> None:
        pass


@dataclass
class Links:
    """What the watchdog asks of the engine (engine/board.py), and what it runs as it leaves."""
    board: Any = dataclasses.field(default_factory=LocalBoard)
    store: str = "none"                                   # the store's address, for the record
    flight: Callable[[], tuple[str | None, str | None]] = lambda: (None, None)  # (record, waiting in)
    classify: Callable[[BaseException], str | None] = lambda exc: None        # timeout | peer | None
    set_timeout: Callable[[float], None] = lambda seconds: None
    on_leave: list[Callable[[], None]] = dataclasses.field(default_factory=list)  # rank 0: release the lock
    exit: Callable[[int], None] = os._exit


class Watchdog:
    """One rank's watchdog thread; `progress` is what its training thread reports to."""

    def __init__(self, cfg: WatchdogCfg, run_dir: Path, rank: int, token: str, links: Links, progress: Progress,
                 failures: dict | None = None, alert_command: str = "", is_main: bool | None = None):
        self.cfg, self.run_dir, self.rank, self.token, self.links = cfg, Path(run_dir), rank, token, links
        self.progress, self.failures, self.alert_command = progress, failures, alert_command
        self.is_main = rank == 0 if is_main is None else is_main
        self.host, self.pid = socket.gethostname(), os.getpid()
        # Every rank's (host, pid), gathered once at the start (health.door): a rank whose beat this
        # watchdog never read is still named by its host in a record (a link down before the first
        # read left it "?", and the record named one host of two).
        self.peers: list[tuple[str, int]] = []
        self.limits = Limits(cfg, progress.longest)
        self._saved = dict(progress.longest)
        self.grace_s = max(3 * cfg.beat_s, 2.0)  # a peer whose connection closed and stopped beating this long is gone
        self.join_s = max(3.0, 5 * cfg.beat_s)   # the caller waits this long for the others' dumps
        self.started = self.rebased = time.monotonic()
        self.changed: dict[int, tuple[Any, float]] = {}  # rank -> (its beat count, when it last changed)
        self.bound: float | None = None
        self.broken: str | None = None
        self._work: Work | None = None          # the phase's work being tracked, its last value and when it moved
        self._work_value: Any = None
        self._work_at = self.started
        self._said_at = 0.0                     # the phase's age when this rank last said it is slow, not stopped
        self._said_silent: set[int] = set()     # peers named as silent (_say_silent), until they beat again
        self.closed, self.leaving = False, False
        self._leave_lock = threading.Lock()
        self._stop = threading.Event()
        self.reaper: subprocess.Popen | None = None
        links.board.source = lambda: dataclasses.asdict(self._me(time.monotonic()))  # read by the board's exchange
        progress.after_first = self._first_bound
        self._thread = threading.Thread(target=self._run, name="dsslm-watchdog", daemon=True)
        self._thread.start()

    # --- the thread ------------------------------------------------------------------------

    def _run(self) -> None:
        last = time.monotonic()
        while not self._stop.wait(self.cfg.beat_s):
            now = time.monotonic()
            if now - last > GAP_BEATS * self.cfg.beat_s + 1.0:
                self.rebased, self.changed = now, {}  # we were stopped: nobody else aged meanwhile
            last = now
            try:
                self.tick(now)
            except Exception as exc:  # noqa: BLE001 - the watchdog must never take the run down
                print(f"dsslm: watchdog: {type(exc).__name__}: {exc}", file=sys.stderr, flush=True)

    def tick(self, now: float) -> None:
        step = self.progress.now[0]
        self._learn(step)
        self._track(now)
        at, beats, verdict = self.links.board.view()
        if verdict is None and now - at > 3 * self.cfg.beat_s:  # the store is silent: a partition's other side may have called
            verdict = hangs.claimed(self.run_dir, self.token)
        if verdict is not None:
            self._join(verdict)
            return
        seen = self._seen(now, at, beats)  # every tick: it also tracks when each rank's beats last moved
        if self.cfg.enabled and self._interrupted(now, at, seen):
            return
        if self.cfg.enabled or self.broken:
            found = judge(seen, self.cfg.floor_s, now - max(at, self.rebased), self.links.store, self.broken,
                          self.grace_s, 4 * self.cfg.beat_s)
            if found is not None:
                self.call(found)
                return
            self._say_slow(now, seen)
            self._say_silent(seen)
        self._reset_failures(step)

    def _interrupted(self, now: float, at: float, seen: list[Seen]) -> bool:
        """A Ctrl-C or SIGTERM the loop waits to answer at the end of its step, while a peer has
        stopped beating: that step never ends, and a person at the terminal would wait floor_s for
        nothing (then press Ctrl-C again and lose the diagnosis). Called at once, as `grace_s` of
        silence after a broken collective is: the record written, marked interrupted, every
        process ended, the lock released. Only a silent peer (its beat thread stopped with it)
        counts: a step that is merely long ends, and the stop is answered there as always."""
        stop = stop_waiting()
        if stop is None or now - stop[1] < self.grace_s:
            return False
        found = judge(seen, self.grace_s, now - max(at, self.rebased), self.links.store, None, self.grace_s,
                      4 * self.cfg.beat_s)
        if found is None or found.cause != "stopped_beating":
            return False
        found.interrupted = "Ctrl-C" if stop[0] == signal.SIGINT else signal.Signals(stop[0]).name
        self.call(found)
        return True

    def _say_silent(self, seen: list[Seen]) -> None:
        """One console line when a peer has been silent for SILENT_SAY of floor_s, said by the
        lowest rank still beating: the wait for a hang's verdict is not a minute of nothing."""
        limit = self.cfg.floor_s
        quiet = {s.rank: s for s in seen if not s.exited and s.silent_s >= SILENT_SAY * limit}
        self._said_silent &= set(quiet)  # one that beat again may be named again
        speaker = min((s.rank for s in seen if not s.exited and s.rank not in quiet), default=None)
        if speaker != self.rank:
            return
        for rank in sorted(set(quiet) - self._said_silent):
            s = quiet[rank]
            who = (f"rank {rank} ({s.host}, pid {s.pid})" if s.phase != "?" else
                   f"rank {rank} ({'' if s.host == '?' else s.host + ', '}never heard from)")
            where = f" in {s.phase} at step {s.step}" if s.phase in ORDER else ""
            print(f"dsslm: {who} silent for {s.silent_s:.0f} s{where}; calling a hang at {limit:.0f} s (Ctrl-C "
                  f"calls it now, with its record)", file=sys.stderr, flush=True)
            self._said_silent.add(rank)

    def _track(self, now: float) -> None:
        """When the current phase's work last advanced (its Work's value changed)."""
        work = self.progress.work
        try:
            value = work.done() if work is not None else None
        except Exception:  # noqa: BLE001 - a measure that fails measures nothing: judged as without one
            work, value = None, None
        if work is not self._work:
            self._work, self._work_value, self._work_at, self._said_at = work, value, now, 0.0
        elif value != self._work_value:
            self._work_value, self._work_at = value, now

    def _idle(self, now: float) -> float:
        if self._work is None or self._work is not self.progress.work:
            return -1.0
        return max(0.0, round(now - max(self._work_at, self.rebased), 3))

    def _say_slow(self, now: float, seen: list[Seen]) -> None:
        """One console line when this rank's phase outlives its limit while its work advances, and
        again at each further multiple of the limit: the verdict waits, and says why. Where rank 0
        does the same work (every rank validates, every rank writes its shard), rank 0 alone says it."""
        me = self._me(now)
        if not (me.age_s > me.limit_s and me.working(self.cfg.floor_s)) or self._work is None:
            return
        if not self.is_main and any(s.rank == 0 and (s.step, s.phase) == (me.step, me.phase) for s in seen):
            return
        if me.age_s < self._said_at + me.limit_s:
            return
        self._said_at = me.age_s
        try:
            detail = self._work.describe()
        except Exception:  # noqa: BLE001 - the line without its figures
            detail = ""
        quiet = max(self.cfg.floor_s, me.limit_s)
        print(f"dsslm: {self._work.what}: {me.age_s:.0f} s so far{', ' + detail if detail else ''}, "
              f"{self._work.verb} (past its limit of {me.limit_s:.0f} s; a hang only once it makes no progress "
              f"for {quiet:.0f} s)", file=sys.stderr, flush=True)

    def _me(self, now: float) -> Seen:
        step, phase, since = self.progress.now
        first = self.progress.first_step is None or step == self.progress.first_step
        # Not below 0: `now` is read before the report, and the training thread may report between
        # the two reads; a negative age would fail the others' check of this beat (hangs.SEEN_SPEC),
        # and they would see this rank as one that never beat ("?").
        return Seen(self.rank, self.host, self.pid, step, phase, max(0.0, round(now - max(since, self.rebased), 3)),
                    self.limits.of(phase, first), idle_s=self._idle(now))

    def _seen(self, now: float, at: float, beats: list[Any]) -> list[Seen]:
        out = []
        for rank, beat in enumerate(beats):
            if rank == self.rank:
                out.append(self._me(now))
                continue
            if not hangs.seen_ok(beat):  # never beat, or not a beat: silent since we started
                host, pid = self.peers[rank] if rank < len(self.peers) else ("?", 0)
                out.append(Seen(rank, host, pid, -1, "?", now - self.rebased, float("inf"), max(0.0, at - self.rebased)))
                continue
            count, changed_at = self.changed.get(rank, (None, at))
            if beat.get("n") != count:
                self.changed[rank] = (beat.get("n"), at)
                changed_at = at
            fields = {k: beat[k] for k in ("host", "pid", "step", "phase")}
            limit = beat.get("limit_s") if isinstance(beat.get("limit_s"), (int, float)) else float("inf")
            idle = beat.get("idle_s")
            idle = idle + now - changed_at if isinstance(idle, (int, float)) and idle >= 0 else -1.0
            out.append(Seen(rank, **fields, age_s=beat["age_s"] + now - changed_at, limit_s=limit,
                            silent_s=max(0.0, at - changed_at), exited=beat.get("exited") is True, idle_s=idle))
        return out

    def _learn(self, step: int) -> None:
        """Save the phase times (rank 0) when a phase is first timed or grew by 10% where it moves
        a limit, and hand the training thread the collectives' bound once the first step is done
        and whenever it moves."""
        longest, saved = dict(self.progress.longest), self._saved

        def grew(phase: str) -> bool:
            now, before = longest[phase], saved[phase]
            return (before < 0 <= now) or (now > 1.1 * before and self.cfg.factor * now > self.cfg.floor_s)
        if self.is_main and any(grew(phase) for phase in PHASES):
            try:
                hangs.write_learned(self.run_dir, {k: v for k, v in longest.items() if v >= 0})
                self._saved = longest
            except OSError:
                pass  # the next growth tries again; a requeue without them starts from the defaults
        first = self.progress.first_step
        if first is not None and step > first and self.bound is not None:  # the first is the training thread's
            bound = self.limits.bound()
            if abs(bound - self.bound) > 0.01 * self.bound:
                self.bound = bound
                self.progress.pending = lambda: self.links.set_timeout(bound)  # set by the training thread

    def _first_bound(self) -> None:
        """The training thread, at its first report after the first step: the collectives' timeout
        becomes the bound (every phase not yet timed at the ceiling: the widest it will be)."""
        bound = self.limits.bound()
        self.links.set_timeout(bound)
        self.bound = bound

    def _reset_failures(self, step: int) -> None:
        f = self.failures
        if self.is_main and f is not None and f["in_a_row"] > 0 and step > f["step"]:
            try:
                self.failures = hangs.reset_failures(self.run_dir, f)
            except OSError:
                pass

    # --- the training thread's collective failed ---------------------------------------------

    def failed(self, exc: BaseException) -> None:
        """Called with the exception a training thread's collective raised: a dead peer (its
        connection closed and its beats stopped) or the collectives' timeout is diagnosed and the
        process exits here; otherwise this returns and the exception goes on (exit 1)."""
        kind = self.links.classify(exc)
        if kind is None or self.closed:
            return
        if kind == "timeout":
            now = time.monotonic()
            at, beats, _ = self.links.board.view()
            verdict = judge(self._seen(now, at, beats), self.cfg.floor_s, 0.0, self.links.store, kind,
                            quiet_s=4 * self.cfg.beat_s)
            verdict.why += f" ({' '.join(str(exc).split())[:300]})"
            self.call(verdict)
        self.broken = kind
        deadline = time.monotonic() + self.grace_s + 3 * self.cfg.beat_s
        while time.monotonic() < deadline:  # the thread calls it (and never returns) or finds every peer alive
            time.sleep(self.cfg.beat_s / 4)
        self.broken = None

    # --- calling it, and leaving --------------------------------------------------------------

    def call(self, verdict: Verdict) -> None:
        if oom.claimed(self.run_dir, self.token):  # a rank ran out of memory: its record says so, no hang
            self._leave(None, EXIT_OUT_OF_MEMORY, None)
            return
        row = hangs.in_a_row(self.run_dir, *verdict.where())
        code = EXIT_CRASH_LOOP if self.cfg.crash_loop and row >= self.cfg.crash_loop else EXIT_REQUEUE
        if verdict.interrupted == "Ctrl-C":  # the person asked to stop: not a requeue
            code = EXIT_INTERRUPTED
        folder, code, won = hangs.claim(self.run_dir, self.token, code)
        if folder is not None:
            self.links.board.announce(f"{folder.name} {code}")
        self._leave(folder, code, (verdict, row) if won else None)

    def _join(self, announced: str) -> None:
        name, _, code = announced.partition(" ")
        if code.isdigit() and name and "/" not in name and not name.startswith("."):  # another process wrote it
            self._leave(self.run_dir / hangs.HANGS / name, int(code), None)

    def _leave(self, folder: Path | None, code: int, won: tuple[Verdict, int] | None) -> None:
        with self._leave_lock:
            if self.leaving:  # the other thread is ending the process
                time.sleep(self.join_s + 60)
                return
            self.leaving = True
        try:
            if folder is not None:
                self._dump(folder)
            if won is not None:
                self._record(folder, code, *won)
        finally:
            tell_agent(code)
            for fn in self.links.on_leave:
                try:
                    fn()
                except Exception:  # noqa: BLE001 - leaving anyway
                    pass
            sys.stdout.flush()
            sys.stderr.flush()
            self.links.exit(code)

    def _dump(self, folder: Path) -> None:
        """This rank's Python stacks, flight record and view, into the hang's folder."""
        try:
            with open(folder / f"stacks-rank{self.rank}.txt", "w") as f:
                faulthandler.dump_traceback(f, all_threads=True)
            record, waiting = self.links.flight()
            if record:
                (folder / f"flight-rank{self.rank}.json").write_text(record)
            write_json_atomic(folder / f"rank-{self.rank}.json",
                              {**dataclasses.asdict(self._me(time.monotonic())), "collective": waiting})
        except Exception as exc:  # noqa: BLE001 - the record is worth less than leaving
            print(f"dsslm: watchdog: rank {self.rank} could not dump into {folder}: {exc}", file=sys.stderr, flush=True)

    def _record(self, folder: Path, code: int, verdict: Verdict, row: int) -> None:
        everyone = verdict.first + verdict.waiting
        expect = [s.rank for s in everyone if s.silent_s <= self.grace_s]  # the ones that can still dump
        deadline = time.monotonic() + self.join_s
        while time.monotonic() < deadline and not all((folder / f"rank-{r}.json").exists() for r in expect):
            time.sleep(0.05)
        views = {s.rank: hangs.read_json(folder / f"rank-{s.rank}.json", hangs.SEEN_SPEC, "rank view") or {}
                 for s in everyone}
        step, phase = verdict.where()

        def entry(s: Seen) -> dict:
            collective = views[s.rank].get("collective")
            return {**dataclasses.asdict(s), "collective": collective if isinstance(collective, str) else None,
                    "dumped": bool(views[s.rank])}
        proven = {s.rank for s in verdict.proven}
        record = {"schema": 1, "cause": verdict.cause, "why": verdict.why, "step": step, "phase": phase,
                  "first": [{**entry(s), "proven": s.rank in proven} for s in verdict.first],
                  "waiting": [entry(s) for s in verdict.waiting],
                  # the only hosts a node's exclusion counts (health/exclude.py): proven stopped
                  "blamed": [{"rank": s.rank, "host": s.host, "pid": s.pid} for s in verdict.proven],
                  "called_by": {"rank": self.rank, "host": self.host}, "store": self.links.store,
                  "in_a_row": row, "exit_code": code, "time": time.time(),
                  "time_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
                  **({"interrupted": verdict.interrupted} if verdict.interrupted else {})}
        try:
            hangs.write_record(folder, record)
        except OSError:
            pass
        line = describe(record, folder)
        print(f"dsslm: {line}", file=sys.stderr, flush=True)
        note_status(f"hang {code}")
        events = EventLog(self.run_dir, True, self.alert_command)
        events.emit("hang", step=step, phase=phase, cause=verdict.cause, record=str(folder),
                    exit_code=code, in_a_row=row, line=line)
        events.close()  # waits for the alert command (bounded)

    # --- the job's start and end --------------------------------------------------------------

    def start_reaper(self, node: list[tuple[int, int]]) -> None:
        """Watch this node's ranks `(pid, start time)` from a process of their own (health/reaper.py)."""
        claim = self.run_dir / hangs.HANGS / f".called-{self.token}"
        grace = self.join_s + 30.0 + 2 * self.cfg.beat_s  # the caller's wait for dumps, then its alert command
        argv = [sys.executable, reaper.__file__, str(claim), f"{grace:g}", f"{self.cfg.beat_s:g}",
                *(f"{pid}:{start}" for pid, start in node)]
        self.reaper = subprocess.Popen(argv, stdin=subprocess.DEVNULL, close_fds=True)

    def close(self) -> None:
        """The job is over (its saves finished): stop judging, say so to the others, stop the reaper."""
        self.closed = True
        self._stop.set()
        self._thread.join(timeout=2 * self.cfg.beat_s + 1)
        self.links.board.close({**dataclasses.asdict(self._me(time.monotonic())), "n": -1, "exited": True},
                               wait_s=2 * self.cfg.beat_s)
        if self.reaper is not None:
            self.reaper.kill()
            self.reaper.wait()
