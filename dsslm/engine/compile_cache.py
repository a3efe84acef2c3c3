"""`train.compile`'s caches kept with the run, so a requeue's first step reuses the last start's
compilation instead of paying for it again (~21.5 s on a CPU for the default model, every start).

What torch 2.13 caches on disk, and where, all under one folder once TORCHINDUCTOR_CACHE_DIR
names it: inductor's FX graph cache (`fxgraph/`, the generated code's key to its output), AOT
autograd's cache (`aotautograd/`, forward and backward graphs), the generated kernels themselves
(C++ `.so` files on a CPU, `xx/` folders), the autotuning results (`cache/`) and, on a GPU,
Triton's kernels (TRITON_CACHE_DIR, which inductor would otherwise point at `triton/<device>`
there, or Triton at ~/.triton). When torch reads them:

- TORCHINDUCTOR_CACHE_DIR at every use (`torch._inductor.runtime.cache_dir_utils.cache_dir`),
  except the local autotune cache's path, which is memoized on first use: `clear_caches()` drops
  it (as torch's own `temporary_cache_dir` does). TRITON_CACHE_DIR when inductor first compiles a
  Triton kernel, and only if it is unset. So both are set here, before the first step's compile;
  `job.setup` enters this right after run.dir's lock is taken (the engine is built by then, but
  `nn.Module.compile` compiles nothing until the first forward).
- `fx_graph_cache` and `enable_autograd_cache` (both on by default in 2.13) from their variables
  (TORCHINDUCTOR_FX_GRAPH_CACHE, TORCHINDUCTOR_AUTOGRAD_CACHE) once, at import: the config fields
  are patched here for this run; a variable the user set, and TORCHINDUCTOR_FORCE_DISABLE_CACHES,
  still win (torch gives an environment "force" precedence over a patch).

The folder is `run.dir/cache/compile-<key>/` (or `train.compile_cache/compile-<key>/`, for a
node-local disk), keyed by what changes the compiled graphs: torch's version, the device type (and
GPU model), the world size, the engine, and the keys that shape the model and its inputs
(`cache_key`). Inductor keys each entry by the graph itself as well, so a key that left something
out would cost cache misses, never a wrong kernel. Nothing is created until inductor writes (a run
refused before its first step leaves run.dir as it found it).

Every rank may share the folder: inductor writes each file to `.<pid>.<thread>.tmp` beside it and
renames it into place (`codecache.write_atomic`), Triton does the same, and C++ builds are done
under a file lock in `locks/`. Inductor trusts what it finds there as it trusts its own default
folder in /tmp: it loads the pickled graphs and the `.so` files without checks of its own, so a
cache folder must be writable only by those trusted with the run (dsslm never unpickles it).
"""
from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import json
import os
from pathlib import Path
from typing import Iterator

import torch

from dsslm.config import Config, ConfigError

# The train.* and engine.* keys that change the compiled graphs (every model.* key does as well).
TRAIN_KEYS = ("micro_batch_size", "precision", "compile", "activation_checkpointing",
              "activation_checkpointing_every")
ENGINE_KEYS = ("kind", "zero_stage")
ENV = ("TORCHINDUCTOR_CACHE_DIR", "TRITON_CACHE_DIR")


def cache_key(cfg: Config, world_size: int, device: torch.device) -> str:
    """16 hex digits of what the compiled graphs depend on beyond the code itself."""
    shaping = {
        "torch": torch.__version__,
        "device": device.type,
        "gpu": torch.cuda.get_device_name(device) if device.type == "cuda" else "",
        "world_size": world_size,
        "model": dataclasses.asdict(cfg.model),
        "train": {key: getattr(cfg.train, key) for key in TRAIN_KEYS},
        "engine": {key: getattr(cfg.engine, key) for key in ENGINE_KEYS},
    }
    return hashlib.sha256(json.dumps(shaping, sort_keys=True, default=str).encode()).hexdigest()[:16]


def cache_root(cfg: Config) -> Path:
    """`train.compile_cache` with `~` and `$VARS` expanded (a node-local `$SLURM_TMPDIR/...` is
    read on the node), or run.dir/cache."""
    if not cfg.train.compile_cache:
        return Path(cfg.run.dir) / "cache"
    path = os.path.expanduser(os.path.expandvars(cfg.train.compile_cache))
    if "$" in path:
        raise ConfigError(f"train.compile_cache={cfg.train.compile_cache}: {path} still names an environment "
                          "variable this process does not have; set it, or name the folder outright")
    return Path(path)


def cache_folder(cfg: Config, world_size: int, device: torch.device) -> Path:
    """Where this run's compile caches live: `<root>/compile-<key>`, an absolute path."""
    return (cache_root(cfg) / f"compile-{cache_key(cfg, world_size, device)}").absolute()


@contextlib.contextmanager
def kept_with_run(cfg: Config, world_size: int, device: torch.device) -> Iterator[Path | None]:
    """Under `train.compile`, point torch's compile caches at `cache_folder` until the run ends
    (then the environment and inductor's config are as they were); without it, nothing."""
    if not cfg.train.compile:
        yield None
        return
    folder = cache_folder(cfg, world_size, device)
    import torch._functorch.config as functorch_config
    import torch._inductor.config as inductor_config
    from torch._inductor.utils import clear_caches

    before = {name: os.environ.get(name) for name in ENV}
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = str(folder)
    if device.type == "cuda":
        os.environ["TRITON_CACHE_DIR"] = str(folder / "triton")
    clear_caches()  # paths memoized from another folder, in a process that compiled before
    try:
        with inductor_config.patch(fx_graph_cache=True), functorch_config.patch(enable_autograd_cache=True):
            yield folder
    finally:
        for name, value in before.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value
        clear_caches()
