"""`accelerate launch --num_processes 2` on a machine without GPUs ran one process and exited 0:
accelerate's single-process launcher ignores the count. dsslm reads the environment that launcher
gives its process (built here by accelerate's own code) and refuses it with the command that works."""
from __future__ import annotations

import os

import pytest
from accelerate.commands.launch import _validate_launch_command, launch_command_parser
from accelerate.utils.launch import prepare_simple_launcher_cmd_env

from dsslm.config import ConfigError, load
from dsslm.engine.launch import apply_launcher

OUTSIDE = ("ACCELERATE_USE_CPU", "MASTER_ADDR", "MASTER_PORT", "WORLD_SIZE", "RANK", "LOCAL_RANK")


def simple_launcher_env(monkeypatch, tmp_path, *flags: str) -> dict:
    """What `accelerate launch FLAGS -m dsslm.train` hands the one process it starts on this machine
    (no GPU; no accelerate config file: HF_HOME is empty)."""
    for key in OUTSIDE:
        monkeypatch.delenv(key, raising=False)
    monkeypatch.setenv("HF_HOME", str(tmp_path))
    args = launch_command_parser().parse_args([*flags, "-m", "dsslm.train"])
    args, defaults, _ = _validate_launch_command(args)
    assert defaults is None and not args.multi_gpu  # what sends it to the single-process launcher
    return prepare_simple_launcher_cmd_env(args)[1]


@pytest.mark.parametrize("flags,drop_cpu", [(("--num_processes", "2"), False),
                                            (("--cpu", "--num_processes", "2"), True),
                                            (("--num_processes", "1", "--num_machines", "2",
                                              "--main_process_ip", "10.0.0.1", "--main_process_port", "29500"), False)])
def test_several_processes_asked_of_the_single_process_launcher_are_refused_with_the_command_that_works(
        monkeypatch, tmp_path, flags, drop_cpu):
    env = simple_launcher_env(monkeypatch, tmp_path, *flags)
    with pytest.raises(ConfigError) as raised:
        apply_launcher(load(), env)
    message = str(raised.value)
    assert "started 1 process" in message and "accelerate launch --multi_gpu --num_processes N" in message
    assert "--config_file configs/accelerate/ddp.yaml" in message and os.path.isfile("configs/accelerate/ddp.yaml")
    assert ("drop --cpu" in message) == drop_cpu


def test_one_process_asked_for_is_one_process(monkeypatch, tmp_path):
    assert apply_launcher(load(), simple_launcher_env(monkeypatch, tmp_path)) == []
    assert apply_launcher(load(), simple_launcher_env(monkeypatch, tmp_path, "--num_processes", "1")) == []


def test_processes_torchrun_started_for_accelerate_are_not_questioned():
    """--multi_gpu and a config file go through torchrun, which numbers each process."""
    env = {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29500", "WORLD_SIZE": "2", "RANK": "1",
           "ACCELERATE_MIXED_PRECISION": "no"}
    assert apply_launcher(load(), env) == []
