"""Typed config tree: dataclasses loaded through OmegaConf with dotted overrides.

`load("configs/tiny.yaml", ["optim.peak_lr=3e-4"])` returns a validated `Config`. Every error is
a `ConfigError` whose message names the key and what is allowed, so `main()` can print one line
and exit 2. The keys are in `keys.py`, their checks in `validate.py`, the reading in `load.py`;
everything is imported from here.
"""
from dsslm.config.keys import (HF_PREFIX, BatchRampCfg, CkptCfg, Config, ConfigError, DataCfg, EngineCfg, EvalCfg,
                               FaultsCfg, ModelCfg, MonitorCfg, NodesCfg, ObserveCfg, OptimCfg, RunCfg, StragglersCfg,
                               TrainCfg, WatchdogCfg,
                               accumulation_for, ffn_hidden_of, keep_global_batch, micro_batch_for, mix_of, shuffle_spec,
                               to_dict)
from dsslm.config.load import CONFIG_DIR, DEFAULT_CONFIG, _explain as _explain, load  # _explain: ckpt/drift.py's messages
from dsslm.config.validate import (join_problems, validate, validate_data, validate_mix, validate_model, validate_optim,
                                   validate_spike_policy)

__all__ = ["HF_PREFIX", "BatchRampCfg", "CkptCfg", "Config", "ConfigError", "DataCfg", "EngineCfg", "EvalCfg",
           "FaultsCfg", "ModelCfg", "MonitorCfg", "NodesCfg", "ObserveCfg", "OptimCfg", "RunCfg", "StragglersCfg",
           "TrainCfg", "WatchdogCfg", "accumulation_for",
           "ffn_hidden_of", "keep_global_batch", "micro_batch_for", "mix_of", "shuffle_spec", "to_dict", "CONFIG_DIR",
           "DEFAULT_CONFIG", "load",
           "join_problems", "validate", "validate_data", "validate_mix", "validate_model", "validate_optim",
           "validate_spike_policy"]
