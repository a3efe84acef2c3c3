"""A resume on another number of processes is refused (another global batch) with advice that
works as written: appended to the command that was refused, it resumes. `set
train.global_batch_size=12` alone was refused again with train.micro_batch_size=12 on 2 processes."""
from __future__ import annotations

import re

import pytest

from dsslm.ckpt.train_state import ResumeRefused, check_fingerprint, fingerprint
from dsslm.config import ConfigError, accumulation_for, load

WHERE = "checkpoint step-00000002"


def at_world(overrides: list[str], world_size: int):
    """The config a command makes on `world_size` processes, and its global batch (as the engine derives it)."""
    cfg = load(None, overrides)
    if cfg.train.global_batch_size:
        cfg.train.grad_accum = accumulation_for(cfg.train, world_size)
    return cfg, cfg.train.micro_batch_size * cfg.train.grad_accum * world_size


def refusal(made_with: list[str], made_on: int, command: list[str], world_size: int) -> str:
    old_cfg, old = at_world(made_with, made_on)
    cfg, new = at_world(command, world_size)
    with pytest.raises(ResumeRefused) as raised:
        check_fingerprint(fingerprint(old_cfg, "a" * 64, "b" * 64, old), fingerprint(cfg, "a" * 64, "b" * 64, new),
                          cfg, WHERE)
    return str(raised.value)


def resumes_as_written(made_with: list[str], made_on: int, command: list[str], world_size: int) -> str:
    """The advice, checked: the command plus the overrides it names loads, and its fingerprint matches."""
    message = refusal(made_with, made_on, command, world_size)
    advice = re.search(r"; set ((?:train\.[a-z_]+=\d+ ?)+)", message)
    assert advice, message
    old_cfg, old = at_world(made_with, made_on)
    cfg, new = at_world(command + advice.group(1).split(), world_size)
    assert new == old
    assert check_fingerprint(fingerprint(old_cfg, "a" * 64, "b" * 64, old), fingerprint(cfg, "a" * 64, "b" * 64, new),
                             cfg, WHERE) == {}
    return advice.group(1).strip()


@pytest.mark.parametrize("made_with,made_on,command,world_size,advice", [
    # one process with micro-batch 12, resumed on 2: the micro-batch halves with the global batch kept
    ([], 1, [], 2, "train.global_batch_size=12 train.micro_batch_size=6"),
    # 4 -> 2 processes: the global batch alone (grad_accum follows)
    (["train.micro_batch_size=4"], 4, ["train.micro_batch_size=4"], 2, "train.global_batch_size=16"),
    # 12 sequences on 2 processes of micro-batch 4: 6 each, in micro-batches of 3
    (["train.micro_batch_size=4", "train.grad_accum=3"], 1, ["train.micro_batch_size=4"], 2,
     "train.global_batch_size=12 train.micro_batch_size=3"),
    # train.grad_accum set by the user: global_batch_size beside it is refused, so the product is named
    (["train.micro_batch_size=4", "train.grad_accum=2"], 1, ["train.micro_batch_size=4", "train.grad_accum=2"], 2,
     "train.grad_accum=1"),
    (["train.micro_batch_size=4", "train.grad_accum=3"], 1, ["train.micro_batch_size=4", "train.grad_accum=3"], 2,
     "train.micro_batch_size=3 train.grad_accum=2"),
])
def test_the_advice_names_every_key_that_must_change_and_resumes(made_with, made_on, command, world_size, advice):
    assert resumes_as_written(made_with, made_on, command, world_size) == advice


def test_a_global_batch_the_world_size_cannot_split_says_so_instead_of_advice_that_fails():
    message = refusal(["train.micro_batch_size=4", "train.grad_accum=3"], 1, ["train.micro_batch_size=4"], 5)
    assert "12 sequences do not split over 5 processes" in message and "set train." not in message.split("; ", 1)[1]


def test_a_global_batch_that_is_not_a_multiple_names_values_that_work():
    cfg = load(None, ["train.global_batch_size=12", "train.micro_batch_size=12"])
    with pytest.raises(ConfigError, match=r"set train\.micro_batch_size=6 \(or train\.global_batch_size=24\)"):
        accumulation_for(cfg.train, 2)
    with pytest.raises(ConfigError, match=r"set train\.global_batch_size=60, or launch a number of processes that "
                                          r"divides 12"):
        accumulation_for(cfg.train, 5)
