"""The first ZeRO start on a CPU machine compiles DeepSpeed's communication extension for a minute
or two: the user is told before it starts, and not again once it is cached."""
from __future__ import annotations

import sys

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


def test_a_first_build_is_followed_by_a_line_saying_it_is_done(tmp_path, monkeypatch, capsys):
    """Two minutes of silence ended with DeepSpeed's own line; the build now has a line after it too."""
    monkeypatch.setattr(cpp_extension, "_get_build_directory", lambda name, verbose: str(tmp_path))
    with zero.build_notice(torch.device("cpu")):
        print("building", file=sys.stderr)
    before, during, after = capsys.readouterr().err.splitlines()
    assert "building DeepSpeed's CPU communication extension" in before and during == "building"
    assert after.startswith("dsslm: built DeepSpeed's CPU communication extension in ") and "cache" in after
    (tmp_path / f"{zero.SHM_OP}.so").write_bytes(b"")
    with zero.build_notice(torch.device("cpu")):
        pass
    with zero.build_notice(None):  # ranks other than 0
        pass
    assert capsys.readouterr().err == ""
