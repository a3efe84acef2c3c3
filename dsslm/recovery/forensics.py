"""Forensics of one spike: `run.dir/spikes/step-XXXXXXXX/`, what a person needs to look at it.

Written when the monitor calls a step an outlier or a rewind (not during the replays that
triage it, whose evidence goes into the triage decision):

    batch.safetensors  the whole step's batch, every rank's share gathered to rank 0:
                       `indices` (global sequence indices, int64 [B]), `inputs` and `targets`
                       (int64 [B, seq_len]), `sequence_loss` (mean cross-entropy per real
                       target of each sequence, fp64 [B])
    spike.json         the step, loss, pre-clip grad norm, the monitor's reason and its window
                       (the clean history the verdict was judged against), the grad norm of
                       each layer group and parameter (before clipping), the worst sequences,
                       and the tokenizer that decodes the batch (`python -m dsslm.report`)
    triage.json        {"decisions": [...]}: each triage decision that covered this step

Every rank also keeps the last few spike steps' global sequence indices, per-sequence losses
and which are a repeated n-gram, in memory (with or without `monitor.forensics`; a replay's spike
steps too, without a folder): `data_entries` turns them into the skip entries a data verdict
commits, what stands out and no further than it earns (`recovery.reach`). Those of
the steps a streak open at a checkpoint can span travel in its part "triage" (`ReplayProgress`),
so a resume in the middle of a streak names the same data as the uninterrupted run.

A folder is written into `spikes/.tmp-*` and renamed into place (files and folders fsynced), so
a reader sees a whole folder or none; a step that spikes again (a replay, a resume) gets
`step-XXXXXXXX.1`, `.2`, ... and nothing is replaced. At most MAX_FOLDERS per process: a run
spiking on every step does not fill the disk. A failed write is an event, never a crash.

Read back for a person by `spike_lines` (`python -m dsslm.report`): one row per spike with its
triage verdict, then the worst sequences of each spike's batch, decoded. Anyone with write
access to run.dir could have edited the folders, so every spike.json and triage.json is checked
field by field and every tensor's shape and dtype before use; a folder that fails is listed as
unreadable, naming what failed. The batch is decoded with the tokenizer the spike names: the byte
tokenizer, or DATA_DIR's tokenizer.json when its SHA-256 is the one recorded.
"""
from __future__ import annotations

import collections
import json
import os
import secrets
from pathlib import Path
from typing import Any, Callable

import numpy as np
import torch
from safetensors.torch import load_file, save_file

from dsslm.ckpt.format import step_name
from dsslm.config import Config
from dsslm.data.loader import Loader
from dsslm.data.skips import merge_skip_list
from dsslm.data.stream import StepSlice
from dsslm.data.tokenizer import TOKENIZER_FILE, BPETokenizer, ByteTokenizer
from dsslm.durable import file_mode, publish_folder, write_json_atomic
from dsslm.engine.base import Engine
from dsslm.fields import MAX_STEP, Fields, Float, Int, Json, ListOf, StateError, Str
from dsslm.model import LAYER_GROUPS, layer_group
from dsslm.recovery.reach import DOCUMENT_SAMPLES, candidates, document_losses, repeated, stands_out, step_repeated

SPIKES_DIR = "spikes"
BATCH_FILE, SPIKE_FILE, TRIAGE_FILE = "batch.safetensors", "spike.json", "triage.json"
FORMAT = 1
MAX_FOLDERS = 200
WORST = 8  # sequences listed in spike.json, by loss
MAX_DOCUMENTS = 16  # candidates whose documents a verdict reads (`data_entries`)
MAX_SUSPECTS = 65_536  # chunks that stood out once, kept (the oldest dropped first)
REMEMBERED = 64  # spike steps whose sequence losses stay in memory (a streak is a few steps)


class Forensics:
    def __init__(self, cfg: Config, engine: Engine, run_dir: Path, tokenizer: dict, emit: Callable[..., Any],
                 loader: Loader | None = None):
        self.enabled = cfg.monitor.enabled and cfg.monitor.forensics
        self.engine, self.dir, self.tokenizer, self.emit = engine, Path(run_dir) / SPIKES_DIR, tokenizer, emit
        self.loader, self.precision, self.micro = loader, cfg.train.precision, cfg.train.micro_batch_size
        # Chunks by id as training reads them (job.setup: through the fault drills).
        self.read_chunks: Callable[[np.ndarray], tuple] | None = loader.read_chunks if loader is not None else None
        self.written = 0  # the same count on every rank: every rank captures the same steps
        # step -> (global sequence indices, mean loss per token of each, which are a repeated
        # n-gram), the whole step's, every rank.
        self.sequences: collections.OrderedDict[int, tuple[np.ndarray, ...]] = collections.OrderedDict()
        # chunk -> the epoch it stood out in, alone and unproven (`recovery.reach`): standing out
        # again in another pass is its second strike. In the checkpoint part "triage".
        self.suspects: collections.OrderedDict[int, int] = collections.OrderedDict()

    def capture(self, step: int, fed: StepSlice, micro_batches: list, result: Any, verdict: str, reason: str,
                window: dict, folder: bool = True) -> None:
        """Every rank: gather the step's sequences, their losses and the gradient norms (before
        the gradients are dropped); rank 0 writes the folder (unless not `folder`: a replay's
        step, whose sequences alone are kept). `window` is rank 0's monitor window."""
        # The same condition on every rank: the collectives below match.
        write = self.enabled and self.written < MAX_FOLDERS and folder
        inputs = torch.cat([x for x, _ in micro_batches])
        targets = torch.cat([y for _, y in micro_batches])
        sequence_ce = torch.cat(result.sequence_ce).double().cpu()
        real = (targets != -100).sum(-1).clamp(min=1)
        rows = torch.cat([inputs.cpu(), targets.cpu()[:, -1:]], dim=1)
        share = (np.asarray(fed.indices), (sequence_ce / real).numpy(), repeated(rows)) + \
            ((inputs.cpu(), targets.cpu()) if write else ())
        shares = self.engine.all_gather(share)
        indices = np.concatenate([s[0] for s in shares]).astype(np.int64)
        self.sequences[step] = (indices, np.concatenate([s[1] for s in shares]).astype(np.float64),
                                step_repeated(np.concatenate([s[2] for s in shares])))
        self.sequences.move_to_end(step)
        while len(self.sequences) > REMEMBERED:
            self.sequences.popitem(last=False)
        if not write:
            return
        self.written += 1
        norms = self.engine.grad_norms()
        if not self.engine.is_main:
            return
        batch = {"indices": torch.from_numpy(indices),
                 "inputs": torch.cat([s[3] for s in shares]).long(),
                 "targets": torch.cat([s[4] for s in shares]).long(),
                 "sequence_loss": torch.from_numpy(self.sequences[step][1])}
        losses = batch["sequence_loss"]
        worst = torch.argsort(torch.nan_to_num(losses, nan=float("inf")), descending=True)[:WORST]
        spike = {"format": FORMAT, "step": step, "verdict": verdict, "reason": reason, "loss": result.loss,
                 "gnorm": result.gnorm, "data_position": fed.first, "batch_sequences": fed.batch_size,
                 "grad_norms": group_norms(norms), "grad_norms_by_parameter": norms, "monitor_window": window,
                 "worst_sequences": [{"row": int(i), "index": int(batch["indices"][i]), "loss": float(losses[i])}
                                     for i in worst],
                 "tokenizer": self.tokenizer}
        try:
            self._write(step, batch, spike)
        except Exception as exc:  # noqa: BLE001 - OSError, and safetensors' SafetensorError for an I/O error
            # Rank 0 alone writes: an exception here would leave it and the other ranks in
            # different places (they are already in the re-run's or the verdict's collectives).
            self.emit("forensics_failed", step=step, reason=repr(exc))

    def data_entries(self, steps: Any, monitor: Any) -> list:
        """Every rank, together: the skip entries a data verdict on the spike steps `steps` commits
        (`recovery.reach`): the candidates' chunks, or their documents where those stand out, for
        good; a lone candidate of ordinary text as its position only (this pass). Nothing for a
        step whose sequences do not stand out, or that was not captured (before a resume)."""
        found = self.engine.decide(lambda: candidates(self.sequences, steps, monitor, self.loader, self.suspects))
        if not found:
            return []
        asked = found[:MAX_DOCUMENTS]  # the rest: by their chunks (a poisoned batch of 512 needs no 4,096 reads)
        docs = [self.loader.document_chunks(c.chunk, DOCUMENT_SAMPLES) for c in asked]
        losses = document_losses(self.engine, self.read_chunks, docs, self.precision, self.micro)

        def reach() -> tuple[list, list]:
            entries, struck = [], []
            for i, c in enumerate(found):
                whole = i < len(asked) and stands_out(losses[i], c.side, monitor.z_of)
                if c.strong or whole:
                    entries += self.loader.data_entries(np.asarray([c.index]), np.asarray([whole]))
                else:  # ordinary text that stood out once: left out of this pass, named nowhere
                    entries.append([c.index, c.index + 1])
                    struck.append((c.chunk, c.epoch))
            return merge_skip_list(entries), struck
        entries, struck = self.engine.decide(reach)
        for chunk, epoch in struck:  # every rank: the suspects travel in each rank's checkpoint part
            self.suspects.setdefault(chunk, epoch)
            while len(self.suspects) > MAX_SUSPECTS:
                self.suspects.popitem(last=False)
        return entries

    def record_decision(self, steps: list[int], decision: dict) -> None:
        """Add a triage decision to the folder of every step it covers that has one (rank 0)."""
        if not self.enabled or not self.engine.is_main:
            return
        for step in steps:
            folder = newest_folder(self.dir, step)
            if folder is None:
                continue
            path = folder / TRIAGE_FILE
            try:
                decisions = read_decisions(path)
                write_json_atomic(path, {"format": FORMAT, "decisions": decisions + [_jsonable(decision)]}, indent=1)
            except (OSError, ValueError) as exc:
                self.emit("forensics_failed", step=step, reason=f"{path}: {exc}")

    def _write(self, step: int, batch: dict, spike: dict) -> None:
        self.dir.mkdir(parents=True, exist_ok=True)
        tmp = self.dir / f".tmp-{step_name(step)}-{os.getpid()}-{secrets.token_hex(4)}"
        tmp.mkdir()
        try:
            save_file(batch, str(tmp / BATCH_FILE))
            os.chmod(tmp / BATCH_FILE, file_mode())  # save_file makes it 0600: a lab mate could not read it
            (tmp / SPIKE_FILE).write_text(json.dumps(_jsonable(spike), indent=1))
            publish_folder(tmp, free_name(self.dir, step))
        finally:
            if tmp.exists():
                for child in tmp.iterdir():
                    child.unlink()
                tmp.rmdir()


def group_norms(norms: dict[str, float]) -> dict[str, float]:
    """Per-parameter L2 norms folded into the model's layer groups (sqrt of summed squares)."""
    squares: dict[str, float] = {}
    for name, value in norms.items():
        group = layer_group(name)
        squares[group] = squares.get(group, 0.0) + value ** 2
    return {g: squares[g] ** 0.5 for g in LAYER_GROUPS if g in squares}


def folders_of(spikes_dir: Path, step: int) -> list[Path]:
    """step-XXXXXXXX, step-XXXXXXXX.1, ... that exist, oldest first."""
    base = spikes_dir / step_name(step)
    out = [base] if base.is_dir() else []
    n = 1
    while (spikes_dir / f"{base.name}.{n}").is_dir():
        out.append(spikes_dir / f"{base.name}.{n}")
        n += 1
    return out


def newest_folder(spikes_dir: Path, step: int) -> Path | None:
    found = folders_of(spikes_dir, step)
    return found[-1] if found else None


def free_name(spikes_dir: Path, step: int) -> Path:
    found = folders_of(spikes_dir, step)
    return spikes_dir / (step_name(step) if not found else f"{step_name(step)}.{len(found)}")


def read_decisions(path: Path) -> list:
    """The decisions of a triage.json (ValueError if it is not one this module wrote)."""
    if not path.exists():
        return []
    data = json.loads(path.read_text())
    if not isinstance(data, dict) or data.get("format") != FORMAT or not isinstance(data.get("decisions"), list):
        raise ValueError("not a triage.json of this format; left as it is")
    return data["decisions"]


def _jsonable(value: Any) -> Any:
    if isinstance(value, float) and not np.isfinite(value):
        return str(value)
    if isinstance(value, dict):
        return {str(k): _jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_jsonable(v) for v in value]
    return value


# Reading the folders back, for a person (`python -m dsslm.report`).

SHOWN = 3          # worst sequences shown per spike
TEXT_CHARS = 160   # of each, after escaping
SPIKE_SPEC = Fields(
    open=True, format=Int(1, 1), step=Int(0, MAX_STEP), verdict=Str(32), reason=Str(), loss=Float(finite=False),
    gnorm=Float(finite=False), worst_sequences=ListOf(Fields(row=Int(0), index=Int(0), loss=Float(finite=False)),
                                                      max_len=64),
    tokenizer=Fields(open=True, kind=Str(16), sha256=Str(64), data_dir=Str()))
DECISION_SPEC = Fields(open=True, verdict=Str(32), scope=Str(16), spike_start=Int(0, MAX_STEP),
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
    SPIKE_SPEC.validate(spike, SPIKE_FILE)
    decisions = read_decisions(folder / TRIAGE_FILE)
    for i, decision in enumerate(decisions):
        DECISION_SPEC.validate(decision, f"{TRIAGE_FILE}.decisions[{i}]")
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
