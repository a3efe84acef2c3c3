"""The files a run and its tools write follow the umask (issue 48 item 5): report/summary.md and
spikes/*/batch.safetensors were 0600 whatever the umask (mkstemp, safetensors' save_file), so a lab
mate on a shared filesystem could not open the two files they look at first."""
import contextlib
import json
import os
import stat

import pytest
import torch

from dsslm import report
from dsslm.durable import file_mode, umask
from dsslm.hf.write import write_weights
from helpers import capture_a_spike

MODES = [(0o022, 0o644), (0o077, 0o600), (0o002, 0o664)]


@contextlib.contextmanager
def umask_of(mask):
    old = os.umask(mask)
    try:
        yield
    finally:
        os.umask(old)


def mode_of(path):
    return stat.S_IMODE(path.stat().st_mode)


def small_run(run_dir):
    run_dir.mkdir(parents=True)
    (run_dir / "metrics.jsonl").write_text("".join(
        json.dumps({"step": s, "loss": 5.0 - s / 10, "lr": 1e-3, "lr_scale": 1.0, "gnorm": 1.0, "tokens": 64 * s,
                    "tokens_per_s": 1000.0, "verdict": "ok"}) + "\n" for s in range(1, 21)))
    (run_dir / "events.jsonl").write_text(json.dumps({"event": "start", "time": 1.7e9, "step": 0}) + "\n")
    return run_dir


@pytest.mark.parametrize("mask, want", MODES)
def test_the_umask_is_read_without_changing_it(mask, want):
    with umask_of(mask):
        assert umask() == mask and file_mode() == want
        assert os.umask(mask) == mask  # still in force


def test_without_proc_the_umask_is_read_by_setting_it_back(monkeypatch):
    """A system without /proc/self/status's Umask line (Linux < 4.7, macOS)."""
    import dsslm.durable as durable

    def no_proc(*args, **kwargs):
        raise FileNotFoundError("/proc/self/status")
    monkeypatch.setattr(durable, "open", no_proc, raising=False)
    with umask_of(0o027):
        assert umask() == 0o027 and file_mode() == 0o640 and os.umask(0o027) == 0o027


@pytest.mark.parametrize("mask, want", MODES)
def test_the_report_files_follow_the_umask(tmp_path, mask, want):
    run_dir = small_run(tmp_path / "run")
    with umask_of(mask):
        assert report.main([str(run_dir)]) == 0
    files = sorted((run_dir / "report").iterdir())
    assert files and {p.name: mode_of(p) for p in files} == {p.name: want for p in files}


@pytest.mark.parametrize("mask, want", MODES[:2])
def test_a_spike_folder_follows_the_umask(tmp_path, mask, want):
    with umask_of(mask):
        emitted = capture_a_spike(tmp_path)
    assert emitted == []
    folder = tmp_path / "spikes" / "step-00000051"
    assert {p.name: mode_of(p) for p in folder.iterdir()} == {"batch.safetensors": want, "spike.json": want}


@pytest.mark.parametrize("shard_bytes", [1 << 20, 8], ids=["one-file", "sharded"])
def test_an_exported_model_follows_the_umask(tmp_path, shard_bytes):
    with umask_of(0o022):
        write_weights(tmp_path, {"a": torch.zeros(4), "b": torch.ones(4)}, shard_bytes)
    assert {p.name: mode_of(p) for p in tmp_path.iterdir()} == {p.name: 0o644 for p in tmp_path.iterdir()}
