"""The DeepSpeed config of a ZeRO run: a template file with dsslm's own values filled in.

No deepspeed import here (the JSON is plain data); `engine/zero.py` hands the result to
`deepspeed.initialize`.
"""
from __future__ import annotations

import json
import math
from pathlib import Path

from dsslm.config import Config, ConfigError

DS_CONFIG_DIR = Path(__file__).resolve().parents[2] / "ds_configs"
# Under bf16, filled in when the file leaves them out or writes "auto": gradients accumulate
# across micro-batches and are reduced in fp32, as FSDP's fp32 reduce policy does. bf16 keeps 8
# significant bits: each addition of micro-batch gradients or ranks' contributions kept in it
# rounds by up to 2^-8 = 3.9e-3 relative, against 6e-8 in fp32. A file may still choose bf16
# explicitly (half the traffic), knowingly.
BF16_GRAD_DTYPES = {"data_types.grad_accum_dtype": "fp32", "communication_data_type": "fp32"}


def ds_config(cfg: Config, world_size: int) -> dict:
    """The DeepSpeed config for this run: the template file with dsslm's own values filled in."""
    default = DS_CONFIG_DIR / f"zero{cfg.engine.zero_stage}.json"
    path = Path(cfg.engine.ds_config) if cfg.engine.ds_config else default
    if not path.is_file():
        raise ConfigError(f"engine.ds_config={str(path)!r}: no such file; leave it empty for "
                          f"ds_configs/zero{{stage}}.json")
    try:
        conf = json.loads(path.read_text())
    except json.JSONDecodeError as err:
        raise ConfigError(f"engine.ds_config={str(path)!r} is not JSON: {err}") from None
    for section in ("optimizer", "scheduler"):
        if section in conf:
            raise ConfigError(f"{path} has a {section!r} section; dsslm passes its own AdamW and learning "
                              f"rate (optim.*): remove the section")
    t = cfg.train
    zero = conf.setdefault("zero_optimization", {})
    owned = {  # dotted DeepSpeed key -> (its value for this run, the dsslm key it comes from)
        "train_micro_batch_size_per_gpu": (t.micro_batch_size, "train.micro_batch_size"),
        "gradient_accumulation_steps": (t.grad_accum, "train.grad_accum"),
        "train_batch_size": (t.micro_batch_size * t.grad_accum * world_size, "train.micro_batch_size"),
        "gradient_clipping": (cfg.optim.clip, "optim.clip"),
        "bf16.enabled": (t.precision == "bf16", "train.precision"),
        "fp16.enabled": (t.precision == "fp16", "train.precision"),
        "zero_optimization.stage": (cfg.engine.zero_stage, "engine.zero_stage"),
    }
    if t.precision == "fp16":  # DeepSpeed's own scaler starts at 2^initial_scale_power
        power = math.log2(t.loss_scale_init)
        if power != int(power):
            raise ConfigError(f"train.loss_scale_init={t.loss_scale_init:g}: DeepSpeed starts its loss scale at a "
                              f"power of two; set {2 ** math.floor(power):g} or {2 ** math.ceil(power):g}")
        owned["fp16.initial_scale_power"] = (int(power), "train.loss_scale_init")
    for dotted, (value, key) in owned.items():
        node, leaf = _parent(conf, dotted)
        written = node.get(leaf, "auto")
        if written != "auto" and written != value:
            raise ConfigError(f"{path}: {dotted}={written!r} but {key} gives {value!r}; write \"auto\" "
                              f"there (dsslm fills it) or change {key}")
        node[leaf] = value
    for dotted, value in (BF16_GRAD_DTYPES.items() if t.precision == "bf16" else ()):
        node, leaf = _parent(conf, dotted)
        if node.get(leaf, "auto") == "auto":
            node[leaf] = value
    if cfg.optim.name == "muon":
        # DeepSpeed asserts on any client optimizer it has not tested; ours steps the flat
        # partitions it is given (elementwise) and makes the matrices whole itself (muon.MuonAdamW).
        conf.setdefault("zero_allow_untested_optimizer", True)
    if zero["stage"] == 3:
        # Parameter gathering stays inside DeepSpeed's forward hooks; never all-gather on save.
        zero.setdefault("stage3_gather_16bit_weights_on_model_save", False)
    return conf


def _parent(conf: dict, dotted: str) -> tuple[dict, str]:
    """The dict holding `dotted`'s last part (created on the way) and that part."""
    *parents, leaf = dotted.split(".")
    node = conf
    for part in parents:
        node = node.setdefault(part, {})
    return node, leaf
