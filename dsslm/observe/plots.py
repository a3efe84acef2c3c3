"""The report's figures: loss (with validation, alerts and hangs marked), learning rate, grad norm,
throughput, update ratio, downstream tasks (eval.tasks), each rank's time a step in each phase (the
straggler report).

A rewind or a resume after a crash repeats step numbers: the run went back to an older
checkpoint and ran those steps again. Every plot is against the optimizer step; records whose
weights were later thrown away ("abandoned") are drawn faded, so the solid line is the
trajectory the final weights actually took.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
from matplotlib.figure import Figure
from matplotlib.ticker import EngFormatter

from dsslm.observe.sinks import read_jsonl

FIGSIZE_IN = (9, 4.5)
DPI = 120
NON_FINITE = {"nan", "inf", "-inf", "infinity", "-infinity"}  # the sinks write non-finite floats as strings
# A metric beyond this is an overflow: the trainer's values are fp32/bf16 (< 3.4e38) or seconds.
LARGEST = 1e300
ABANDONED_LABEL = "rolled back (abandoned)"
MARKER_STYLE = {  # kind -> (label, color, linestyle)
    "skip": ("skipped step", "tab:orange", ":"),
    "rewind": ("rewind (shaded: steps rerun)", "tab:red", "-"),
    "resume": ("resume from checkpoint", "tab:green", "--"),
    "alert": ("alert (events.jsonl)", "goldenrod", ""),  # a triangle on the top edge: alerts may come often
    "hang": ("hang (run.dir/hangs/)", "darkviolet", "-."),
}
LOSS_MARKERS = ("skip", "rewind", "resume", "alert", "hang")


@dataclass
class Run:
    name: str
    train: list[dict]                # step records, in file order
    val: list[dict]                  # records carrying val_loss, in file order
    events: list[dict]
    train_kept: np.ndarray           # False where a later record went back to this step or before
    val_kept: np.ndarray
    bad_lines: dict[str, int]        # file name -> unreadable lines
    evals: list[dict] = field(default_factory=list)  # records carrying eval_acc (downstream tasks)
    evals_kept: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=bool))
    phases: list[dict] = field(default_factory=list)  # the straggler report's records (phase_s: per-rank times)
    # The hang records (run.dir/hangs/*/hang.json), read by the report: observe never imports health.
    hangs: list[dict] = field(default_factory=list)


def kept_flags(metrics: list[dict], is_train: list[bool]) -> list[bool]:
    """For each record: True unless a later training record has a step <= its step.

    A later record at an equal or smaller step means the run reloaded an older checkpoint
    (rewind, or resume after a crash), so the weights this record described were discarded.
    One backward pass with a running minimum.
    """
    kept = [True] * len(metrics)
    min_later = math.inf
    for i in range(len(metrics) - 1, -1, -1):
        kept[i] = metrics[i]["step"] < min_later
        if is_train[i]:
            min_later = min(min_later, metrics[i]["step"])
    return kept


def load_run(run_dir: Path) -> Run:
    metrics, bad_metrics = read_jsonl(run_dir / "metrics.jsonl")
    events, bad_events = read_jsonl(run_dir / "events.jsonl")
    # An event's name is what every reader keys on (set lookups, comparisons): a record whose
    # `event` is a list or a map is not one of ours, and is skipped like an unreadable line.
    named = [e for e in events if isinstance(e.get("event"), str)]
    events, bad_events = named, bad_events + len(events) - len(named)
    metrics = [r for r in metrics if is_number(r.get("step"))]
    is_train = ["loss" in r for r in metrics]
    is_val = [isinstance(r.get("val_loss"), dict) for r in metrics]
    is_eval = [isinstance(r.get("eval_acc"), dict) for r in metrics]
    kept = kept_flags(metrics, is_train)
    return Run(
        name=run_dir.resolve().name,
        train=[r for r, t in zip(metrics, is_train) if t],
        val=[r for r, v in zip(metrics, is_val) if v],
        events=events,
        train_kept=np.array([k for k, t in zip(kept, is_train) if t], dtype=bool),
        val_kept=np.array([k for k, v in zip(kept, is_val) if v], dtype=bool),
        bad_lines={k: v for k, v in (("metrics.jsonl", bad_metrics), ("events.jsonl", bad_events)) if v},
        evals=[r for r, e in zip(metrics, is_eval) if e],
        evals_kept=np.array([k for k, e in zip(kept, is_eval) if e], dtype=bool),
        phases=[r for r in metrics if isinstance(r.get("phase_s"), dict)],
    )


def column(records: list[dict], key: str) -> np.ndarray:
    """Float column; NaN where the field is missing or not a number (matplotlib skips NaN)."""
    return np.array([as_float(r.get(key)) for r in records], dtype=float)


def as_float(v) -> float:
    """The value as a float: NaN/inf as the sinks write them (strings) or as JSON reads them stay
    non-finite (counted as such), as does a value past LARGEST; anything that is not a number, or an
    int past float's range (another tool's line; float() raises OverflowError), is NaN."""
    if isinstance(v, str) and v.strip().lower() in NON_FINITE:
        return float(v)
    if not isinstance(v, (int, float)) or isinstance(v, bool):
        return math.nan
    try:
        f = float(v)
    except OverflowError:
        return math.nan
    # Past LARGEST the value is drawn as the overflow it is: matplotlib's tick arithmetic itself
    # overflows on data near float's maximum ("arange: cannot compute length").
    return f if not abs(f) > LARGEST else math.copysign(math.inf, f)


def is_number(v) -> bool:
    """A finite int or float within LARGEST, not a bool: only such a value can be a step, a time or a
    count to print or place on an axis (JSON's NaN/Infinity and a 400-digit int parse, then break
    int(), float() and the axes). The comparison is exact for any int and False for NaN."""
    return isinstance(v, (int, float)) and not isinstance(v, bool) and -LARGEST <= v <= LARGEST


def set_finite_lim(set_lim, lo: float, hi: float) -> None:
    """Axis limits only when both are finite: matplotlib raises on NaN/inf, which a limit computed
    from values near float's range (1e308 * 1.1) can become; the axis then keeps its autoscale."""
    if math.isfinite(lo) and math.isfinite(hi) and lo < hi:
        set_lim(lo, hi)


def with_breaks(x: np.ndarray, y: np.ndarray, mask: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """x, y where mask holds, with a NaN between runs that are not adjacent in the file,
    so separate abandoned segments are not joined by a line."""
    idx = np.flatnonzero(mask)
    gaps = np.flatnonzero(np.diff(idx) > 1) + 1
    return np.insert(x[idx], gaps, np.nan), np.insert(y[idx], gaps, np.nan)


def smooth(y: np.ndarray, window: int) -> np.ndarray:
    """Centered moving average; the window shrinks at the ends instead of padding."""
    if window <= 1 or y.size < 3:
        return y
    half = window // 2
    csum = np.concatenate([[0.0], np.cumsum(y)])
    lo = np.clip(np.arange(y.size) - half, 0, y.size)
    hi = np.clip(np.arange(y.size) + half + 1, 0, y.size)
    return (csum[hi] - csum[lo]) / (hi - lo)


def draw_markers(ax, run: Run, kinds=("skip", "rewind", "resume")) -> None:
    """Vertical lines at skips (event or verdict), rewinds (shaded back to to_step), resumes and
    hangs (event or record); alerts as triangles along the top edge."""
    for kind in kinds:
        events = [e for e in run.events if e.get("event") == kind and is_number(e.get("step"))]
        steps = {e["step"] for e in events}
        if kind == "skip":
            steps |= {r["step"] for r in run.train if r.get("verdict") == "skip_step"}
        if kind == "hang":  # a record whose event was never written (the job was killed first) still counts
            steps |= {r["step"] for r in run.hangs if is_number(r.get("step"))}
        label, color, style = MARKER_STYLE[kind]
        if kind == "alert":
            if steps:
                x = sorted(steps)
                # Just inside the top edge: above it they would run into a panel's title.
                ax.plot(x, [0.975] * len(x), "v", color=color, ms=7, mec="black", mew=0.5,
                        transform=ax.get_xaxis_transform(), label=label, zorder=5)
            continue
        for i, step in enumerate(sorted(steps)):
            ax.axvline(step, color=color, ls=style, lw=1.0, alpha=0.8, label=None if i else label)
        for e in events if kind == "rewind" else []:
            to_step = e["to_step"] if is_number(e.get("to_step")) else e["step"]
            ax.axvspan(to_step, e["step"], color=color, alpha=0.08, lw=0)


def new_figure(title: str, ylabel: str, nrows: int = 1):
    height_in = FIGSIZE_IN[1] * (1 + 0.55 * (nrows - 1))
    fig = Figure(figsize=(FIGSIZE_IN[0], height_in), dpi=DPI, layout="constrained")
    axes = fig.subplots(nrows, 1, squeeze=False)[:, 0]
    fig.suptitle(title)
    for ax in axes:
        ax.set_xlabel("optimizer step")
        ax.set_ylabel(ylabel)
        ax.grid(True, alpha=0.3)
    return fig, axes


def finish(fig, path: Path, *axes) -> Path:
    """Legend outside the axes, on the right: it can never hide a curve."""
    handles, labels = [], []
    for ax in axes:
        for h, lab in zip(*ax.get_legend_handles_labels()):
            if lab not in labels:
                handles.append(h)
                labels.append(lab)
    fig.legend(handles, labels, loc="outside right upper", fontsize="small", markerscale=1.5)
    fig.savefig(path)
    return path


def plot_kept_and_abandoned(ax, x, y, kept, color, label, **kw) -> None:
    """Solid line for the surviving trajectory, a faded one for steps later rolled back."""
    # Kept steps strictly increase in file order (see kept_flags), so one unbroken line.
    ax.plot(x[kept], y[kept], color=color, label=label, **kw)
    plot_abandoned(ax, x, y, kept)


def plot_abandoned(ax, x, y, kept) -> None:
    if not kept.all():
        ax.plot(*with_breaks(x, y, ~kept), color="0.55", alpha=0.6, lw=0.9, label=ABANDONED_LABEL)


def plot_loss(run: Run, out: Path) -> Path:
    """Two panels: the whole run, then the part after the initial drop, where runs differ."""
    fig, (whole, zoom) = new_figure(f"Loss: {run.name}", "cross-entropy (nats/token)", nrows=2)
    steps, loss = column(run.train, "step"), column(run.train, "loss")
    # Spikes that were skipped or rewound are left out of the smoothed line: they were not trained on.
    bad = not_applied(run)
    good = run.train_kept & ~bad & np.isfinite(loss)
    window = max(1, min(201, int(good.sum()) // 50)) | 1
    smoothed = smooth(loss[good], window)
    for ax in (whole, zoom):
        ax.plot(steps[good], loss[good], ".", ms=2.5, color="tab:blue", alpha=0.3, label="train (raw)")
        ax.plot(steps[good], smoothed, color="tab:blue", lw=1.6,
                label=f"train (moving avg, {window} steps)" if window > 1 else "train")
        plot_abandoned(ax, steps, loss, run.train_kept)
        if bad.any():
            ax.plot(steps[bad], loss[bad], "x", color="tab:red", ms=6, label="step not applied (skip/rewind)")
        plot_val(ax, run)
        draw_markers(ax, run, LOSS_MARKERS)
    if good.sum() >= 2:
        # A spike up to one data range above the curve stays in view; a larger one would flatten it
        # and still shows as its marker line.
        # Python floats: a loss near float's range makes the cap inf (no clipping), not a numpy warning.
        cap = 2 * float(loss[good].max()) - float(loss[good].min())
        if whole.get_ylim()[1] > cap:
            whole.set_ylim(top=cap)
            peak = int(np.nanargmax(np.where(np.isfinite(loss), loss, np.nan)))
            whole.text(0.99, 0.97, f"y clipped: peak {loss[peak]:.3g} at step {steps[peak]:g}",
                       transform=whole.transAxes, ha="right", va="top", fontsize="x-small", color="0.35")
        x0 = steps[good][good.sum() // 5]
        zoom.set_title(f"from step {x0:g}, zoomed", fontsize="medium")
        whole.set_xlabel("")  # the zoom panel below carries the x label
        zoom_to(zoom, x0, steps[good], loss[good], smoothed, run)
    return finish(fig, out / "loss.png", whole)


def not_applied(run: Run) -> np.ndarray:
    """Steps whose update was dropped (skip_step) or undone (rewind)."""
    return np.array([r.get("verdict", "ok") != "ok" for r in run.train], dtype=bool)


def zoom_to(ax, x0: float, steps: np.ndarray, loss: np.ndarray, smoothed: np.ndarray, run: Run) -> None:
    after = steps >= x0
    val = [v for r in run.val if r["step"] >= x0 for v in map(as_float, r["val_loss"].values()) if math.isfinite(v)]
    lo = min([smoothed[after].min()] + val)
    hi = max([np.percentile(loss[after], 99.5)] + val)
    pad = 0.08 * (hi - lo) or 0.1
    set_finite_lim(ax.set_xlim, x0 - 0.01 * (steps[-1] - x0), steps[-1] + 0.01 * (steps[-1] - x0))
    set_finite_lim(ax.set_ylim, lo - pad, hi + pad)


def plot_val(ax, run: Run) -> None:
    domains = sorted({d for r in run.val for d in r["val_loss"]})
    # Blue is the training loss; red, orange and green are the event markers.
    colors = ["tab:purple", "tab:brown", "tab:pink", "tab:olive", "tab:cyan", "black"]
    steps = column(run.val, "step")
    for i, domain in enumerate(domains):
        y = column([r["val_loss"] for r in run.val], domain)
        has = np.isfinite(y)
        plot_kept_and_abandoned(ax, steps[has], y[has], run.val_kept[has], colors[i % len(colors)],
                                f"val: {domain}", marker="o", ms=3.5, lw=1.2)


def plot_lr(run: Run, out: Path) -> Path:
    fig, (ax,) = new_figure(f"Learning rate: {run.name}", "learning rate (as applied)")
    steps, kept = column(run.train, "step"), run.train_kept
    plot_kept_and_abandoned(ax, steps, column(run.train, "lr"), kept, "tab:blue", "lr (schedule × lr_scale)")
    ax.ticklabel_format(axis="y", style="sci", scilimits=(0, 0))
    twin = ax.twinx()
    scale = column(run.train, "lr_scale")
    twin.plot(steps[kept], scale[kept], color="tab:orange", lw=1.2, drawstyle="steps-post", label="lr_scale")
    twin.set_ylabel("lr_scale (multiplier)")
    # "inf" (how the sinks write an infinite scale) is no limit: the top comes from finite values.
    finite = scale[np.isfinite(scale)]
    top = float(finite.max()) if finite.size else 1.0
    set_finite_lim(twin.set_ylim, 0, max(1.05, top * 1.1))
    draw_markers(ax, run, ("rewind", "resume"))
    return finish(fig, out / "lr.png", ax, twin)


def clip_threshold(run: Run) -> float | None:
    """optim.clip from the start event's config (nested or dotted), else a `clip` field."""
    configs = [e["config"] for e in run.events
               if e.get("event") == "start" and isinstance(e.get("config"), dict)]
    candidates = [c["optim"].get("clip") for c in configs if isinstance(c.get("optim"), dict)]
    candidates += [c.get("optim.clip") for c in configs] + [r.get("clip") for r in run.train + run.events]
    return next((float(v) for v in candidates if is_number(v) and v > 0), None)


def plot_gnorm(run: Run, out: Path) -> Path:
    fig, (ax,) = new_figure(f"Gradient norm before clipping: {run.name}", "global L2 grad norm (log scale)")
    steps, gnorm, kept = column(run.train, "step"), column(run.train, "gnorm"), run.train_kept
    gnorm[gnorm <= 0] = np.nan  # log axis
    plot_kept_and_abandoned(ax, steps, gnorm, kept, "tab:blue", "grad norm", lw=0.9)
    bad = not_applied(run)
    if bad.any():
        ax.plot(steps[bad], gnorm[bad], "x", color="tab:red", ms=6, label="step not applied (skip/rewind)")
    clip = clip_threshold(run)
    if clip is not None:
        ax.axhline(clip, color="black", ls="--", lw=1.0, label=f"clip threshold ({clip:g})")
    ax.set_yscale("log")
    draw_markers(ax, run)  # also marks skips whose grad norm was NaN/inf and so has no point
    return finish(fig, out / "gnorm.png", ax)


def rate(value: float) -> str:
    """A throughput as a person reads it: 1,267 (not EngFormatter's `1.26681 k`), 4.52 below 100."""
    return f"{value:,.0f}" if abs(value) >= 100 else f"{value:.3g}"


def plot_throughput(run: Run, out: Path) -> Path:
    fig, (ax,) = new_figure(f"Throughput: {run.name}", "tokens/s (all ranks)")
    steps, kept = column(run.train, "step"), run.train_kept
    tokens_per_s = column(run.train, "tokens_per_s")
    plot_kept_and_abandoned(ax, steps, tokens_per_s, kept, "tab:blue", "tokens/s", lw=0.9)
    if np.isfinite(tokens_per_s[kept]).any():
        median = np.nanmedian(tokens_per_s[kept])
        ax.axhline(median, color="black", ls=":", lw=1.0, label=f"median {rate(median)} tokens/s")
    ax.yaxis.set_major_formatter(EngFormatter())
    ax.set_ylim(bottom=0)
    draw_markers(ax, run, ("rewind", "resume"))
    return finish(fig, out / "throughput.png", ax)


def plot_update_ratio(run: Run, out: Path) -> Path | None:
    """One line per parameter group, surviving trajectory only (abandoned steps would double the lines)."""
    rows = [r["update_ratio"] | {"step": r["step"]} for r, k in zip(run.train, run.train_kept)
            if k and isinstance(r.get("update_ratio"), dict)]
    if not rows:
        return None
    fig, (ax,) = new_figure(f"Update/parameter ratio per group: {run.name}",
                            "‖Δθ‖ / ‖θ‖ per step (log scale)")
    steps = column(rows, "step")
    # First-seen order is the model's order (embed, layers..., head), which sorting would scramble.
    for i, group in enumerate(dict.fromkeys(g for r in rows for g in r if g != "step")):
        y = column(rows, group)
        y[y <= 0] = np.nan
        ax.plot(steps, y, lw=1.0, label=group, color=f"C{i % 10}", ls="-" if i < 10 else "--")
    ax.set_yscale("log")
    draw_markers(ax, run, ("rewind", "resume"))
    return finish(fig, out / "update_ratio.png", ax)


def plot_evals(run: Run, out: Path) -> Path | None:
    """Downstream tasks: accuracy (raw solid, per character dashed) against its chance level, and
    the gold continuation's bits per byte, which moves long before a small model's accuracy does."""
    if not run.evals:
        return None
    fig, (acc_ax, bpb_ax) = new_figure(f"Downstream tasks: {run.name}", "accuracy", nrows=2)
    bpb_ax.set_ylabel("bits per byte of the gold answer")
    steps = column(run.evals, "step")
    tasks = list(dict.fromkeys(t for r in run.evals for t in r["eval_acc"]))
    for i, task in enumerate(tasks):
        color = f"C{i % 10}"
        for ax, key, style, label in ((acc_ax, "eval_acc", "-", f"{task}: acc"),
                                      (acc_ax, "eval_acc_norm", "--", f"{task}: acc_norm (per char)"),
                                      (bpb_ax, "eval_bpb", "-", f"{task}: bpb")):
            y = column([r.get(key) if isinstance(r.get(key), dict) else {} for r in run.evals], task)
            has = np.isfinite(y)
            plot_kept_and_abandoned(ax, steps[has], y[has], run.evals_kept[has], color, label, ls=style,
                                    marker="o", ms=3)
        chance = column([r.get("eval_chance") if isinstance(r.get("eval_chance"), dict) else {}
                         for r in run.evals], task)
        if np.isfinite(chance).any():
            acc_ax.axhline(np.nanmean(chance), color=color, ls=":", lw=1.0, label=f"{task}: chance")
    acc_ax.set_xlabel("")
    draw_markers(acc_ax, run, ("rewind", "resume"))
    return finish(fig, out / "evals.png", acc_ax, bpb_ax)


def plot_phases(run: Run, out: Path) -> Path | None:
    """The straggler report's per-rank times a step (health/stragglers.py), one panel per phase any
    rank spent time in, one line per rank; each rank named a straggler marked where it was."""
    rows = run.phases
    if not rows:
        return None
    names = list(dict.fromkeys(name for r in rows for name, v in r["phase_s"].items() if isinstance(v, list)))
    names = [n for n in names if any(as_float(x) > 0 for r in rows for x in (r["phase_s"].get(n) or [])
                                     if isinstance(r["phase_s"].get(n), list))]
    if not names:
        return None
    fig, axes = new_figure(f"Time a step per rank and phase: {run.name}", "ms a step", nrows=len(names))
    steps = column(rows, "step")
    ranks = max(len(r["phase_s"].get(n) or []) for r in rows for n in names if isinstance(r["phase_s"].get(n), list))
    hosts = next((r["hosts"] for r in reversed(rows) if isinstance(r.get("hosts"), list)), [])
    for ax, name in zip(axes, names):
        ax.set_title(name, fontsize="medium")
        for rank in range(ranks):
            y = np.array([1e3 * as_float(v[rank]) if isinstance(v := r["phase_s"].get(name), list) and rank < len(v)
                          else math.nan for r in rows])
            host = f" ({hosts[rank]})" if rank < len(hosts) else ""
            ax.plot(steps, y, lw=1.0, marker=".", ms=3, color=f"C{rank % 10}", label=f"rank {rank}{host}",
                    ls="-" if rank < 10 else "--")
            named = [i for i, r in enumerate(rows) for v in (r.get("stragglers") or [])
                     if isinstance(v, dict) and v.get("rank") == rank and v.get("phase") == name]
            if named:
                ax.plot(steps[named], y[named], "x", color="tab:red", ms=8, label="named a straggler")
        ax.set_ylim(bottom=0)
    for ax in axes[:-1]:
        ax.set_xlabel("")
    return finish(fig, out / "phases.png", *axes)


def write_figures(run: Run, out: Path) -> list[Path]:
    """Every figure that has data, into `out`."""
    written = [plot_loss(run, out), plot_lr(run, out), plot_gnorm(run, out), plot_throughput(run, out),
               plot_update_ratio(run, out), plot_evals(run, out), plot_phases(run, out)]
    return [p for p in written if p is not None]


GOODPUT_COLORS = {"productive": "tab:green", "recomputed": "tab:red", "checkpoint": "tab:blue",
                  "evaluation": "tab:purple", "startup": "tab:orange", "hang_detection": "tab:brown",
                  "between_starts": "tab:gray", "other": "tab:olive"}


def plot_goodput(ledger: dict, out: Path) -> Path | None:
    """goodput.png: the run's wall time and each start's, stacked by part (observe/goodput.py)."""
    starts = ledger.get("starts") or []
    if not ledger.get("wall_s"):
        return None
    rows = [("run", ledger["parts"])] + [(f"start {i + 1}", s["parts"]) for i, s in enumerate(starts)]
    fig, (ax,) = new_figure("where the wall time went (goodput)", "", 1)
    ax.set_xlabel("hours")
    labels = [name for name, _ in rows][::-1]
    left = np.zeros(len(rows))
    for part, color in GOODPUT_COLORS.items():
        widths = np.array([max(0.0, as_float(parts.get(part, 0.0))) / 3600 for _, parts in rows][::-1])
        widths[~np.isfinite(widths)] = 0.0
        if widths.any():
            ax.barh(labels, widths, left=left, color=color, label=part.replace("_", " "))
        left += widths
    return finish(fig, out / "goodput.png", ax)
