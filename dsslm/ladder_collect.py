"""`python -m dsslm.ladder --collect`: each point's outcome and final validation loss, read from its
run.dir; the seed mean and spread per (width, depth, rate); the best rate per width and depth; the
rule fitted to them; a markdown table (printed, and ladder.md), ladder.png, and the results added to
ladder.json. No torch: a collect runs anywhere the folder is readable, in about a second.

A point's outcome, from its events since its last start (and, for a local ladder, the exit code
logs/NAME.exit): finished (validated at its last step, a finite loss), diverged (finished with a
non-finite validation loss: the spike policy was off), escalated (the spike policy gave up, exit 3),
failed (a crash or a refusal), stopped (a preemption's save: run the ladder again to resume),
incomplete (started, no stop recorded: running, or killed), not started.

The rule: for each (width, depth) the rate with the lowest seed mean on the grid, refined by a
parabola through it and its two neighbours in log rate (where it is inside the grid), then a least-
squares fit of log best rate = c + a log width (+ b log depth, with two depths or more). Under muP
a is near 0 (the rate transfers); under the standard parametrisation negative (a wider model wants
a smaller rate). --target-width/--target-depth: the rate the rule predicts there.
"""
from __future__ import annotations

import math
import sys
import time
from pathlib import Path

import numpy as np

from dsslm.durable import write_json_atomic
from dsslm.observe.sinks import read_jsonl_backward

DONE = ("finished", "diverged", "escalated")  # a point with an outcome: a ladder run again skips it
STOPS = ("end", "finished", "escalation", "preempt_save", "failed", "interrupted", "preempted")


def fmt_lr(lr: float) -> str:
    """3e-3, 1e-2, 3.16e-3: the rate as a name and a table cell, short and exact to 3 digits."""
    mantissa, exponent = f"{lr:.2e}".split("e")
    return f"{mantissa.rstrip('0').rstrip('.')}e{int(exponent)}"


def _mean(values: list[float]) -> float:
    return sum(values) / len(values)


def final_val(run_dir: Path, domain: str) -> tuple[float | None, int | None]:
    """The newest validation record's loss (`domain`'s, or the mean over its domains) and step."""
    for record in read_jsonl_backward(run_dir / "metrics.jsonl"):
        losses = record.get("val_loss")
        if not isinstance(losses, dict) or not losses:
            continue
        if domain and domain not in losses:
            return None, record.get("step")
        values = [losses[domain]] if domain else list(losses.values())
        return _mean([float("nan") if v is None else float(v) for v in values]), record.get("step")
    return None, None


def val_domains(run_dir: Path) -> list[str]:
    for record in read_jsonl_backward(run_dir / "metrics.jsonl"):
        if isinstance(record.get("val_loss"), dict):
            return list(record["val_loss"])
    return []


def point_status(point: dict, out: Path, domain: str = "") -> dict:
    run_dir = Path(point["run_dir"])
    since_start = []  # the newest job's events, newest first
    for event in read_jsonl_backward(run_dir / "events.jsonl"):
        if event.get("event") == "start":
            break
        since_start.append(event.get("event"))
    stop = next((e for e in since_start if e in STOPS), None)
    exit_file = out / "logs" / f"{point['name']}.exit"
    try:
        code = int(exit_file.read_text().strip()) if exit_file.is_file() else None
    except ValueError:
        code = None
    loss, step = final_val(run_dir, domain)
    if "escalation" in since_start or code == 3:
        status = "escalated"
    elif stop in ("end", "finished"):
        status = "diverged" if loss is not None and not math.isfinite(loss) else "finished"
    elif stop == "preempt_save" or (stop in ("interrupted", "preempted") and code in (0, 130, None)):
        status = "stopped"
    elif stop == "failed" or code not in (None, 0):
        status = "failed"
    else:
        status = "incomplete" if (run_dir / "events.jsonl").exists() else "not started"
    finite = loss is not None and math.isfinite(loss)
    return {"name": point["name"], "width": point["width"], "depth": point["depth"], "lr": point["lr"],
            "seed": point["seed"], "status": status, "exit_code": code, "val_step": step,
            "val_loss": loss if finite and status == "finished" else None}


def cells(results: list[dict]) -> list[dict]:
    """One cell per (width, depth, rate): the seeds' losses, their mean, min and max. A rate any of
    whose seeds diverged or escalated has no mean (it is not a rate to use); one with seeds still to
    come has the mean of those that finished."""
    grouped: dict[tuple, list[dict]] = {}
    for r in results:
        grouped.setdefault((r["width"], r["depth"], r["lr"]), []).append(r)
    out = []
    for (width, depth, lr), group in sorted(grouped.items()):
        losses = [r["val_loss"] for r in group if r["val_loss"] is not None]
        bad = sum(r["status"] in ("diverged", "escalated") for r in group)
        out.append({"width": width, "depth": depth, "lr": lr, "seeds": len(group), "finished": len(losses),
                    "diverged": bad, "mean": _mean(losses) if losses and not bad else None,
                    "min": min(losses) if losses else None, "max": max(losses) if losses else None})
    return out


def best_rates(table: list[dict]) -> list[dict]:
    """Per (width, depth): the grid's best rate and the parabola's (in log10 rate) through it and its
    neighbours, where they have means and the parabola opens upwards; else the grid's, flagged."""
    best = []
    for key in sorted({(c["width"], c["depth"]) for c in table}):
        row = [c for c in table if (c["width"], c["depth"]) == key]
        scored = [(i, c) for i, c in enumerate(row) if c["mean"] is not None]
        if not scored:
            best.append({"width": key[0], "depth": key[1], "grid_lr": None, "lr": None, "loss": None, "edge": False})
            continue
        i, cell = min(scored, key=lambda t: t[1]["mean"])
        fitted, edge = cell["lr"], i in (0, len(row) - 1)
        if not edge and row[i - 1]["mean"] is not None and row[i + 1]["mean"] is not None:
            x = [math.log10(row[j]["lr"]) for j in (i - 1, i, i + 1)]
            a, b, _ = np.polyfit(x, [row[j]["mean"] for j in (i - 1, i, i + 1)], 2)
            if a > 0:
                fitted = 10 ** float(np.clip(-b / (2 * a), x[0], x[2]))
        best.append({"width": key[0], "depth": key[1], "grid_lr": cell["lr"], "lr": fitted, "loss": cell["mean"],
                     "edge": edge})
    return best


def fit_rule(best: list[dict], target_width: int, target_depth: int) -> dict:
    """log best rate = c + a log width [+ b log depth], least squares over the (width, depth)s with a
    best rate; the exponents are fitted only for a dimension the ladder varies."""
    rows = [b for b in best if b["lr"] is not None]
    widths, depths = sorted({b["width"] for b in rows}), sorted({b["depth"] for b in rows})
    rule: dict = {"points": len(rows), "width_exponent": None, "depth_exponent": None, "predicted_lr": None}
    if not rows:
        return rule
    columns = [np.ones(len(rows))]
    if len(widths) > 1:
        columns.append(np.log([b["width"] for b in rows]))
    if len(depths) > 1:
        columns.append(np.log([b["depth"] for b in rows]))
    coef, *_ = np.linalg.lstsq(np.stack(columns, 1), np.log([b["lr"] for b in rows]), rcond=None)
    coef = [float(c) for c in coef]
    rule["log_c"] = coef[0]
    k = 1
    if len(widths) > 1:
        rule["width_exponent"], k = coef[k], k + 1
    if len(depths) > 1:
        rule["depth_exponent"] = coef[k]
    grid = [b["grid_lr"] for b in rows]
    rule["grid_spread"] = max(grid) / min(grid)  # the best grid rates' max / min across widths and depths
    tw, td = target_width or None, target_depth or None
    if tw or td:
        log_lr = coef[0] + (rule["width_exponent"] or 0) * math.log(tw or widths[-1]) \
            + (rule["depth_exponent"] or 0) * math.log(td or depths[-1])
        rule.update(predicted_lr=math.exp(log_lr), target_width=tw or widths[-1], target_depth=td or depths[-1])
    return rule


def _num(v: float | None, digits: int = 4) -> str:
    return "-" if v is None else f"{v:.{digits}f}"


def parametrisation(rules: dict) -> str:
    """What the ladder's points train under, for its report and plot: the width and the depth
    rule each on its own (a depth-only ladder is not the standard parametrisation)."""
    keys = [f"model.{k}={rules[k]}" for k in ("mup_base_width", "mup_base_depth") if rules.get(k)]
    if not keys:
        return "standard parametrisation"
    return f"{'muP' if rules.get('mup_base_width') else 'depth-muP'} ({', '.join(keys)})"


def report(plan: dict, results: list[dict], table: list[dict], best: list[dict], rule: dict) -> str:
    rules = plan.get("rules", {})
    param = parametrisation(rules)
    counts = {s: sum(r["status"] == s for r in results) for s in dict.fromkeys(r["status"] for r in results)}
    lines = [f"ladder: {len(results)} points, {param}, model.n_heads={rules.get('n_heads')}; "
             + ", ".join(f"{n} {s}" for s, n in counts.items()), "",
             "| width | depth | lr | seeds | val loss (mean) | min | max | note |", "|---|---|---|---|---|---|---|---|"]
    for c in table:
        mark = " **best**" if any(b["grid_lr"] == c["lr"] and (b["width"], b["depth"]) == (c["width"], c["depth"])
                                  for b in best) else ""
        note = ", ".join(filter(None, [f"{c['diverged']} diverged" if c["diverged"] else "",
                                       f"{c['seeds'] - c['finished'] - c['diverged']} not finished"
                                       if c["seeds"] - c["finished"] - c["diverged"] else ""]))
        lines.append(f"| {c['width']} | {c['depth']} | {fmt_lr(c['lr'])} | {c['finished']}/{c['seeds']} | "
                     f"{_num(c['mean'])}{mark} | {_num(c['min'])} | {_num(c['max'])} | {note} |")
    lines.append("")
    for b in best:
        if b["lr"] is None:
            lines.append(f"width {b['width']}, depth {b['depth']}: no rate finished on every seed")
            continue
        how = ("; at the grid's edge: the best may lie beyond it; widen --lrs" if b["edge"] else
               f", {fmt_lr(b['lr'])} by the parabola through it and its neighbours" if b["lr"] != b["grid_lr"] else "")
        lines.append(f"width {b['width']}, depth {b['depth']}: best rate {fmt_lr(b['grid_lr'])} on the grid "
                     f"(loss {b['loss']:.4f}){how}")
    if rule.get("width_exponent") is not None or rule.get("depth_exponent") is not None:
        terms = " x ".join(filter(None, [f"width^({rule['width_exponent']:+.2f})" if rule["width_exponent"] is not None
                                         else "", f"depth^({rule['depth_exponent']:+.2f})"
                                         if rule["depth_exponent"] is not None else ""]))
        lines.append(f"rule: best lr = {fmt_lr(math.exp(rule['log_c']))} x {terms} (least squares in log-log over "
                     f"{rule['points']} best rates); the grid's best rates span {rule['grid_spread']:.3g}x")
    elif rule["points"]:
        lines.append("rule: one width and depth only: no trend to fit")
    if rule.get("predicted_lr") is not None:
        lines.append(f"predicted best lr at width {rule['target_width']}, depth {rule['target_depth']}: "
                     f"{fmt_lr(rule['predicted_lr'])}")
    return "\n".join(lines)


def collect(plan: dict, out: Path, target_width: int = 0, target_depth: int = 0, domain: str = "") -> int:
    """Read every point, print the table and the rule, write ladder.md, ladder.png and ladder.json's
    results. 0, whatever the points' outcomes (the table says them); 2 for a --domain no run has."""
    from dsslm.ladder_plot import plot
    results = [point_status(p, out, domain) for p in plan["points"]]
    if domain and not any(r["val_loss"] is not None for r in results):
        seen = sorted({d for p in plan["points"] for d in val_domains(Path(p["run_dir"]))})
        print(f"dsslm.ladder: --domain {domain}: no point has its validation loss (the runs have: "
              f"{', '.join(seen) or 'none yet'})", file=sys.stderr)
        return 2
    table = cells(results)
    best = best_rates(table)
    rule = fit_rule(best, target_width, target_depth)
    text = report(plan, results, table, best, rule)
    (out / "ladder.md").write_text(text + "\n")
    drawn = plot(plan, table, best, out / "ladder.png")
    plan["results"] = {"collected": time.time(), "domain": domain or "mean", "points": results, "cells": table,
                       "best": best, "rule": rule}
    write_json_atomic(out / "ladder.json", plan, indent=1)
    print(text)
    print(f"wrote {out / 'ladder.md'}, {out / 'ladder.json'}" + (f" and {out / 'ladder.png'}" if drawn else
                                                                  " (no ladder.png: matplotlib is not installed)"))
    return 0
