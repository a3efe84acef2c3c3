"""False alarms of the spike monitor on clean text (issue 36), and the drills it must still catch.

Clean runs of `python -m dsslm.train` (a subprocess per run, the checkout of `--tree`: its dsslm
is what runs) over a matrix, counting from each run's run.dir what the spike policy did on text
with nothing wrong in it: escalations (exit 3), rewinds (`rewind` events, a triage's replays
included), LR cuts (`lr_scale` events that lower it), skipped steps (kept steps whose last record
is `skip_step`, % of steps), tokens named as data (the data entries of the final checkpoint's
skip list), and grad-norm surges noted (`gnorm_surge` events; 0 where the monitor has none).

The run is the issue's recipe: 2 layers, context 64, `train.micro_batch_size` sequences a step (one
process, no accumulation), everything else configs/tiny.yaml's (4 heads, min_lr 2e-4, cosine,
rewind points every 50 steps, checkpoints every 250 and at the end). Factors:

    data       code/byte (the embedded stdlib corpus), plays/byte and plays/bpe (a 1.1 MB plays text,
               `--plays`, BPE vocabulary `--bpe-vocab`, prepared by the tree's own `dsslm.data prepare`)
    peak_lr    1e-3, 3e-3          warmup   20, 100
    batch      8, 32 sequences     d_model  64, 128            seeds 1-3, `--steps` (300)

Design: for each data set the half fraction of the four two-level factors that holds the riskiest
cell (lr 3e-3, warmup 20, batch 8, d_model 64; coded +1, the other levels -1, kept where the
product is +1: 8 cells, every level of every factor, no main effect aliased with another), plus
the cell where the issue saw every seed alarm (d_model 128, lr 3e-3, warmup 20, batch 8) on each
data set, plus seeds 1-`--risky-seeds` (12) of the riskiest cell on plays/byte. `--full`: all 16
cells of each data set. `--quick`: 12 runs of the riskiest cells, for iterating.

`--drills`: the same recipe on a few cells, each drill of `faults.*` at step `--steps` / 2 (after
the early phase where the false alarms are): poisoned batches (3 batches of random tokens,
expected `data`), an LR burst (12x for 6 steps, `state`), a one-off gradient fault (x1000 on one
step, `transient`), a non-finite loss (`transient`, by a rewind). Caught: an alarm (a step that is
not ok, or a skip / rewind / triage event) within [drill step - 2, drill step + 20]; verdict: the
last triage decision touching those steps (window scope first), else `skip` / `rewind`; delay:
steps from the drill's first step (for poisoned batches, the first step fed them) to that alarm.

`--geometry` (issue 49): the riskiest recipe on the embedded corpus at a global batch of 64 split as real runs split it
(micro-batches x accumulation x ranks: 8 x 8 x 1, 4 x 8 x 2, 1 x 32 x 2; 2 ranks through `python -m
dsslm.torchrun`), clean at `--seeds` seeds, then the poison and LR-burst drills on each split;
`--drill-step` puts the drills early (10-100, in the initial descent) instead of at `--steps` / 2.

`--long` (issue 49): two runs of the riskiest recipe over many passes of a ~1.2M-token corpus of
prose and code (pydoc's topics and stdlib source, one document per file; `--steps 30000` is 14
passes): clean, and with two poison windows (3 batches of random tokens at `--drill-step`, default
`--steps` / 6, and 3x it). Reports what the policy did and the share of the corpus it named.

Goal (issue 36): 0 escalations, 0 rewinds, 0 LR cuts, 0 tokens named, skipped steps at most 0.5%,
in every cell; every drill caught with the right verdict where today's monitor catches it.

    nice -n 5 .venv/bin/python bench/bench_false_alarms.py [--tree PATH] [--jobs 1] [--quick | --drills]
        [--out DIR] [--json FILE]      # --summarize FILE: the tables of a saved --json, nothing run

The plays text: `bench/out/shakespeare.txt` by default (tinyshakespeare's input.txt, or the
stand-in `bench/shakespeare_text.py` builds from Gutenberg plays). Runs set OMP_NUM_THREADS=1.
"""
from __future__ import annotations

import argparse
import itertools
import json
import math
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from bench_spikes import read_json, read_jsonl, spike_score  # noqa: E402

LR, WARMUP, BATCH, D_MODEL = (1e-3, 3e-3), (100, 20), (32, 8), (128, 64)  # (safe, risky) levels
DATASETS = ("code/byte", "plays/byte", "plays/bpe")
RISKY = {"data": "plays/byte", "lr": 3e-3, "warmup": 20, "batch": 8, "d_model": 64}
HOT = {"lr": 3e-3, "warmup": 20, "batch": 8, "d_model": 128}  # the issue: every seed alarmed here
RECIPE = ["model.n_layers=2", "model.seq_len=64", "run.tensorboard=false"]
ALARMS = ("skip", "rewind", "triage", "lr_scale", "escalation", "gnorm_surge")
DRILLS = {  # name -> (expected verdict, overrides at drill step s)
    "poison": ("data", lambda s: [f"faults.poison_batches=[[{s},{s + 3}]]"]),
    "lr_burst": ("state", lambda s: [f"faults.lr_burst=[[{s},{s + 6},12.0]]"]),
    "grad_fault": ("transient", lambda s: [f"faults.grad_fault_steps=[{s}]"]),
    "nan": ("transient", lambda s: [f"faults.nan_steps=[{s}]"]),
    # --long: two poison windows, at s and 3s (each 3 batches of random tokens)
    "poison2": ("data", lambda s: [f"faults.poison_batches=[[{s},{s + 3}],[{3 * s},{3 * s + 3}]]"]),
}
DRILL_CELLS = [
    {"data": "plays/byte", "lr": 3e-3, "warmup": 20, "batch": 8, "d_model": 64},
    {"data": "plays/byte", "lr": 3e-3, "warmup": 20, "batch": 8, "d_model": 128},
    {"data": "code/byte", "lr": 1e-3, "warmup": 100, "batch": 8, "d_model": 64},
    {"data": "plays/bpe", "lr": 3e-3, "warmup": 20, "batch": 8, "d_model": 64},
]
CELL_KEYS = ("data", "lr", "warmup", "batch", "d_model")
# Real geometry (issue 49): the riskiest recipe on the embedded corpus at a global batch of 64 split as real runs split it,
# accumulation 8-32 and 2 ranks (`--geometry`); `batch` is then the global batch. On the embedded
# corpus: it needs nothing outside the checkout.
GEOMETRY_CELLS = [dict(RISKY, data="code/byte", batch=64, accum=accum, ranks=ranks)
                  for accum, ranks in ((8, 1), (8, 2), (32, 2))]
# Long runs (issue 49, `--long`): the riskiest recipe over many passes of a ~1.2M-token corpus of
# prose and code (mixed/byte: Python's pydoc topics and stdlib source, one document per file).
LONG = dict(RISKY, data="mixed/byte")
MIXED_BYTES = 1_200_000


def cell_of(data: str, lr: float, warmup: int, batch: int, d_model: int) -> dict:
    return {"data": data, "lr": lr, "warmup": warmup, "batch": batch, "d_model": d_model}


def coded(cell: dict) -> int:
    """The product of the four factors coded +1 (risky level) / -1."""
    levels = ((LR, "lr"), (WARMUP, "warmup"), (BATCH, "batch"), (D_MODEL, "d_model"))
    return math.prod(1 if cell[key] == pair[1] else -1 for pair, key in levels)


def matrix(args) -> list[tuple[dict, int, str]]:
    """(cell, seed, drill) of every run, most telling first: the risky seeds, the hot cells, the rest."""
    seeds = range(1, args.seeds + 1)
    if args.quick:
        risky = [(RISKY, s, "") for s in range(1, 7)]
        hot = [(dict(HOT, data="plays/byte"), s, "") for s in (1, 2)]
        others = [(dict(RISKY, data="code/byte"), 1, ""), (dict(RISKY, data="plays/bpe"), 1, ""),
                  (cell_of("code/byte", 1e-3, 100, 8, 64), 1, ""), (cell_of("plays/bpe", 1e-3, 100, 32, 128), 1, "")]
        return risky + hot + others
    if args.long:
        return [(LONG, 1, ""), (LONG, 1, "poison2")]
    if args.geometry:
        clean = [(cell, s, "") for s in seeds for cell in GEOMETRY_CELLS]
        return clean + [(cell, 1, drill) for drill in ("poison", "lr_burst") for cell in GEOMETRY_CELLS]
    if args.drills:
        cells = DRILL_CELLS if not args.drill_cells else [DRILL_CELLS[int(i)] for i in args.drill_cells.split(",")]
        return [(cell, seed, drill) for drill in DRILLS for cell in cells for seed in range(1, args.drill_seeds + 1)]
    grid = [cell_of(d, *levels) for d in DATASETS for levels in itertools.product(LR, WARMUP, BATCH, D_MODEL)]
    kept = [c for c in grid if args.full or coded(c) == 1 or c == dict(HOT, data=c["data"])]
    risky = [(RISKY, s, "") for s in range(1, max(args.risky_seeds, args.seeds) + 1)]
    hot = [(c, s, "") for c in kept if c == dict(HOT, data=c["data"]) for s in seeds]
    # Seed by seed, so that a bench cut short has every cell at fewer seeds.
    rest = [(c, s, "") for s in seeds for c in kept if c != RISKY and c != dict(HOT, data=c["data"])]
    return risky + hot + rest


def split_of(cell: dict) -> tuple[int, int]:
    """(accumulation, ranks): 1 and 1 for the cells of the matrix."""
    return cell.get("accum", 1), cell.get("ranks", 1)


def label(cell: dict) -> str:
    accum, ranks = split_of(cell)
    split = f" = {cell['batch'] // (accum * ranks)} x {accum} x {ranks}" if (accum, ranks) != (1, 1) else ""
    return f"{cell['data']} lr {cell['lr']:g} wu {cell['warmup']} b {cell['batch']}{split} d {cell['d_model']}"


def run_name(cell: dict, seed: int, drill: str) -> str:
    name = f"{cell['data'].replace('/', '-')}-lr{cell['lr']:g}-wu{cell['warmup']}-b{cell['batch']}-d{cell['d_model']}"
    accum, ranks = split_of(cell)
    name += f"-a{accum}-r{ranks}" if (accum, ranks) != (1, 1) else ""
    return (f"{drill}-" if drill else "") + f"{name}-s{seed}"


def tree_env(tree: Path) -> dict:
    return dict(os.environ, PYTHONPATH=str(tree), OMP_NUM_THREADS="1", MKL_NUM_THREADS="1")


def check_tree(tree: Path) -> None:
    """The child imports the tree's dsslm (not the editable install the venv points at)."""
    out = subprocess.run([sys.executable, "-c", "import dsslm; print(dsslm.__file__)"], cwd=tree,
                         env=tree_env(tree), capture_output=True, text=True, check=True).stdout.strip()
    if not Path(out).resolve().is_relative_to(tree.resolve()):
        raise SystemExit(f"bench: --tree {tree} imports dsslm from {out}")


def prepare_data(tree: Path, root: Path, plays: Path, bpe_vocab: int, wanted: set[str]) -> dict[str, str]:
    """data set -> data.dir ("" = the embedded corpus), prepared by the tree's own CLI."""
    dirs = {"code/byte": ""}
    if "mixed/byte" in wanted:
        out = root / "data" / "mixed-byte"
        if not (out / "manifest.json").is_file():
            subprocess.run([sys.executable, "-m", "dsslm.data", "prepare", "--input", str(mixed_sources(root)),
                            "--out", str(out), "--domain", "mixed", "--tokenizer", "byte"], cwd=tree,
                           env=tree_env(tree), check=True, stdout=subprocess.DEVNULL)
        dirs["mixed/byte"] = str(out)
    for name, extra in (("plays/byte", ["--tokenizer", "byte"]),
                        ("plays/bpe", ["--tokenizer", "bpe", "--vocab-size", str(bpe_vocab)])):
        if name not in wanted:
            continue
        if not plays.is_file():
            raise SystemExit(f"bench: no plays text at {plays}: pass --plays (tinyshakespeare's input.txt, or "
                             "bench/shakespeare_text.py --plays DIR --out bench/out/shakespeare.txt)")
        out = root / "data" / name.replace("/", "-")
        if not (out / "manifest.json").is_file():
            subprocess.run([sys.executable, "-m", "dsslm.data", "prepare", "--input", str(plays), "--out", str(out),
                            "--domain", "plays", *extra], cwd=tree, env=tree_env(tree), check=True,
                           stdout=subprocess.DEVNULL)
        dirs[name] = str(out)
    return dirs


def mixed_sources(root: Path) -> Path:
    """~MIXED_BYTES of prose (pydoc's topics) and code (stdlib modules), one document per file,
    alternating, in a fixed order: a corpus nothing here was tuned on."""
    from pydoc_data.topics import topics
    src = root / "src-mixed"
    if src.is_dir():
        return src
    src.mkdir(parents=True)
    prose = [topics[k] for k in sorted(topics) if len(topics[k]) > 500]
    code = [p.read_text(errors="replace") for p in sorted(Path(os.__file__).parent.glob("*.py"))]
    size = 0
    for i, text in enumerate(itertools.chain.from_iterable(itertools.zip_longest(prose, code))):
        if text and size < MIXED_BYTES:
            text = text.encode("ascii", "ignore").decode()[:MIXED_BYTES - size]
            (src / f"doc-{i:05d}.txt").write_text(text)
            size += len(text)
    return src


def corpus_tokens(data_dir: str) -> int | None:
    """Train tokens of a prepared DATA_DIR (its manifest), None for the embedded corpus."""
    if not data_dir:
        return None
    manifest = json.loads((Path(data_dir) / "manifest.json").read_text())
    return sum(int(s["tokens"]) for d in manifest["domains"].values() for s in d["train"])


def overrides(cell: dict, seed: int, steps: int, data_dir: str, run_dir: Path, drill: str,
              drill_step: int | None = None) -> list[str]:
    accum, ranks = split_of(cell)
    out = [*RECIPE, f"run.dir={run_dir}", f"run.seed={seed}", f"train.total_steps={steps}",
           f"model.d_model={cell['d_model']}", f"train.micro_batch_size={cell['batch'] // (accum * ranks)}",
           f"train.grad_accum={accum}", f"optim.peak_lr={cell['lr']:g}", f"optim.warmup_steps={cell['warmup']}"]
    if data_dir:
        out.append(f"data.dir={data_dir}")
    if drill:
        out += DRILLS[drill][1](drill_step or steps // 2)
    return out


def command(cell: dict) -> list[str]:
    """The launcher: one process, or `--ranks` gloo processes through dsslm's torchrun."""
    ranks = split_of(cell)[1]
    if ranks == 1:
        return [sys.executable, "-m", "dsslm.train"]
    return [sys.executable, "-m", "dsslm.torchrun", "--standalone", "--nproc_per_node", str(ranks), "-m", "dsslm.train"]


def run_one(tree: Path, root: Path, dirs: dict, cell: dict, seed: int, drill: str, steps: int,
            drill_step: int | None = None) -> dict:
    run_dir = root / run_name(cell, seed, drill)
    if run_dir.exists():
        shutil.rmtree(run_dir)
    started = time.perf_counter()
    with open(root / f"{run_dir.name}.log", "w") as log:
        rc = subprocess.run([*command(cell),
                             *overrides(cell, seed, steps, dirs[cell["data"]], run_dir, drill, drill_step)],
                            cwd=tree, env=tree_env(tree), stdout=log, stderr=subprocess.STDOUT).returncode
    result = {"cell": cell, "seed": seed, "drill": drill, "run_dir": str(run_dir), "rc": rc,
              "wall_s": round(time.perf_counter() - started, 1), **measure(run_dir, steps),
              "corpus_tokens": corpus_tokens(dirs[cell["data"]])}
    if drill:
        result["drill_result"] = judge_drill(run_dir, drill, steps, cell["batch"], drill_step)
    return result


def final_skip_list(run_dir: Path) -> list:
    ckpts = sorted((run_dir / "checkpoints").glob("step-*"))
    state = read_json(ckpts[-1] / "state.json") if ckpts else None
    if state is None:
        state = read_json(run_dir / "skip_list.json") or {}
    return state.get("skip_list", [])


def merged_tokens(entries: list[dict]) -> int:
    """Tokens covered by the skip list's data entries ({"shard", "tokens": [a, b]}), overlaps once."""
    total, by_shard = 0, {}
    for e in entries:
        by_shard.setdefault(e["shard"], []).append(tuple(e["tokens"]))
    for spans in by_shard.values():
        end = -1
        for a, b in sorted(spans):
            total += max(0, b - max(a, end))
            end = max(end, b)
    return total


def measure(run_dir: Path, steps: int) -> dict:
    metrics, events = read_jsonl(run_dir / "metrics.jsonl"), read_jsonl(run_dir / "events.jsonl")
    records = [r for r in metrics if "loss" in r]
    final = {r["step"]: r for r in records}  # a replayed step's last record is the one kept
    skip_list = final_skip_list(run_dir)
    data_entries = [e for e in skip_list if isinstance(e, dict)]
    alarms = sorted([(r["step"], "record", r.get("reason", r["verdict"])) for r in records if r["verdict"] != "ok"]
                    + [(e.get("step", 0), e["event"], e.get("reason", e.get("verdict", ""))) for e in events
                       if e["event"] in ALARMS], key=lambda a: a[0])
    first = alarms[0] if alarms else None
    escalation = next((e for e in events if e["event"] == "escalation"), None)
    return {
        "steps_done": max(final, default=0),
        "rewinds": sum(e["event"] == "rewind" for e in events),
        "lr_cuts": sum(e["event"] == "lr_scale" and e.get("new", 1) < e.get("old", 1) for e in events),
        "lr_scale": min((e.get("new", 1.0) for e in events if e["event"] == "lr_scale"), default=1.0),
        "skipped_steps": sum(r["verdict"] == "skip_step" for r in final.values()),
        "skip_events": sum(e["event"] == "skip" for e in events),
        "triages": sum(e["event"] == "triage" for e in events),
        "verdicts": [e.get("verdict") for e in events if e["event"] == "triage"],
        "tokens_named": merged_tokens(data_entries),
        "data_entries": len(data_entries),
        "window_sequences": sum(e[1] - e[0] for e in skip_list if isinstance(e, list)),
        "gnorm_surges": sum(e["event"] == "gnorm_surge" for e in events),
        "alarm_steps": len({a[0] for a in alarms}),
        "first_alarm": None if first is None else {
            "step": first[0], "kind": first[1], "reason": str(first[2])[:300],
            "gnorm_x_median": gnorm_ratio(records, final, first[0])},
        "escalation": None if escalation is None else {"step": escalation.get("step"),
                                                       "reason": str(escalation.get("reason", ""))[:300]},
        "spike_score": spike_score([final[s] for s in sorted(final)]) if final else math.nan,
        "final_loss": final[max(final)]["loss"] if final else None,
    }


def gnorm_ratio(records: list[dict], final: dict[int, dict], step: int) -> float | None:
    """The first alarmed step's grad norm (its first record not ok, else its first) against the median of
    the kept ok steps among the 50 before it (the monitor's own ratio, against its baseline, is in `reason`)."""
    before = [r["gnorm"] for s, r in final.items() if step - 50 <= s < step and r["verdict"] == "ok"
              and isinstance(r["gnorm"], (int, float))]
    at_step = [r for r in records if r["step"] == step]
    at = next((r["gnorm"] for r in at_step if r["verdict"] != "ok"), at_step[0]["gnorm"] if at_step else None)
    if not before or not isinstance(at, (int, float)):
        return None
    return round(at / statistics.median(before), 2)


def judge_drill(run_dir: Path, drill: str, steps: int, batch: int, drill_step: int | None = None) -> dict:
    """Caught / verdict / delay of the drill at `drill_step` (default steps // 2; module doc)."""
    s = drill_step or steps // 2
    metrics, events = read_jsonl(run_dir / "metrics.jsonl"), read_jsonl(run_dir / "events.jsonl")
    records = [r for r in metrics if "loss" in r]
    start = s if drill != "poison" else next(  # the first step fed a poisoned batch (skips move it)
        (r["step"] for r in records if s * batch <= r.get("data_position", -1) < (s + 3) * batch), s + 1)
    lo, hi = start - 2, start + 20
    hits = sorted([r["step"] for r in records if r["verdict"] != "ok" and lo <= r["step"] <= hi]
                  + [e["step"] for e in events if e["event"] in ALARMS and lo <= e.get("step", -1) <= hi])
    touching = [e for e in events if e["event"] == "triage" and e.get("spike_start", e["step"]) <= hi
                and e.get("target", e["step"]) >= start - 2]
    windows = [e for e in touching if e.get("scope") == "window"]
    decision = (windows or touching or [None])[-1]
    rewound = any(e["event"] == "rewind" and lo <= e.get("step", -1) <= hi for e in events)
    if decision is not None:
        verdict = decision.get("verdict", "?")
    elif hits:
        verdict = "rewind" if rewound else "skip"
    else:
        verdict = "-"
    return {"drill_step": start, "caught": bool(hits), "verdict": verdict, "rewound": rewound,
            "delay": (hits[0] - start) if hits else None, "expected": DRILLS[drill][0]}


# ---------------------------------------------------------------- tables


def group(runs: list[dict], key) -> dict:
    out: dict = {}
    for r in runs:
        out.setdefault(key(r), []).append(r)
    return out


def pct(skipped: int, steps: int) -> str:
    return f"{skipped} ({100 * skipped / max(steps, 1):.2f}%)"


def clean_table(runs: list[dict], steps: int) -> str:
    head = ("| data | peak_lr | warmup | batch | d_model | runs | runs with alarms | escalated (exit 3) | rewinds "
            "| LR cuts | skipped steps (% of steps) | tokens named as data | grad-norm surges noted |")
    lines = [head, "|" + "---|" * 13]
    tot = {"runs": 0, "alarmed": 0, "esc": 0, "rew": 0, "cuts": 0, "skip": 0, "tok": 0, "surge": 0}
    cells = group(runs, lambda r: tuple(r["cell"][k] for k in CELL_KEYS))
    for key in sorted(cells, key=lambda k: (DATASETS.index(k[0]) if k[0] in DATASETS else 9, *k[1:])):
        rs = cells[key]
        row = {"runs": len(rs), "alarmed": sum(r["alarm_steps"] > 0 or r["rc"] == 3 for r in rs),
               "esc": sum(r["rc"] == 3 for r in rs), "rew": sum(r["rewinds"] for r in rs),
               "cuts": sum(r["lr_cuts"] for r in rs), "skip": sum(r["skipped_steps"] for r in rs),
               "tok": sum(r["tokens_named"] for r in rs), "surge": sum(r["gnorm_surges"] for r in rs)}
        for k, v in row.items():
            tot[k] += v
        lines.append(f"| {key[0]} | {key[1]:g} | {key[2]} | {key[3]} | {key[4]} | {row['runs']} | {row['alarmed']} "
                     f"| {row['esc']} | {row['rew']} | {row['cuts']} | {pct(row['skip'], row['runs'] * steps)} "
                     f"| {row['tok']:,} | {row['surge']} |")
    lines.append(f"| **total** | | | | | {tot['runs']} | {tot['alarmed']} | {tot['esc']} | {tot['rew']} | "
                 f"{tot['cuts']} | {pct(tot['skip'], tot['runs'] * steps)} | {tot['tok']:,} | {tot['surge']} |")
    return "\n".join(lines)


def alarm_lines(runs: list[dict]) -> str:
    out = []
    for r in runs:
        first = r["first_alarm"]
        if first is None and r["rc"] in (0, 3):
            continue
        what = (f"first alarm at step {first['step']} ({first['kind']}"
                + (f", grad norm {first['gnorm_x_median']}x the median of the 50 steps before" if first.get(
                    "gnorm_x_median") else "") + f"): {first['reason']}") if first else "no alarm"
        esc = f"; exit 3 at step {r['escalation']['step']}: {r['escalation']['reason']}" if r["escalation"] else ""
        rc = f"; exit {r['rc']}" if r["rc"] not in (0, 3) else ""
        out.append(f"- {label(r['cell'])}" + (f" [{r['drill']}]" if r.get("drill") else "")
                   + f", seed {r['seed']}: {what}; {r['alarm_steps']} steps alarmed, {r['rewinds']} rewinds, "
                   f"{r['lr_cuts']} LR cuts, {r['skipped_steps']} skipped, {r['tokens_named']:,} tokens named, "
                   f"verdicts {r['verdicts']}{esc}{rc}")
    return "\n".join(out) if out else "(no run alarmed)"


def drill_table(runs: list[dict]) -> str:
    head = ("| drill (expected) | data | peak_lr | warmup | batch | d_model | runs | caught | right verdict "
            "| verdicts | delay (steps) | escalated |")
    lines = [head, "|" + "---|" * 12]
    tot = {"runs": 0, "caught": 0, "right": 0, "esc": 0}
    for (drill, *key), rs in group(runs, lambda r: (r["drill"], *(r["cell"][k] for k in CELL_KEYS))).items():
        ds = [r["drill_result"] for r in rs]
        delays = [d["delay"] for d in ds if d["delay"] is not None]
        caught, right = sum(d["caught"] for d in ds), sum(d["verdict"] == d["expected"] for d in ds)
        esc = sum(r["rc"] == 3 for r in rs)
        for k, v in (("runs", len(rs)), ("caught", caught), ("right", right), ("esc", esc)):
            tot[k] += v
        verdicts = ", ".join(f"{d['verdict']}{' (rewind)' if d['rewound'] else ''}" for d in ds)
        lines.append(f"| {drill} ({ds[0]['expected']}) | {key[0]} | {key[1]:g} | {key[2]} | {key[3]} | {key[4]} "
                     f"| {len(rs)} | {caught}/{len(rs)} | {right}/{len(rs)} | {verdicts} "
                     f"| {', '.join(map(str, delays)) or '-'} | {esc} |")
    lines.append(f"| **total** | | | | | | {tot['runs']} | {tot['caught']}/{tot['runs']} | "
                 f"{tot['right']}/{tot['runs']} | | | {tot['esc']} |")
    return "\n".join(lines)


def long_table(runs: list[dict], steps: int) -> str:
    """--long: what the policy did over many passes, and how much of the corpus it named."""
    lines = ["| run | passes | triages (verdicts) | rewinds | LR cuts | skipped steps | tokens named | "
             "share of the corpus | final loss |", "|" + "---|" * 9]
    for r in runs:
        corpus = r.get("corpus_tokens") or 0
        passes = steps * r["cell"]["batch"] * 64 / corpus if corpus else float("nan")
        verdicts = ", ".join(f"{v} {r['verdicts'].count(v)}" for v in sorted(set(r["verdicts"]))) or "-"
        share = f"{100 * r['tokens_named'] / corpus:.3f}%" if corpus else "-"
        lines.append(f"| {r['drill'] or 'clean'} | {passes:.1f} | {r['triages']} ({verdicts}) | {r['rewinds']} "
                     f"| {r['lr_cuts']} | {pct(r['skipped_steps'], steps)} | {r['tokens_named']:,} | {share} "
                     f"| {r['final_loss']} |")
    return "\n".join(lines)


def report(saved: dict) -> str:
    runs, steps = saved["runs"], saved["meta"]["steps"]
    meta = saved["meta"]
    head = (f"{len(runs)} runs x {steps} steps, tree {meta['tree']}, {meta['mode']}, jobs {meta['jobs']}, "
            f"{meta.get('elapsed_s', 0):.0f} s, load {meta.get('load_start')} -> {meta.get('load_end')}")
    if meta["mode"] == "long":
        return f"{head}\n\n{long_table(runs, steps)}\n\nRuns with an alarm:\n{alarm_lines(runs)}"
    if meta["mode"] == "drills":
        return f"{head}\n\n{drill_table(runs)}\n\nRuns with an alarm (the drill's included):\n{alarm_lines(runs)}"
    return f"{head}\n\n{clean_table(runs, steps)}\n\nRuns with an alarm:\n{alarm_lines(runs)}"


def load_avg() -> str:
    return " ".join(f"{x:.2f}" for x in os.getloadavg())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tree", type=Path, default=HERE.parent, help="the checkout whose dsslm runs (default: this)")
    parser.add_argument("--jobs", type=int, default=1, help="runs in parallel (each one thread)")
    parser.add_argument("--out", type=Path, default=None, help="keep the run folders here (default: a temp dir)")
    parser.add_argument("--json", type=Path, default=None, help="every run's figures, rewritten after each run")
    parser.add_argument("--quick", action="store_true", help="12 runs of the riskiest cells")
    parser.add_argument("--full", action="store_true", help="all 16 cells of each data set, not the half fraction")
    parser.add_argument("--drills", action="store_true", help="the drills on DRILL_CELLS instead of clean runs")
    parser.add_argument("--drill-cells", default="", help="indices into DRILL_CELLS, e.g. 0,1 (default all)")
    parser.add_argument("--drill-seeds", type=int, default=1)
    parser.add_argument("--geometry", action="store_true",
                        help="the riskiest recipe at a global batch of 64 split 8x8x1, 4x8x2, 1x32x2: clean, and poison "
                             "and LR-burst drills")
    parser.add_argument("--long", action="store_true",
                        help="two long runs (use --steps 30000) of the riskiest recipe over a ~1.2M-token corpus of "
                             "prose and code: clean, and two poison windows at --drill-step and 3x it")
    parser.add_argument("--drill-step", type=int, default=None, help="the drills' step (default --steps / 2): 10-100 "
                                                                       "for the early faults")
    parser.add_argument("--seeds", type=int, default=3)
    parser.add_argument("--risky-seeds", type=int, default=12)
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--plays", type=Path, default=HERE / "out" / "shakespeare.txt")
    parser.add_argument("--bpe-vocab", type=int, default=2048)
    parser.add_argument("--summarize", type=Path, default=None, help="print the tables of a --json file; run nothing")
    parser.add_argument("--remeasure", action="store_true", help="with --summarize: read each run.dir again")
    args = parser.parse_args()
    if args.summarize:
        saved = json.loads(args.summarize.read_text())
        if args.remeasure:
            steps = saved["meta"]["steps"]
            for r in saved["runs"]:
                r.update(measure(Path(r["run_dir"]), steps))
                if r.get("drill"):
                    r["drill_result"] = judge_drill(Path(r["run_dir"]), r["drill"], steps, r["cell"]["batch"],
                                                    saved["meta"].get("drill_step"))
        print(report(saved))
        return
    tree = args.tree.resolve()
    check_tree(tree)
    plan = matrix(args)
    if args.long and args.drill_step is None:
        args.drill_step = args.steps // 6  # the poison at 1/6 and 1/2 of the run
    mode = ("long" if args.long else "geometry" if args.geometry else "drills" if args.drills else "quick" if args.quick else
            "full" if args.full else "fraction")
    meta = {"tree": str(tree), "mode": mode, "steps": args.steps, "jobs": args.jobs, "planned": len(plan),
            "drill_step": args.drill_step,
            "plays": str(args.plays), "bpe_vocab": args.bpe_vocab, "load_start": load_avg(),
            "started": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime())}
    print(f"{len(plan)} runs planned ({mode}), tree {tree}, load {meta['load_start']}", flush=True)
    started, runs, lock = time.perf_counter(), [], threading.Lock()
    with tempfile.TemporaryDirectory() as tmp:
        root = (args.out or Path(tmp)).resolve()
        root.mkdir(parents=True, exist_ok=True)
        dirs = prepare_data(tree, root, args.plays, args.bpe_vocab, {c["data"] for c, _, _ in plan})

        def one(item):
            cell, seed, drill = item
            result = run_one(tree, root, dirs, cell, seed, drill, args.steps, args.drill_step)
            with lock:
                runs.append(result)
                meta.update(elapsed_s=round(time.perf_counter() - started), load_end=load_avg(), done=len(runs))
                if args.json:
                    tmp_json = args.json.with_suffix(".tmp")
                    tmp_json.write_text(json.dumps({"meta": meta, "runs": runs}, indent=1, default=str))
                    tmp_json.replace(args.json)
                first = result["first_alarm"]
                print(f"[{len(runs)}/{len(plan)} {time.perf_counter() - started:.0f} s] {run_name(cell, seed, drill)}: "
                      f"rc {result['rc']}, {result['wall_s']} s"
                      + (f", alarm at step {first['step']}" if first else "")
                      + (f", drill {result['drill_result']}" if drill else ""), flush=True)

        with ThreadPoolExecutor(max_workers=args.jobs) as pool:
            list(pool.map(one, plan))
    meta.update(elapsed_s=round(time.perf_counter() - started), load_end=load_avg())
    print("\n" + report({"meta": meta, "runs": runs}))


if __name__ == "__main__":
    main()
