"""The loop's own state between steps (`TrainState`), the fingerprint a resume is checked against,
and the refusal of a resume that would not continue the same run.

Steps are counted as everywhere in dsslm: `step` is the number of optimizer steps completed, so
the record of a step's update and the checkpoint taken right after it carry the same number.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

from dsslm.fields import (MAX_COUNT, MAX_STEP, Fields, Float, Int, Json, ListOf, MapOf, Optional, SkipList,
                               Str, Window)
from dsslm.config import Config, ConfigError, keep_global_batch, shuffle_spec
from dsslm.ckpt.drift import SHAPE_KEYS, config_hash, drift, hashed_items, shape_refusal

# A rewind carried out (recovery.rewind.rewind_record): the first spike step, the window of global
# sequences it skipped, the checkpoint step it went back to and the lr_scale factor it applied;
# a triage decision adds its verdict, and a temporary backoff (monitor.lr_recover_steps) the
# step its ramp back to the full learning rate starts from (`target`), and a data verdict the
# data it committed to the skip list (`skip`, data.skips entries).
REWIND_RECORD = Fields(optional=("verdict", "target", "skip"), open=True, step=Int(0, MAX_STEP), window=Window(),
                       to_step=Int(0, MAX_STEP), lr_scale_factor=Float(0.0, 1.0), verdict=Str(32),
                       target=Int(0, MAX_STEP), skip=SkipList())


@dataclass
class TrainState:
    """What the loop carries from one step to the next, and restores from a checkpoint."""
    step: int = 0                    # optimizer steps completed
    tokens_seen: int = 0             # real target tokens trained on so far, all ranks
    next_sequence: int = 0           # the data stream's position: the next global sequence to consider
    # What is never fed: [start, end) global-sequence windows and {"shard", "tokens"} data (data.skips)
    skip_list: list = field(default_factory=list)
    lr_scale: float = 1.0            # multiplies the planned learning rate; lowered by the spike policy
    rewinds: list = field(default_factory=list)    # rewinds carried out (recovery.rewind.rewind_record)
    skipped_steps: int = 0
    clipped_steps: int = 0
    lineage: list = field(default_factory=list)    # parent runs this run branched from
    # Target tokens trained per domain, like tokens_seen (metrics.jsonl's domain_tokens). None: restored
    # from a checkpoint that predates it; the loop then derives it from the position.
    domain_tokens: dict | None = field(default_factory=dict)
    # The furthest step the run has trained to, in any pass: a step at or below it is a replay
    # (a rewind's, a triage's), which neither validates nor evaluates again (it was, once).
    reached: int = 0
    # The order the run's epochs read their chunks in (data.permute's kind, as parse_shuffle reads
    # it). "" in a checkpoint saved before it was recorded: that run read numpy's materialised
    # permutation, "array", and resumes with it.
    shuffle: str = ""

    state_spec = Fields(
        optional=("domain_tokens", "reached", "shuffle"),
        step=Int(0, MAX_STEP), tokens_seen=Int(0, MAX_COUNT), next_sequence=Int(0, MAX_COUNT),
        skip_list=SkipList(),
        lr_scale=Float(1e-12, 1.0), rewinds=ListOf(REWIND_RECORD, max_len=100_000),
        skipped_steps=Int(0, MAX_STEP), clipped_steps=Int(0, MAX_STEP),
        lineage=ListOf(Fields(open=True, run_dir=Str(), step=Int(0, MAX_STEP), checkpoint=Str()), max_len=1000),
        domain_tokens=Optional(MapOf(Int(0, MAX_COUNT), max_len=10_000)), reached=Int(0, MAX_STEP),
        shuffle=Str(64))

    def state_dict(self) -> dict:
        return dataclasses.asdict(self)

    def load_state_dict(self, state: dict) -> None:
        for f in dataclasses.fields(self):
            # Optional: a checkpoint from before `domain_tokens` (None: derived) or `reached` (its step).
            default = state.get("step", 0) if f.name == "reached" else "" if f.name == "shuffle" else None
            setattr(self, f.name, state.get(f.name, default) if f.name in ("domain_tokens", "reached", "shuffle")
                    else state[f.name])


def epoch_order(cfg: Config, how: str, state: TrainState) -> str:
    """The order the run reads its epochs in (data.permute's kind): data.shuffle's where it names
    one (ckpt.accept refused a resume it would change), else that of the run it continues (a
    resume, or a branch at its parent's position: "" is array, the order before kinds were
    recorded), else feistel."""
    wanted = shuffle_spec(cfg.data)
    if wanted:
        return wanted
    if how == "resume" or (how == "branch" and state.next_sequence > 0):
        return state.shuffle or "array"
    return "feistel"


class ResumeRefused(ConfigError):
    """The checkpoint was made by a different config, tokenizer or dataset."""


class NothingToResume(RuntimeError):
    """run.dir's logs show a run past step 0, but none of its checkpoints can be resumed: a start
    at step 0 there would bury that run under a second history (exits.EXIT_NOTHING_TO_RESUME)."""


# The fingerprint: what must match for a resume to continue the same computation.
FINGERPRINT_SPEC = Fields(config_hash=Str(64), config_items=MapOf(Json()), data_manifest_sha256=Str(64),
                            tokenizer_sha256=Str(64), global_batch_size=Int(1, MAX_COUNT))


def fingerprint(cfg: Config, manifest_sha: str, tokenizer_sha: str, global_batch_size: int) -> dict:
    return {"config_hash": config_hash(cfg), "config_items": hashed_items(cfg),
            "data_manifest_sha256": manifest_sha, "tokenizer_sha256": tokenizer_sha,
            "global_batch_size": global_batch_size}


def _allowed(key: str, allow_drift: tuple[str, ...]) -> bool:
    """`--allow-drift data.mix` covers data.mix.web and data.mix.code too."""
    return any(key == a or key.startswith(a + ".") for a in allow_drift)


def keep_batch(cfg: Config, old: int, new: int) -> str:
    """How to resume with the checkpoint's global batch on this world size, as overrides that work
    as written (a micro-batch of the old size may not split it over more processes)."""
    t = cfg.train
    world_size = max(1, new // max(1, t.micro_batch_size * t.grad_accum))
    keys = keep_global_batch(cfg, world_size, old)
    if keys is None:
        return (f"{old} sequences do not split over {world_size} processes: resume on a number of processes "
                f"that divides {old}")
    return f"set {keys} (its global batch on {world_size} process{'es' if world_size > 1 else ''})"


def check_fingerprint(saved: dict, now: dict, cfg: Config, where: str,
                      allow_drift: tuple[str, ...] = ()) -> dict[str, Any]:
    """Raise ResumeRefused naming the first difference not allowed; return the allowed ones."""
    differences: dict[str, Any] = {}
    for key, (old, new) in drift(saved["config_items"], cfg).items():
        differences[key] = [old, new]
    for key, name in (("data_manifest_sha256", "data"), ("tokenizer_sha256", "tokenizer"),
                      ("global_batch_size", "global_batch_size")):
        if saved[key] != now[key]:
            differences[name] = [saved[key], now[key]]
    # A shape key is never honoured, whatever was allowed (see ckpt.drift).
    refused = {k: v for k, v in differences.items() if k in SHAPE_KEYS or not _allowed(k, allow_drift)}
    if refused:
        # Another tokenizer is the cause where model.vocab_size (following the data) differs too.
        first = "tokenizer" if "tokenizer" in refused else next(iter(refused))
        refused = {first: refused[first], **refused}
        key, (old, new) = next(iter(refused.items()))
        more = f" (and {len(refused) - 1} more: {', '.join(list(refused)[1:4])})" if len(refused) > 1 else ""
        if key in SHAPE_KEYS:
            raise ResumeRefused(shape_refusal(key, old, new, where, more))
        # Starting a new run.dir from the weights is meaningful where a branch accepts the difference.
        branch = ("" if where.startswith("parent") or key.startswith("model.") or key == "tokenizer" else
                  f", or start a new run.dir from its weights with run.init_from={cfg.run.dir}/checkpoints/"
                  f"{where.split()[-1]}")
        restore = keep_batch(cfg, old, new) if key == "global_batch_size" else "restore it"
        what = "branch" if where.startswith("parent") else "resume"
        raise ResumeRefused(f"{what} refused: {where} was made with {key}={old!r}, now {new!r}{more}; "
                            f"{restore}, pass --allow-drift {key} to continue this run under the new value{branch}")
    return differences
