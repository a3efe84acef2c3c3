import pytest

from dsslm import config
from dsslm.ckpt.drift import config_hash, drift, from_dict, hashed_items
from dsslm.config import ConfigError, load
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
    ("data.verify=sometimes", "data.verify"),
    ("data.mix.web=-1", "data.mix.web"),
    ("data.mix.web=nan", "data.mix.web"),
    ("data.mix.web=0", "data.mix"),
    ("data.mix.web=abc", "data.mix.web"),
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
    changed = drift(hashed_items(base), load(None, ["model.d_model=256"]))
    assert list(changed) == ["model.d_model"]


def test_shipped_configs_validate():
    for name in ("tiny", "125m", "350m", "1b"):
        load(config.CONFIG_DIR / f"{name}.yaml", [])


def test_a_key_added_since_the_checkpoint_is_no_drift_at_its_default():
    saved = hashed_items(load(None, []))
    del saved["model.norm_eps"]  # a checkpoint written before the key existed
    assert drift(saved, load(None, [])) == {}
    assert drift(saved, load(None, ["model.norm_eps=1e-5"])) == {"model.norm_eps": (None, 1e-5)}


@pytest.mark.parametrize("override, named", [
    ("model.norm_eps=0", "model.norm_eps"), ("model.rope_theta=-1", "model.rope_theta"),
    ("run.init_from=hf:", "run.init_from"), ("model.ffn_hidden=-64", "model.ffn_hidden"),
])
def test_model_and_init_from_values_are_checked(override, named):
    with pytest.raises(ConfigError, match=named.replace(".", r"\.")):
        load(None, [override])


def test_from_dict_checks_a_saved_config_like_a_loaded_one():
    tree = config.to_dict(load(None, ["model.d_model=256"]))
    assert from_dict(tree, "state.json").model.d_model == 256
    tree["model"]["n_heads"] = 3
    with pytest.raises(ConfigError, match=r"state\.json: model\.d_model=256 must be divisible"):
        from_dict(tree, "state.json")
    tree["model"]["n_heads"], tree["model"]["colour"] = 4, "red"
    with pytest.raises(ConfigError, match=r"state\.json: unknown config key 'model\.colour'"):
        from_dict(tree, "state.json")
def test_data_verify_takes_true_false_or_full_and_mix_weights_of_any_scale():
    assert [load(None, [f"data.verify={v}"]).data.verify for v in ("true", "false", "full")] == [True, False, "full"]
    cfg = load(None, ["data.mix.web=7", "data.mix.code=3", "data.mix.books=0"])
    assert cfg.data.mix == {"web": 7.0, "code": 3.0, "books": 0.0}
    with pytest.raises(ConfigError, match=r"data\.mix\.rare=1e-09 is below a millionth"):
        load(None, ["data.mix.web=1", "data.mix.rare=1e-9"])


def test_a_mix_changes_the_config_hash_and_prefetch_does_not():
    base = load(None, [])
    assert config_hash(base) == config_hash(load(None, ["data.prefetch=false", "data.verify=full"]))
    assert config_hash(base) != config_hash(load(None, ["data.mix.code=1"]))


def test_load_records_the_keys_the_config_file_and_the_overrides_set(tmp_path):
    """A key set to its default value could not be told from one not set (run.init_from=hf: took
    the folder's shape over model.n_layers=4, the default): load() records which keys were set."""
    assert load(None, []).explicit == frozenset()  # configs/tiny.yaml by default: dsslm's values, not the user's
    cfg = load(None, ["model.n_layers=4", "data.mix={web: 1}"])
    assert {"model.n_layers", "data.mix.web"} <= cfg.explicit and "model.n_heads" not in cfg.explicit
    (tmp_path / "c.yaml").write_text("model:\n  d_model: 128\ntrain:\n  total_steps: 500\n")
    cfg = load(tmp_path / "c.yaml", ["optim.peak_lr=1e-3"])
    assert {"model.d_model", "train.total_steps", "optim.peak_lr"} <= cfg.explicit
    assert "model.n_layers" not in cfg.explicit and "explicit" not in config.to_dict(cfg)  # not saved
