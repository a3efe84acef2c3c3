"""Validation of a loaded Config: one ConfigError naming every key that cannot work, and how to fix it.

The checks run together and the user hears all their problems at once, not one per attempt: a
check that would fail because of another (d_model % n_heads when n_heads is 0) runs only when
that one passed, and a key already named is not named again.
"""
from __future__ import annotations

import contextvars
import dataclasses
import math
import re
from typing import Any

from dsslm.config.keys import HF_PREFIX, Config, ConfigError

# The problems found so far by the validate() in progress; None outside one: a check then raises.
_found: contextvars.ContextVar[list[str] | None] = contextvars.ContextVar("dsslm_config_problems", default=None)


def _key_of(message: str) -> str:
    match = re.match(r"[\w.-]+", message)
    return match.group(0) if match else message


def _check(ok: bool, message: str) -> bool:
    if ok:
        return True
    found = _found.get()
    if found is None:
        raise ConfigError(message)
    if _key_of(message) not in {_key_of(m) for m in found}:
        found.append(message)
    return False


def join_problems(problems: list[str]) -> str:
    """Several problems as one line: `2 problems: (1) ...; (2) ...`."""
    if len(problems) == 1:
        return problems[0]
    return f"{len(problems)} problems: " + "; ".join(f"({i}) {p}" for i, p in enumerate(problems, 1))


def one_error(problems: list[str]) -> ConfigError | None:
    """Every problem in one ConfigError (one line on stderr), or None when there is none."""
    return ConfigError(join_problems(problems)) if problems else None


def _check_choice(key: str, value: Any, allowed: tuple) -> None:
    _check(value in allowed, f"{key}={value!r} is not allowed; use one of {', '.join(map(str, allowed))}")


def validate(cfg: Config) -> None:
    """Raise one ConfigError naming every key that cannot work, and how to fix each."""
    error = one_error(problems(cfg))
    if error is not None:
        raise error


def problems(cfg: Config) -> list[str]:
    """What validate() would say, one message per key that cannot work."""
    token = _found.set([])
    try:
        _check_all(cfg)
        return list(_found.get())
    finally:
        _found.reset(token)


def _check_all(cfg: Config) -> None:
    _check_finite(cfg)
    t, e = cfg.train, cfg.engine
    _check_choice("train.precision", t.precision, ("bf16", "fp16", "fp32"))
    _check_choice("train.device", t.device, ("auto", "cpu", "cuda"))
    _check_choice("engine.kind", e.kind, ("ddp", "zero", "fsdp"))
    _check_choice("engine.zero_stage", e.zero_stage, (1, 2, 3))
    _check_choice("faults.crash_mode", cfg.faults.crash_mode, ("sigkill", "raise"))
    _check_choice("train.activation_checkpointing", t.activation_checkpointing, ("none", "full", "every_n"))
    _check_choice("engine.fsdp_grad_reduce", e.fsdp_grad_reduce, ("step", "micro_batch"))
    _check_choice("ckpt.format", cfg.ckpt.format, ("auto", "sharded", "gathered"))
    for key, value in (("train.total_steps", t.total_steps), ("train.micro_batch_size", t.micro_batch_size),
                       ("train.grad_accum", t.grad_accum), ("ckpt.every", cfg.ckpt.every),
                       ("ckpt.keep_last", cfg.ckpt.keep_last),
                       ("train.activation_checkpointing_every", t.activation_checkpointing_every)):
        _check(value >= 1, f"{key}={value} must be >= 1")
    _check(t.global_batch_size >= 0, f"train.global_batch_size={t.global_batch_size} must be >= 0 (0 = unset)")
    _check(cfg.ckpt.keep_every >= 0, f"ckpt.keep_every={cfg.ckpt.keep_every} must be >= 0 (0 = none)")
    _check(cfg.run.val_every >= 0, f"run.val_every={cfg.run.val_every} must be >= 0 (0 = never)")
    _check(cfg.run.val_batches >= 1, f"run.val_batches={cfg.run.val_batches} must be >= 1")
    m = cfg.model
    _check(m.init_std >= 0, f"model.init_std={m.init_std} must be >= 0")
    _check(m.eos_id >= -1 and (m.vocab_size == 0 or m.eos_id < m.vocab_size),
           f"model.eos_id={m.eos_id} must be -1 (the data's EOS) or an id below model.vocab_size={m.vocab_size}")
    _check(bool(cfg.run.dir.strip()), "run.dir is empty; name the run's folder, e.g. run.dir=runs/my-run")
    _check(cfg.run.lock_stale_s > 0, f"run.lock_stale_s={cfg.run.lock_stale_s} must be > 0")
    _check(t.z_loss >= 0, f"train.z_loss={t.z_loss} must be >= 0")
    _check(t.compile_cache == t.compile_cache.strip() and "\0" not in t.compile_cache,
           f"train.compile_cache={t.compile_cache!r}: name a folder without surrounding spaces, or \"\" for "
           "run.dir/cache")
    _check(t.loss_scale_init >= 1, f"train.loss_scale_init={t.loss_scale_init} must be >= 1")
    validate_model(cfg)
    validate_optim(cfg)
    validate_data(cfg)
    validate_spike_policy(cfg)
    validate_watchdog(cfg)
    validate_nodes(cfg)


# The phases a rank reports (dsslm/health/watchdog.py's PHASES, less the start's load): where the
# hang drill can stop it.
DRILL_PHASES = ("data", "forward_backward", "optimizer", "collective", "checkpoint", "evaluation", "downstream")


def validate_watchdog(cfg: Config) -> None:
    """observe.watchdog, engine.collective_timeout_s and the hang drill."""
    w, f = cfg.observe.watchdog, cfg.faults
    _check(w.floor_s > 0, f"observe.watchdog.floor_s={w.floor_s} must be > 0")
    _check(w.ceiling_s >= w.floor_s and w.first_s >= w.floor_s,
           f"observe.watchdog.ceiling_s={w.ceiling_s} and first_s={w.first_s} must be >= floor_s={w.floor_s}")
    _check(w.factor >= 1, f"observe.watchdog.factor={w.factor} must be >= 1")
    # A live rank beats several times within floor_s, or a late beat would look like a dead rank.
    _check(0 < w.beat_s <= w.floor_s / 4, f"observe.watchdog.beat_s={w.beat_s} must be in (0, floor_s / 4 = "
                                          f"{w.floor_s / 4:g}]")
    _check(w.crash_loop >= 0, f"observe.watchdog.crash_loop={w.crash_loop} must be >= 0 (0 = never stop requeueing)")
    _check(cfg.engine.collective_timeout_s >= 1,
           f"engine.collective_timeout_s={cfg.engine.collective_timeout_s} must be >= 1")
    _check_choice("faults.hang_phase", f.hang_phase, DRILL_PHASES)
    for key in ("write_mb_s", "load_mb_s", "eval_batch_s", "step_s"):
        _check(getattr(f, key) >= 0, f"faults.{key}={getattr(f, key)} must be >= 0 (0 = off)")
    _check(f.hang_rank >= 0, f"faults.hang_rank={f.hang_rank} must be a rank >= 0")


def validate_nodes(cfg: Config) -> None:
    """observe.nodes, observe.stragglers and the straggler drill."""
    n, s, f = cfg.observe.nodes, cfg.observe.stragglers, cfg.faults
    _check(0 <= n.min_bandwidth < 1, f"observe.nodes.min_bandwidth={n.min_bandwidth} must be in [0, 1) (0 = never)")
    _check(0 <= n.min_matmul < 1, f"observe.nodes.min_matmul={n.min_matmul} must be in [0, 1) (0 = never)")
    _check(n.max_clock_skew_s > 0, f"observe.nodes.max_clock_skew_s={n.max_clock_skew_s} must be > 0")
    _check(n.exclude_hours >= 0, f"observe.nodes.exclude_hours={n.exclude_hours} must be >= 0 (0 = never exclude)")
    _check(n.hang_blames >= 0, f"observe.nodes.hang_blames={n.hang_blames} must be >= 0 (0 = never)")
    _check(s.every >= 0, f"observe.stragglers.every={s.every} must be >= 0 (0 = off)")
    _check(s.factor > 1, f"observe.stragglers.factor={s.factor} must be > 1")
    _check(0 <= s.min_share < 1, f"observe.stragglers.min_share={s.min_share} must be in [0, 1)")
    _check(s.persist >= 1, f"observe.stragglers.persist={s.persist} must be >= 1")
    _check_choice("faults.slow_phase", f.slow_phase, ("data", "optimizer"))
    _check(f.slow_s >= 0, f"faults.slow_s={f.slow_s} must be >= 0")


def _check_finite(node: Any, prefix: str = "") -> None:
    """Every float key is a finite number: a bound like `> 0` lets inf through (optim.peak_lr=inf
    trained to non-finite weights; model.rope_theta=inf made RoPE the identity without a word)."""
    for f in dataclasses.fields(node):
        value, key = getattr(node, f.name), f"{prefix}{f.name}"
        if dataclasses.is_dataclass(value):
            _check_finite(value, f"{key}.")
        elif isinstance(value, float):
            _check(math.isfinite(value), f"{key}={value} must be a finite number")


def validate_model(cfg: Config) -> None:
    """The model's shape and its initialisation (run.seed, run.init_from)."""
    m = cfg.model
    for key, value in (("model.d_model", m.d_model), ("model.n_layers", m.n_layers), ("model.n_heads", m.n_heads),
                       ("model.seq_len", m.seq_len), ("model.vocab_pad_to", m.vocab_pad_to)):
        _check(value >= 1, f"{key}={value} must be >= 1")
    _check(0 <= cfg.run.seed < 2**63, f"run.seed={cfg.run.seed} must be in [0, 2^63)")
    if (m.n_heads >= 1 and _check(m.d_model % m.n_heads == 0,
                                  f"model.d_model={m.d_model} must be divisible by model.n_heads={m.n_heads}")):
        _check((m.d_model // m.n_heads) % 2 == 0,
               f"model.d_model/model.n_heads={m.d_model // m.n_heads} must be even for RoPE; change model.n_heads")
    _check(0.0 <= m.dropout < 1.0, f"model.dropout={m.dropout} must be in [0, 1)")
    _check(0.0 < m.norm_eps < 1.0, f"model.norm_eps={m.norm_eps} must be in (0, 1)")
    _check(m.rope_theta > 0, f"model.rope_theta={m.rope_theta} must be > 0")
    _check(m.document_mask or not m.document_positions, "model.document_positions=true needs model.document_mask=true")
    _check(m.vocab_size >= 0 and m.ffn_hidden >= 0,
           f"model.vocab_size={m.vocab_size} and model.ffn_hidden={m.ffn_hidden} must be >= 0 (0 = derived)")
    _check(m.mup_base_width >= 0 and m.mup_base_depth >= 0, f"model.mup_base_width={m.mup_base_width} and "
           f"model.mup_base_depth={m.mup_base_depth} must be >= 0 (0 = off: the standard parametrisation)")
    if cfg.run.init_from.startswith(HF_PREFIX):
        _check(len(cfg.run.init_from) > len(HF_PREFIX),
               f"run.init_from={cfg.run.init_from!r} names no folder; write run.init_from=hf:PATH/TO/HF_DIR")
        # An export folds muP's multipliers into the weights; read back under muP they would apply twice.
        _check(not (m.mup_base_width or m.mup_base_depth),
               f"model.mup_base_width={m.mup_base_width} / mup_base_depth={m.mup_base_depth} cannot start from "
               f"run.init_from={cfg.run.init_from}: a Hugging Face folder holds standard-parametrisation weights; "
               "drop model.mup_base_width and model.mup_base_depth")


def validate_optim(cfg: Config) -> None:
    """AdamW and the LR schedule."""
    o, t = cfg.optim, cfg.train
    _check_choice("optim.schedule", o.schedule, ("cosine", "wsd"))
    _check_choice("optim.decay_shape", o.decay_shape, ("linear", "1-sqrt"))
    _check_choice("optim.impl", o.impl, ("auto", "single", "foreach", "fused"))
    _check_choice("optim.name", o.name, ("adamw", "muon"))
    _check_choice("optim.muon_ns_dtype", o.muon_ns_dtype, ("auto", "bfloat16", "float32"))
    _check(o.muon_weight_decay is None or o.muon_weight_decay >= 0,
           f"optim.muon_weight_decay={o.muon_weight_decay} must be >= 0, or null for AdamW's decay per step")
    _check(o.muon_lr > 0 and 0 <= o.muon_momentum < 1,
           f"optim.muon_lr={o.muon_lr} must be > 0 and optim.muon_momentum={o.muon_momentum} in [0, 1)")
    for role in ("embedding", "hidden", "head", "scalars"):
        mult = getattr(o, f"lr_{role}")
        _check(mult >= 0, f"optim.lr_{role}={mult} must be >= 0 (a multiplier of the scheduled rate; 0 freezes the role)")
    if _check(o.peak_lr > 0, f"optim.peak_lr={o.peak_lr} must be > 0"):
        _check(0 <= o.min_lr <= o.peak_lr, f"optim.min_lr={o.min_lr} must be in [0, optim.peak_lr={o.peak_lr}]")
    if t.total_steps >= 1:  # else named already: the bounds below follow from it
        _check(0 <= o.warmup_steps <= t.total_steps,
               f"optim.warmup_steps={o.warmup_steps} must be in [0, train.total_steps={t.total_steps}]; for a run "
               f"this short set optim.warmup_steps={t.total_steps // 10} (a tenth of it), or raise train.total_steps")
    if o.schedule == "wsd" and t.total_steps >= 1 and 0 <= o.warmup_steps <= t.total_steps:
        _check(1 <= o.decay_steps <= t.total_steps - o.warmup_steps,
               f"optim.decay_steps={o.decay_steps} must be in [1, train.total_steps - optim.warmup_steps"
               f"={t.total_steps - o.warmup_steps}] for optim.schedule=wsd")
    _check(o.weight_decay >= 0, f"optim.weight_decay={o.weight_decay} must be >= 0")
    _check(o.eps > 0, f"optim.eps={o.eps} must be > 0")
    _check(o.clip > 0, f"optim.clip={o.clip} must be > 0 (a huge value disables clipping)")
    _check(0 < o.beta1 < 1 and 0 < o.beta2 < 1, "optim.beta1 and optim.beta2 must be in (0, 1)")


def validate_data(cfg: Config) -> None:
    """The batch ramp, verification and the mixture."""
    ramp = cfg.train.batch_ramp
    _check(ramp.start >= 0 and ramp.tokens >= 0,
           f"train.batch_ramp.start={ramp.start} and train.batch_ramp.tokens={ramp.tokens} must be >= 0")
    _check((ramp.start > 0) == (ramp.tokens > 0),
           "train.batch_ramp needs both start (sequences) and tokens, or neither; e.g. "
           "train.batch_ramp.start=32 train.batch_ramp.tokens=1000000")
    _check(cfg.data.verify in (True, False, "full"),
           f"data.verify={cfg.data.verify!r} is not allowed; use true (hash what changed since the cached "
           "verification), false (sizes only) or full (hash every shard)")
    _check(cfg.data.shuffle in ("auto", "feistel", "block", "array"),
           f"data.shuffle={cfg.data.shuffle!r} is not a kind; use auto (a resume keeps its checkpoint's), "
           "feistel, block or array")
    _check(cfg.data.shuffle_block >= 1 and cfg.data.shuffle_window >= 1,
           f"data.shuffle_block={cfg.data.shuffle_block} and data.shuffle_window={cfg.data.shuffle_window} "
           "must be >= 1 (chunks per block, blocks per window)")
    validate_mix(cfg.data.mix)
    validate_stages(cfg.data.mix_stages, bool(cfg.data.mix))


def validate_spike_policy(cfg: Config) -> None:
    """The monitor, clipping, drill and observe keys."""
    m, o, f, ob = cfg.monitor, cfg.optim, cfg.faults, cfg.observe
    _check(ob.audit_tol >= 0, f"observe.audit_tol={ob.audit_tol} must be >= 0")
    _check(cfg.eval.every >= 0 and cfg.eval.max_examples >= 0, f"eval.every={cfg.eval.every} and "
           f"eval.max_examples={cfg.eval.max_examples} must be >= 0 (0: the start and the last step only; all examples)")
    _check(ob.every >= 0, f"observe.every={ob.every} must be >= 0 (0 = off)")
    _check(0 < ob.slow_fraction < 1, f"observe.slow_fraction={ob.slow_fraction} must be in (0, 1)")
    _check_choice("observe.wandb_mode", ob.wandb_mode, ("", "online", "offline"))
    _check_choice("monitor.detector", m.detector, ("mad", "zscore", "max_multiple"))
    _check_choice("monitor.nonfinite", m.nonfinite, ("rewind", "skip"))
    _check_choice("optim.clip_mode", o.clip_mode, ("fixed", "zclip"))
    _check_choice("faults.grad_fault_mode", f.grad_fault_mode, ("scale", "nan"))
    _check(0 < m.lr_backoff <= 1, f"monitor.lr_backoff={m.lr_backoff} must be in (0, 1]")
    _check(m.window >= 3, f"monitor.window={m.window} must be >= 3")
    _check(m.gnorm_trend >= 0, f"monitor.gnorm_trend={m.gnorm_trend} must be >= 0 (0 = the window median only)")
    _check(m.loss_trend >= 0, f"monitor.loss_trend={m.loss_trend} must be >= 0 (0 = the window median only)")
    _check(m.loss_trend_z > 0, f"monitor.loss_trend_z={m.loss_trend_z} must be > 0")
    _check(m.sequence_window >= 1, f"monitor.sequence_window={m.sequence_window} must be >= 1")
    _check(m.skip_batches >= 1, f"monitor.skip_batches={m.skip_batches} must be >= 1")
    _check(m.max_multiple > 1 and m.max_multiple_steps >= 1,
           f"monitor.max_multiple={m.max_multiple} must be > 1 and monitor.max_multiple_steps="
           f"{m.max_multiple_steps} >= 1")
    _check(m.triage_max_replay_steps >= 0, f"monitor.triage_max_replay_steps={m.triage_max_replay_steps} must be >= 0")
    _check(m.rewind_every >= 0 and m.rewind_points >= 1, f"monitor.rewind_every={m.rewind_every} must be >= 0 "
           f"(0 = off) and monitor.rewind_points={m.rewind_points} >= 1")
    _check(m.max_backoffs >= 1, f"monitor.max_backoffs={m.max_backoffs} must be >= 1")
    _check(0 < m.max_skip_share <= 1, f"monitor.max_skip_share={m.max_skip_share} must be in (0, 1] (1: never ask)")
    _check(m.lr_recover_steps >= 0, f"monitor.lr_recover_steps={m.lr_recover_steps} must be >= 0 (0: a backoff stays)")
    _check(0 < o.zclip_alpha < 1, f"optim.zclip_alpha={o.zclip_alpha} must be in (0, 1)")
    _check(o.zclip_z > 0 and o.zclip_warmup_steps >= 2,
           f"optim.zclip_z={o.zclip_z} must be > 0 and optim.zclip_warmup_steps={o.zclip_warmup_steps} >= 2")
    _check(f.repeat_ngram >= 0, f"faults.repeat_ngram={f.repeat_ngram} must be >= 0 (0 = one whole document)")
    _check(0 <= f.replay_noise < 0.5, f"faults.replay_noise={f.replay_noise} must be in [0, 0.5)")
    _check(f.grad_fault_scale > 0, f"faults.grad_fault_scale={f.grad_fault_scale} must be > 0")
    for key in ("poison_batches", "repeat_batches", "repeat_chunks", "poison_chunks"):
        for window in getattr(f, key):
            _check(isinstance(window, list) and len(window) == 2 and all(isinstance(x, int) for x in window)
                   and 0 <= window[0] < window[1],
                   f"faults.{key} entry {window!r} must be [start, end] with 0 <= start < end")
    for key in ("lr_burst", "grad_surge"):
        for burst in getattr(f, key):
            _check(isinstance(burst, list) and len(burst) == 3 and all(isinstance(x, int) for x in burst[:2])
                   and 1 <= burst[0] < burst[1] and isinstance(burst[2], (int, float)) and burst[2] > 0,
                   f"faults.{key} entry {burst!r} must be [start, end, multiplier] with 1 <= start < end "
                   f"and multiplier > 0")
    for step in f.grad_fault_steps:
        _check(isinstance(step, int) and step >= 1, f"faults.grad_fault_steps entry {step!r} must be a step >= 1")


def validate_mix(mix: dict[str, float], key: str = "data.mix") -> None:
    """data.mix: finite weights >= 0 with a positive total; each named positive weight at least a
    millionth of the total (weights are kept in parts per million: a smaller one would be 0)."""
    valid = [_check(_is_number(weight) and math.isfinite(weight) and weight >= 0,
                    f"{key}.{domain}={weight!r} must be a finite number >= 0") for domain, weight in mix.items()]
    if not mix or not all(valid):
        return
    total = sum(mix.values())
    _check(total > 0, f"{key} has no positive weight; give at least one domain a weight > 0, or drop {key}")
    for domain, weight in mix.items():
        _check(weight == 0 or weight >= total * 1e-6,
               f"{key}.{domain}={weight} is below a millionth of the total {total}; raise it or set it to 0")
    _check(sum(w > 0 for w in mix.values()) <= 256, f"{key} gives more than 256 domains a positive weight")


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def validate_stages(stages: list, with_mix: bool) -> None:
    """data.mix_stages: [{start, weights}], starts from 0 strictly increasing, each stage's weights
    as data.mix's; not beside data.mix (which of the two would hold?)."""
    if not stages:
        return
    _check(not with_mix, "data.mix and data.mix_stages are both set; put data.mix's weights in a stage at start 0")
    starts = []
    for i, stage in enumerate(stages):
        ok = _check(isinstance(stage, dict) and set(stage) == {"start", "weights"} and type(stage["start"]) is int
                    and stage["start"] >= 0 and isinstance(stage["weights"], dict) and bool(stage["weights"]),
                    f"data.mix_stages[{i}]={stage!r} must be {{start: a global sequence >= 0, weights: {{domain: "
                    "weight, ...}}}}")
        if ok:
            starts.append(stage["start"])
            validate_mix(stage["weights"], f"data.mix_stages[{i}].weights")
    if len(starts) == len(stages):
        _check(starts[0] == 0, f"data.mix_stages starts at sequence {starts[0]}; the first stage must have start: 0")
        _check(all(a < b for a, b in zip(starts, starts[1:])),
               f"data.mix_stages' starts {starts} must increase; list the stages in the order they begin")
