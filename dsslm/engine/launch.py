"""What the launcher asked for, reconciled with `engine.*` before an engine is built.

`accelerate launch` describes its choices in environment variables, not arguments. dsslm's own
engines do the sharding (Accelerate's FSDP and DeepSpeed plugins are never used: on CPU they
silently fall back to plain DDP), so the launch flags are translated into `engine.*` here:

- `--use_deepspeed [--zero_stage N]` (ACCELERATE_USE_DEEPSPEED, ACCELERATE_DEEPSPEED_ZERO_STAGE)
  selects engine.kind=zero with that stage; `--deepspeed_config_file F` becomes engine.ds_config.
- `--use_fsdp` (ACCELERATE_USE_FSDP) selects engine.kind=fsdp.
- `--multi_gpu` alone changes nothing: engine.kind decides, as under torchrun.
- Without a GPU (or with `--cpu`), and without `--multi_gpu` or a config file, accelerate runs
  its single-process launcher whatever `--num_processes` says: that launcher alone sets
  ACCELERATE_USE_CPU, and sets MASTER_PORT only when more than one process was asked for, with
  no WORLD_SIZE. The run stops there (exit 2) with the command that starts them.

The launcher wins over the config for the engine (the flags were typed for this run; `engine.*`
may change on resume), and rank 0 prints one line saying so. Flags that would change what is
computed (`--mixed_precision`, `--gradient_accumulation_steps`, `--gradient_clipping`) must agree
with train.precision / train.grad_accum / optim.clip, or the run stops with a ConfigError naming
the key: a silent mismatch between the launcher and the config is the one outcome we rule out.
"""
from __future__ import annotations

import os
import sys
from datetime import timedelta

import torch
import torch.distributed as dist

from dsslm.config import Config, ConfigError, accumulation_for

TRUE = ("1", "true", "yes")


def _flag(env: dict, key: str) -> bool:
    return env.get(key, "").strip().lower() in TRUE


def apply_launcher(cfg: Config, env: dict | None = None) -> list[str]:
    """Fold Accelerate's launch flags into `cfg.engine` (in place); return what changed, as lines."""
    env = dict(os.environ) if env is None else env
    changes: list[str] = []
    check_process_count(env)
    _check_agrees(cfg, env)
    if _flag(env, "ACCELERATE_USE_DEEPSPEED") and _flag(env, "ACCELERATE_USE_FSDP"):
        raise ConfigError("accelerate launch was given both --use_deepspeed and --use_fsdp; pick one "
                          "(engine.kind=zero or engine.kind=fsdp)")
    if _flag(env, "ACCELERATE_USE_DEEPSPEED"):
        stage = env.get("ACCELERATE_DEEPSPEED_ZERO_STAGE", "").strip()
        want_stage = int(stage) if stage else cfg.engine.zero_stage
        if want_stage not in (1, 2, 3):
            raise ConfigError(f"accelerate launch --zero_stage {stage}: dsslm runs ZeRO stage 1, 2 or 3 "
                              f"(stage 0 is plain data parallel: launch with --multi_gpu and engine.kind=ddp)")
        if (cfg.engine.kind, cfg.engine.zero_stage) != ("zero", want_stage):
            changes.append(f"engine.kind={cfg.engine.kind} engine.zero_stage={cfg.engine.zero_stage} -> "
                           f"engine.kind=zero engine.zero_stage={want_stage} (accelerate launch --use_deepspeed)")
        for flag, key in (("--offload_optimizer_device", "ACCELERATE_DEEPSPEED_OFFLOAD_OPTIMIZER_DEVICE"),
                          ("--offload_param_device", "ACCELERATE_DEEPSPEED_OFFLOAD_PARAM_DEVICE")):
            if env.get(key, "none").strip().lower() not in ("", "none"):
                raise ConfigError(f"accelerate launch {flag} {env[key]}: dsslm's ZeRO engine keeps optimizer "
                                  f"state and parameters on the device; launch with {flag} none")
        cfg.engine.kind, cfg.engine.zero_stage = "zero", want_stage
        ds_file = env.get("ACCELERATE_DEEPSPEED_CONFIG_FILE", "").strip()
        if ds_file and ds_file != cfg.engine.ds_config:
            changes.append(f"engine.ds_config={cfg.engine.ds_config!r} -> {ds_file!r} "
                           f"(accelerate launch --deepspeed_config_file)")
            cfg.engine.ds_config = ds_file
    elif _flag(env, "ACCELERATE_USE_FSDP"):
        if cfg.engine.kind != "fsdp":
            changes.append(f"engine.kind={cfg.engine.kind} -> engine.kind=fsdp (accelerate launch --use_fsdp; "
                           f"dsslm shards with torch fully_shard itself, FSDP_* plugin options are not read)")
        cfg.engine.kind = "fsdp"
    return changes


def check_process_count(env: dict) -> None:
    """ConfigError where accelerate launch was asked for several processes and started one."""
    simple_launcher = "ACCELERATE_USE_CPU" in env and not env.get("WORLD_SIZE")
    if not (simple_launcher and env.get("MASTER_PORT")):
        return
    drop_cpu = "drop --cpu, and " if _flag(env, "ACCELERATE_USE_CPU") else ""
    raise ConfigError(f"accelerate launch started 1 process, not the --num_processes (or --num_machines) asked for: "
                      f"with no GPU, or --cpu, and neither --multi_gpu nor --config_file it runs its single-process "
                      f"launcher; {drop_cpu}launch with `accelerate launch --multi_gpu --num_processes N -m dsslm.train "
                      f"...` or `accelerate launch --config_file configs/accelerate/ddp.yaml --num_processes N -m "
                      f"dsslm.train ...` (N gloo processes on a CPU); for one process, unset MASTER_PORT")


def _check_agrees(cfg: Config, env: dict) -> None:
    precision = env.get("ACCELERATE_MIXED_PRECISION", "no").strip().lower()
    want = {"no": None, "bf16": "bf16", "fp16": "fp16"}.get(precision, precision)
    if want is not None and want != cfg.train.precision:
        raise ConfigError(f"accelerate launch --mixed_precision {precision} but train.precision="
                          f"{cfg.train.precision}; set train.precision={want} or launch with --mixed_precision no")
    grad_accum = env.get("ACCELERATE_GRADIENT_ACCUMULATION_STEPS", "").strip()
    t = cfg.train
    if grad_accum and t.global_batch_size:
        # The accumulation follows from the global batch at this world size; a flag that says
        # otherwise would be ignored in silence.
        world = int(env.get("WORLD_SIZE", "1"))
        derived = accumulation_for(t, world)
        if int(grad_accum) != derived:
            raise ConfigError(f"accelerate launch --gradient_accumulation_steps {grad_accum} but train.global_batch_size="
                              f"{t.global_batch_size} / (train.micro_batch_size={t.micro_batch_size} x world size "
                              f"{world}) gives train.grad_accum {derived}; drop the flag (the global batch sets it)")
    elif grad_accum and int(grad_accum) != t.grad_accum:
        raise ConfigError(f"accelerate launch --gradient_accumulation_steps {grad_accum} but train.grad_accum="
                          f"{t.grad_accum}; set train.grad_accum={grad_accum} or drop the flag")
    clip = env.get("ACCELERATE_GRADIENT_CLIPPING", "").strip().lower()
    if clip and clip != "none" and float(clip) != cfg.optim.clip:
        raise ConfigError(f"accelerate launch --gradient_clipping {clip} but optim.clip={cfg.optim.clip}; "
                          f"set optim.clip={clip} or drop the flag")


def in_launcher() -> bool:
    """True under torchrun / accelerate launch / srun with more than one process."""
    return int(os.environ.get("WORLD_SIZE", "1")) > 1


def is_first_process() -> bool:
    """Rank 0 as the launcher numbered it, for output made before or after any engine exists."""
    return int(os.environ.get("RANK", "0")) == 0


def leave_process_group() -> None:
    """Tear down a process group someone other than an engine kept alive (the drill's)."""
    if dist.is_initialized():
        dist.destroy_process_group()


def announce(changes: list[str]) -> None:
    """One stderr line per change, from the first rank only (ranks are not known yet)."""
    if changes and is_first_process():
        for line in changes:
            print(f"dsslm: {line}", file=sys.stderr, flush=True)


def ensure_process_group(device: torch.device, timeout_s: int = 1800) -> None:
    """A one-rank group for a sharded engine run as plain `python -m dsslm.train`.

    DeepSpeed and fully_shard both need a process group even for one process; a store on a free
    loopback port keeps two such runs on one machine from colliding.
    """
    if dist.is_initialized():
        return
    import socket
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    store = dist.TCPStore("127.0.0.1", port, world_size=1, is_master=True,
                          timeout=timedelta(seconds=timeout_s))
    backend = "nccl" if device.type == "cuda" else "gloo"
    dist.init_process_group(backend=backend, store=store, rank=0, world_size=1,
                            timeout=timedelta(seconds=timeout_s))
