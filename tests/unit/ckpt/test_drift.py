"""A resume that would change the model's shape is refused with advice that works, never turned
into a new model trained in the same run.dir; `--allow-drift` takes only keys that exist and whose
drift dsslm can honour, and a resume says what each honoured drift changes (the LR plan too)."""
from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from dsslm.ckpt.drift import check_allow_drift
from dsslm.config import ConfigError
from dsslm.train import main, train
from helpers import TINY, events, read_jsonl, tiny_cfg

STEPS = ["train.total_steps=8", "ckpt.every=4", "optim.warmup_steps=2"]


@pytest.mark.parametrize("key", ["foo.bar", "optim.peak_lrr", "modle"])
def test_allow_drift_of_an_unknown_key_is_exit_2(key):
    with pytest.raises(ConfigError, match=f"--allow-drift {key}: no such config key"):
        check_allow_drift([key])


@pytest.mark.parametrize("key", ["model.d_model", "model.n_layers", "model.vocab_pad_to", "model"])
def test_allow_drift_of_the_model_shape_is_refused_with_advice(key):
    with pytest.raises(ConfigError, match="sets the model's shape.*new run.dir"):
        check_allow_drift([key])


def test_allow_drift_takes_keys_sections_mix_domains_and_fingerprint_parts():
    keys = ["optim.peak_lr", "optim", "data.mix", "data.mix.web", "data", "tokenizer", "global_batch_size",
            "model.dropout", "train.total_steps"]
    assert check_allow_drift(keys) == tuple(keys)


def test_a_derived_ffn_width_and_the_number_it_derives_are_one_shape():
    """model.ffn_hidden=0 on d_model 32 is 128: a resume that spelled it out was refused as
    "another shape", and one that dropped it after an HF import said to restore 128."""
    from dsslm.ckpt.drift import drift, hashed_items
    from dsslm.config import load
    saved = hashed_items(load(None, ["model.d_model=32", "model.ffn_hidden=0"]))
    assert drift(saved, load(None, ["model.d_model=32", "model.ffn_hidden=128"])) == {}
    assert drift(saved, load(None, ["model.d_model=32", "model.ffn_hidden=192"])) == {"model.ffn_hidden": (0, 192)}
    assert "model.d_model" in drift(saved, load(None, ["model.d_model=64", "model.ffn_hidden=128"]))


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> Path:
    run_dir = tmp_path_factory.mktemp("drift") / "run"
    assert train(tiny_cfg(run_dir, *STEPS)) == 0
    return run_dir


def _folders(run_dir: Path) -> list[str]:
    return sorted(p.name for p in (run_dir / "checkpoints").iterdir())


@pytest.mark.slow
def test_a_shape_drift_is_refused_even_when_allowed_and_nothing_is_touched(reference, tmp_path, capsys):
    run_dir = tmp_path / "run"
    shutil.copytree(reference, run_dir)
    before, metrics = _folders(run_dir), (run_dir / "metrics.jsonl").read_bytes()
    args = [f"run.dir={run_dir}", *TINY, *STEPS, "train.total_steps=12", "model.d_model=48"]
    assert main(["--allow-drift", "model.d_model", *args]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "model.d_model" in err[0] and "new run.dir" in err[0], err
    # Called past the CLI's check (a script's train(cfg, allow_drift)), the resume itself refuses.
    with pytest.raises(ConfigError, match="model.d_model=32, now 48: a model of another shape"):
        train(tiny_cfg(run_dir, *STEPS, "train.total_steps=12", "model.d_model=48"), ("model.d_model",))
    assert _folders(run_dir) == before  # no step 0 of a new model, nothing renamed .invalid-*
    assert (run_dir / "metrics.jsonl").read_bytes() == metrics
    assert not events(run_dir, "passed_over")


@pytest.mark.slow
def test_a_refused_hyperparameter_names_the_flag_and_a_branch_that_works(reference, tmp_path, capsys):
    run_dir = tmp_path / "run"
    shutil.copytree(reference, run_dir)
    assert main([f"run.dir={run_dir}", *TINY, *STEPS, "train.total_steps=12", "optim.weight_decay=0.2"]) == 2
    err = capsys.readouterr().err
    ckpt = f"{run_dir}/checkpoints/step-00000008"
    assert "--allow-drift optim.weight_decay" in err and f"run.init_from={ckpt}" in err
    # The advice works: a new run.dir from those weights trains.
    assert main([f"run.dir={tmp_path / 'new'}", *TINY, *STEPS, "train.total_steps=12", "optim.weight_decay=0.2",
                 f"run.init_from={ckpt}"]) == 0
    assert events(tmp_path / "new", "branch")[0]["parent"] == ckpt


@pytest.mark.slow
def test_a_resume_that_re_plans_the_cosine_says_the_old_and_new_lr(reference, tmp_path, capsys):
    from dsslm.config import load
    from dsslm.optim import lr_at
    run_dir = tmp_path / "run"
    shutil.copytree(reference, run_dir)
    assert main([f"run.dir={run_dir}", *TINY, *STEPS, "train.total_steps=12"]) == 0
    old = lr_at(8, load(None, [*TINY, *STEPS]))
    new = lr_at(8, load(None, [*TINY, *STEPS, "train.total_steps=12"]))
    assert new > old
    changes = events(run_dir, "resume")[-1]["changes"]
    assert changes == [f"learning-rate plan: step 9 trains at {new:.4g} where the checkpoint's plan had {old:.4g} "
                       f"(optim.* or train.total_steps changed)"]
    assert changes[0] in capsys.readouterr().err
    assert [r["lr"] for r in read_jsonl(run_dir / "metrics.jsonl") if r.get("step") == 9][-1] == new


@pytest.mark.slow
def test_re_running_a_finished_run_says_so_and_trains_nothing(reference, tmp_path, capsys):
    run_dir = tmp_path / "run"
    shutil.copytree(reference, run_dir)
    metrics = (run_dir / "metrics.jsonl").read_bytes()
    ends = len(events(run_dir, "end"))
    assert main([f"run.dir={run_dir}", *TINY, *STEPS]) == 0
    captured = capsys.readouterr()
    assert "this run is finished: step 8 of train.total_steps=8" in captured.err
    assert "starting at step" not in captured.out
    assert (run_dir / "metrics.jsonl").read_bytes() == metrics and len(events(run_dir, "end")) == ends
    assert _folders(run_dir) == _folders(reference)


def test_a_branch_asked_of_a_run_dir_with_checkpoints_says_it_resumes_instead(reference, tmp_path):
    """run.init_from on a run.dir that already has checkpoints resumes them (a requeued job carries
    its command's init_from); asked for anew, it was dropped without a word. The resume says so."""
    run_dir = tmp_path / "run"
    shutil.copytree(reference, run_dir)
    other = reference / "checkpoints" / sorted(_folders(reference))[0]
    assert train(tiny_cfg(run_dir, *STEPS, f"run.init_from={other}")) == 0
    changes = events(run_dir, "resume")[-1]["changes"]
    assert any(f"run.init_from={other} is not used" in c for c in changes), changes


def test_init_std_is_read_once_so_a_checkpoint_that_hashed_it_is_no_drift():
    """model.init_std draws the first weights and nothing after: a checkpoint made under 0.02 (one
    written before the key became mutable still lists it) resumed under tiny.yaml's 0.05 was
    refused as a drift of a value the resume never reads."""
    from dsslm.ckpt.drift import drift, hashed_items
    from dsslm.config import load
    old = {**hashed_items(load(None, TINY)), "model.init_std": 0.02}
    assert drift(old, load(None, [*TINY, "model.init_std=0.05"])) == {}
    assert drift(old, load(None, [*TINY, "model.init_std=0.05", "optim.weight_decay=0.2"])) == {
        "optim.weight_decay": (0.1, 0.2)}


@pytest.mark.slow
def test_a_resume_under_another_init_std_continues_to_the_bit(reference, tmp_path):
    run_dir = tmp_path / "run"
    shutil.copytree(reference, run_dir)
    shutil.rmtree(run_dir / "checkpoints" / "step-00000008")  # resume from step 4, retrain 5-8
    assert train(tiny_cfg(run_dir, *STEPS, "model.init_std=0.05")) == 0
    assert events(run_dir, "resume")[-1]["step"] == 4

    def losses(path: Path) -> dict[int, float]:
        return {r["step"]: r["loss"] for r in read_jsonl(path / "metrics.jsonl") if "loss" in r and r["step"] > 4}
    assert losses(run_dir) == losses(reference) and len(losses(reference)) == 4
