"""A model that cannot fit in this machine's memory is refused before it is built: one line with
the estimate, exit 2, nothing written (it was OOM-killed in silence, exit 137)."""
from __future__ import annotations

import pytest

from dsslm.config import ConfigError, load
from dsslm.health import fits
from dsslm.train import main
from helpers import TINY


def test_the_estimate_counts_every_local_rank_and_the_engines_sharding(monkeypatch):
    cfg = load(None, ["monitor.rewind_every=0"])  # no rewind points: the model and the snapshot
    n = 10**9
    assert fits.model_bytes(cfg, n, 1) == 16 * n
    fsdp = load(None, ["engine.kind=fsdp"])
    assert fits.model_bytes(fsdp, n, 4) == 4 * n
    zero1 = load(None, ["engine.kind=zero", "engine.zero_stage=1"])
    assert fits.model_bytes(zero1, n, 4) == (4 + 4 + 2) * n
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    with pytest.raises(ConfigError, match=r"1,000M parameters needs .* x 2 ranks.*and 40.0 GB is available"):
        fits.refuse_unfit(cfg, n, "cpu", 2, available=40 * 10**9)  # 2 x 16 GB and the snapshot
    fits.refuse_unfit(cfg, n, "cuda", 2, available=40 * 10**9)  # the GPU holds it: not the host's to judge
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "1")
    fits.refuse_unfit(cfg, n, "cpu", 2, available=40 * 10**9)


def test_a_model_too_large_for_the_host_exits_2_in_one_line_and_writes_nothing(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(fits, "available_memory", lambda: 1_000_000)  # a 1 MB machine
    run_dir = tmp_path / "run"
    assert main([f"run.dir={run_dir}", *TINY]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "is available; use a smaller model" in err[0]
    assert not run_dir.exists()
