"""The layout's import rules (docs/design.md), read from the source with ast.

- torch.distributed, deepspeed and accelerate are imported only inside dsslm/engine/;
- model.py imports nothing of dsslm but config;
- data/ and ckpt/format.py import only config, durable and fields of dsslm (and data/ itself);
- the ground floor (config/, durable, exits, fields, muon) imports nothing of dsslm outside itself; model, optim,
  precision, rng and clip import only the ground floor (so no loop runs through a folder);
- lower folders never import higher ones: data and ckpt never import recovery, observe or
  train; recovery never imports observe or train; hf/ only what a checkpoint and its data need;
  nothing but the CLIs imports train or job;
- evals/ (downstream tasks) imports only the ground floor and the low modules (the engine and the
  sinks it is handed are duck-typed), and only job (the in-loop hook) and the eval CLI import it;
- health/ (the watchdog, the node check, the straggler report) never imports recovery, ckpt, evals
  or train, observe never imports health, and outside health/ the loop talks to it through one
  door (health.door); the report CLI may read its records (health.nodes, health.hangs).
"""
from __future__ import annotations

import ast
from pathlib import Path

import pytest

from helpers import ROOT

PACKAGE = ROOT / "dsslm"
DISTRIBUTED = ("torch.distributed", "deepspeed", "accelerate")
CLIS = {"dsslm.train", "dsslm.drill", "dsslm.report", "dsslm.export", "dsslm.sample", "dsslm.eval"}


def module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imports_of(path: Path, package: str) -> set[str]:
    """Every module `path` (in `package`) imports, at any depth (function bodies included), as
    absolute names."""
    tree = ast.parse(path.read_text(), filename=str(path))
    found: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # relative: resolve against this module's package
                anchor = package.rsplit(".", node.level - 1)[0] if node.level > 1 else package
                base = f"{anchor}.{base}" if base else anchor
            found.add(base)
            found.update(f"{base}.{alias.name}" for alias in node.names)
    return found


def package_of(path: Path) -> str:
    return module_name(path) if path.name == "__init__.py" else module_name(path).rsplit(".", 1)[0]


MODULES = {module_name(p): imports_of(p, package_of(p)) for p in sorted(PACKAGE.rglob("*.py"))}


def dsslm_imports(module: str) -> set[str]:
    return {m for m in MODULES[module] if m == "dsslm" or m.startswith("dsslm.")}


def in_folder(module: str, folder: str) -> bool:
    return module == f"dsslm.{folder}" or module.startswith(f"dsslm.{folder}.")


def test_the_reader_sees_every_module():
    assert {"dsslm.train", "dsslm.model", "dsslm.engine.base", "dsslm.data.loader", "dsslm.ckpt.format",
            "dsslm.recovery.monitor", "dsslm.observe.sinks"} <= set(MODULES)


@pytest.mark.parametrize("module", sorted(MODULES))
def test_distributed_libraries_only_inside_engine(module):
    if in_folder(module, "engine"):
        return
    bad = sorted(m for m in MODULES[module] if m.startswith(DISTRIBUTED) or m.split(".")[0] in DISTRIBUTED)
    assert not bad, f"{module} imports {bad}: only dsslm/engine/ may; ask the engine instead"


GROUND_FLOOR = ("dsslm.config", "dsslm.durable", "dsslm.exits", "dsslm.fields", "dsslm.muon")
LOW = ("dsslm.model", "dsslm.optim", "dsslm.precision", "dsslm.rng", "dsslm.clip")


def below(imported: str, allowed: tuple[str, ...]) -> bool:
    return imported == "dsslm" or any(imported == a or imported.startswith(a + ".") for a in allowed)


@pytest.mark.parametrize("module", sorted(m for m in MODULES if m != "dsslm" and below(m, GROUND_FLOOR)))
def test_the_ground_floor_imports_nothing_of_dsslm(module):
    own = next(g for g in GROUND_FLOOR if below(module, (g,)))  # config/ is a folder: its modules import each other
    bad = sorted(m for m in dsslm_imports(module) if m != "dsslm" and not below(m, (own,)))
    assert not bad, f"{module} is on the ground floor and imports {bad}"


@pytest.mark.parametrize("module", LOW)
def test_low_modules_import_only_the_ground_floor(module):
    bad = sorted(m for m in dsslm_imports(module) if not below(m, GROUND_FLOOR))
    assert not bad, f"{module} may import only {GROUND_FLOOR} of dsslm; it imports {bad}"


def test_model_imports_only_config():
    assert {m for m in dsslm_imports("dsslm.model") if m != "dsslm.config" and not m.startswith("dsslm.config.")} == set()


@pytest.mark.parametrize("module", sorted(m for m in MODULES if in_folder(m, "data") or m == "dsslm.ckpt.format"))
def test_data_and_ckpt_format_import_only_config_durable_fields_and_data(module):
    # fields: the shard path rule manifest.json and skip entries share (fields.shard_path_problem)
    allowed = ("dsslm.config", "dsslm.durable", "dsslm.fields", "dsslm.data")
    bad = sorted(m for m in dsslm_imports(module) if not any(m == a or m.startswith(a + ".") for a in allowed)
                 and m != "dsslm")
    assert not bad, f"{module} imports {bad}"


HIGHER = {"data": ("ckpt", "recovery", "observe", "train", "engine", "hf"),
          "ckpt": ("recovery", "observe", "train", "hf"), "hf": ("recovery", "observe", "train", "engine"),
          "recovery": ("observe", "train"), "engine": ("ckpt", "recovery", "observe", "train", "data"),
          "observe": ("recovery", "train", "health"), "health": ("recovery", "ckpt", "evals", "train")}


@pytest.mark.parametrize("module", sorted(MODULES))
def test_no_folder_imports_a_higher_one(module):
    folder = next((f for f in HIGHER if in_folder(module, f)), None)
    if folder is None:
        return
    bad = sorted(m for m in dsslm_imports(module)
                 if any(in_folder(m, higher) or m == f"dsslm.{higher}" for higher in HIGHER[folder]))
    assert not bad, f"{module} (in {folder}/) imports {bad}"


@pytest.mark.parametrize("module", sorted(MODULES))
def test_only_the_clis_import_train(module):
    if module in CLIS:
        return
    bad = sorted(m for m in dsslm_imports(module) if below(m, ("dsslm.train", "dsslm.job")))
    assert not bad, f"{module} imports {bad}: only the CLIs may"


EVALS_USERS = {"dsslm.job", "dsslm.eval"}


@pytest.mark.parametrize("module", sorted(m for m in MODULES if in_folder(m, "evals")))
def test_evals_import_only_the_ground_floor_and_low_modules(module):
    bad = sorted(m for m in dsslm_imports(module) if not below(m, GROUND_FLOOR + LOW + ("dsslm.evals",)))
    assert not bad, f"{module} (in evals/) imports {bad}: it scores a forward it is handed"


@pytest.mark.parametrize("module", sorted(MODULES))
def test_only_the_job_and_the_eval_cli_import_evals(module):
    if module in EVALS_USERS or in_folder(module, "evals"):
        return
    bad = sorted(m for m in dsslm_imports(module) if in_folder(m, "evals"))
    assert not bad, f"{module} imports {bad}: only {sorted(EVALS_USERS)} may"


HEALTH_READERS = {"dsslm.report": ("dsslm.health.nodes", "dsslm.health.hangs")}


@pytest.mark.parametrize("module", sorted(m for m in MODULES if not in_folder(m, "health")))
def test_the_loop_talks_to_health_through_its_door(module):
    allowed = ("dsslm.health.door", *HEALTH_READERS.get(module, ()))
    bad = sorted(m for m in dsslm_imports(module) if in_folder(m, "health") and not below(m, allowed))
    assert not bad, f"{module} imports {bad}: outside dsslm/health/ only its door, dsslm.health.door"


def test_the_reader_catches_nested_and_relative_imports(tmp_path):
    """The rules must be able to fail: imports inside functions and relative ones are seen."""
    bad = tmp_path / "bad.py"
    bad.write_text("def f():\n    import deepspeed\n    from torch.distributed import barrier\n"
                   "    from ..train import main\n")
    found = imports_of(bad, "dsslm.data")
    assert {"deepspeed", "torch.distributed", "dsslm.train"} <= found
