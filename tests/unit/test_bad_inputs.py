"""Bad input to `python -m dsslm.train`: exit 2, one line on stderr naming what to fix, and
nothing written (no run.dir, no lock)."""
from __future__ import annotations

import pytest

from dsslm.data.__main__ import main as prepare
from dsslm.train import main
from helpers import TINY


def small_data(tmp_path):
    (tmp_path / "a.txt").write_text("a short line of text\n" * 30)  # ~600 byte tokens
    assert prepare(["prepare", "--input", str(tmp_path / "a.txt"), "--out", str(tmp_path / "data")]) == 0
    return tmp_path / "data"


def case_args(case: str, tmp_path) -> tuple[list[str], str]:
    """(the case's arguments, a phrase the error line must contain)."""
    if case == "yaml syntax error":
        (tmp_path / "c.yaml").write_text("train:\n  total_steps: [10,\n")
        return [f"--config={tmp_path / 'c.yaml'}"], "YAML syntax error at line"
    if case == "yaml top level is a list":
        (tmp_path / "c.yaml").write_text("- run\n- train\n")
        return [f"--config={tmp_path / 'c.yaml'}"], "not a list"
    if case == "negative seed":
        return ["run.seed=-3"], "run.seed=-3"
    if case == "run.dir is a file":
        (tmp_path / "run").write_text("my notes")
        return [], "is a file"
    if case == "init_from missing":
        return [f"run.init_from={tmp_path / 'nowhere'}"], "run.init_from="
    if case == "seq_len longer than the data":
        return [f"data.dir={small_data(tmp_path)}", "model.seq_len=4096"], "model.seq_len"
    # Found by review: each was a traceback (exit 1), or trained silently on a value that cannot work.
    if case == "vocab_size below the data's":  # wrote a step-0 checkpoint, then an IndexError
        return [f"data.dir={small_data(tmp_path)}", "model.vocab_size=100"], "model.vocab_size=100 is below the 257"
    if case == "a list where a map belongs":
        return ["data.mix=[1,2]"], "a list where a mapping belongs"
    if case == "yaml list where a map belongs":
        (tmp_path / "c.yaml").write_text("data:\n  mix: [1, 2]\n")
        return [f"--config={tmp_path / 'c.yaml'}"], "a list where a mapping belongs"
    if case == "infinite learning rate":
        return ["optim.peak_lr=inf"], "optim.peak_lr=inf must be a finite number"
    if case == "infinite rope theta":
        return ["model.rope_theta=inf"], "model.rope_theta=inf must be a finite number"
    if case == "negative eps":
        return ["optim.eps=-1"], "optim.eps=-1.0 must be > 0"
    if case == "negative init_std":
        return ["model.init_std=-1"], "model.init_std=-1.0 must be >= 0"
    if case == "negative keep_every":
        return ["ckpt.keep_every=-1"], "ckpt.keep_every=-1"
    if case == "eos_id past the vocabulary":
        return ["model.document_mask=true", "model.eos_id=100000", "model.vocab_size=257"], "model.eos_id=100000"
    if case == "eos_id past the data's vocabulary":  # vocab_size from the data: the mask never split a document
        return ["model.document_mask=true", "model.eos_id=999"], "model.eos_id=999 is not a token id"
    if case == "eos_id other than the data's":  # the mask split documents at a token that ends none
        return ["model.document_mask=true", "model.eos_id=5"], "model.eos_id=5 but"
    if case == "cuda without a GPU":  # an AttributeError from torch's CPU build, exit 1
        import torch
        if torch.cuda.is_available():
            pytest.skip("a GPU is visible here")
        return ["train.device=cuda"], "train.device=cuda: no GPU is visible here"
    if case == "no validation batches":
        return ["run.val_every=1", "run.val_batches=0"], "run.val_batches=0"
    raise KeyError(case)


@pytest.mark.parametrize("case", ["yaml syntax error", "yaml top level is a list", "negative seed",
                                  "run.dir is a file", "init_from missing", "seq_len longer than the data",
                                  "vocab_size below the data's", "a list where a map belongs",
                                  "yaml list where a map belongs", "infinite learning rate", "infinite rope theta",
                                  "negative eps", "negative init_std", "negative keep_every",
                                  "eos_id past the vocabulary", "eos_id past the data's vocabulary",
                                  "eos_id other than the data's", "cuda without a GPU", "no validation batches"])
def test_bad_input_exits_2_with_one_line_and_writes_nothing(tmp_path, capsys, case):
    args, phrase = case_args(case, tmp_path)
    capsys.readouterr()
    rc = main([f"run.dir={tmp_path / 'run'}", *TINY, "train.total_steps=10", *args])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and len(err) == 1 and phrase in err[0], err
    if case == "run.dir is a file":
        assert (tmp_path / "run").read_text() == "my notes"
    else:
        assert not (tmp_path / "run").exists()


def test_an_empty_run_dir_is_refused(tmp_path, capsys, monkeypatch):
    """run.dir="" trained into the current folder (checkpoints/, events.jsonl beside the user's files)."""
    monkeypatch.chdir(tmp_path)
    rc = main(['run.dir=""', *TINY, "train.total_steps=10"])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and len(err) == 1 and "run.dir is empty" in err[0], err
    assert list(tmp_path.iterdir()) == []


def test_ctrl_c_while_the_config_is_read_is_one_line_and_exit_130(tmp_path, capsys, monkeypatch):
    """The handler named cfg.run.dir, which a Ctrl-C inside load() had not set: UnboundLocalError."""
    import dsslm.train as train_module

    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt
    monkeypatch.setattr(train_module, "load_checked", interrupted)
    assert main([f"run.dir={tmp_path / 'run'}", *TINY]) == 130
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "interrupted" in err[0], err
