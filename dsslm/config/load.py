"""A YAML file and dotted overrides into a validated Config; OmegaConf's errors as ConfigError."""
from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any, Callable

import yaml
from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from dsslm.config.keys import Config, ConfigError
from dsslm.config.validate import one_error, problems

CONFIG_DIR = Path(__file__).resolve().parent.parent.parent / "configs"
DEFAULT_CONFIG = CONFIG_DIR / "tiny.yaml"


def load(path: str | Path | None = None, overrides: list[str] | tuple[str, ...] = (),
         checks: tuple[Callable[[Config], list[str]], ...] = ()) -> Config:
    """The config at `path` (default configs/tiny.yaml) with `key=value` overrides applied. Its
    `explicit` holds the keys `path` and the overrides set (not the default file's: those are
    dsslm's choice, not the user's). `checks`: more problems to report with the config's own (a
    path that does not exist), in the same ConfigError."""
    schema = OmegaConf.structured(Config)
    given = bool(path)
    path = Path(path) if path else DEFAULT_CONFIG
    loaded = _read(path)
    try:
        merged, accum_set = OmegaConf.merge(schema, loaded), OmegaConf.select(loaded, "train.grad_accum") is not None
    except OmegaConfBaseException as err:
        raise ConfigError(f"--config {path}: {_explain(err)}") from None
    except (TypeError, ValueError) as err:
        raise ConfigError(f"--config {path}: {err} (a list where a mapping belongs, or the reverse); check it "
                          f"against configs/tiny.yaml") from None
    explicit = _dotted_keys(OmegaConf.to_container(loaded)) if given else set()
    bad: list[str] = []
    for item in overrides:  # each one on its own: every bad override is named at once
        try:
            if "=" not in item:
                raise ConfigError(f"override {item!r} is not key=value; write e.g. train.total_steps=100")
            override = OmegaConf.from_dotlist([item])
            merged, accum_set = OmegaConf.merge(merged, override), accum_set or item.startswith("train.grad_accum=")
            explicit |= _dotted_keys(OmegaConf.to_container(override))
        except ConfigError as err:
            bad.append(str(err))
        except OmegaConfBaseException as err:
            bad.append(_explain(err))
        except (TypeError, ValueError) as err:  # a list where a map belongs (data.mix=[1,2]): OmegaConf's merge
            bad.append(f"{err} (a list where a mapping belongs, or the reverse); check the overrides and "
                       f"--config against configs/tiny.yaml")
    if bad:  # the config they were meant to make does not exist: its own checks would mislead
        raise one_error(bad)
    try:
        cfg = OmegaConf.to_object(merged)
    except OmegaConfBaseException as err:
        raise ConfigError(_explain(err)) from None
    found = [] if not (accum_set and cfg.train.global_batch_size) else [
        f"train.global_batch_size={cfg.train.global_batch_size} and train.grad_accum={cfg.train.grad_accum} are "
        f"both set; drop train.grad_accum (it follows per world size)"]
    found += problems(cfg)
    for check in checks:
        found += check(cfg)
    if found:
        raise one_error(found)
    cfg.explicit = frozenset(explicit)
    return cfg


def _read(path: Path) -> DictConfig:
    if not path.is_file():
        raise ConfigError(f"--config {path}: no such file; pass a YAML file such as configs/tiny.yaml")
    try:
        loaded = OmegaConf.load(path)
    except yaml.YAMLError as err:
        mark = getattr(err, "problem_mark", None)
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark is not None else ""
        problem = getattr(err, "problem", None) or str(err).splitlines()[0]
        raise ConfigError(f"--config {path}: YAML syntax error{where} ({problem}); fix the file") from None
    except (OSError, UnicodeDecodeError) as err:
        raise ConfigError(f"--config {path}: cannot be read ({err}); pass a YAML text file") from None
    if not isinstance(loaded, DictConfig):
        raise ConfigError(f"--config {path}: the top level must be a mapping of sections (run:, model:, "
                          f"train:, ...), not a list; see configs/tiny.yaml")
    return loaded


def _dotted_keys(tree: Any, prefix: str = "") -> set[str]:
    """Every key of a nested mapping, dotted: {"model": {"d_model": 64}} -> {"model", "model.d_model"}."""
    keys: set[str] = set()
    for key, value in tree.items() if isinstance(tree, dict) else ():
        keys.add(f"{prefix}{key}")
        keys |= _dotted_keys(value, f"{prefix}{key}.")
    return keys


def _explain(err: OmegaConfBaseException) -> str:
    key = getattr(err, "full_key", "") or ""
    if "not in struct" in str(err) or "Key" in type(err).__name__:
        section = key.rsplit(".", 1)[0] if "." in key else ""
        allowed = _keys_of(section)
        return f"unknown config key {key!r}; allowed here: {', '.join(allowed)}"
    if "Incompatible value 'None'" in str(err):  # `run.dir=` with nothing after the '='
        default = _default_of(key)
        example = (f" such as {key}={default}" if default not in (None, "") else
                   f" ({key}='\"\"' for an empty string, its default)" if default == "" else "")
        return f"{key} is empty (nothing after '='); give it a value{example}, or drop the override"
    return f"bad value for {key!r}: {str(err).splitlines()[0]}"


def _default_of(dotted: str) -> Any:
    node: Any = Config()
    for part in dotted.split("."):
        node = getattr(node, part, None)
    return node


def _keys_of(section: str) -> list[str]:
    node: Any = Config()
    for part in filter(None, section.split(".")):
        node = getattr(node, part, None)
    if node is None or not dataclasses.is_dataclass(node):
        node = Config()
        section = ""
    prefix = f"{section}." if section else ""
    return [prefix + f.name for f in dataclasses.fields(node)]
