"""Spike policies against each other on real text: five arms x five cells x seeds, one table.

Arms (the same harness, the same model, data and schedule):
    fixed      global-norm clipping at optim.clip = 1.0, no monitor
    olmo       OLMo-core's skip-step: z-score of loss and grad norm over the last 128 steps at
               6 sigma (detector zscore), every outlier (non-finite included) skipped, never a rewind
    zclip      ZClip alone (optim.clip_mode=zclip, no fixed ceiling), no monitor
    rewind     dsslm without triage (monitor.triage=false): skip isolated outliers, rewind and
               skip the window on sustained ones, back the lr off when a region repeats
    triage     dsslm as shipped: in-place re-runs and replays that tell data / state / transient apart
    ramp       triage with monitor.lr_recover_steps=100: a state backoff ramps back over 100 steps

Cells (what happens to the run; drills from `faults.*`, steps are step counts):
    clean      nothing
    data       two windows of batches made of one repeated 4-gram of real text (repeat_batches)
    state      a 12x learning-rate burst over six steps (lr_burst)
    transient  one rank's gradients x1000 once (grad_fault_steps) and a non-finite loss once (nan_steps)
    recipe     no drill, a recipe that spikes by itself (RECIPE: peak lr 3e-2, beta2 0.999, eps 1e-12,
               no z-loss, no weight decay, one head, untied embeddings)
    epoch2     the data drill (three batches of a repeated 4-gram, repeat_batches [90, 93)) in the
               first epoch of a small corpus (`small_corpus`: ~133 steps an epoch), the run spanning
               2+ epochs: the drill follows the chunks, so they recur scattered over every later
               epoch. (At batches [40, 43) the default monitor missed it: grad norms are still
               large and falling there.)
    scattered  the small corpus's one long document (~240 chunks) made a repeated 2-gram wherever
               it is fed (repeat_chunks): the shuffle puts ~2 of its sequences in each batch, never
               most of one. Weaker drills were never detected by the default monitor (300 steps,
               seed 1): a 50-chunk document (one sequence in ~40% of batches) as a repeated 4-gram,
               1-gram or random tokens; 280 or 420 chunks as random tokens; this document or 530
               chunks as a 1-gram

Per cell, over seeds (mean; per-seed values in --json): final validation loss against the same
arm's clean run of the same seed (for `clean`, against `fixed` clean; for `recipe`, against `fixed`
recipe), OLMo-core's spike score (the share of steps whose loss or grad norm is above mean +
6 sigma of the previous 128, or non-finite), rewinds, steps recomputed (step records abandoned by a
rewind, plus in-place re-runs), data batches skipped (skip-list batches plus skipped steps; in
brackets those named as data, skipped in every epoch), runs
that diverged (non-finite or > 1.5x the reference val loss) or escalated (exit 3), attribution
accuracy (the last triage decision covering a drilled event against its cause), drilled sequences
fed in kept steps (the last record of a step, verdict ok) before / from the first detected spike
(goal after: 0; "no spike" when the run never detected one), and on clean runs the skips and
rewinds (false positives). epoch2 and scattered train on the small corpus: their val loss has no
reference run ("n/a").

Durable checkpoints are as far apart as the shipped configs make them (`--ckpt-every 1000`: none
inside a 400-step run but the start), with in-memory rewind points every `--rewind-every` (50)
steps; `--ckpt-every 20 --rewind-every 0` is the spacing the first table was measured at.

    OMP_NUM_THREADS=1 .venv/bin/python bench/bench_spikes.py [--seeds 3] [--steps 400] [--out DIR]
"""
from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # this checkout's dsslm, not an installed one
from dsslm.config import load  # noqa: E402
from dsslm.data.loader import Loader  # noqa: E402
from dsslm.data.prepare import prepare  # noqa: E402
from dsslm.data.skips import chunk_range, entries_of, windows_of  # noqa: E402
from dsslm.recovery.faults import Drills  # noqa: E402
from dsslm.recovery.rewind import Escalation  # noqa: E402
from dsslm.train import train  # noqa: E402

SHAPE = ["model.d_model=64", "model.n_layers=2", "model.n_heads=2", "model.seq_len=64", "train.micro_batch_size=16",
         "train.precision=fp32", "train.device=cpu", "run.tensorboard=false", "observe.every=0", "run.val_batches=8",
         "optim.peak_lr=3e-3", "optim.min_lr=3e-4", "optim.warmup_steps=30", "ckpt.every=20", "ckpt.keep_last=3"]
SPACING = ["ckpt.every=1000", "monitor.rewind_every=50"]  # set from --ckpt-every / --rewind-every
ARMS = {
    "fixed": ["monitor.enabled=false"],
    "olmo": ["monitor.detector=zscore", "monitor.window=128", "monitor.min_history=64", "monitor.loss_z=6",
             "monitor.hard_loss_z=1e9", "monitor.max_skips=1000000", "monitor.nonfinite=skip", "monitor.triage=false"],
    "zclip": ["monitor.enabled=false", "optim.clip_mode=zclip", "optim.clip=1e9"],
    "rewind": ["monitor.triage=false"],
    "triage": [],
    "ramp": ["monitor.lr_recover_steps=100"],
}
SMALL: dict = {}  # epoch2 / scattered: {"dir", "epoch_steps", "document": [first, end) chunk ids}, from small_corpus
SMALL_CELLS = ("epoch2", "scattered")
RECIPE = ["optim.peak_lr=3e-2", "optim.beta2=0.999", "optim.eps=1e-12", "train.z_loss=0", "optim.weight_decay=0",
          "model.n_heads=1", "model.tie_embeddings=false"]


def cells(steps: int) -> dict[str, tuple[list[str], list[tuple[str, int, int]]]]:
    """cell -> (overrides, drilled events as (cause, first step, last step a spike may show))."""
    a, b, s, t1, t2 = steps * 3 // 8, steps * 3 // 4, steps // 2, steps * 3 // 8, steps * 3 // 4
    return {
        "clean": ([], []),
        "data": ([f"faults.repeat_batches=[[{a},{a + 3}],[{b},{b + 3}]]"],
                 [("data", a - 10, a + 6), ("data", b - 20, b + 6)]),  # an earlier skip window moves batch b earlier
        "state": ([f"faults.lr_burst=[[{s},{s + 6},12.0]]"], [("state", s, s + 10)]),
        "transient": ([f"faults.grad_fault_steps=[{t1}]", f"faults.nan_steps=[{t2}]"],
                      [("transient", t1, t1), ("transient", t2, t2)]),
        "recipe": (RECIPE, []),
        **small_cells(steps),
    }


def small_cells(steps: int) -> dict:
    if not SMALL:
        return {}
    data, (first, end) = f"data.dir={SMALL['dir']}", SMALL["document"]
    return {
        "epoch2": ([data, "faults.repeat_batches=[[90,93]]"], [("data", 80, 96)]),
        # Anywhere: the document's sequences are in batches all over every epoch.
        "scattered": ([data, f"faults.repeat_chunks=[[{first},{end}]]", "faults.repeat_ngram=2"],
                      [("data", 1, steps)]),
    }


def small_corpus(root: Path, seq_len: int = 64, batch: int = 16, seed: int = 1) -> dict:
    """A corpus of stdlib modules (one document each: many of 2-8 KB and one of 16-20 KB) with an
    epoch of ~133 steps of 16 x 64 tokens, and the chunk range of its long document (its whole
    chunks: ~240, about two in every batch of an epoch)."""
    src = root / "small-src"
    src.mkdir()
    total, long = 0, False
    for path in sorted(Path(os.__file__).parent.glob("*.py")):
        text = path.read_text(errors="replace")
        if 2_000 < len(text) < 8_000 and total < 120_000:
            (src / path.name).write_text(text)
            total += len(text)
        elif 16_000 < len(text) < 20_000 and not long:
            # First in the stream (prepare reads files by name), before the first val block: prepare
            # cuts the stream into ~1000 blocks and ends a document a val block cuts off, so at
            # val_fraction 0.02 (a val block every ~6.8K tokens here) no document stayed whole.
            (src / f"0-{path.name}").write_text(text)
            long = True
    # The first val block is block ceil(1 / f) - 1: at 0.005, ~27K tokens in, past the long document.
    prepare([src], root / "small-data", domain="code", val_fraction=0.005)
    loader = Loader(root / "small-data", seq_len, seed)
    (path, _), = loader._train  # one shard
    ends = np.flatnonzero(np.asarray(loader._shard(path)) == loader.manifest["tokenizer"]["eos_id"]) + 1
    a, b = max(zip(np.concatenate([[0], ends[:-1]]), ends), key=lambda ab: ab[1] - ab[0])  # the longest
    # Chunk i reads tokens [i*seq_len, i*seq_len + seq_len + 1): the chunks wholly inside [a, b).
    document = [-(-int(a) // seq_len), (int(b) - seq_len - 1) // seq_len + 1]
    if document[1] - document[0] >= 200:
        return {"dir": str(root / "small-data"), "epoch_steps": loader.n_chunks // batch, "document": document}
    raise SystemExit("bench: no stdlib module of 16-20 KB for the scattered cell's document")


def read_jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()] if path.exists() else []


FED: dict[int, int] = {}  # data_position -> drilled sequences its latest computation was fed


def counting_corrupt(corrupt):
    """Drills.corrupt, noting per step (by its first global sequence) how many sequences a drill
    replaced: the last computation at a position is the one its step's last record describes."""
    def wrapped(self, micro_batches, indices):
        out = corrupt(self, micro_batches, indices)
        if len(indices):
            FED[int(indices[0])] = sum(int((a[0] != b[0]).any(dim=1).sum()) for a, b in zip(micro_batches, out))
        return out
    return wrapped


Drills.corrupt = counting_corrupt(Drills.corrupt)


def run(root: Path, arm: str, cell: str, seed: int, steps: int, overrides: list[str]) -> dict:
    run_dir = root / f"{arm}-{cell}-{seed}"
    cfg = load(None, SHAPE + [f"run.dir={run_dir}", f"run.seed={seed}", f"train.total_steps={steps}",
                              f"run.val_every={steps}", *SPACING, *ARMS[arm], *overrides])
    started, escalated = time.perf_counter(), False
    FED.clear()
    try:
        train(cfg)
    except Escalation:
        escalated = True
    return measure(run_dir, escalated, time.perf_counter() - started)


def poisoned_feeds(records: list[dict], final: dict[int, dict]) -> tuple[int, int | None]:
    """Drilled sequences fed in kept steps (a step's last record, verdict ok) before the first
    step any record of which was not ok, and from it on (None: no spike was ever detected)."""
    spikes = [r["step"] for r in records if r["verdict"] != "ok"]
    first = min(spikes) if spikes else None
    kept = [(s, FED.get(r["data_position"], 0)) for s, r in final.items() if r["verdict"] == "ok"]
    before = sum(n for s, n in kept if first is None or s < first)
    return before, (None if first is None else sum(n for s, n in kept if s >= first))


def measure(run_dir: Path, escalated: bool, wall_s: float) -> dict:
    metrics, events = read_jsonl(run_dir / "metrics.jsonl"), read_jsonl(run_dir / "events.jsonl")
    records = [r for r in metrics if "loss" in r]
    final = {r["step"]: r for r in records}  # a replayed step's last record is the one kept
    vals = [r["val_loss"] for r in metrics if "val_loss" in r]
    val = statistics.fmean(as_float(v) for v in vals[-1].values()) if vals else math.nan
    batch = records[0]["batch_sequences"] if records else 1
    skip_list = (read_json(run_dir / "skip_list.json") or {}).get("skip_list", [])
    kept_skips = sum(r["verdict"] == "skip_step" for r in final.values())
    fed_before, fed_after = poisoned_feeds(records, final)
    return {"val": val, "fed_before": fed_before, "fed_after": fed_after, "escalated": escalated, "wall_s": wall_s,
            "spike_score": spike_score([final[s] for s in sorted(final)]),
            "rewinds": sum(e["event"] == "rewind" for e in events),
            "skips": sum(e["event"] == "skip" for e in events),
            "recomputed": len(records) - len(final) + sum(e["event"] == "triage" and e.get("scope") == "step"
                                                          for e in events),
            "batches_skipped": sum(sequences_skipped(skip_list, events)) / batch + kept_skips,
            # Of them, named as data: never fed again, in any epoch (the rest is positions, this pass).
            "batches_named": sequences_skipped(skip_list, events)[1] / batch,
            "decisions": [e for e in events if e["event"] == "triage"]}


def sequences_skipped(skip_list: list, events: list[dict]) -> tuple[int, int]:
    """Sequences the skip list takes out of one epoch: its windows' positions (this epoch only), and
    its data entries' chunks (every epoch)."""
    seq_len = next((e["config"]["model"]["seq_len"] for e in events if e["event"] == "start"), 1)
    return (sum(end - start for start, end in windows_of(skip_list)),
            sum(hi - lo for lo, hi in (chunk_range(*e["tokens"], seq_len, 2**62) for e in entries_of(skip_list))))


def read_json(path: Path) -> dict | None:
    return json.loads(path.read_text()) if path.exists() else None


def spike_score(trajectory: list[dict], window: int = 128, sigmas: float = 6.0) -> float:
    """OLMo-core's: the share of steps whose loss or grad norm is above mean + 6 std of the
    previous `window` steps, or non-finite (steps with fewer than 16 finite before them: unscored)."""
    series = {key: [as_float(r[key]) for r in trajectory] for key in ("loss", "gnorm")}
    flagged = scored = 0
    for i in range(16, len(trajectory)):
        hits = []
        for xs in series.values():
            past = [x for x in xs[max(0, i - window):i] if math.isfinite(x)]
            if len(past) >= 16:
                hits.append(not math.isfinite(xs[i]) or xs[i] > statistics.fmean(past) + sigmas * statistics.pstdev(past))
        scored += bool(hits)
        flagged += any(hits)
    return flagged / max(scored, 1)


def as_float(x) -> float:
    return float(x) if not isinstance(x, str) else float("nan")


def attribution(result: dict, drilled: list[tuple[str, int, int]]) -> list[bool | None]:
    """For each drilled event: is the last triage decision touching its steps of its cause? None
    where no decision touches it: the drill never raised a spike, so nothing was attributed (a
    detection miss, reported apart; its cost shows in the val loss). `unknown` counts as wrong."""
    out: list[bool | None] = []
    for cause, first, last in drilled:
        touching = [d for d in result["decisions"] if d["spike_start"] <= last and d["target"] >= first]
        windows = [d for d in touching if d["scope"] == "window"]
        final = (windows or touching or [None])[-1]
        out.append(None if final is None else final["verdict"] == cause)
    return out


def summarize(results: dict, steps: int) -> list[dict]:
    rows = []
    for arm in ARMS:
        for cell, (_, drilled) in cells(steps).items():
            per_seed = results[arm].get(cell)
            if not per_seed:
                continue
            rel = []
            for seed, r in per_seed.items():
                ref_arm, ref_cell = ("fixed", cell) if cell in ("clean", "recipe") else (arm, "clean")
                ref = math.nan if cell in SMALL_CELLS else results[ref_arm][ref_cell][seed]["val"]
                rel.append(100 * (r["val"] / ref - 1) if math.isfinite(r["val"]) and math.isfinite(ref) else math.nan)
            triaged = arm in ("triage", "ramp")
            judged = [ok for r in per_seed.values() for ok in attribution(r, drilled)] if triaged else []
            correct = [ok for ok in judged if ok is not None]
            undetected = len(judged) - len(correct)
            rs = list(per_seed.values())
            after = [r["fed_after"] for r in rs if r["fed_after"] is not None]
            rows.append({
                "arm": arm, "cell": cell, "val_delta_pct": statistics.fmean(rel) if rel else math.nan,
                "val_delta_max_pct": max(rel, key=lambda x: -math.inf if math.isnan(x) else abs(x)),
                "spike_score_pct": 100 * statistics.fmean(r["spike_score"] for r in rs),
                "rewinds": statistics.fmean(r["rewinds"] for r in rs),
                "recomputed": statistics.fmean(r["recomputed"] for r in rs),
                "batches_skipped": statistics.fmean(r["batches_skipped"] for r in rs),
                "batches_named": statistics.fmean(r.get("batches_named", math.nan) for r in rs),
                "diverged": sum((not math.isfinite(r["val"])) or x > 50 for r, x in zip(rs, rel)),
                "escalated": sum(r["escalated"] for r in rs), "seeds": len(rs),
                "attribution": (f"{sum(correct)}/{len(correct)}" + (f" ({undetected} never spiked)" if undetected else ""))
                if judged else "-",
                "poisoned_fed": (f"{statistics.fmean(r['fed_before'] for r in rs):.1f} / "
                                 + (f"{statistics.fmean(after):.1f}" if after else "no spike")
                                 + (f" ({len(rs) - len(after)} no spike)" if after and len(after) < len(rs) else ""))
                if any(cause == "data" for cause, _, _ in drilled) else "-",
                "false_positives": (f"{statistics.fmean(r['skips'] for r in rs):.1f} skips, "
                                    f"{statistics.fmean(r['rewinds'] for r in rs):.1f} rewinds")
                if cell == "clean" else "-",
            })
    return rows


def table(rows: list[dict]) -> str:
    head = ("| arm | cell | val vs ref (mean / worst) | spike score | rewinds | steps recomputed | batches skipped "
            "(of them named as data: every epoch) "
            "| diverged / escalated | attribution | drilled sequences kept: before / from first spike "
            "| clean: false positives |")
    lines = [head, "|" + "---|" * 11]
    for r in rows:
        val = ("n/a" if math.isnan(r["val_delta_pct"]) and r["cell"] in SMALL_CELLS
               else f"{r['val_delta_pct']:+.2f}% / {r['val_delta_max_pct']:+.2f}%")
        lines.append(f"| {r['arm']} | {r['cell']} | {val} "
                     f"| {r['spike_score_pct']:.2f}% | {r['rewinds']:.1f} | {r['recomputed']:.1f} "
                     f"| {r['batches_skipped']:.1f} ({r.get('batches_named', math.nan):.1f}) "
                     f"| {r['diverged']}/{r['seeds']} , {r['escalated']}/{r['seeds']} "
                     f"| {r['attribution']} | {r['poisoned_fed']} | {r['false_positives']} |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=400)
    parser.add_argument("--arms", default=",".join(ARMS))
    parser.add_argument("--cells", default="clean,data,state,transient,recipe,epoch2,scattered")
    parser.add_argument("--ckpt-every", type=int, default=1000, help="durable checkpoints (the shipped spacing)")
    parser.add_argument("--rewind-every", type=int, default=50, help="in-memory rewind points (0: none)")
    parser.add_argument("--out", type=Path, default=None, help="keep the run folders here (default: a temp dir)")
    parser.add_argument("--json", type=Path, default=None, help="write every run's figures here")
    parser.add_argument("--summarize", type=Path, default=None, help="print the table of a --json file; run nothing")
    args = parser.parse_args()
    if args.summarize:
        saved = json.loads(args.summarize.read_text())["runs"]
        rows = [r for r in summarize(saved, args.steps) if r["cell"] in args.cells.split(",")
                and r["arm"] in args.arms.split(",")]
        print(table(rows))
        return
    torch.set_num_threads(1)  # small runs: a second thread only waits on a shared 2-core machine
    arms, wanted = args.arms.split(","), args.cells.split(",")
    SPACING[:] = [f"ckpt.every={args.ckpt_every}", f"monitor.rewind_every={args.rewind_every}"]
    started = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        root = args.out or Path(tmp)
        if set(wanted) & set(SMALL_CELLS):
            SMALL.update(small_corpus(Path(tmp)))
            print(f"small corpus: {SMALL['epoch_steps']} steps an epoch, document chunks {SMALL['document']}",
                  flush=True)
        results: dict = {arm: {} for arm in ARMS}
        for arm in ARMS:
            for cell, (overrides, _) in cells(args.steps).items():
                # fixed clean is every clean run's reference, fixed recipe every recipe run's.
                needed = (arm in arms and cell in wanted) or (arm == "fixed" and cell == "clean") \
                    or (arm == "fixed" and cell == "recipe" and cell in wanted) or (cell == "clean" and arm in arms)
                if not needed:
                    continue
                results[arm][cell] = {seed: run(root, arm, cell, seed, args.steps, overrides)
                                      for seed in range(1, args.seeds + 1)}
                print(f"done {arm}/{cell} ({time.perf_counter() - started:.0f} s)", flush=True)
    rows = [r for r in summarize(results, args.steps) if r["arm"] in arms and r["cell"] in wanted]
    print(f"\n{args.seeds} seeds x {args.steps} steps, {time.perf_counter() - started:.0f} s\n")
    print(table(rows))
    if args.json:
        args.json.write_text(json.dumps({"rows": rows, "runs": results}, indent=1, default=str))


if __name__ == "__main__":
    main()
