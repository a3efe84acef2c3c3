"""The README's commands, run as a new user copies them (the venv's python named, relative paths from
the repository root), sized down so they finish in seconds: none may end in a traceback or a
non-zero exit. What is changed, and only that: model, batch and step counts appended to every
`dsslm.train`, 8 ranks made 2, the BPE vocabulary made small for a small corpus."""
from __future__ import annotations

import os
import re
import shlex
import subprocess

import pytest

from helpers import ROOT

SMALL = ["model.d_model=32", "model.n_layers=2", "model.n_heads=2", "model.seq_len=32",
         "train.micro_batch_size=2", "train.global_batch_size=4", "train.total_steps=4", "ckpt.every=2",
         "run.val_every=2", "run.val_batches=1", "optim.warmup_steps=1", "train.precision=fp32",
         "train.device=cpu", "train.compile=false", "run.tensorboard=false"]
SKIP = ("scripts/test.sh", "-m pytest")  # the test suite itself


def readme_commands() -> list[str]:
    """Every command line of the README's shell blocks (``` with no language, or bash/sh)."""
    text = (ROOT / "README.md").read_text()
    commands = []
    for lang, body in re.findall(r"```(\w*)\n(.*?)```", text, flags=re.S):
        if lang not in ("", "bash", "sh", "shell"):
            continue
        for line in body.splitlines():
            line = re.sub(r"\s+#\s.*$", "", line).strip()  # a trailing comment
            if line and not line.startswith("#"):
                commands.append(line)
    return commands


def sized_down(command: str) -> list[str] | None:
    if any(skip in command for skip in SKIP):
        return None
    command = command.split("&&")[-1].strip()  # `bash scripts/setup.sh && ...`: the venv is set up already
    argv = shlex.split(command)
    argv = ["2" if prev == "--nproc_per_node" else arg for prev, arg in zip([""] + argv, argv)]
    argv = ["400" if prev == "--vocab-size" else arg for prev, arg in zip([""] + argv, argv)]
    if "dsslm.train" in argv:
        argv += SMALL
    return argv


def test_the_readme_has_the_commands_this_test_expects():
    commands = readme_commands()
    assert any("dsslm.data prepare" in c for c in commands) and any("dsslm.export" in c for c in commands)
    assert all(c.startswith((".venv/bin/", "bash scripts/")) for c in commands), commands


@pytest.mark.slow
def test_every_readme_command_runs_as_copied(tmp_path):
    # A fresh clone's layout: the venv and the configs where the README says, books/ the user's text.
    for name in (".venv", "configs", "dsslm", "tests", "bench", "pyproject.toml"):  # the linter reads the last four
        (tmp_path / name).symlink_to(ROOT / name)
    (tmp_path / "books").mkdir()
    source = (ROOT / "dsslm" / "train.py").read_text() + (ROOT / "README.md").read_text()
    for i in range(3):
        (tmp_path / "books" / f"book{i}.txt").write_text(source[i * 4000:(i + 6) * 4000])
    env = {**os.environ, "PYTHONPATH": str(ROOT), "DS_ACCELERATOR": "cpu", "OMP_NUM_THREADS": "1"}
    ran = []
    for command in readme_commands():
        argv = sized_down(command)
        if argv is None:
            continue
        proc = subprocess.run(argv, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
        assert proc.returncode == 0 and "Traceback" not in proc.stderr, f"{command}\n{proc.stderr[-3000:]}"
        ran.append(command)
    assert len(ran) >= 9, ran
    assert (tmp_path / "hf" / "books" / "config.json").is_file()
