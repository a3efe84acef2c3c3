"""ladder.png (`python -m dsslm.ladder --collect`): final validation loss against the peak learning
rate on a log axis, one line per width and depth (the seed mean, where every seed finished), a band
from the seeds' min to max, the best rate starred, diverged rates marked x at the top."""
from __future__ import annotations

from pathlib import Path

from dsslm.ladder_collect import fmt_lr, parametrisation


def plot(plan: dict, table: list[dict], best: list[dict], path: Path) -> bool:
    """False where matplotlib is not installed (the table and ladder.json still say everything)."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    keys = sorted({(c["width"], c["depth"]) for c in table})
    depths = {d for _, d in keys}
    fig, ax = plt.subplots(figsize=(7, 4.5))
    finite = [v for c in table for v in (c["min"], c["max"]) if v is not None]
    top = max(finite) if finite else 1.0
    colours = plt.cm.viridis([i / max(1, len(keys) - 1) * 0.9 for i in range(len(keys))])
    for colour, (width, depth) in zip(colours, keys):
        row = [c for c in table if (c["width"], c["depth"]) == (width, depth)]
        label = f"width {width}" + (f", depth {depth}" if len(depths) > 1 else "")
        means = [(c["lr"], c["mean"]) for c in row if c["mean"] is not None]
        if means:
            ax.plot(*zip(*means), marker="o", color=colour, label=label)
        band = [(c["lr"], c["min"], c["max"]) for c in row if c["min"] is not None]
        if band:
            lrs, lows, highs = zip(*band)
            ax.fill_between(lrs, lows, highs, color=colour, alpha=0.2, linewidth=0)
        gone = [c["lr"] for c in row if c["diverged"]]
        if gone:
            ax.plot(gone, [top] * len(gone), "x", color=colour, markersize=8)
        for b in best:
            if (b["width"], b["depth"]) == (width, depth) and b["grid_lr"] is not None:
                ax.plot([b["grid_lr"]], [b["loss"]], "*", color=colour, markersize=14, markeredgecolor="black")
    lrs = sorted({c["lr"] for c in table})
    ax.set_xscale("log")
    ax.set_xticks(lrs, [fmt_lr(lr) for lr in lrs])
    ax.minorticks_off()
    rules = plan.get("rules", {})
    param = parametrisation(rules)
    seeds = len(plan.get("grid", {}).get("seeds", [])) or 1
    gone = "; x: diverged" if any(c["diverged"] for c in table) else ""
    ax.set(xlabel="peak learning rate (optim.peak_lr)", ylabel="final validation loss",
           title=f"{param}: mean and min-max of {seeds} seed(s){gone}")
    ax.title.set_fontsize(10)
    ax.grid(True, alpha=0.3)
    if keys:
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return True
