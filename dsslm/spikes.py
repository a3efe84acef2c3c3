"""Reading `run.dir/spikes/` back for a person (`python -m dsslm.report`): one row per spike with
its triage verdict, then the worst sequences of each spike's batch, decoded.

The folders are written by `recovery.forensics`; anyone with write access to run.dir could have
edited them, so every spike.json and triage.json is checked field by field and every tensor's
shape and dtype before use. A folder that fails is listed as unreadable, naming what failed.
The batch is decoded with the tokenizer the spike names: the byte tokenizer, or DATA_DIR's
tokenizer.json when its SHA-256 is the one recorded.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file

from dsslm.ckpt.schema import MAX_STEP, Fields, Float, Int, Json, ListOf, StateError, Str
from dsslm.data.tokenizer import TOKENIZER_FILE, BPETokenizer, ByteTokenizer
from dsslm.recovery.forensics import BATCH_FILE, SPIKE_FILE, SPIKES_DIR, TRIAGE_FILE, read_decisions

SHOWN = 3          # worst sequences shown per spike
TEXT_CHARS = 160   # of each, after escaping
SPIKE_SCHEMA = Fields(
    open=True, format=Int(1, 1), step=Int(0, MAX_STEP), verdict=Str(32), reason=Str(), loss=Float(finite=False),
    gnorm=Float(finite=False), worst_sequences=ListOf(Fields(row=Int(0), index=Int(0), loss=Float(finite=False)),
                                                      max_len=64),
    tokenizer=Fields(open=True, kind=Str(16), sha256=Str(64), data_dir=Str()))
DECISION_SCHEMA = Fields(open=True, verdict=Str(32), scope=Str(16), spike_start=Int(0, MAX_STEP),
                         target=Int(0, MAX_STEP), replay_steps=Int(0, MAX_STEP), evidence=Json())


def spike_folders(run_dir: Path) -> list[Path]:
    root = Path(run_dir) / SPIKES_DIR
    if not root.is_dir():
        return []
    return sorted(p for p in root.iterdir() if p.is_dir() and p.name.startswith("step-"))


def read_spike(folder: Path) -> tuple[dict, list[dict], dict[str, torch.Tensor]]:
    """spike.json, the triage decisions and the batch of one folder, checked; ValueError naming
    what does not fit."""
    spike = json.loads((folder / SPIKE_FILE).read_text())
    SPIKE_SCHEMA.check(spike, SPIKE_FILE)
    decisions = read_decisions(folder / TRIAGE_FILE)
    for i, decision in enumerate(decisions):
        DECISION_SCHEMA.check(decision, f"{TRIAGE_FILE}.decisions[{i}]")
    batch = load_file(folder / BATCH_FILE)
    rows = batch.get("inputs")
    if rows is None or rows.dim() != 2 or rows.dtype != torch.int64:
        raise ValueError(f"{BATCH_FILE}: inputs is not an int64 [batch, seq_len] tensor")
    for entry in spike["worst_sequences"]:
        if entry["row"] >= rows.shape[0]:
            raise ValueError(f"{SPIKE_FILE}: worst sequence row {entry['row']} is not in the batch of {rows.shape[0]}")
    return spike, decisions, batch


def decoder_for(spec: dict) -> Any:
    """The tokenizer a spike was fed with, or ValueError saying why it cannot be had."""
    if spec["kind"] == "byte":
        tok = ByteTokenizer()
    elif spec["kind"] == "bpe":
        path = Path(spec["data_dir"]) / TOKENIZER_FILE
        if not path.is_file():
            raise ValueError(f"{path} is not there")
        tok = BPETokenizer.from_file(path)
    else:
        raise ValueError(f"unknown tokenizer kind {spec['kind']!r}")
    if tok.sha256 != spec["sha256"]:
        raise ValueError(f"the tokenizer at {spec['data_dir']} is not the one the run used (SHA-256 differs)")
    return tok


def printable(text: str, limit: int = TEXT_CHARS) -> str:
    """One markdown-table-safe line: escapes visible, cut at `limit` characters."""
    out = text.replace("\\", "\\\\").replace("\n", "\\n").replace("\t", "\\t").replace("\r", "\\r")
    out = out.replace("|", "\\|").replace("`", "'")
    return out if len(out) <= limit else out[:limit - 3] + "..."


def spike_lines(run_dir: Path) -> list[str]:
    """The report's "Spikes" section (empty when the run has no spike folders)."""
    folders = spike_folders(run_dir)
    if not folders:
        return []
    lines = ["", "## Spikes", "", f"{len(folders)} spike folder(s) under {SPIKES_DIR}/; the verdict is the last "
             "triage decision covering the step.", "",
             "| step | monitor | loss | gnorm | verdict | triage | replayed steps |", "|---|---|---|---|---|---|---|"]
    details: list[str] = []
    for folder in folders:
        try:
            spike, decisions, batch = read_spike(folder)
        except (OSError, ValueError, StateError) as exc:
            lines.append(f"| {folder.name} | unreadable: {printable(str(exc), 120)} | | | | | |")
            continue
        final = decisions[-1] if decisions else None
        verdict = final["verdict"] if final else "(not triaged)"
        scope = f"{final['scope']} {final['spike_start']}-{final['target']}" if final else ""
        replayed = sum(d["replay_steps"] for d in decisions)
        lines.append(f"| {spike['step']} | {spike['verdict']}: {printable(spike['reason'], 80)} | {_fmt(spike['loss'])} "
                     f"| {_fmt(spike['gnorm'])} | {verdict} | {scope} | {replayed} |")
        details += worst_lines(folder, spike, batch)
    return lines + details


def worst_lines(folder: Path, spike: dict, batch: dict[str, torch.Tensor]) -> list[str]:
    out = ["", f"### {folder.name}: worst sequences", ""]
    try:
        tok = decoder_for(spike["tokenizer"])
    except (OSError, ValueError) as exc:
        return out + [f"cannot decode: {printable(str(exc))}"]
    targets = batch.get("targets")
    for entry in spike["worst_sequences"][:SHOWN]:
        ids = batch["inputs"][entry["row"]].tolist()
        if targets is not None and targets.shape == batch["inputs"].shape:
            ids.append(int(targets[entry["row"], -1]))
        out.append(f"- sequence {entry['index']} (loss {_fmt(entry['loss'])}): `{printable(tok.decode(ids))}`")
    return out


def _fmt(value: Any) -> str:
    return f"{value:.4g}" if isinstance(value, (int, float)) else str(value)
