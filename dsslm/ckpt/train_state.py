"""The loop's own state between steps (`TrainState`), the fingerprint a resume is checked against,
and the refusal of a resume that would not continue the same run.

Steps are counted as everywhere in dsslm: `step` is the number of optimizer steps completed, so
the record of a step's update and the checkpoint taken right after it carry the same number.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

from dsslm.fields import (MAX_COUNT, MAX_STEP, Fields, Float, Int, Json, ListOf, MapOf, Optional, Str,
                               Window)
from omegaconf import OmegaConf
from omegaconf.errors import OmegaConfBaseException

from dsslm.config import Config, ConfigError, _explain, config_hash, hashed_items, validate

# A rewind carried out (recovery.rewind.rewind_record): the first spike step, the window of global
# sequences it skipped, the checkpoint step it went back to and the lr_scale factor it applied;
# a triage decision adds its verdict, and a temporary backoff (monitor.lr_recover_steps) the
# step its ramp back to the full learning rate starts from (`target`).
REWIND_RECORD = Fields(optional=("verdict", "target"), open=True, step=Int(0, MAX_STEP), window=Window(),
                       to_step=Int(0, MAX_STEP), lr_scale_factor=Float(0.0, 1.0), verdict=Str(32),
                       target=Int(0, MAX_STEP))


@dataclass
class TrainState:
    """What the loop carries from one step to the next, and restores from a checkpoint."""
    step: int = 0                    # optimizer steps completed
    tokens_seen: int = 0             # real target tokens trained on so far, all ranks
    next_sequence: int = 0           # the data stream's position: the next global sequence to consider
    skip_list: list = field(default_factory=list)  # half-open [start, end) global-sequence windows never fed
    lr_scale: float = 1.0            # multiplies the planned learning rate; lowered by the spike policy
    rewinds: list = field(default_factory=list)    # rewinds carried out (recovery.rewind.rewind_record)
    skipped_steps: int = 0
    clipped_steps: int = 0
    lineage: list = field(default_factory=list)    # parent runs this run branched from
    # Target tokens trained per domain, like tokens_seen (metrics.jsonl's domain_tokens). None: restored
    # from a checkpoint that predates it; the loop then derives it from the position.
    domain_tokens: dict | None = field(default_factory=dict)

    state_spec = Fields(
        optional=("domain_tokens",),
        step=Int(0, MAX_STEP), tokens_seen=Int(0, MAX_COUNT), next_sequence=Int(0, MAX_COUNT),
        skip_list=ListOf(Window(), max_len=100_000),
        lr_scale=Float(1e-12, 1.0), rewinds=ListOf(REWIND_RECORD, max_len=100_000),
        skipped_steps=Int(0, MAX_STEP), clipped_steps=Int(0, MAX_STEP),
        lineage=ListOf(Fields(open=True, run_dir=Str(), step=Int(0, MAX_STEP), checkpoint=Str()), max_len=1000),
        domain_tokens=Optional(MapOf(Int(0, MAX_COUNT), max_len=10_000)))

    def state_dict(self) -> dict:
        return dataclasses.asdict(self)

    def load_state_dict(self, state: dict) -> None:
        for f in dataclasses.fields(self):
            setattr(self, f.name, state.get(f.name) if f.name == "domain_tokens" else state[f.name])


# Reading a saved config (moved here from config.py, which holds what a user types).
# Hashed keys added after checkpoints were first written, and the value those older checkpoints
# were made with: their absence is that value, not a difference. `model.vocab_pad_to=1` is the
# unpadded embedding of checkpoints from before padding existed, so a resume under the default
# 64 is refused naming the key (the shapes differ), and one with `model.vocab_pad_to=1` continues.
LEGACY_VALUES = {"model.vocab_pad_to": 1}


def drift(saved: dict[str, Any], cfg: Config) -> dict[str, tuple[Any, Any]]:
    """Keys whose value differs between a checkpoint's hashed items and `cfg`: key -> (saved, now).

    A key the checkpoint does not have (dsslm added it since) is read at the value the older code
    behaved as: LEGACY_VALUES where that differs from today's default (model.vocab_pad_to was 1,
    no padding), else the default (model.norm_eps=1e-6 was a constant before): then no drift."""
    now, defaults = hashed_items(cfg), hashed_items(Config())
    saved = {**{k: v for k, v in LEGACY_VALUES.items() if k in now}, **saved}
    keys = set(saved) | set(now)
    return {k: (saved.get(k), now.get(k)) for k in sorted(keys) if saved.get(k) != now.get(k)
            and not (k not in saved and k in defaults and now.get(k) == defaults[k])}


def _has_key(tree: dict, dotted: str) -> bool:
    node: Any = tree
    for part in dotted.split("."):
        if not isinstance(node, dict) or part not in node:
            return False
        node = node[part]
    return True


def from_dict(tree: Any, where: str) -> Config:
    """A Config from a saved tree (a checkpoint's state.json `config`), checked like a loaded one.

    `where` names the file in the error, since the user did not type these keys."""
    if not isinstance(tree, dict):
        raise ConfigError(f"{where}: the config is not an object")
    # A key older dsslm did not write reads as what that code did (see drift).
    legacy = [f"{key}={value}" for key, value in LEGACY_VALUES.items() if not _has_key(tree, key)]
    try:
        cfg = OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(Config), tree,
                                                  OmegaConf.from_dotlist(legacy)))
        validate(cfg)
    except OmegaConfBaseException as err:
        raise ConfigError(f"{where}: {_explain(err)}") from None
    except ConfigError as err:
        raise ConfigError(f"{where}: {err}") from None
    return cfg


class ResumeRefused(ConfigError):
    """The checkpoint was made by a different config, tokenizer or dataset."""


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
    refused = {k: v for k, v in differences.items() if not _allowed(k, allow_drift)}
    if refused:
        key, (old, new) = next(iter(refused.items()))
        more = f" (and {len(refused) - 1} more: {', '.join(list(refused)[1:4])})" if len(refused) > 1 else ""
        raise ResumeRefused(f"resume refused: {where} was made with {key}={old!r}, now {new!r}{more}; "
                            f"restore it, use another run.dir, or pass --allow-drift {key}")
    return differences
