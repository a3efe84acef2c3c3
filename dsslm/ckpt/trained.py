"""A trained model for the tools (export, sample, eval), from a checkpoint folder or a run dir.

`open_trained(path)` verifies the folder against its MANIFEST, rebuilds the run's config from its
own state.json (checked like a config a user typed), builds the model that config describes and
checks every tensor's name, shape and dtype against it before loading any: a MANIFEST proves
only that nobody changed the folder after it was written. A run dir gives its newest checkpoint
that passes all of that; newer ones that fail are named on stderr and passed over, as a resume
does. The reading is read-only: unlike `CheckpointStore`, whose constructor finishes a replace
that a crash interrupted, nothing here renames or deletes, so a tool may read the run dir of a
job that is still training.

Every failure is a `ToolError` naming the folder and what is wrong; the CLIs print it as one line
and exit 2.
"""
from __future__ import annotations

import argparse
import sys
from dataclasses import dataclass
from pathlib import Path

import torch

from dsslm.ckpt.format import Checkpoint, CheckpointError, candidates, invalid_reason, parse_name, read_manifest
from dsslm.ckpt.shards import check_headers, open_folder, verify_share
from dsslm.ckpt.accept import check_table
from dsslm.fields import MAX_STEP, Int, StateError, validate
from dsslm.ckpt.drift import from_dict
from dsslm.ckpt.train_state import FINGERPRINT_SPEC
from dsslm.config import Config, ConfigError, validate_model
from dsslm.data import DataError, load_manifest
from dsslm.data.manifest import verify_split
from dsslm.data.corpus import default_data_dir
from dsslm.data.tokenizer import ByteTokenizer, load_tokenizer
from dsslm.model import Transformer, build_model


class ToolError(ValueError):
    """Bad input to a tool (a missing or corrupted checkpoint, data of another tokenizer)."""


class OneLineParser(argparse.ArgumentParser):
    def error(self, message):  # one line on stderr and exit 2, not argparse's usage block
        self.exit(2, f"{self.prog}: error: {message}; see --help\n")


@dataclass
class Trained:
    path: Path           # the checkpoint folder
    step: int
    cfg: Config          # the run's own config, from state.json (model.vocab_size filled in)
    model: Transformer   # fp32, eval mode, on `device`
    fingerprint: dict    # the data manifest and tokenizer hashes the run trained with
    device: torch.device


def pick_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name == "cuda" and not torch.cuda.is_available():
        raise ToolError("--device cuda: no GPU is visible here; use --device cpu")
    return torch.device(name)


def open_trained(path: str | Path, device: torch.device = torch.device("cpu")) -> Trained:
    """The model of a checkpoint folder, or of a run dir's newest usable checkpoint."""
    path = Path(path)
    if not path.exists():
        raise ToolError(f"{path} does not exist; name a checkpoint folder (RUN_DIR/checkpoints/step-XXXXXXXX) "
                        "or a run dir")
    if parse_name(path.name) is not None:
        try:
            return _accept(load_weights(path), device)
        except (CheckpointError, StateError) as exc:
            raise ToolError(f"{path} cannot be used: {exc}") from None
    if not (path / "checkpoints").is_dir():
        raise ToolError(f"{path} is neither a checkpoint folder (step-XXXXXXXX) nor a run dir with checkpoints/")
    return _newest(path / "checkpoints", device)


def _newest(ckpt_dir: Path, device: torch.device) -> Trained:
    """The store's reader rule, read-only: newest step first, `step-N` before its `.replaced` aside."""
    reasons = []

    def pass_over(name: str, reason: str) -> None:
        reasons.append(f"{name}: {reason}")
        print(f"dsslm: passed over {ckpt_dir / name}: {reason}", file=sys.stderr)
    found = candidates(ckpt_dir, pass_over)
    for step in sorted(found, reverse=True):
        for path in found[step]:
            try:
                return _accept(load_weights(path), device)
            except (CheckpointError, StateError) as exc:
                pass_over(path.name, str(exc))
    more = f" ({len(reasons)} passed over; newest: {reasons[0]})" if reasons else ""
    raise ToolError(f"{ckpt_dir} holds no valid checkpoint{more}")


def load_weights(folder: Path) -> Checkpoint:
    """Verify every file as a resume does (its MANIFEST hash; every tensor finite, second moments
    >= 0; the shard headers against the index, so no piece of another save is read), then open
    state.json and the index of the tensors (sharded or gathered); the weights are read one
    tensor at a time when the model is filled."""
    reason = invalid_reason(folder, hash_files=False)
    if reason is not None:
        raise CheckpointError(f"not a valid checkpoint: {reason}")
    files = read_manifest(folder)["files"]
    verified = verify_share(folder, files, list(files))
    if verified["bad"] is not None:
        raise CheckpointError(f"not a valid checkpoint: {verified['bad']}")
    ckpt = open_folder(folder, files)
    check_headers(ckpt.reader.index, verified["headers"])
    return ckpt


def _accept(ckpt: Checkpoint, device: torch.device) -> Trained:
    state = ckpt.state
    if not isinstance(state, dict) or "config" not in state:
        raise StateError("state.json has no config")
    validate(state.get("step"), Int(0, MAX_STEP), "state.step")
    if state["step"] != ckpt.step:
        raise StateError(f"state.step: {state['step']}, the folder name says {ckpt.step}")
    validate(state.get("fingerprint"), FINGERPRINT_SPEC, "state.fingerprint")
    try:
        cfg = from_dict(state["config"], "state.json", rules=validate_model)  # the model it builds
    except ConfigError as exc:
        raise StateError(str(exc)) from None
    if cfg.model.vocab_size < 1:
        raise StateError("state.json: config.model.vocab_size is not set")
    torch.manual_seed(0)  # the initial values are overwritten; seeded only so nothing here is random
    model = build_model(cfg.model)
    params = dict(model.named_parameters())  # a tied head is one parameter, stored once
    tensors = ckpt.reader.index["tensors"]
    model_keys = {k[len("model/"):]: v for k, v in tensors.items() if k.startswith("model/")}
    # meta tensors: the shapes and dtypes the index claims, checked before any byte is read
    check_table("model", {n: torch.empty(v["shape"], device="meta",
                                         dtype=torch.float32 if v["dtype"] == "F32" else torch.float64)
                          for n, v in model_keys.items()},
                {n: tuple(p.shape) for n, p in params.items()}, exact=True)
    with torch.no_grad():
        for name, param in params.items():  # one tensor in memory at a time
            param.copy_(ckpt.reader.read(f"model/{name}").reshape(param.shape))
    return Trained(ckpt.path, state["step"], cfg, model.to(device).eval(), state["fingerprint"], device)


def data_dir_of(trained: Trained, given: str | Path | None) -> Path:
    """--data if given, else the DATA_DIR the run trained on ("" is the embedded corpus)."""
    if given:
        return Path(given)
    return Path(trained.cfg.data.dir) if trained.cfg.data.dir else default_data_dir()


def open_data(trained: Trained, given: str | Path | None, verify_val: bool = False) -> tuple[Path, dict]:
    """A DATA_DIR and its manifest (shard sizes checked; the val shards hashed if `verify_val`),
    refused unless it uses the tokenizer the model trained with."""
    data_dir = data_dir_of(trained, given)
    try:
        manifest = load_manifest(data_dir, verify=False)
        if verify_val:
            verify_split(data_dir, manifest, "val")
    except DataError as exc:
        hint = "" if given else "; pass --data DATA_DIR prepared with the run's tokenizer"
        raise ToolError(f"{exc}{hint}") from None
    want, have = trained.fingerprint["tokenizer_sha256"], manifest["tokenizer"]["sha256"]
    if have != want:
        raise ToolError(f"{data_dir} uses another tokenizer ({manifest['tokenizer']['kind']}, sha256 {have[:12]}) "
                        f"than {trained.path} was trained with (sha256 {want[:12]}); pass --data DATA_DIR "
                        "prepared with the run's tokenizer")
    return data_dir, manifest


def tokenizer_of(trained: Trained, given: str | Path | None):
    """The run's tokenizer: the byte one needs no files; others come from the DATA_DIR."""
    if not given and trained.fingerprint["tokenizer_sha256"] == ByteTokenizer.sha256:
        return ByteTokenizer()
    data_dir, manifest = open_data(trained, given)
    try:
        return load_tokenizer(data_dir, manifest)  # checks the file against the manifest's hash
    except ValueError as exc:
        raise ToolError(str(exc)) from None
