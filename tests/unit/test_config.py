import pytest

from dsslm import config
from dsslm.config import ConfigError, config_hash, drift, load
from dsslm.train import main


def test_default_loads_and_overrides_apply():
    cfg = load(None, ["optim.peak_lr=3e-4", "model.n_layers=2"])
    assert cfg.optim.peak_lr == 3e-4 and cfg.model.n_layers == 2
    assert cfg.optim.beta1 == 0.9 and cfg.optim.beta2 == 0.95 and cfg.optim.eps == 1e-8


@pytest.mark.parametrize("override, named", [
    ("optim.peak_lrr=1", "optim.peak_lrr"),
    ("nonsense.key=1", "nonsense"),
    ("train.precision=fp8", "train.precision"),
    ("engine.kind=megatron", "engine.kind"),
    ("model.n_heads=3", "model.n_heads"),
    ("train.total_steps=abc", "train.total_steps"),
    ("optim.schedule=wsd", "optim.decay_steps"),
])
def test_bad_key_or_value_names_the_key(override, named):
    with pytest.raises(ConfigError, match=named.replace(".", r"\.")):
        load(None, [override])


def test_main_exits_2_with_one_line(tmp_path, capsys):
    rc = main([f"run.dir={tmp_path / 'run'}", "optim.peak_lrr=1"])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and len(err) == 1 and "optim.peak_lrr" in err[0]
    assert not (tmp_path / "run").exists()  # nothing written that could look like a run


def test_missing_config_file_exits_2(tmp_path, capsys):
    assert main(["--config", str(tmp_path / "nope.yaml")]) == 2
    assert "nope.yaml" in capsys.readouterr().err


def test_hash_ignores_resume_mutable_keys():
    base = load(None, [])
    assert config_hash(base) == config_hash(load(None, ["train.total_steps=999", "ckpt.every=7"]))
    assert config_hash(base) != config_hash(load(None, ["optim.peak_lr=1e-3"]))
    changed = drift(config.hashed_items(base), load(None, ["model.d_model=256"]))
    assert list(changed) == ["model.d_model"]


def test_shipped_configs_validate():
    for name in ("tiny", "125m", "350m", "1b"):
        load(config.CONFIG_DIR / f"{name}.yaml", [])
