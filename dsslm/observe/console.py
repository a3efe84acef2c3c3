"""What a person reads while a run goes: rank 0's console, through Python's `logging` (logger "dsslm").

On a terminal, a one-line progress bar; anywhere else (a file, a pipe, a Slurm log) one line
every `run.log_every` steps: step, loss, grad norm, LR, tokens/s, ETA. In both, one line for
every event in LINES (a save, the resume and its audit, a skip, a rewind, a triage verdict and
what it changed, an lr_scale change, an alert, a preemption save, an escalation), and a summary
at the end. Every event passes through `Sinks.emit`, so this table is the one place that decides
what a person hears; events.jsonl keeps everything.

The level is the logger's: DSSLM_LOG_LEVEL (debug, info, warning, error; default info), or set
it, and handlers and format, on `logging.getLogger("dsslm")` before the run starts: dsslm adds
its own stderr handler only when that logger has none.
"""
from __future__ import annotations

import collections
import logging
import math
import os
import sys
import time
from pathlib import Path
from typing import Any, Callable

LOG = logging.getLogger("dsslm")
FORMAT = "%(asctime)s dsslm: %(message)s"


class _Stderr(logging.StreamHandler):
    """sys.stderr as it is at each line (a test's capture, a redirect made after the start)."""

    def emit(self, record: logging.LogRecord) -> None:
        self.stream = sys.stderr
        super().emit(record)


ETA_WINDOW = 50  # steps of the ETA's recent wall time per step (StepRate)
ETA_STEP_CHANGE = 1.03  # the most the ETA's time per step moves in one step (StepRate)
LEVELS = {"debug": logging.DEBUG, "info": logging.INFO, "warning": logging.WARNING, "error": logging.ERROR}


def configure() -> None:
    """The "dsslm" logger as the user left it, else: DSSLM_LOG_LEVEL, one stderr handler."""
    given = None
    if LOG.level == logging.NOTSET:
        name = os.environ.get("DSSLM_LOG_LEVEL") or "info"  # exported but empty: unset
        # The documented names only: getattr(logging, NAME) also took "raiseExceptions" (level 1).
        given = None if name.lower() in LEVELS else name
        LOG.setLevel(LEVELS.get(name.lower(), logging.INFO))
    if not LOG.handlers:
        # Unconfigured by the user; a library's logging.config call (disable_existing_loggers)
        # must not silence the run.
        LOG.disabled = False
        handler = _Stderr()
        handler.setFormatter(logging.Formatter(FORMAT, "%Y-%m-%d %H:%M:%S"))
        LOG.addHandler(handler)
        LOG.propagate = False  # our handler prints it; a root handler would print it twice
    if given is not None:  # said, not refused: the run is worth more than its log level
        LOG.warning(f"DSSLM_LOG_LEVEL={given!r} is not one of {', '.join(LEVELS)}; logging at info")


def _g(value: Any) -> str:
    return f"{value:.4g}" if isinstance(value, (int, float)) and not isinstance(value, bool) else str(value)


def _plus_one(value: Any) -> Any:
    return value + 1 if isinstance(value, int) and not isinstance(value, bool) else value


def _duration(seconds: float) -> str:
    if not math.isfinite(seconds):
        return "?"
    seconds = int(seconds)
    hours, rest = divmod(seconds, 3600)
    return f"{hours}h{rest // 60:02d}m" if hours else f"{rest // 60}m{rest % 60:02d}s"


def _resume(f: dict) -> str:
    changes = "; ".join(f.get("changes") or [])
    return (f"resumed from {f.get('checkpoint')} at step {f.get('step')}" + (f"; changed: {changes}" if changes else ""))


def _audit(f: dict) -> str:
    verdict = f.get("verdict")
    if verdict == "nothing_to_compare":
        return f"resume audit: nothing to compare ({f.get('reason', '')})"
    return (f"resume audit: {verdict}: {f.get('compared', 0)} recomputed step(s) compared with the interrupted "
            f"job's records (largest differences: loss {_g(f.get('max_loss_diff'))}, grad norm "
            f"{_g(f.get('max_gnorm_diff'))}; expected {f.get('expected')})"
            + (f"; {f['reason']}" if f.get("reason") else ""))


def _triage(f: dict) -> str:
    verdict, scope = f.get("verdict"), f.get("scope")
    what = {"data": "caused by the data", "state": "caused by the model's state: the learning rate is lowered",
            "transient": "caused by a transient fault: training continues unchanged",
            "unknown": "cause unknown (the replays told neither data nor state)",
            "batch": "caused by this batch, whose text does not stand out: left out of this pass, named nowhere"
            }.get(verdict, f"caused by {verdict}")
    line = f"triage of the spike at step {f.get('spike_start', f.get('step'))}: {what}"
    if scope == "step":  # decided within the spike's step: this is the first line to say there was one
        first = (f.get("evidence") or [{}])[0]
        why = f" ({first['reason']})" if isinstance(first, dict) and first.get("reason") else ""
        line = f"spike at step {f.get('spike_start', f.get('step'))}{why}, re-run in place: {what}"
    if scope == "window":
        line += f" (after replaying {f.get('replay_steps')} step(s) from step {f.get('from_step')})"
    line += _skipped(f)
    if verdict == "state" and f.get("lr_factor") is not None:
        line += f"; lr_scale x{_g(f['lr_factor'])}"
    if f.get("fallback"):
        line += f"; {f['fallback']}"
    if f.get("escalated"):
        line += "; escalated"
    return line


def _skipped(f: dict) -> str:
    """What a decision leaves out from now on: the documents it named (skip_list entries) and the
    positions it skips this pass only (its windows: the widening past the spike steps), else its
    window of positions; an empty window ([a, a], as non-data verdicts write it) is nothing."""
    skip, window = f.get("skip") or [], f.get("window") or []
    if skip:
        spans = [e for e in skip if isinstance(e, dict)]
        positions = [e for e in skip if isinstance(e, (list, tuple)) and len(e) == 2]
        said = [f"the data it read ({len(spans)} span(s) of documents)"] if spans else []
        said += [f"sequences {', '.join(f'[{a}, {b})' for a, b in positions)} of this pass"] if positions else []
        return "; skips " + " and ".join(said) if said else ""
    if len(window) == 2 and isinstance(window[0], int) and isinstance(window[1], int) and window[1] > window[0]:
        return f"; skips sequences {window}"
    return ""


def _rewind(f: dict) -> str:
    if f.get("triage_phase"):  # a replay of the triage, not a decision (the triage line says that)
        line = (f"triage of the spike at step {f.get('step')}: {f.get('triage_phase')} replay from step "
                f"{f.get('to_step')}")
        return line + ("; its data left out" if f.get("skip") or f.get("window") else "")
    return f"spike at step {f.get('step')} ({f.get('reason')}): rewound to step {f.get('to_step')}" + _skipped(f)


def _lr_scale(f: dict) -> str:
    recover = f.get("recover_steps")
    tail = f", recovering over {recover} steps" if recover else " from here on"
    return f"learning rate scale {_g(f.get('old'))} -> {_g(f.get('new'))} at step {f.get('step')}{tail}"


def _evaluation(record: dict) -> str:
    """Each task's accuracy, per-character accuracy (acc_norm) and chance, and the gold's bits per byte."""
    def metric(name: str, task: str) -> str:
        value = (record.get(f"eval_{name}") or {}).get(task)
        return f"{value:.3f}" if isinstance(value, (int, float)) else "?"
    return "; ".join(f"{task} acc {metric('acc', task)}, per-char {metric('acc_norm', task)} (chance "
                     f"{metric('chance', task)}), bpb {metric('bpb', task)}" for task in sorted(record["eval_acc"]))


def _holder(previous: object) -> str:
    """run.dir/LOCK's holder as a person names it: the process, where, since when."""
    if not isinstance(previous, dict) or "pid" not in previous:
        return "an unreadable lock"
    job = f", Slurm job {previous['slurm_job_id']}" if previous.get("slurm_job_id") else ""
    return (f"process {previous.get('pid')} on {previous.get('host', '?')}{job} (started "
            f"{previous.get('started', '?')})")


def memory_line(per_rank: dict[str, int]) -> str:
    """One rank's memory event in words: MiB of parameters, gradients, optimizer state, rewind points."""
    names = {"param_bytes": "parameters", "grad_bytes": "gradients", "optim_bytes": "optimizer state",
             "rewind_point_bytes": "per rewind point", "rewind_bytes": "rewind points in all"}
    return ", ".join(f"{v / 2**20:.1f} MiB {names.get(k, k)}" for k, v in per_rank.items() if isinstance(v, (int, float)))


def _alert(f: dict) -> str:
    text = f.get("message") or ", ".join(f"{k}={_g(v)}" for k, v in f.items() if k not in ("step", "time"))
    return f"alert at step {f.get('step')}: {f.get('reason')}: {text}"


def _surge(f: dict) -> str:
    held = f.get("held_out_gnorm")
    shared = f"a held-out batch's {_g(held)} too" if held is not None else "no held-out batch to compare"
    return (f"step {f.get('step')}: grad norm {_g(f.get('gnorm'))} with a normal loss ({f.get('reason')}; "
            f"{shared}): applied, clipped; a surge, not a spike")


# event -> (level, line); a None line is not printed. Events not named here go to DEBUG.
LINES: dict[str, tuple[int, Callable[[dict], str | None]]] = {
    "save": (logging.INFO, lambda f: f"saved {f.get('checkpoint')} (step {f.get('step')}, "
                                     f"{f.get('bytes', 0) / 1e6:.1f} MB in {_g(f.get('seconds'))} s)"),
    "resume": (logging.INFO, _resume),
    "branch": (logging.INFO, lambda f: f"branched from {f.get('parent')} at step {f.get('step')}; {f.get('data')}"),
    "import": (logging.INFO, lambda f: f"started from imported weights {f.get('source')}"),
    "resume_audit": (logging.INFO, _audit),
    "skip": (logging.WARNING, lambda f: f"step {f.get('step')}: update skipped ({f.get('reason')}); loss "
                                        f"{_g(f.get('loss'))}, grad norm {_g(f.get('gnorm'))}"),
    "gnorm_surge": (logging.INFO, _surge),
    "rewind": (logging.WARNING, _rewind),
    "triage": (logging.WARNING, _triage),
    "lr_scale": (logging.WARNING, _lr_scale),
    "alert": (logging.WARNING, _alert),
    "escalation": (logging.ERROR, lambda f: f"escalated to a human at step {f.get('step')}: {f.get('reason')}"),
    "passed_over": (logging.WARNING, lambda f: f"checkpoint {f.get('checkpoint')} passed over: {f.get('reason')}"),
    "restart_from_scratch": (logging.WARNING, lambda f: f"starting over at step 0 (run.restart_from_scratch): this "
                                                        f"run.dir was trained to step {f.get('recorded_step')}; "
                                                        + (f"kept, not resumed: {', '.join(f['not_resumable'])}"
                                                           if f.get("not_resumable") else
                                                           "checkpoints/ held no checkpoint")),
    "lock_takeover": (logging.WARNING, lambda f: f"took run.dir over from a dead holder, {_holder(f.get('previous'))}: "
                                                 f"{f.get('reason')}"),
    "leftovers_removed": (logging.INFO, lambda f: f"removed half-written saves {f.get('folders')}"),
    "recovery_rebuilt": (logging.WARNING, lambda f: f"rebuilt the run's skip list: {f.get('reason')}"),
    "forensics_failed": (logging.WARNING, lambda f: f"spike forensics at step {f.get('step')} not written: "
                                                    f"{f.get('reason')}"),
    "triage_phase_not_run": (logging.WARNING, lambda f: f"triage of the spike at step {f.get('spike_start')}: the "
                                                        f"{f.get('phase')} replay is not run ({f.get('reason')})"),
    "skip_share": (logging.INFO, lambda f: f"step {f.get('step')}: the skip list names " + ", ".join(
        f"{v:.2%} of {d}" for d, v in sorted((f.get('shares') or {}).items())) +
        f" (a person is asked past {f.get('max_skip_share', 1):.0%} of a domain: monitor.max_skip_share)"),
    "domain_emptied": (logging.WARNING, lambda f: f"step {f.get('step')}: {f.get('reason')}"),
    # epoch counts from 0: epoch 1 is the second pass, the first that repeats the domain's data.
    "domain_epoch": (logging.INFO, lambda f: f"domain {f.get('domain')} repeats its data: its pass "
                                             f"{_plus_one(f.get('epoch'))} (epoch {f.get('epoch')}) starts at step "
                                             f"{f.get('step')}"),
    "finished": (logging.INFO, lambda f: f"this run is finished: step {f.get('step')} of train.total_steps="
                                         f"{f.get('total_steps')}; nothing to train (raise train.total_steps to "
                                         f"extend it, or use a new run.dir)"),
    "preempted": (logging.WARNING, lambda f: None if f.get("exit_line") else
                  f"{f.get('signal')} before the first step: {f.get('reason')}"),
    "interrupted": (logging.WARNING, lambda f: f"interrupted at step {f.get('step')}"),
    "failed": (logging.ERROR, lambda f: None if f.get("exit_line") else f"failed at step {f.get('step')}: "
                                                                         f"{f.get('error')}"),
    "straggler": (logging.WARNING, lambda f: f"step {f.get('step')}: {f.get('line')} (run.dir/nodes.json)"),
}


class StepRate:
    """The wall time per step an ETA is planned with: that of the last ETA_WINDOW steps (wall time,
    not a step's own: that leaves out validation, evaluations and saves, and with frequent validation
    the ETA said 0m00s for a run with most of its time to go), never below those steps' own mean
    time, and moving at most ETA_STEP_CHANGE a step from the last estimate. A recent window, not the
    job's average: a machine that got 14x slower or faster mid-run kept the whole run's average
    ("20m59s" with 55 s left); bounded moves, so a shared machine's varying load does not swing the
    ETA 10-60x between lines (a 14x change of pace is followed within ~90 steps)."""

    def __init__(self) -> None:
        self.window: collections.deque[tuple[int, float, float]] = collections.deque(maxlen=ETA_WINDOW + 1)
        self.per_step: float | None = None

    def update(self, step: int, now: float, step_time_s: float) -> float | None:
        """Seconds per step after this step's record, or None while nothing is measured. The
        job's first step (compilation, the first allocations, the prefetch's cold start: a minute
        under compile for a second's step, once per requeue) only starts the clock; so does the
        first step after a rewind (the step went back: no progress to measure)."""
        if self.window and step <= self.window[-1][0]:
            self.window.clear()
        self.window.append((step, now, step_time_s))
        if len(self.window) < 2:
            return self.per_step
        (first, t0, _), (last, t1, _) = self.window[0], self.window[-1]
        own = [s for _, _, s in list(self.window)[1:]]
        target = max((t1 - t0) / (last - first), sum(own) / len(own))
        if self.per_step is not None:
            moved = ETA_STEP_CHANGE ** max(1, last - self.window[-2][0])
            target = min(max(target, self.per_step / moved), self.per_step * moved)
        self.per_step = target
        return self.per_step


class Console:
    """Rank 0's lines for a person (all methods are no-ops elsewhere)."""

    def __init__(self, run_dir: Path, enabled: bool, total_steps: int, log_every: int = 1,
                 tty: bool | None = None):
        self.run_dir, self.enabled, self.total_steps = run_dir, enabled, total_steps
        self.log_every = max(1, log_every)
        self.tty = enabled and (sys.stderr.isatty() if tty is None else tty)
        self.bar_shown = False
        self.started = time.time()
        self.eta = StepRate()
        self.first_step: int | None = None
        self.last: dict = {}
        self.val: dict[str, float] = {}
        self.best_val: dict[str, float] = {}
        self.spikes: list[str] = []
        self.surges = 0  # grad-norm surges applied (not spikes: the summary counts them apart)
        self.stragglers: dict = {}  # rank -> its latest `straggler` event (the summary names them)
        self.saved: str | None = None
        self.evaluation: dict | None = None  # the last eval.tasks record, for the summary
        if enabled:
            configure()

    # --- steps --------------------------------------------------------------------------------
    def step(self, record: dict, now: float | None = None) -> None:
        """`now`: the step's time.monotonic() reading, when the caller took one."""
        if not self.enabled:
            return
        step = record["step"]
        if self.first_step is None:
            self.first_step = step
        per_step = self.eta.update(step, time.monotonic() if now is None else now, record.get("step_time_s", 0.0))
        self.last = record
        eta = max(0, self.total_steps - step) * (per_step if per_step is not None else math.inf)
        if self.tty:
            sys.stderr.write(f"\rstep {step}/{self.total_steps}  loss {record['loss']:.4f}  "
                             f"{record.get('tokens_per_s', 0):,.0f} tok/s  eta {_duration(eta)}   ")
            sys.stderr.flush()
            self.bar_shown = True
        elif step % self.log_every == 0 or step == self.total_steps or step == self.first_step:
            LOG.info(f"step {step}/{self.total_steps}  loss {record['loss']:.4f}  gnorm {record.get('gnorm', 0):.3g}  "
                     f"lr {record.get('lr', 0):.3g}  {record.get('tokens_per_s', 0):,.0f} tok/s  eta {_duration(eta)}")

    def val_loss(self, record: dict) -> None:
        """A validation record's line, or a downstream evaluation's (eval.tasks: `eval_acc`...)."""
        if self.enabled and isinstance(record.get("eval_acc"), dict):
            self.evaluation = record
            self.line(logging.INFO, f"step {record['step']}: evaluation: {_evaluation(record)}")
        if not self.enabled or not record.get("val_loss"):
            return
        self.val = dict(record["val_loss"])
        for domain, loss in self.val.items():
            self.best_val[domain] = min(loss, self.best_val.get(domain, math.inf))
        self.line(logging.INFO, f"step {record['step']}: validation loss "
                   + ", ".join(f"{d} {v:.4f}" for d, v in sorted(self.val.items())))

    # --- events -------------------------------------------------------------------------------
    def event(self, event: str, fields: dict) -> None:
        if not self.enabled:
            return
        if event == "save":
            self.saved = str(self.run_dir / "checkpoints" / str(fields.get("checkpoint")))
        elif event == "skip":
            self.spikes.append(f"step {fields.get('step')}: skipped")
        elif event == "triage":
            self.spikes.append(f"step {fields.get('spike_start', fields.get('step'))}: {fields.get('verdict')}")
        elif event == "rewind" and not fields.get("triage_phase"):
            self.spikes.append(f"step {fields.get('step')}: rewound")
        elif event == "gnorm_surge":
            self.surges += 1
        elif event == "straggler":  # the latest report of each rank, for the run's summary
            self.stragglers[fields.get("rank")] = fields
        if event == "preempt_save":
            self._preempt_save(fields)
        elif event == "end":
            self._summary(fields)
        elif event in LINES:
            level, line = LINES[event]
            text = line(fields)
            if text:
                self.line(level, text)
        else:
            self.line(logging.DEBUG, f"{event}: {fields}")

    def _preempt_save(self, f: dict) -> None:
        where = self.run_dir / "checkpoints" / f"step-{int(f.get('step', 0)):08d}"
        self.line(logging.WARNING, f"stopped by {f.get('signal', 'a stop signal')} after step {f.get('step')}: "
                   f"saved {where}; run the same command again to resume from step {f.get('step')}")

    def _summary(self, f: dict) -> None:
        seconds = time.time() - self.started
        val = ", ".join(f"{d} {v:.4f} (best {self.best_val[d]:.4f})" for d, v in sorted(self.val.items()))
        # A resumed job's clock and spike events are its own, while the step and tokens are the
        # run's: say which is which rather than divide one by the other.
        resumed = self.first_step is not None and self.first_step > 1
        job = " in this job" if resumed else ""
        spikes = (f"{len(self.spikes)} spike event(s){job}: " + "; ".join(self.spikes[-10:]) if self.spikes
                  else f"no spikes{job}") + (f", {self.surges} grad-norm surge(s) applied" if self.surges else "")
        loss = f", final loss {self.last['loss']:.4f}" if self.last else ""
        slow = "; ".join(f"rank {r} ({v.get('host')}) in {v.get('phase')}, {v.get('factor')}x, reported {v.get('reports')} "
                         f"time(s) in a row" for r, v in sorted(self.stragglers.items(), key=lambda kv: str(kv[0])))
        spikes += f"; stragglers{job}: {slow} (run.dir/nodes.json)" if slow else ""
        evals = (f"last evaluation (step {self.evaluation['step']}): {_evaluation(self.evaluation)}; "
                 if self.evaluation else "")
        took = (f"in all; this job trained steps {self.first_step}-{f.get('step')} in {_duration(seconds)}" if resumed
                else f"in {_duration(seconds)}")
        self.line(logging.INFO, f"finished: step {f.get('step')} of {self.total_steps}, {f.get('tokens', 0):,} tokens "
                   f"{took}{loss}; validation loss: {val or 'not measured'}; {evals}{spikes}; "
                   f"checkpoints in {self.run_dir / 'checkpoints'}" + (f" (newest {self.saved})" if self.saved else ""))

    def line(self, level: int, text: str) -> None:
        if self.bar_shown:  # the bar's line ends before the event's line starts
            sys.stderr.write("\n")
            self.bar_shown = False
        LOG.log(level, text)

    def close(self) -> None:
        if self.bar_shown:
            sys.stderr.write("\n")
            self.bar_shown = False


# A CPU core's sustained training throughput, roughly (fp32 matmuls of a small transformer, forward
# and backward): enough to tell a minute per step from a second, not to plan a run by.
CPU_FLOPS_PER_THREAD = 5e10
SLOW_CPU_STEP_S = 30.0


def warn_at_start(cfg: Any, device_type: str, n_params: int, tokens_per_step: int, threads: int,
                  corpus_sequences: int = 0) -> list[str]:
    """Warnings a person should read before a run starts (rank 0; logged and returned): a config
    sized for a GPU started on the CPU, a run too short for its validation or checkpoint interval,
    and a step larger than the corpus (`corpus_sequences`: every step repeats all of it)."""
    lines = []
    step_sequences = tokens_per_step // max(1, cfg.model.seq_len)
    if 0 < corpus_sequences < step_sequences:
        lines.append(f"one step trains {step_sequences:,} sequences, {step_sequences / corpus_sequences:.1f}x the "
                     f"corpus's {corpus_sequences:,} (of model.seq_len={cfg.model.seq_len} tokens): every step "
                     f"repeats all of it; prepare more text, or lower train.micro_batch_size or model.seq_len")
    if device_type == "cpu":
        seconds = 6 * n_params * tokens_per_step / (CPU_FLOPS_PER_THREAD * max(1, threads))
        if seconds > SLOW_CPU_STEP_S:
            total = seconds * max(0, cfg.train.total_steps)
            lines.append(f"this config ({n_params / 1e6:.0f}M parameters, {tokens_per_step:,} tokens/step) runs on "
                         f"the CPU: about {_duration(seconds)} per step, {_duration(total)} for "
                         f"train.total_steps={cfg.train.total_steps}; use a GPU, or a smaller config such as "
                         f"configs/tiny.yaml")
    total_steps = cfg.train.total_steps
    if cfg.ckpt.every > total_steps:
        lines.append(f"ckpt.every={cfg.ckpt.every} is more than train.total_steps={total_steps}: no trained step is "
                     f"saved before the end, so a crash loses them all; set e.g. ckpt.every={max(1, total_steps // 4)}")
    if cfg.run.val_every > total_steps:
        lines.append(f"run.val_every={cfg.run.val_every} is more than train.total_steps={total_steps}: validation "
                     f"runs only at the last step; set e.g. run.val_every={max(1, total_steps // 4)}")
    if cfg.model.mup_base_width and cfg.model.tie_embeddings and cfg.model.d_model > cfg.model.mup_base_width:
        # The shared table's AdamW step follows the sum of both gradients; the head's carries muP's
        # 1/m, so the wider the model, the less the head's side moves it (docs/mup.md#tied-embeddings).
        lines.append(f"model.mup_base_width={cfg.model.mup_base_width} with tied embeddings: the head's share of the "
                     f"shared table's update shrinks with width, so the best rate transfers but wider models "
                     f"learn no better (measured, docs/mup.md#tied-embeddings); set model.tie_embeddings=false")
    for line in lines:
        LOG.warning(line)
    return lines
