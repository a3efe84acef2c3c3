"""The first ZeRO start on a CPU machine compiles DeepSpeed's communication extension for a minute
or two: the user is told before it starts, and not again once it is cached."""
from __future__ import annotations

import torch
from torch.utils import cpp_extension

from dsslm.engine import zero


def test_a_first_build_is_announced_and_a_cached_one_is_not(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(cpp_extension, "_get_build_directory", lambda name, verbose: str(tmp_path))
    line = zero.say_if_building(torch.device("cpu"))
    assert line and "building DeepSpeed's CPU communication extension" in line and str(tmp_path) in line
    assert line in capsys.readouterr().err
    (tmp_path / f"{zero.SHM_OP}.so").write_bytes(b"")
    assert zero.say_if_building(torch.device("cpu")) is None
    assert zero.say_if_building(torch.device("cuda")) is None
