"""dsslm.engine.compile_cache: the key of a run's compile caches, the folder they live in, and the
environment and inductor config set for the run and put back after it. Nothing compiles here
(tests/scenarios/test_compile.py has a restart that hits the cache)."""
import os
from pathlib import Path

import pytest
import torch

from dsslm.config import ConfigError, load
from dsslm.engine.compile_cache import cache_folder, cache_key, cache_root, kept_with_run

CPU = torch.device("cpu")


def cfg(*overrides: str):
    return load(None, ["run.dir=runs/r", "train.compile=true", *overrides])


def test_the_key_is_stable_and_a_resumes_mutable_keys_leave_it_alone():
    base = cache_key(cfg(), 1, CPU)
    assert len(base) == 16 and base == cache_key(cfg(), 1, CPU)
    # A requeue that extends the run, moves it or changes its logging reuses the cache.
    same = ("train.total_steps=999", "run.dir=elsewhere", "optim.peak_lr=3e-3", "ckpt.every=7", "run.val_every=0",
            "train.compile_cache=/local/x")
    for override in same:
        assert cache_key(cfg(override), 1, CPU) == base, override


def test_the_key_changes_with_what_changes_the_compiled_graphs(monkeypatch):
    base = cache_key(cfg(), 1, CPU)
    changed = ("model.d_model=64", "model.n_layers=2", "model.seq_len=32", "model.document_mask=true",
               "train.micro_batch_size=3", "train.precision=bf16", "train.activation_checkpointing=full",
               "engine.kind=fsdp", "engine.zero_stage=2")
    keys = {override: cache_key(cfg(override), 1, CPU) for override in changed}
    assert base not in keys.values() and len(set(keys.values())) == len(changed), keys
    assert cache_key(cfg(), 2, CPU) != base  # world size
    assert cache_key(cfg(), 1, torch.device("meta")) != base  # device type
    monkeypatch.setattr(torch, "__version__", "9.9.9")
    assert cache_key(cfg(), 1, CPU) != base


def test_the_folder_is_run_dir_cache_by_default_and_absolute(tmp_path):
    c = cfg(f"run.dir={tmp_path / 'run'}")
    folder = cache_folder(c, 1, CPU)
    assert folder == tmp_path / "run" / "cache" / f"compile-{cache_key(c, 1, CPU)}"
    relative = cache_folder(cfg("run.dir=runs/r"), 1, CPU)
    assert relative.is_absolute() and relative.parent == Path.cwd() / "runs" / "r" / "cache"


def test_a_configured_folder_expands_variables_and_home(monkeypatch, tmp_path):
    monkeypatch.setenv("NODE_LOCAL", str(tmp_path))
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert cache_root(cfg("train.compile_cache=$NODE_LOCAL/dsslm")) == tmp_path / "dsslm"
    assert cache_root(cfg("train.compile_cache=~/c")) == tmp_path / "home" / "c"
    assert cache_folder(cfg("train.compile_cache=$NODE_LOCAL"), 1, CPU).parent == tmp_path
    monkeypatch.delenv("NOT_SET_HERE", raising=False)
    with pytest.raises(ConfigError, match="NOT_SET_HERE"):
        cache_root(cfg("train.compile_cache=$NOT_SET_HERE/c"))


def test_a_folder_with_surrounding_spaces_is_refused():
    with pytest.raises(ConfigError, match="train.compile_cache"):
        cfg("train.compile_cache=' /x'")


def test_without_compile_nothing_is_touched(monkeypatch, tmp_path):
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", "/theirs")
    with kept_with_run(cfg(f"run.dir={tmp_path}", "train.compile=false"), 1, CPU) as folder:
        assert folder is None and os.environ["TORCHINDUCTOR_CACHE_DIR"] == "/theirs"


def test_the_run_points_inductor_at_its_folder_and_puts_everything_back(monkeypatch, tmp_path):
    import torch._functorch.config as functorch_config
    import torch._inductor.config as inductor_config
    from torch._inductor.runtime.cache_dir_utils import cache_dir
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "theirs"))
    monkeypatch.delenv("TRITON_CACHE_DIR", raising=False)
    c = cfg(f"run.dir={tmp_path / 'run'}")
    with kept_with_run(c, 1, CPU) as folder:
        assert folder == cache_folder(c, 1, CPU)
        assert not (tmp_path / "run").exists()  # created by inductor's first write, not before
        assert os.environ["TORCHINDUCTOR_CACHE_DIR"] == str(folder) and cache_dir() == str(folder)
        assert inductor_config.fx_graph_cache and functorch_config.enable_autograd_cache
        assert "TRITON_CACHE_DIR" not in os.environ  # a CPU run compiles no Triton kernel
    assert os.environ["TORCHINDUCTOR_CACHE_DIR"] == str(tmp_path / "theirs")
    assert "TRITON_CACHE_DIR" not in os.environ


def test_a_gpu_run_keeps_tritons_kernels_in_the_folder_too(monkeypatch, tmp_path):
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "H100")
    monkeypatch.setenv("TRITON_CACHE_DIR", "/theirs")
    gpu = torch.device("cuda", 0)
    with kept_with_run(cfg(f"run.dir={tmp_path}"), 8, gpu) as folder:
        assert os.environ["TRITON_CACHE_DIR"] == str(folder / "triton")
    assert os.environ["TRITON_CACHE_DIR"] == "/theirs"
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "A100")
    assert cache_folder(cfg(f"run.dir={tmp_path}"), 8, gpu) != folder  # another GPU model, another folder
