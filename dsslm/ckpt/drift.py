"""What a resume may change from its checkpoint (`--allow-drift KEY`), and what each change does.

A drift dsslm cannot honour is refused before anything is read or written: a key that does not
exist (a typo would otherwise be accepted silently) and a key that sets the model's shape (a
checkpoint of another shape cannot be continued: its tensors do not fit, and passing it over
would start a new model in the same run.dir). A drift that is honoured is described in the
`resume` event, the learning-rate plan included: an extended cosine schedule re-plans the LR of
every remaining step, and the user hears the old and new value at the resume step.
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
from typing import Any, Callable

from omegaconf import OmegaConf
from omegaconf.errors import OmegaConfBaseException

from dsslm.config import Config, ConfigError, _explain, ffn_hidden_of, to_dict, validate
from dsslm.optim import lr_at

# Keys that set a tensor's shape or what a data position means (a sequence of seq_len tokens):
# a checkpoint made under another value cannot continue as this run.
# muP's keys do not change a tensor's shape but what the weights compute (multipliers on the logits,
# the scores and the branches) and their rates: weights trained under one parametrisation are another
# function under the other, so these never drift either.
PARAMETRISATION_KEYS = ("model.mup_base_width", "model.mup_base_depth")
SHAPE_KEYS = ("model.d_model", "model.n_layers", "model.n_heads", "model.seq_len", "model.vocab_size",
              "model.vocab_pad_to", "model.ffn_hidden", "model.qk_norm", "model.tie_embeddings") + PARAMETRISATION_KEYS
# The fingerprint's parts that are not config keys.
FINGERPRINT_NAMES = ("data", "tokenizer", "global_batch_size")


def _keys(tree: dict, prefix: str = "") -> list[str]:
    out = []
    for key, value in tree.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict) and value:
            out.extend(_keys(value, name + "."))
        else:
            out.append(name)
    return out


def _config_keys() -> list[str]:
    return _keys(dataclasses.asdict(Config()))


def _covers(allowed: str, key: str) -> bool:
    return key == allowed or key.startswith(allowed + ".")


def check_allow_drift(keys: tuple[str, ...] | list[str]) -> tuple[str, ...]:
    """The `--allow-drift` keys, each checked: ConfigError (exit 2) for one that names no config key
    or section, and for one that covers a key setting the model's shape."""
    known = _config_keys()
    for key in keys:
        exists = (key in FINGERPRINT_NAMES or any(_covers(key, k) for k in known)
                  or key.startswith("data.mix."))  # the mixture's domains are the user's names
        if not exists:
            raise ConfigError(f"--allow-drift {key}: no such config key; name a key (e.g. optim.peak_lr), a "
                              f"section (e.g. optim), or one of {', '.join(FINGERPRINT_NAMES)}")
        shape = [k for k in SHAPE_KEYS if _covers(key, k)]
        if shape:
            what = _what(shape[0])
            raise ConfigError(f"--allow-drift {key}: {shape[0]} sets the model's {what}, and a checkpoint of "
                              f"another {what} cannot continue this run; train the new {what} in a new run.dir "
                              f"(or restore {shape[0]})")
    return tuple(keys)


def _what(key: str) -> str:
    return "parametrisation" if key in PARAMETRISATION_KEYS else "shape"


def shape_refusal(key: str, old: Any, new: Any, where: str, more: str = "") -> str:
    """The refusal of a resume (or a branch: `where` names a parent) whose model shape (or muP
    parametrisation) changed, with advice that works."""
    what = _what(key)
    if where.startswith("parent"):
        return (f"branch refused: {where} was made with {key}={old!r}, now {new!r}{more}: a branch continues "
                f"its parent's weights in their {what}; set {key}={old!r}, or train the new {what} without "
                f"run.init_from")
    return (f"resume refused: {where} was made with {key}={old!r}, now {new!r}{more}: a model of another {what} "
            f"cannot continue this run, and --allow-drift cannot change that; restore {key}={old!r}, or "
            f"train the new {what} in a new run.dir")


def describe(drifted: dict[str, Any], saved_config: Any, cfg: Config, step: int, next_sequence: int) -> list[str]:
    """One sentence per honoured change a resume makes, and the LR plan's change at the resume step."""
    changes = []
    for key, (old, new) in drifted.items():
        if key == "data":
            changes.append(f"data: another corpus; the stream continues at its sequence {next_sequence}")
        elif key == "tokenizer":
            changes.append("tokenizer: another tokenizer; token ids mean what the new one says from here on")
        elif key == "global_batch_size":
            changes.append(f"global_batch_size: {old} -> {new} sequences per step from step {step + 1}; the "
                           f"stream continues at sequence {next_sequence}")
        elif key.startswith("data.mix"):
            changes.append(f"{key}: {old!r} -> {new!r}: each domain's share of the sequences from step {step + 1}")
        else:
            changes.append(f"{key}: {old!r} -> {new!r} from step {step + 1}")
    saved_run = saved_config.get("run") if isinstance(saved_config, dict) else None
    saved_from = saved_run.get("init_from", "") if isinstance(saved_run, dict) else ""
    if cfg.run.init_from and cfg.run.init_from != saved_from:  # a branch asked of a run.dir that has checkpoints
        changes.append(f"run.init_from={cfg.run.init_from} is not used: run.dir holds this run's checkpoints, and a "
                       "resume continues them (start a branch in a new run.dir)")
    plan = lr_change(saved_config, cfg, step)
    if plan is not None:
        old_lr, new_lr = plan
        changes.append(f"learning-rate plan: step {step + 1} trains at {new_lr:.4g} where the checkpoint's plan "
                       f"had {old_lr:.4g} (optim.* or train.total_steps changed)")
    return changes


def lr_change(saved_config: Any, cfg: Config, step: int) -> tuple[float, float] | None:
    """(the checkpoint's planned LR, today's) for the step after `step`, when they differ."""
    try:
        old_cfg = from_dict(saved_config, "the checkpoint's config", rules=None)
    except ConfigError:
        return None  # nothing to compare with; the fingerprint already vouched for what matters
    old, new = lr_at(step, old_cfg), lr_at(step, cfg)
    return None if abs(old - new) <= 1e-12 * max(abs(old), abs(new), 1e-30) else (old, new)


# What a resume compares: every key but those that may change without changing what the run
# computes up to that point.

# Keys that may change between a checkpoint and its resume without changing what the run
# computes up to that point. Everything else must match (or be allowed with --allow-drift).
RESUME_MUTABLE_KEYS = (
    "run.dir", "run.log_every", "run.val_every", "run.val_batches", "run.init_from",
    "run.tensorboard", "run.alert_command", "run.lock_stale_s", "run.restart_from_scratch", "train.compile_cache",
    "run.preflight",
    "data.dir", "data.verify", "data.prefetch",
    # The order a run reads its epochs in is recorded in its train state (TrainState.shuffle) and
    # checked there (ckpt.accept): auto means "the checkpoint's", which no hash of the config can say.
    "data.shuffle", "data.shuffle_block", "data.shuffle_window",
    "train.total_steps",
    "train.device", "train.micro_batch_size", "train.grad_accum", "train.global_batch_size", "ckpt", "faults",
    "monitor.max_rewinds", "engine",
    "observe", "monitor.triage", "monitor.triage_max_replay_steps", "monitor.max_backoffs", "monitor.forensics",
    "monitor.rewind_every", "monitor.rewind_points", "monitor.loss_trend", "monitor.loss_trend_z",
    "monitor.max_skip_share",
    # How the same math is scheduled: rounding-level differences only, like a change of engine.
    "train.compile", "train.activation_checkpointing", "train.activation_checkpointing_every", "train.tf32",
    "optim.impl", "eval",
    # Muon: who orthogonalises changes no bit; NS's dtype is rounding, and `auto` already resolves
    # differently when a CPU run resumes on a GPU (train.device may change).
    "optim.muon_distribute", "optim.muon_ns_dtype",
    # Read once, when the weights are drawn: a resume's weights come from its checkpoint, so a new
    # value (configs/tiny.yaml's default moved from 0.02 to 0.05) changes nothing the run computes.
    "model.init_std",
)


def _flatten(tree: dict, prefix: str = "") -> dict[str, Any]:
    flat: dict[str, Any] = {}
    for key, value in tree.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict):
            flat.update(_flatten(value, name + "."))
        else:
            flat[name] = value
    return flat


def _mutable(key: str) -> bool:
    return any(key == k or key.startswith(k + ".") for k in RESUME_MUTABLE_KEYS)


def hashed_items(cfg: Config) -> dict[str, Any]:
    """The flat key -> value map that the config hash covers (mutable keys left out)."""
    return {key: value for key, value in _flatten(to_dict(cfg)).items() if not _mutable(key)}


def config_hash(cfg: Config) -> str:
    blob = json.dumps(hashed_items(cfg), sort_keys=True, default=str).encode()
    return hashlib.sha256(blob).hexdigest()[:16]


# Reading a saved config: what older checkpoints meant by the keys they lack.

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
    # A checkpoint written before a key became mutable still holds it: it is no difference either.
    saved = {**{k: v for k, v in LEGACY_VALUES.items() if k in now},
             **{k: v for k, v in saved.items() if not _mutable(k)}}
    keys = set(saved) | set(now)
    return {k: (saved.get(k), now.get(k)) for k in sorted(keys) if saved.get(k) != now.get(k)
            and not (k not in saved and k in defaults and now.get(k) == defaults[k])
            and not (k == "model.ffn_hidden" and _same_width(saved, now))}


def _same_width(saved: dict, now: dict) -> bool:
    """model.ffn_hidden=0 (derived) and the number it derives are one shape."""
    try:
        return (ffn_hidden_of(int(saved["model.d_model"]), int(saved["model.ffn_hidden"])) ==
                ffn_hidden_of(int(now["model.d_model"]), int(now["model.ffn_hidden"])))
    except (KeyError, TypeError, ValueError):  # a hostile or partial saved config: differs, as it says
        return False


def _has_key(tree: dict, dotted: str) -> bool:
    node: Any = tree
    for part in dotted.split("."):
        if not isinstance(node, dict) or part not in node:
            return False
        node = node[part]
    return True


def from_dict(tree: Any, where: str, rules: Callable[[Config], None] | None = validate) -> Config:
    """A Config from a saved tree (a checkpoint's state.json `config`), checked by `rules`: like a
    loaded one by default; a checkpoint's own config with fewer (`validate_model`: the model it
    builds) or none (its structure alone), since a rule added later must not make a run that an
    older dsslm trained unreadable (optim.clip=inf and run.val_batches=0 were accepted then).

    `where` names the file in the error, since the user did not type these keys."""
    if not isinstance(tree, dict):
        raise ConfigError(f"{where}: the config is not an object")
    # A key older dsslm did not write reads as what that code did (see drift).
    legacy = [f"{key}={value}" for key, value in LEGACY_VALUES.items() if not _has_key(tree, key)]
    try:
        cfg = OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(Config), tree,
                                                  OmegaConf.from_dotlist(legacy)))
        if rules is not None:
            rules(cfg)
    except OmegaConfBaseException as err:
        raise ConfigError(f"{where}: {_explain(err)}") from None
    except ConfigError as err:
        raise ConfigError(f"{where}: {err}") from None
    except (TypeError, ValueError) as err:  # a list where a map belongs: OmegaConf's merge raises these
        raise ConfigError(f"{where}: {err}") from None
    return cfg
