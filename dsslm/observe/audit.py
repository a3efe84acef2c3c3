"""The resume audit: every real resume proves that it was exact.

A job killed at step k had written the records of steps c+1..k (metrics.jsonl) after its last
checkpoint c. The job that resumes from c trains those steps again; each must give the loss and
grad norm that was recorded. The loop hands every step's record to the audit:

    audit = ResumeAudit.after_resume(run_dir, from_step=c, env=run_env(...), ...)   # rank 0, before any record of ours
    audit.compare(record)   # every step; compares while inside c+1..k, then emits one `resume_audit` event

Where the computation is deterministic (CPU, and the same world size, engine, micro-batch split,
torch version and thread count as the job that wrote the records) the two must be equal to the
bit, and any difference is an `alert`: a piece of state was not restored. Elsewhere (CUDA kernels
are not bitwise deterministic; another world size sums in another order) a relative difference
up to `observe.audit_tol` is expected, and more is an alert.

The audit compares what recovery decided as well: the `triage` decisions the interrupted job
made after the checkpoint (read from events.jsonl, back to the checkpoint's `save` or the resume
that started from it) must come again, in order, with the same verdict, scope, spike steps,
window, lr_scale and escalation (`audit.observe(event)`, every event this job emits; one
`resume_audit` event with `scope: "recovery"` once they have all come, or at the first that
differs, with an `alert` where results are bitwise reproducible). Transient verdicts are left
out: a fault that struck once does not strike the recomputation. Each step's `verdict` (ok,
skip_step, rewind) is compared like its loss.

Which records: the unbroken run of step records (steps rising by one) at the end of metrics.jsonl,
if it passes through or starts right after step c; that is the trajectory that left the
checkpoint. Records whose inputs differ from the recomputed step (`lr`, the data position: a
changed schedule, a skip window merged from skip_list.json) are not comparable and are counted,
not compared. Rank 0 only; no control flow depends on the audit.
"""
from __future__ import annotations

import math
from pathlib import Path
from typing import Any, Callable, Iterable

from dsslm.observe.sinks import read_jsonl_backward
from dsslm.optim import older_muon

INPUT_KEYS = ("lr", "lr_scale", "data_batch", "data_position", "batch_sequences")  # what the step was fed
NON_FINITE = {"nan": math.nan, "inf": math.inf, "-inf": -math.inf}


def run_env(device: str, world_size: int, engine: str, micro_batch_size: int, grad_accum: int,
            torch_version: str, torch_threads: int, schedule: dict[str, Any] | None = None) -> dict[str, Any]:
    """What must match for a recomputed step to be bitwise equal (recorded in the `start` event).
    `schedule`: the keys a resume may change that schedule the same math another way (optim.impl,
    train.compile, ...: rounding-level differences, drift.RESUME_MUTABLE_KEYS), by their names."""
    return {"device": device, "world_size": world_size, "engine": engine, "micro_batch_size": micro_batch_size,
            "grad_accum": grad_accum, "torch": torch_version, "torch_threads": torch_threads, **(schedule or {})}


def _number(value: Any) -> float | None:
    if isinstance(value, str):
        return NON_FINITE.get(value.lower())
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    return float(value)


def _diff(a: float, b: float) -> float:
    if a == b or (math.isnan(a) and math.isnan(b)):
        return 0.0  # inf == inf; both NaN is the same outcome
    d = abs(a - b)
    return math.inf if math.isnan(d) else d


def recorded_after(metrics: Path, from_step: int) -> dict[int, dict]:
    """The records of steps after `from_step` of the trajectory that left checkpoint `from_step`
    (see the module docstring); {} when the log has none."""
    run: list[dict] = []
    for record in read_jsonl_backward(metrics):
        step = record.get("step")
        if not isinstance(step, int) or isinstance(step, bool) or "loss" not in record:
            continue  # validation records, or not ours
        if run and step != run[-1]["step"] - 1:
            break  # a resume or a rewind: older records belong to another trajectory
        run.append(record)
        if step <= from_step:
            break
    run.reverse()
    if not run or run[0]["step"] > from_step + 1:
        return {}
    return {r["step"]: r for r in run if r["step"] > from_step}


RECOVERY_KEYS = ("step", "verdict", "scope", "spike_start", "target", "window", "lr_scale", "escalated")


def recorded_decisions(events: Path, from_step: int) -> list[dict]:
    """The interrupted job's non-transient `triage` decisions made after it held checkpoint
    `from_step` (after that step's newest `save`, or the `resume` from it), oldest first; [] when
    the log does not reach back to one."""
    found: list[dict] = []
    for event in read_jsonl_backward(events):
        name = event.get("event")
        if name == "triage" and event.get("verdict") != "transient":
            found.append({k: event.get(k) for k in RECOVERY_KEYS})
        elif name in ("save", "resume") and event.get("step") == from_step:
            return found[::-1]
        elif name == "resume":
            return []  # that job started elsewhere: its decisions did not leave this checkpoint
    return []


def last_start(events: Path) -> dict:
    """The newest `start` event: the job that wrote the newest records ({} where there is none)."""
    return next((e for e in read_jsonl_backward(events) if e.get("event") == "start"), {})


def _flat(tree: Any, prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in (tree.items() if isinstance(tree, dict) else ()):
        if isinstance(value, dict):
            out.update(_flat(value, f"{prefix}{key}."))
        else:
            out[f"{prefix}{key}"] = value
    return out


def config_changes(recorded: Any, now: dict | None, mutable: tuple[str, ...]) -> list[str]:
    """The keys whose values differ between the config the records were made with and `now`,
    leaving out `mutable` keys (and their sub-keys) and keys either side lacks (an older version's
    config has fewer: not a change, but for Muon's updates before issue 41, `optim.muon_split`).
    [] where either is unknown."""
    if not isinstance(recorded, dict) or not now:
        return []
    before, after = _flat(recorded), _flat(now)
    changed = [k for k in after if k in before and before[k] != after[k]
               and not any(k == m or k.startswith(m + ".") for m in mutable)]
    return sorted(changed + (["optim.muon_split"] if older_muon(recorded) else []))


STOPS = ("end", "finished", "escalation", "preempt_save", "failed")  # how a job's events end


def last_stop(newest_first: Iterable[dict], kinds: tuple[str, ...] = STOPS) -> dict | None:
    """The newest job's own stop event of `kinds` (events newest first): None where that job
    started and left none, since an older job's end says nothing of a run extended since."""
    for event in newest_first:
        name = event.get("event")
        if name == "start":
            return None
        if name in kinds:
            return event
    return None


def _why_nothing(events: Path, from_step: int) -> str:
    """Why no recorded step follows the checkpoint: the last job stopped there on purpose (a
    preemption's save, or the end of the run before train.total_steps was raised), or it died
    there or lost its records."""
    stop = last_stop(read_jsonl_backward(events), ("preempt_save", "end"))
    if stop is not None and stop.get("step") == from_step:
        how = (f"stopped by {stop.get('signal') or 'a stop signal'} and saved this checkpoint"
               if stop["event"] == "preempt_save" else "finished at this checkpoint")
        return f"the last job {how}; no step after it was trained"
    return "no records of steps after the checkpoint (it was taken at the crash, or the log lost them)"


class ResumeAudit:
    """Compares recomputed steps with recorded ones and reports once (see the module docstring)."""

    def __init__(self, emit: Callable[..., Any], expected: dict[int, dict] | None = None, from_step: int = 0,
                 exact_why: str = "", tol: float = 0.0, last_step: int = 0):
        self.emit, self.expected, self.from_step = emit, expected or {}, from_step
        self.exact = not exact_why   # "" when bitwise equality is expected; else why not
        self.exact_why, self.tol = exact_why, tol
        self.last_step = min(max(self.expected, default=0), last_step)
        self.compared: list[int] = []
        self.incomparable = 0
        self.changed_inputs: dict[str, int] = {}  # an input key that differed -> the first step it did
        self.unreadable: dict[str, int] = {}      # loss or gnorm missing in a record -> the first step
        self.worst = {"loss": 0.0, "gnorm": 0.0}
        self.first_mismatch: dict | None = None
        self.decisions: list[dict] = []   # recorded triage decisions still to come again
        self.decisions_compared = 0

    @classmethod
    def off(cls) -> "ResumeAudit":
        return cls(lambda *a, **k: None)

    @classmethod
    def after_resume(cls, run_dir: Path, from_step: int, env: dict, tol: float, total_steps: int,
                     emit: Callable[..., Any], config: dict | None = None,
                     mutable: tuple[str, ...] = (), start: dict | None = None) -> "ResumeAudit":
        """Read what the crashed job recorded after `from_step` (call before this job writes).
        `config`: this job's config (as its `start` event records it), compared, but for the
        `mutable` keys (drift.RESUME_MUTABLE_KEYS), with the config of the job that wrote the
        records. Where they differ (this resume or that job's passed --allow-drift), the records
        ran another computation: nothing is compared. An alert there said "the resume did not
        restore everything" of a change a user asked for, and paged someone. `start`: that job's
        `start` event, where the caller has read it already."""
        if start is None:
            start = last_start(run_dir / "events.jsonl")  # read once: the env and the config of one job
        changed = config_changes(start.get("config"), config, mutable)
        if changed:
            emit("resume_audit", step=from_step, from_step=from_step, compared=0, verdict="nothing_to_compare",
                 reason=f"the job that recorded the steps after the checkpoint ran another config ("
                        f"{', '.join(changed[:4])}{' and more' if len(changed) > 4 else ''})")
            return cls(emit, None, from_step)
        expected = recorded_after(run_dir / "metrics.jsonl", from_step)
        recorded_env = start.get("env") if isinstance(start.get("env"), dict) else None
        audit = cls(emit, expected, from_step, _why_not_exact(recorded_env, env),
                    tol, total_steps)
        audit.decisions = recorded_decisions(run_dir / "events.jsonl", from_step)
        if not audit.expected or audit.last_step <= from_step:
            audit.expected = {}
            emit("resume_audit", step=from_step, from_step=from_step, compared=0, verdict="nothing_to_compare",
                 reason=_why_nothing(run_dir / "events.jsonl", from_step))
        return audit

    def compare(self, record: Any) -> None:
        """One recomputed step (a StepRecord, or its dict). Never raises: the audit runs on rank 0
        alone, and an exception here would leave the other ranks in the next step's collectives."""
        if not self.expected:
            return
        try:
            self._compare_step(record)
        except Exception as exc:  # noqa: BLE001 - a record another writer left malformed, or a bug here
            self._give_up(exc)

    def _give_up(self, exc: Exception) -> None:
        """Stop auditing this job, saying why (no alert: it is the records that are in doubt)."""
        self.expected, self.decisions = {}, []
        self.emit("resume_audit", step=self.from_step, from_step=self.from_step, compared=len(self.compared),
                  verdict="nothing_to_compare", reason=f"the records could not be compared ({exc!r})")

    def _compare_step(self, record: Any) -> None:
        got = record.to_json() if hasattr(record, "to_json") else record
        want = self.expected.pop(got["step"], None)
        if want is not None:
            self._compare(got, want)
        if got["step"] >= self.last_step or got.get("verdict") == "rewind" or not self.expected:
            self._report(got["step"])
            self.expected = {}

    def observe(self, event: dict) -> None:
        """Every event this job emits (a `Sinks` listener): a triage decision must be the next one
        the interrupted job recorded. Never raises (see `compare`)."""
        if not self.decisions or event.get("event") != "triage" or event.get("verdict") == "transient":
            return
        try:
            self._observe_decision(event)
        except Exception as exc:  # noqa: BLE001
            self._give_up(exc)

    def _observe_decision(self, event: dict) -> None:
        want = self.decisions.pop(0)
        got = {k: event.get(k) for k in RECOVERY_KEYS}
        self.decisions_compared += 1
        differs = [k for k in RECOVERY_KEYS if got[k] != want[k]]
        if differs or not self.decisions:
            expected = "exact" if self.exact else f"not bitwise ({self.exact_why})"
            self.emit("resume_audit", step=got["step"], from_step=self.from_step, scope="recovery",
                      compared=self.decisions_compared, verdict="mismatch" if differs else "exact",
                      expected=expected, **({"recorded": want, "recomputed": got} if differs else {}))
            if differs and self.exact:
                self.emit("alert", step=got["step"], reason="resume_audit", field=differs[0], recorded=want[differs[0]],
                          recomputed=got[differs[0]],
                          message=f"after resuming from step {self.from_step}, the triage of the spike at step "
                                  f"{got['spike_start']} decided {differs[0]}={got[differs[0]]!r} where the "
                                  f"interrupted job decided {want[differs[0]]!r}: recovery state was not restored")
            if differs:
                self.decisions = []

    def _compare(self, got: dict, want: dict) -> None:
        # A record without a loss or grad norm as the loop writes them (another writer's, or an
        # edit) says nothing about this resume: not compared (before: a KeyError, on every resume).
        unreadable = [key for key in ("loss", "gnorm") if _number(want.get(key)) is None]
        if unreadable:
            self.unreadable.setdefault(unreadable[0], got["step"])
            return
        changed = [key for key in INPUT_KEYS if key in got and key in want and got[key] != want[key]]
        if changed:
            self.incomparable += 1
            self.changed_inputs.setdefault(changed[0], got["step"])
            return
        self.compared.append(got["step"])
        for key in ("loss", "gnorm"):
            a, b = _number(got.get(key)), _number(want.get(key))
            d = _diff(a, b) if a is not None and b is not None else math.inf
            self.worst[key] = max(self.worst[key], d)
            scale = max((abs(x) for x in (a, b) if x is not None and math.isfinite(x)), default=0.0)
            allowed = 0.0 if self.exact else self.tol * scale  # NaN against a number is never within it
            if d > allowed and self.first_mismatch is None:
                self.first_mismatch = {"at_step": got["step"], "field": key, "recorded": b, "recomputed": a}
        if self.exact and got.get("verdict") != want.get("verdict") and self.first_mismatch is None:
            self.first_mismatch = {"at_step": got["step"], "field": "verdict", "recorded": want.get("verdict"),
                                   "recomputed": got.get("verdict")}

    def _report(self, step: int) -> None:
        if not self.compared:
            verdict = "nothing_to_compare"
        elif self.first_mismatch is not None:
            verdict = "mismatch"
        else:
            verdict = "exact" if max(self.worst.values()) == 0 else "within_tolerance"
        expected = "exact" if self.exact else f"relative difference <= {self.tol:g} ({self.exact_why})"
        steps = [self.compared[0], self.compared[-1]] if self.compared else []
        why = {}
        if self.incomparable:  # their inputs changed: the resume runs another config (lr, batch)
            why["reason"] = (f"{self.incomparable} recorded step(s) ran with other inputs ("
                             + ", ".join(f"{k} from step {s}" for k, s in self.changed_inputs.items())
                             + "): a config changed at the resume")
        if self.unreadable:
            why["reason"] = "; ".join([*why.values(), "recorded steps without a number for " + ", ".join(
                f"{k} (from step {s})" for k, s in self.unreadable.items()) + " were not compared"])
        self.emit("resume_audit", step=step, from_step=self.from_step, steps=steps, compared=len(self.compared),
                  incomparable=self.incomparable, max_loss_diff=self.worst["loss"],
                  max_gnorm_diff=self.worst["gnorm"], expected=expected, verdict=verdict, **why)
        if verdict == "mismatch":
            m = self.first_mismatch
            self.emit("alert", step=step, reason="resume_audit", **m,
                      message=f"after resuming from step {self.from_step}, step {m['at_step']} recomputed {m['field']} "
                              f"{m['recomputed']!r} where the interrupted job recorded {m['recorded']!r} (expected "
                              f"{expected}): the resume did not restore everything; compare the two runs' state")


def _why_not_exact(before: dict | None, now: dict) -> str:
    """"" if the recorded steps and ours ran where results are bitwise reproducible; else why not."""
    if before is None:
        return "the job that wrote the records did not record its environment"
    if now.get("device") != "cpu":
        return f"{now.get('device')} kernels are not bitwise deterministic"
    # A key the older job did not record (its version had none) is not taken as a change.
    changed = [f"{k} {before.get(k)!r} -> {now[k]!r}" for k in now
               if before.get(k) != now[k] and (k in before or k in ENV_ALWAYS)]
    return ", ".join(changed)


ENV_ALWAYS = ("device", "world_size", "engine", "micro_batch_size", "grad_accum", "torch", "torch_threads")
