"""Plots and a markdown summary of one run, or several side by side:
`python -m dsslm.report RUN_DIR [RUN_DIR ...] [--out DIR]`.

One run: reads RUN_DIR/metrics.jsonl and RUN_DIR/events.jsonl (formats in docs/design.md) and
writes overview.png (loss, lr, grad norm and throughput at a glance), loss.png (alerts and hangs
marked), lr.png, gnorm.png, throughput.png, update_ratio.png (only when records carry
`update_ratio`), evals.png (only with eval.tasks), phases.png (each rank's time a step in each
phase, from the straggler report), goodput.png (where the wall time went, `observe.goodput`; the
figures are drawn by `observe.plots`) and summary.md (with the nodes' check, the stragglers named
and the hangs under RUN_DIR/hangs/) into RUN_DIR/report/ or --out. When RUN_DIR/spikes/ holds spike
forensics, summary.md (and stdout) list every spike with its triage verdict and the few worst
sequences of its batch, decoded (`dsslm.recovery.forensics`).

Two runs or more: compare.md (a table of each run's numbers) with the runs' loss, validation loss,
throughput and learning rate overlaid, one figure each, and each run's overview, into the first
run's report/compare/ or --out (`observe.compare`). Each run's own report is left as it was.
"""
from __future__ import annotations

import contextlib
import datetime as dt
import math
import os
import shutil
import sys
import tempfile
from pathlib import Path

import numpy as np

from dsslm.ckpt.format import inside_checkpoints
from dsslm.ckpt.trained import OneLineParser
from dsslm.durable import file_mode
from dsslm.observe.audit import last_stop
from dsslm.health.hangs import HANG_SPEC, HANGS, read_json
from dsslm.health.nodes import read_nodes
from dsslm.observe.compare import compare_lines, figures_for, plot_overview, run_labels, write_compare_figures
from dsslm.observe.goodput import LABELS, read_ledger
from dsslm.observe.plots import Run, column, is_number, load_run, plot_goodput, write_figures
from dsslm.recovery.forensics import spike_lines

ROUTINE_EVENTS = {"start", "save", "end", "retention_delete"}


def fmt_duration(seconds: float) -> str:
    if not math.isfinite(seconds):  # a damaged line's time (NaN, Infinity) spans no duration
        return "?"
    seconds = int(round(seconds))
    return f"{seconds // 3600}:{seconds % 3600 // 60:02d}:{seconds % 60:02d}"


def fmt_count(n) -> str:
    """1048576000 -> '1,048,576,000 (1.05B)': exact for the record, short for the eye."""
    if not is_number(n):
        return "?"
    for unit, scale in (("T", 1e12), ("B", 1e9), ("M", 1e6), ("k", 1e3)):
        if abs(n) >= scale:
            return f"{n:,.0f} ({n / scale:.3g}{unit})"
    return f"{n:,.0f}"


MAX_NESTING = 6  # our events nest a level or two; a damaged line may nest ~1000 (RecursionError)


def fmt_value(v, depth: int = 0) -> str:
    if isinstance(v, float):
        return f"{v:.4g}"
    if isinstance(v, (dict, list)) and depth >= MAX_NESTING:
        return "{...}" if isinstance(v, dict) else "[...]"
    if isinstance(v, dict):
        return "{" + ", ".join(f"{k}: {fmt_field(k, x, depth + 1)}" for k, x in v.items()) + "}"
    if isinstance(v, list) and any(isinstance(x, (dict, list)) for x in v):  # str() would recurse unbounded
        return "[" + ", ".join(fmt_value(x, depth + 1) for x in v) + "]"
    return str(v).replace("|", "\\|").replace("\n", " ")


TIME_KEYS = {"time", "since", "until", "begin", "heartbeat", "beat"}


def iso(t: float) -> str:
    return dt.datetime.fromtimestamp(t, dt.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


def fmt_field(key, v, depth: int = 0) -> str:
    """A field's value; a time as a date a person reads beside the epoch seconds the record holds
    (`1.764e+09` said nothing, and rounded away the minutes)."""
    t = epoch_time(v) if isinstance(key, str) and (key in TIME_KEYS or key.endswith(("_time", "_at"))) else None
    if t is not None and t >= 1e8:  # from 1973 on: a date, where a small number is a duration
        return f"{v:.3f} ({iso(t)})" if isinstance(v, float) else f"{v} ({iso(t)})"
    return fmt_value(v, depth)


def count(run: Run, event: str, from_records: int = 0) -> int:
    """Events of a kind; the records' own evidence wins when events.jsonl lost some (killed run)."""
    return max(from_records, sum(e.get("event") == event for e in run.events))


def epoch_time(v) -> float | None:
    """An event's time when it can be a date: a damaged line's NaN, Infinity, negative or past-year-5000
    time would turn every duration measured from it into nonsense or an exception."""
    return v if is_number(v) and 0 <= v < 1e11 else None


# What a job records before its `start` (or `finished`: a start on a finished run): its claim of
# run.dir and the checkpoint it read. A job's time runs from the first of these.
OPENING = ("lock_takeover", "leftovers_removed", "passed_over", "resume", "branch", "import", "recovery_upgraded",
           "recovery_rebuilt", "data_verified")


def job_spans(events: list[dict]) -> list[tuple[float, float]]:
    """(first, last) event time of each job: the hours between a job and its requeue are no one's."""
    timed = [(e.get("event"), t) for e in events if (t := epoch_time(e.get("time"))) is not None]
    begins = {0}
    for i, (name, _) in enumerate(timed):
        if name in ("start", "finished"):
            while i > 0 and timed[i - 1][0] in OPENING:
                i -= 1
            begins.add(i)
    cuts = sorted(begins) + [len(timed)]
    return [(min(t for _, t in timed[a:b]), max(t for _, t in timed[a:b])) for a, b in zip(cuts, cuts[1:]) if b > a]


def wall_time(run: Run) -> str:
    spans = job_spans(run.events)
    if sum(epoch_time(e.get("time")) is not None for e in run.events) >= 2:
        total = fmt_duration(sum(last - first for first, last in spans))
        return (f"{total} (first to last event)" if len(spans) == 1 else
                f"{total} in {len(spans)} jobs (each one's first to last event; the time between jobs left out)")
    # Without events the steps' own durations are all there is; they miss start-up and saves.
    step_times = column(run.train, "step_time_s")
    if not np.isfinite(step_times).any():
        return "?"
    return f"{fmt_duration(np.nansum(step_times))} (sum of step_time_s)"


def status_of(events: list[dict]) -> str:
    """How the newest job ended: its own last word since its `start` (an older job's end or
    escalation says nothing of a run extended or fixed since)."""
    e = last_stop(reversed(events)) or {}
    name = e.get("event")
    if name in ("end", "finished"):
        return "finished"
    if name == "escalation":
        return "escalated to a human"
    if name == "preempt_save":
        return f"stopped by {e.get('signal', 'a signal')} at step {e.get('step')}; the next job resumes there"
    if name == "failed":
        return f"failed at step {e.get('step')}: {e.get('error')}"
    return "no end event (still running, or killed)"


def summary_lines(run: Run) -> list[str]:
    kept_train = [r for r, k in zip(run.train, run.train_kept) if k]
    start = next((e for e in run.events if e.get("event") == "start"), {})
    status = status_of(run.events)
    final_loss = [r["loss"] for r in kept_train[-10:] if is_number(r.get("loss"))]
    lines = [f"# Run report: {run.name}", "",
             f"- status: {status}",
             f"- engine: {start.get('engine', '?')}, world size {start.get('world_size', '?')}, "
             f"{fmt_count(start.get('n_params'))} parameters, config hash `{start.get('config_hash', '?')}`"
             if start else "- engine: ? (no start event)",
             f"- steps: {kept_train[-1]['step']} ({len(run.train)} executed, "
             f"{len(run.train) - len(kept_train)} abandoned by rewinds/resumes)",
             f"- tokens: {fmt_count(kept_train[-1].get('tokens'))}",
             f"- wall time: {wall_time(run)}",
             f"- first loss: {fmt_value(kept_train[0]['loss'])} (step {kept_train[0]['step']})",
             f"- final loss: {fmt_value(kept_train[-1]['loss'])} (step {kept_train[-1]['step']}); "
             f"mean of last {len(final_loss)}: {fmt_value(float(np.mean(final_loss))) if final_loss else '?'}"]
    tps = column(kept_train, "tokens_per_s")
    mfu, mem = column(kept_train, "mfu"), column(run.train, "peak_mem_bytes")
    if np.isfinite(tps).any():
        lines.append(f"- throughput: median {np.nanmedian(tps):,.0f} tokens/s")
    if np.isfinite(mfu).any():
        lines.append(f"- MFU: median {np.nanmedian(mfu):.3g}")
    if np.isfinite(mem).any():
        lines.append(f"- peak memory: {np.nanmax(mem) / 2**30:.2f} GiB")
    lines += final_val_lines(run) + final_eval_lines(run)
    lines += counts_table(run) + hang_lines(run) + event_table(run)
    if run.bad_lines:
        lines += ["", "Unreadable lines skipped (a write cut short by a kill): "
                  + ", ".join(f"{k}: {v}" for k, v in run.bad_lines.items())]
    return lines + [""]


def counts_table(run: Run) -> list[str]:
    loss, scale = column(run.train, "loss"), column(run.train, "lr_scale")
    scale_changes = int(np.count_nonzero(np.diff(scale[np.isfinite(scale)])))
    # Skips of the steps the weights came from (a step skipped again after a resume is one skip);
    # rewinds the monitor decided, not the replays of a triage (its phases).
    skips = sum(r.get("verdict") == "skip_step" for r, kept in zip(run.train, run.train_kept) if kept)
    rewinds = max(sum(e.get("event") == "rewind" and not e.get("triage_phase") for e in run.events),
                  sum(r.get("verdict") == "rewind" and not str(r.get("reason", "")).startswith("triage:")
                      for r in run.train))
    counts = {"skips": skips, "rewinds": rewinds, "resumes": count(run, "resume"),
              "lr_scale changes": count(run, "lr_scale", scale_changes), "alerts": count(run, "alert"),
              "escalations": count(run, "escalation"), "passed over": count(run, "passed_over"),
              "saves": count(run, "save"), "non-finite losses": int(np.count_nonzero(~np.isfinite(loss))),
              "hangs": count(run, "hang", len(run.hangs)), "stragglers": count(run, "straggler", len(stragglers(run)))}
    return ["", "## Counts", "", "| " + " | ".join(counts) + " |", "|---" * len(counts) + "|",
            "| " + " | ".join(map(str, counts.values())) + " |"]


def stragglers(run: Run) -> set[tuple]:
    """The ranks the straggler report named, each once however often."""
    return {(v.get("rank"), v.get("host")) for record in run.phases for v in record.get("stragglers") or []
            if isinstance(v, dict)}


def read_hangs(run_dir: Path) -> list[dict]:
    """Each hang under run.dir/hangs/, oldest first: its hang.json with `folder` added, or only
    `folder` where the job ended before writing one (killed, or stopped during the wait)."""
    try:
        names = sorted(p.name for p in (run_dir / HANGS).iterdir() if p.is_dir() and not p.name.startswith("."))
    except OSError:
        return []
    return [(read_json(run_dir / HANGS / name / "hang.json", HANG_SPEC, "hang record") or {}) | {"folder": name}
            for name in names]


def first_ranks(record: dict) -> str:
    first = [v for v in record.get("first") or [] if isinstance(v, dict)]
    return ", ".join(f"rank {v.get('rank')} ({v.get('host')}, pid {v.get('pid')})" for v in first) or "?"


def hang_lines(run: Run) -> list[str]:
    """The hangs section: each hang's time, step, phase, cause, exit code and the rank(s) that
    stopped first, from its record (or its event, where run.dir/hangs/ holds none)."""
    events = [e for e in run.events if e.get("event") == "hang"]
    if not run.hangs and not events:
        return []
    lines = ["", "## Hangs", "", f"{max(len(run.hangs), len(events))} hang(s) (run.dir/hangs/; docs/hangs.md):", ""]
    for r in run.hangs or events:
        t = epoch_time(r.get("time"))
        where = f"hangs/{r['folder']}/" if "folder" in r else fmt_value(r.get("record", "?"))
        if "folder" in r and "step" not in r:
            lines.append(f"- {where}: no readable hang.json (the job ended before writing it, or it is damaged)")
            continue
        step, phase, cause, code, row = (fmt_value(r.get(k, "?")) for k in ("step", "phase", "cause", "exit_code",
                                                                             "in_a_row"))
        lines.append(f"- {iso(t) + ' (' + format(t, '.3f') + ')' if t is not None else 'time ?'}: step {step}, "
                     f"{phase}, cause {cause}, exit {code}, {row} in a row"
                     + (", interrupted" if r.get("interrupted") else "")
                     + (f"; stopped first: {first_ranks(r)}" if "first" in r else "") + f"; {where}")
    return lines


def final_val_lines(run: Run) -> list[str]:
    last: dict[str, tuple] = {}
    # Surviving records ascend in step, so the last one per domain is the newest.
    for r in (r for r, kept in zip(run.val, run.val_kept) if kept):
        last |= {domain: (v, r["step"]) for domain, v in r["val_loss"].items() if v is not None}
    if not last:
        return ["- final val loss: none recorded"]
    return ["- final val loss:"] + [f"  - {d}: {fmt_value(v)} (step {s})" for d, (v, s) in sorted(last.items())]


def final_eval_lines(run: Run) -> list[str]:
    kept = [r for r, k in zip(run.evals, run.evals_kept) if k]
    if not kept:
        return []
    last = kept[-1]

    def of(key: str, task: str):  # a damaged line may hold anything where a {task: value} map belongs
        table = last.get(key)
        return table.get(task) if isinstance(table, dict) else None
    return [f"- downstream tasks at step {last['step']}:"] + [
        f"  - {task}: acc {fmt_value(acc)}, acc_norm {fmt_value(of('eval_acc_norm', task))}, "
        f"chance {fmt_value(of('eval_chance', task))}, bpb {fmt_value(of('eval_bpb', task))}"
        for task, acc in last["eval_acc"].items()]


def event_table(run: Run) -> list[str]:
    rows = [e for e in run.events if e.get("event") not in ROUTINE_EVENTS]
    if not rows:
        return ["", "## Events", "", "No skips, rewinds, resumes, lr_scale changes or alerts."]
    t0 = next((t for e in run.events if (t := epoch_time(e.get("time"))) is not None), None)
    lines = ["", "## Events", "", "| time (UTC) | elapsed | step | event | details |", "|---|---|---|---|---|"]
    for e in rows:
        t = epoch_time(e.get("time"))
        when, elapsed = "?", "?"
        if t is not None:  # then t0 is a date too
            when = dt.datetime.fromtimestamp(t, dt.timezone.utc).strftime("%Y-%m-%d %H:%M:%S")
            elapsed = fmt_duration(t - t0)
        details = ", ".join(f"{k}={fmt_field(k, v)}" for k, v in e.items() if k not in ("event", "time", "step"))
        details = details if len(details) <= 160 else details[:157] + "..."
        lines.append(f"| {when} | {elapsed} | {e.get('step', '?')} | {fmt_value(e.get('event'))} | {details} |")
    return lines


def node_lines(run_dir: Path, run: Run) -> list[str]:
    """The nodes: the check before the first step (run.dir/nodes.json) and every rank the straggler
    report named, with the phase, the steps and the largest factor (figure: phases.png)."""
    doc = read_nodes(run_dir)
    named: dict[tuple, list] = {}
    for record in run.phases:
        for v in record.get("stragglers") or []:
            if isinstance(v, dict) and is_number(v.get("factor")):
                named.setdefault((v.get("rank"), v.get("host"), v.get("phase")), []).append((record["step"], v["factor"]))
    if doc is None and not named:
        return []
    lines = ["", "## Nodes", ""]
    if doc is not None and doc["nodes"]:
        verdicts = "; ".join(f"{host} {node['verdict']}" + (f" ({'; '.join(node['why'])})" if node["why"] else "")
                             for host, node in doc["nodes"].items())
        lines.append(f"- checked before the first step of the newest job in {fmt_value(doc.get('seconds'))} s: "
                     f"{verdicts}")
    for (rank, host, phase), seen in named.items():
        steps = [step for step, _ in seen]
        lines.append(f"- rank {rank} ({host}) named a straggler in {phase} in {len(seen)} report(s), steps "
                     f"{min(steps)}-{max(steps)}, up to {max(f for _, f in seen):g}x the other ranks' median")
    if run.phases and not named:
        lines.append(f"- the straggler report named no rank in {len(run.phases)} report(s)")
    return lines


def goodput_lines(ledger: dict | None) -> list[str]:
    """The goodput section: each part's hours and share of the wall time (figure: goodput.png)."""
    if not ledger or not ledger.get("wall_s"):
        return []
    wall, parts = ledger["wall_s"], ledger["parts"]
    lines = ["", "## Goodput", "",
             f"Wall time {fmt_duration(wall)} from the first start to the last record, {ledger.get('restarts', 0)} "
             f"restart(s), {ledger.get('rewinds', 0)} rewind(s), {ledger.get('hangs', 0)} hang(s) "
             "(goodput.json; figure: goodput.png):", "", "| part | time | share |", "|---|---|---|"]
    for name in ("productive", *LABELS):
        lines.append(f"| {name} | {fmt_duration(parts.get(name, 0.0))} | {100 * parts.get(name, 0.0) / wall:.1f}% |")
    return lines


def with_goodput(lines: list[str], ledger: dict | None) -> list[str]:
    """The goodput section before the events' table (which runs to the end of the summary's tables)."""
    at = next((i for i, line in enumerate(lines) if line.startswith("## Events")), len(lines))
    return lines[:at] + goodput_lines(ledger) + ([""] if at < len(lines) and ledger else []) + lines[at:]


def write_report(run: Run, out: Path, spikes: list[str] | None = None, ledger: dict | None = None) -> list[Path]:
    # The summary is built, and replaces the old one, before any figure is drawn: a run it cannot
    # describe then leaves the folder as it was, and no folder holds new figures beside the summary
    # of an older report.
    text = "\n".join(with_goodput(summary_lines(run), ledger) + (spikes or []))
    out.mkdir(parents=True, exist_ok=True)
    summary = write_atomic(out / "summary.md", text)
    figure = plot_goodput(ledger, out) if ledger else None
    return ([plot_overview(run, out / "overview.png")] + write_figures(run, out) + ([figure] if figure else [])
            + [summary])


def write_comparison(runs: list[Run], run_dirs: list[Path], out: Path) -> list[Path]:
    """compare.md first (as the summary: a page that cannot be built changes nothing), then the figures."""
    labels = run_labels(run_dirs)
    extra = [{"wall time": wall_time(run).split(" (")[0], "hangs": str(count(run, "hang", len(run.hangs))),
              "alerts": str(count(run, "alert")), "status": fmt_value(status_of(run.events))} for run in runs]
    figures = figures_for(runs)
    text = "\n".join(compare_lines(runs, labels, run_dirs, extra, figures))
    out.mkdir(parents=True, exist_ok=True)
    page = write_atomic(out / "compare.md", text)
    return write_compare_figures(runs, labels, out) + [page]


def write_atomic(path: Path, text: str) -> Path:
    """Whole or not at all: a temporary file in the same folder, renamed over `path`. A lone surrogate
    (JSON's "\\udcff", which UTF-8 cannot encode) is written as its escape, not raised."""
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        os.fchmod(fd, file_mode())  # mkstemp's 0600 would keep the summary from a lab mate
        with os.fdopen(fd, "wb") as f:
            f.write(text.encode("utf-8", "backslashreplace"))
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
    return path


def unwritable(out: Path) -> str | None:
    """Why `out` cannot hold the report, or None. Checked before any work, by doing what the report
    will do (create the folder, write a file in it): a file named like the folder, a path under a
    file or in /proc, a read-only mount all fail here with one line instead of a traceback later."""
    if out.exists() and not out.is_dir():
        return "it is a file, not a folder"
    # The topmost folder this makes, removed again when the probe fails: a refusal leaves nothing.
    made = next((p for p in reversed([out, *out.parents]) if not p.exists()), None)
    try:
        out.mkdir(parents=True, exist_ok=True)
        fd, probe = tempfile.mkstemp(dir=out, prefix=".write-test.")
        os.close(fd)
        os.unlink(probe)
    except OSError as exc:
        if made is not None:
            shutil.rmtree(made, ignore_errors=True)
        return exc.strerror or str(exc)
    return None


def refusal(run_dirs: list[Path]) -> str | None:
    """Why these folders cannot be reported on (one line naming the folder), or None."""
    seen: dict[Path, Path] = {}
    for run_dir in run_dirs:
        if not (run_dir / "metrics.jsonl").is_file():
            return f"{run_dir / 'metrics.jsonl'} not found; pass a run.dir that has been trained in"
        if run_dir.resolve() in seen:
            return f"{run_dir} is given twice (as {seen[run_dir.resolve()]}); pass each run once"
        seen[run_dir.resolve()] = run_dir
    return None


def main(argv: list[str] | None = None) -> int:
    parser = OneLineParser(prog="python -m dsslm.report", description=__doc__.splitlines()[0])
    parser.add_argument("run_dirs", type=Path, nargs="+", metavar="RUN_DIR",
                        help="a run's run.dir (holds metrics.jsonl, events.jsonl); two or more: compare them")
    parser.add_argument("--out", type=Path, default=None,
                        help="output folder (default: RUN_DIR/report; with several runs the first one's report/compare)")
    args = parser.parse_args(argv)
    run_dirs = args.run_dirs
    problem = refusal(run_dirs)
    if problem is not None:
        print(f"error: {problem}", file=sys.stderr)
        return 2
    # A comparison is of the first run against the others: it lands beside that run's own report.
    out = args.out or (run_dirs[0] / "report" / "compare" if len(run_dirs) > 1 else run_dirs[0] / "report")
    problem = inside_checkpoints(out)
    if problem is not None:
        print(f"error: --out {out}: {problem}; choose a folder outside the run's checkpoints/", file=sys.stderr)
        return 2
    runs = []
    for run_dir in run_dirs:  # every run read first: a refused run leaves no report folder behind
        run = load_run(run_dir)
        if not run.train:
            print(f"error: {run_dir / 'metrics.jsonl'} has no step records (with step and loss)", file=sys.stderr)
            return 2
        run.hangs = read_hangs(run_dir)
        runs.append(run)
    problem = unwritable(out)
    if problem is not None:
        print(f"error: cannot write the report to {out}: {problem}; pass --out a folder that can be created "
              f"and written to", file=sys.stderr)
        return 2
    if len(runs) > 1:
        for path in write_comparison(runs, run_dirs, out):
            print(path)
        return 0
    spikes = spike_lines(run_dirs[0])
    for path in write_report(runs[0], out, node_lines(run_dirs[0], runs[0]) + spikes, read_ledger(run_dirs[0])):
        print(path)
    if spikes:
        print("\n".join(spikes))
    return 0


if __name__ == "__main__":
    sys.exit(main())
