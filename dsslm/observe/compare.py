"""One run at a glance, and several runs side by side (`python -m dsslm.report A B ...`).

overview.png: one run's loss, learning rate, grad norm and throughput in a 2x2 grid (each is drawn
in full, with its rolled-back steps, in a figure of its own). The comparison: loss.png (training,
whole and zoomed), val_loss.png, throughput.png and lr.png with one line per run, labelled by its
run.dir's name, and compare.md, the page: a table of each run's numbers, then the figures and each
run's overview. Only a run's surviving trajectory is drawn: a rewind's or a resume's repeated steps
would draw each run as two lines, which reads as two runs.
"""
from __future__ import annotations

import math
from pathlib import Path

import numpy as np
from matplotlib.figure import Figure
from matplotlib.ticker import EngFormatter

from dsslm.observe.plots import (DPI, FIGSIZE_IN, LOSS_MARKERS, Run, clip_threshold, column, draw_markers, finish,
                                 new_figure, not_applied, plot_val, rate, set_finite_lim, smooth)

FINAL_OF = 10  # the final loss is the mean of this many last surviving steps: one step's loss is noisy


def run_labels(run_dirs: list[Path]) -> list[str]:
    """Each run's folder name; where two share one (runs/a/default, runs/b/default), as many of the
    folders above as tell them apart, then a number."""
    parts = [d.resolve().parts for d in run_dirs]
    labels = [p[-1] for p in parts]
    for depth in range(2, max(map(len, parts)) + 1):
        clash = {lab for lab in labels if labels.count(lab) > 1}
        if not clash:
            return labels
        labels = ["/".join(p[-depth:]) if lab in clash else lab for p, lab in zip(parts, labels)]
    return [f"{lab} ({i + 1})" if labels.count(lab) > 1 else lab for i, lab in enumerate(labels)]


def trained(run: Run) -> tuple[np.ndarray, np.ndarray]:
    """Steps and losses the final weights were trained on: surviving, applied, finite."""
    steps, loss = column(run.train, "step"), column(run.train, "loss")
    good = run.train_kept & ~not_applied(run) & np.isfinite(loss)
    return steps[good], loss[good]


def window_of(n: int) -> int:
    return max(1, min(201, n // 50)) | 1  # as the report's loss figure smooths


def kept_series(run: Run, key: str, positive: bool = False) -> tuple[np.ndarray, np.ndarray]:
    steps, y = column(run.train, "step"), column(run.train, key)
    keep = run.train_kept & np.isfinite(y) & ((y > 0) if positive else True)
    return steps[keep], y[keep]


# --- one run at a glance --------------------------------------------------------------------------

def plot_overview(run: Run, path: Path) -> Path:
    """overview.png: loss (alerts and hangs marked), learning rate, grad norm, throughput."""
    fig = Figure(figsize=(FIGSIZE_IN[0] * 1.4, FIGSIZE_IN[1] * 1.6), dpi=DPI, layout="constrained")
    (loss_ax, lr_ax), (gnorm_ax, tps_ax) = fig.subplots(2, 2)
    fig.suptitle(f"Overview: {run.name}")
    for ax, title in ((loss_ax, "loss (nats/token)"), (lr_ax, "learning rate"),
                      (gnorm_ax, "grad norm before clipping (log)"), (tps_ax, "tokens/s (all ranks)")):
        ax.set_title(title, fontsize="medium")
        ax.grid(True, alpha=0.3)
    for ax in (gnorm_ax, tps_ax):
        ax.set_xlabel("optimizer step")
    steps, loss = trained(run)
    if loss.size:
        window = window_of(loss.size)
        loss_ax.plot(steps, loss, ".", ms=2, color="tab:blue", alpha=0.25)
        loss_ax.plot(steps, smooth(loss, window), color="tab:blue", lw=1.4,
                     label=f"train (moving avg, {window} steps)" if window > 1 else "train")
    plot_val(loss_ax, run)
    draw_markers(loss_ax, run, LOSS_MARKERS)
    lr_ax.plot(*kept_series(run, "lr"), color="tab:blue", lw=1.2)
    lr_ax.ticklabel_format(axis="y", style="sci", scilimits=(0, 0))
    g_steps, gnorm = kept_series(run, "gnorm", positive=True)
    gnorm_ax.plot(g_steps, gnorm, color="tab:blue", lw=0.8)
    if gnorm.size:
        gnorm_ax.set_yscale("log")
    clip = clip_threshold(run)
    if clip is not None:
        gnorm_ax.axhline(clip, color="black", ls="--", lw=1.0, label=f"clip threshold ({clip:g})")
    t_steps, tps = kept_series(run, "tokens_per_s")
    tps_ax.plot(t_steps, tps, color="tab:blue", lw=0.8)
    if tps.size:
        tps_ax.axhline(float(np.median(tps)), color="black", ls=":", lw=1.0,
                       label=f"median {rate(float(np.median(tps)))} tokens/s")
    tps_ax.yaxis.set_major_formatter(EngFormatter())
    tps_ax.set_ylim(bottom=0)
    return finish(fig, path, loss_ax, lr_ax, gnorm_ax, tps_ax)


# --- several runs ---------------------------------------------------------------------------------

def style(i: int) -> dict:
    return {"color": f"C{i % 10}", "ls": "-" if i < 10 else "--"}


def plot_compare_loss(runs: list[Run], labels: list[str], out: Path) -> Path:
    """The training loss of each run, smoothed; below, from a fifth of the way in, where runs differ."""
    fig, (whole, zoom) = new_figure("Training loss", "cross-entropy (nats/token)", nrows=2)
    whole.set_xlabel("")
    curves = []
    for i, (run, label) in enumerate(zip(runs, labels)):
        steps, loss = trained(run)
        if not loss.size:
            continue
        window = window_of(loss.size)
        smoothed = smooth(loss, window)
        curves.append((steps, smoothed))
        for ax in (whole, zoom):
            ax.plot(steps, smoothed, lw=1.4, label=label + (f" (moving avg, {window} steps)" if window > 1 else ""),
                    **style(i))
    if curves:
        x0 = min(s[s.size // 5] for s, _ in curves)
        after = np.concatenate([y[s >= x0] for s, y in curves])
        lo, hi = float(after.min()), float(np.percentile(after, 99.5))
        set_finite_lim(zoom.set_ylim, lo - 0.08 * (hi - lo or 1), hi + 0.08 * (hi - lo or 1))
        set_finite_lim(zoom.set_xlim, x0, max(float(s[-1]) for s, _ in curves))
        zoom.set_title(f"from step {x0:g}, zoomed", fontsize="medium")
    return finish(fig, out / "loss.png", whole)


def plot_compare_val(runs: list[Run], labels: list[str], out: Path) -> Path | None:
    """Validation loss: a color per run, a line style per domain."""
    domains = sorted({d for run in runs for r in run.val for d in r["val_loss"]})
    if not domains:
        return None
    fig, (ax,) = new_figure("Validation loss", "cross-entropy (nats/token)")
    dashes = ["-", "--", ":", "-."]
    for i, (run, label) in enumerate(zip(runs, labels)):
        steps = column(run.val, "step")
        for j, domain in enumerate(domains):
            y = column([r["val_loss"] for r in run.val], domain)
            has = run.val_kept & np.isfinite(y)
            if has.any():
                ax.plot(steps[has], y[has], marker="o", ms=3, lw=1.2, color=f"C{i % 10}", ls=dashes[j % len(dashes)],
                        label=f"{label}: {domain}")
    return finish(fig, out / "val_loss.png", ax)


def plot_compare_series(runs: list[Run], labels: list[str], key: str, title: str, ylabel: str, path: Path) -> Path:
    fig, (ax,) = new_figure(title, ylabel)
    for i, (run, label) in enumerate(zip(runs, labels)):
        steps, y = kept_series(run, key)
        if key == "tokens_per_s" and y.size:
            label += f" (median {rate(float(np.median(y)))})"
        ax.plot(steps, y, lw=0.9 if key == "tokens_per_s" else 1.4, label=label, **style(i))
    if key == "tokens_per_s":
        ax.yaxis.set_major_formatter(EngFormatter())
        ax.set_ylim(bottom=0)
    else:
        ax.ticklabel_format(axis="y", style="sci", scilimits=(0, 0))
    return finish(fig, path, ax)


def write_compare_figures(runs: list[Run], labels: list[str], out: Path) -> list[Path]:
    written = [plot_compare_loss(runs, labels, out), plot_compare_val(runs, labels, out),
               plot_compare_series(runs, labels, "tokens_per_s", "Throughput", "tokens/s (all ranks)",
                                   out / "throughput.png"),
               plot_compare_series(runs, labels, "lr", "Learning rate", "learning rate (as applied)", out / "lr.png")]
    written += [plot_overview(run, out / overview_name(i)) for i, run in enumerate(runs)]
    return [p for p in written if p is not None]


def overview_name(i: int) -> str:
    return f"overview-{i + 1}.png"  # by position: two labels may differ only in characters a file name cannot hold


# --- the page -------------------------------------------------------------------------------------

def num(v: float) -> str:
    return f"{v:.4g}" if math.isfinite(v) else "?"


def short_count(v: float) -> str:
    if not math.isfinite(v):
        return "?"
    for unit, scale in (("T", 1e12), ("B", 1e9), ("M", 1e6), ("k", 1e3)):
        if abs(v) >= scale:
            return f"{v / scale:.3g}{unit}"
    return f"{v:,.0f}"


def best_val(run: Run, domain: str) -> str:
    steps = column(run.val, "step")
    y = column([r["val_loss"] for r in run.val], domain)
    has = run.val_kept & np.isfinite(y)
    if not has.any():
        return "-"
    at = int(np.argmin(np.where(has, y, np.inf)))
    return f"{num(y[at])} (step {steps[at]:g})"


def run_row(run: Run, domains: list[str]) -> list[str]:
    """final loss, best val loss per domain, tokens, steps, median tokens/s."""
    _, loss = trained(run)
    kept = [r for r, k in zip(run.train, run.train_kept) if k]
    tokens = column(kept, "tokens")
    tokens = tokens[np.isfinite(tokens)][-1:]  # the newest count: a damaged last record may lack one
    _, tps = kept_series(run, "tokens_per_s")
    return ([num(float(loss[-FINAL_OF:].mean())) if loss.size else "?"] + [best_val(run, d) for d in domains]
            + [short_count(float(tokens[0])) if tokens.size else "?", f"{kept[-1]['step']:g}" if kept else "?",
               rate(float(np.median(tps))) if tps.size else "?"])


def compare_lines(runs: list[Run], labels: list[str], run_dirs: list[Path], extra: list[dict[str, str]],
                  figures: list[str]) -> list[str]:
    """compare.md: the table (with the report's own columns in `extra`, one dict per run), the
    figures by name, and each run's overview."""
    domains = sorted({d for run in runs for r in run.val for d in r["val_loss"]})
    head = (["run", f"final loss (mean of last {FINAL_OF})"] + [f"best val loss: {d}" for d in domains]
            + ["tokens", "steps", "tokens/s (median)"] + list(extra[0]))
    rows = [[label.replace("|", "\\|")] + run_row(run, domains) + list(more.values())
            for run, label, more in zip(runs, labels, extra)]
    lines = [f"# Comparing {len(runs)} runs", ""]
    lines += [f"- `{label}`: {d.resolve()}" for label, d in zip(labels, run_dirs)]
    lines += ["", "| " + " | ".join(head) + " |", "|---" * len(head) + "|"]
    lines += ["| " + " | ".join(row) + " |" for row in rows]
    lines += ["", "Curves are against the optimizer step, each run's surviving trajectory only (steps a rewind or "
              "a resume went back over are left out); each run's own report (`python -m dsslm.report RUN_DIR`) "
              "draws those too."]
    titles = {"loss.png": "Training loss", "val_loss.png": "Validation loss", "throughput.png": "Throughput",
              "lr.png": "Learning rate"}
    for name in figures:
        if name in titles:
            lines += ["", f"## {titles[name]}", "", f"![{titles[name]}]({name})"]
    lines += ["", "## Each run"]
    for i, label in enumerate(labels):
        lines += ["", f"### {label}", "", f"![overview of {label}]({overview_name(i)})"]
    return lines + [""]


COMPARE_FIGURES = ["loss.png", "val_loss.png", "throughput.png", "lr.png"]


def figures_for(runs: list[Run]) -> list[str]:
    """The comparison's figure names, as write_compare_figures will write them."""
    has_val = any(r["val_loss"] for run in runs for r in run.val)
    return [n for n in COMPARE_FIGURES if n != "val_loss.png" or has_val]
