"""A newcomer's typo is answered in one line naming every problem, before the heavy imports
(torch, datasets), and `--help` says where the keys are, which ones matter, and the exit codes."""
from __future__ import annotations

import os
import signal
import subprocess

import pytest

from dsslm import exits
from dsslm.config import ConfigError, load
from dsslm.train import main
from helpers import PYTHON, ROOT


def run_cli(*args: str) -> tuple[subprocess.CompletedProcess, list[str], set[str]]:
    """The command under -X importtime: its result, its other stderr lines, the modules it imported."""
    proc = subprocess.run([PYTHON, "-X", "importtime", *args], cwd=ROOT, capture_output=True, text=True, timeout=120)
    timing = [line for line in proc.stderr.splitlines() if line.startswith("import time:")]
    said = [line for line in proc.stderr.splitlines() if not line.startswith("import time:")]
    return proc, said, {line.rsplit("|", 1)[1].strip() for line in timing}


def test_problems_that_cannot_cause_each_other_are_named_together():
    with pytest.raises(ConfigError) as raised:
        load(None, ["train.total_steps=5", "optim.warmup_steps=100", "model.n_heads=0", "optim.peak_lr=nan",
                    "data.mix.web=-1"])
    message = str(raised.value)
    assert message.startswith("4 problems: (1) ") and "\n" not in message, message
    for named in ("optim.warmup_steps=100 must be in [0, train.total_steps=5]", "model.n_heads=0 must be >= 1",
                  "optim.peak_lr=nan must be a finite number", "data.mix.web=-1.0 must be a finite number >= 0"):
        assert named in message
    # n_heads=0 leaves d_model % n_heads unchecked (no ZeroDivisionError), and nan is named once.
    assert message.count("optim.peak_lr") == 1 and "divisible" not in message


def test_every_bad_override_is_named_at_once():
    with pytest.raises(ConfigError) as raised:
        load(None, ["train.colour=3", "optim.peak_lr=fast", "run.dir=runs/x", "nonsense"])
    message = str(raised.value)
    assert message.startswith("3 problems:") and "'train.colour'" in message and "'optim.peak_lr'" in message
    assert "'nonsense' is not key=value" in message


def test_a_smoke_run_with_a_bad_data_dir_hears_both_in_one_line(tmp_path, capsys):
    run_dir = tmp_path / "run"
    assert main([f"run.dir={run_dir}", "train.total_steps=5", "optim.warmup_steps=100",
                 f"data.dir={tmp_path / 'boks'}"]) == exits.EXIT_BAD_INPUT
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("dsslm: 2 problems:"), err
    assert "optim.warmup_steps=100" in err[0] and f"data.dir={tmp_path / 'boks'}: no such folder" in err[0]
    assert not run_dir.exists()


def test_a_refused_train_command_answers_before_torch_is_imported(tmp_path):
    proc, said, imported = run_cli("-m", "dsslm.train", f"run.dir={tmp_path / 'run'}", "train.total_steps=5",
                                   "optim.warmup_steps=100", f"data.dir={tmp_path / 'nope'}")
    assert proc.returncode == exits.EXIT_BAD_INPUT
    assert len(said) == 1 and said[0].startswith("dsslm: 2 problems:"), said
    assert "torch" not in imported and "numpy" not in imported
    assert not (tmp_path / "run").exists()


def test_a_refused_prepare_command_answers_before_torch_and_datasets_are_imported(tmp_path):
    proc, said, imported = run_cli("-m", "dsslm.data", "prepare", "--input", "README.md", str(tmp_path / "nope.txt"),
                                   "--out", str(tmp_path / "data"), "--tokenizer", "bpee")
    assert proc.returncode == exits.EXIT_BAD_INPUT
    assert len(said) == 1 and "--tokenizer 'bpee' is unknown" in said[0] and "nope.txt does not exist" in said[0]
    assert not {"torch", "datasets"} & imported
    assert not (tmp_path / "data").exists()


def test_help_names_the_key_reference_the_keys_most_runs_set_and_every_exit_code():
    proc, said, imported = run_cli("-m", "dsslm.train", "--help")
    assert proc.returncode == 0 and "torch" not in imported
    text = proc.stdout
    assert "docs/configuration.md" in text and "dsslm/config/keys.py" in text and "Read top-down" not in text
    for key in ("run.dir=", "data.dir=", "train.total_steps=", "train.global_batch_size=", "optim.peak_lr=",
                "engine.kind="):
        assert key in text
    codes = {value for name, value in vars(exits).items() if name.startswith("EXIT_")}
    listed = {int(line.split()[0]) for line in text.split("exit codes", 1)[1].splitlines()[1:] if line.strip()}
    assert codes == listed


def test_a_refusal_every_process_finds_is_said_by_one_of_them(tmp_path):
    """`train.global_batch_size=4` with micro-batch 4 on 2 processes was refused by each, in one line
    each. Rank 0 says it; a missing data.dir (node-local) is said by each node's first process."""
    def rank(rank: int, local_rank: int, *overrides: str) -> subprocess.CompletedProcess:
        env = {**os.environ, "WORLD_SIZE": "4", "RANK": str(rank), "LOCAL_RANK": str(local_rank)}
        return subprocess.run([PYTHON, "-m", "dsslm.train", f"run.dir={tmp_path / 'run'}", *overrides], cwd=ROOT,
                              env=env, capture_output=True, text=True, timeout=120)
    batch = ("train.global_batch_size=8", "train.micro_batch_size=4")
    said = {(r, lr): rank(r, lr, *batch) for r, lr in ((0, 0), (1, 1), (2, 0))}
    assert all(p.returncode == exits.EXIT_BAD_INPUT for p in said.values())
    assert "world size 4 = 16; set train.micro_batch_size=2" in said[0, 0].stderr
    assert said[1, 1].stderr == said[2, 0].stderr == ""
    missing = {(r, lr): rank(r, lr, f"data.dir={tmp_path / 'nope'}") for r, lr in ((1, 1), (2, 0))}
    assert missing[1, 1].stderr == "" and "no such folder" in missing[2, 0].stderr


def test_a_refusal_cut_short_by_the_launchers_sigterm_is_still_the_refusal(monkeypatch, capsys):
    """torchrun ends the other ranks once one exits: a SIGTERM during a refusal's way out raised
    Preempted over it, and the rank said "SIGTERM before the first step" and exited 0."""
    import dsslm.train as train_module

    def refused_then_stopped(cfg, allow_drift):
        try:
            raise ConfigError("resume refused: made with global_batch_size=4, now 8")
        except ConfigError:
            raise exits.Preempted(signal.SIGTERM)  # noqa: B904 (the implicit context, as in main)
    monkeypatch.setattr(train_module, "train", refused_then_stopped)
    assert main([]) == exits.EXIT_BAD_INPUT
    assert capsys.readouterr().err == "dsslm: resume refused: made with global_batch_size=4, now 8\n"
