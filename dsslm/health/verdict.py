"""The watchdog's verdict: every rank's view (`Seen`), the judgement on the job (`judge`), and the
console line a called hang says (`describe`). Pure: no thread, no store, no file."""
from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from pathlib import Path

from dsslm.exits import EXIT_CRASH_LOOP
from dsslm.health.progress import LOAD, ORDER


@dataclass
class Seen:
    """One rank as a watchdog sees it."""
    rank: int
    host: str
    pid: int
    step: int
    phase: str
    age_s: float           # since its last report, now
    limit_s: float         # its phase's limit, as its own watchdog computed it
    silent_s: float = 0.0  # how long its beats had not changed, at the last exchange
    exited: bool = False
    idle_s: float = -1.0   # since its phase's work last advanced (Work); -1: the phase has no measure

    def working(self, floor_s: float) -> bool:
        """Its work advanced within its limit (floor_s at least): slow, not stopped. A writer's
        fsync or a load's last file may move no byte for a while; a rank stuck in I/O stops here."""
        return 0.0 <= self.idle_s <= max(floor_s, self.limit_s)

    def ahead_of(self, other: "Seen") -> bool:
        return other.phase in ORDER and self.phase in ORDER and \
            (self.step, ORDER[self.phase]) > (other.step, ORDER[other.phase])


@dataclass
class Verdict:
    cause: str             # stopped_beating | peer_lost | store_silent | stuck | collective_timeout
    first: list[Seen]      # who stopped first (the earliest last report first)
    waiting: list[Seen]    # the others, live, waiting
    why: str
    # The ranks proven to have stopped (their beats stopped, or stuck where the others have gone
    # past): the only ones a node's exclusion may count. A lockstep `stuck` (every rank in one
    # phase), `store_silent` or `collective_timeout` proves nobody: `first` is then merely
    # whichever rank reported a few microseconds earlier.
    proven: list[Seen] = dataclasses.field(default_factory=list)
    # A stop signal (SIGINT, SIGTERM) the loop was waiting to answer at the end of a step that a
    # silent peer would never let end: the hang is called at once, and the record says so.
    interrupted: str = ""

    def where(self) -> tuple[int, str]:
        """Where the job stopped: the furthest (step, phase) a rank reached. A stopped rank's own
        last beat may predate its last report by up to a beat; the ranks waiting for it stop at the
        first collective that needs it, the same place every time (the crash loop's key)."""
        ranks = [s for s in self.first + self.waiting if s.phase in ORDER]
        if not ranks:
            return -1, LOAD
        far = max(ranks, key=lambda s: (s.step, ORDER[s.phase]))
        return far.step, far.phase


def judge(seen: list[Seen], floor_s: float, store_silent_s: float, store: str, broken: str | None = None,
          grace_s: float = 0.0, quiet_s: float = math.inf) -> Verdict | None:
    """The verdict on a job from every rank's view, or None. `broken`: the training thread's
    collective failed (`timeout`, or `peer`: a peer's connection closed), so a peer or the store
    silent for `grace_s` is gone, not floor_s. Nobody is called stuck while another rank has
    not beaten for `quiet_s`: the one that went quiet may be the one the others wait for, its last
    report later than its last beat, and floor_s of silence names it."""
    # The quiet ranks first, then by their last report, earliest first.
    live = sorted((s for s in seen if not s.exited), key=lambda s: (s.silent_s <= quiet_s, -s.age_s))
    if not live:
        return None
    if broken == "timeout":
        return Verdict("collective_timeout", live[:1], live[1:], "a collective ran past its timeout")
    limit = grace_s if broken == "peer" else floor_s
    gone = [s for s in live if s.silent_s > limit]
    if gone:
        return Verdict("peer_lost" if broken else "stopped_beating", gone, [s for s in live if s not in gone],
                       f"no beat for {gone[0].silent_s:.0f} s", proven=gone)
    if store_silent_s > limit:
        return Verdict("store_silent", live[:1], live[1:],
                       f"the job's store at {store} has not answered for {store_silent_s:.0f} s")
    top = live[0]
    if broken is None and top.age_s > top.limit_s and not any(s.silent_s > quiet_s for s in live):
        # A rank whose work still advances is slow, not stopped, and the others wait for it.
        if any(s.working(floor_s) for s in live):
            return None
        others = live[1:]
        # Proven only where the others have gone past it; in lockstep it is merely the first to report.
        proven = [top] if others and all(s.ahead_of(top) for s in others) else []
        return Verdict("stuck", [top], others, f"in {top.phase} for {top.age_s:.0f} s, past its limit "
                                               f"of {top.limit_s:.0f} s", proven=proven)
    return None


def describe(record: dict, folder: Path) -> str:
    """The console line: where it stopped, who, who waited in what, the record, the exit."""
    who = ", ".join(_named(s, record["step"]) for s in record["first"]) or "no rank"
    if record["first"] and not record.get("blamed"):  # nothing proves this rank stopped: no node is blamed
        who += " first to report, not proven stopped (no node blamed)"
    waits = "; ".join(f"rank {s['rank']} waited in {s['collective'] or s['phase']}" for s in record["waiting"][:4])
    more = f" and {len(record['waiting']) - 4} more" if len(record["waiting"]) > 4 else ""
    if record.get("interrupted"):
        end = f"{record['interrupted']} while the others waited: diagnosed at once, exit {record['exit_code']}"
    elif record["exit_code"] == EXIT_CRASH_LOOP:
        end = (f"hang {record['in_a_row']} in a row at step {record['step']} in {record['phase']}: a crash loop, not "
               f"requeued (exit {EXIT_CRASH_LOOP}); fix the cause, then start the run again")
    else:
        end = f"exit {record['exit_code']} (requeue)"
    return (f"hang at step {record['step']} in {record['phase']} ({record['cause']}: {record['why']}): {who}"
            f"{'; ' + waits + more if waits else ''}; record in {folder}; {end}")


def _named(s: dict, step: int) -> str:
    """A rank the hang names. A stopped rank's last beat may be older than the step the job stopped
    at (hang.json keeps both: the job's step, and each rank's last beat): said, so the two agree."""
    own = s.get("step")
    beat = f", its last beat at step {own}" if isinstance(own, int) and 0 <= own != step else ""
    return f"rank {s['rank']} ({s['host']}, pid {s['pid']}{beat})"
