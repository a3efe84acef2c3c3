"""What a checkpoint carries besides tensors, and how it is gathered from and given back to ranks.

Everything here is JSON: the training step, the skip list, lr_scale, rewind history, scaler and
monitor state, every rank's RNG, and the fingerprint a resume is checked against.
"""
from __future__ import annotations

import base64
import dataclasses
import json
import random
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from dsslm.config import ConfigError, Config, config_hash, drift, hashed_items
from dsslm.durable import write_json_atomic

STATE_FORMAT = 1


@dataclass
class RunState:
    step: int = 0                    # optimizer steps completed
    tokens: int = 0                  # real target tokens trained on (all ranks)
    skip_list: list = field(default_factory=list)  # half-open [start, end) data-batch windows
    lr_scale: float = 1.0
    rewinds: list = field(default_factory=list)    # history of rewinds (monitor.plan_rewind records)
    skipped_steps: int = 0
    clipped_steps: int = 0
    lineage: list = field(default_factory=list)    # parent runs this run branched from

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> "RunState":
        names = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: v for k, v in d.items() if k in names})


class ResumeRefused(ConfigError):
    """The checkpoint was made by a different config, tokenizer or dataset."""


# --- RNG ---------------------------------------------------------------------------------------

def _b64(t: torch.Tensor) -> str:
    return base64.b64encode(t.cpu().numpy().tobytes()).decode()


def _unb64(s: str) -> torch.Tensor:
    return torch.from_numpy(np.frombuffer(base64.b64decode(s), dtype=np.uint8).copy())


def rng_state() -> dict:
    version, mt, gauss = random.getstate()
    kind, keys, pos, has_gauss, cached = np.random.get_state()
    out = {"python": [version, list(mt), gauss],
           "numpy": [kind, keys.tolist(), int(pos), int(has_gauss), float(cached)],
           "torch": _b64(torch.get_rng_state())}
    if torch.cuda.is_available():
        out["cuda"] = [_b64(s) for s in torch.cuda.get_rng_state_all()]
    return out


def set_rng_state(state: dict) -> None:
    version, mt, gauss = state["python"]
    random.setstate((version, tuple(mt), gauss))
    kind, keys, pos, has_gauss, cached = state["numpy"]
    np.random.set_state((kind, np.array(keys, dtype=np.uint32), pos, has_gauss, cached))
    torch.set_rng_state(_unb64(state["torch"]))
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all([_unb64(s) for s in state["cuda"]])


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


# --- fingerprint -------------------------------------------------------------------------------

def fingerprint(cfg: Config, manifest_sha: str, tokenizer_sha: str, global_batch_size: int) -> dict:
    return {"config_hash": config_hash(cfg), "config_items": hashed_items(cfg),
            "data_manifest_sha256": manifest_sha, "tokenizer_sha256": tokenizer_sha,
            "global_batch_size": global_batch_size}


def check_fingerprint(saved: dict, now: dict, cfg: Config, where: str,
                      allow_drift: tuple[str, ...] = ()) -> dict[str, Any]:
    """Raise ResumeRefused naming the first difference not allowed; return the allowed ones."""
    differences: dict[str, Any] = {}
    for key, (old, new) in drift(saved["config_items"], cfg).items():
        differences[key] = [old, new]
    for key, name in (("data_manifest_sha256", "data"), ("tokenizer_sha256", "tokenizer"),
                      ("global_batch_size", "global_batch_size")):
        if saved[key] != now[key]:
            differences[name] = [saved[key], now[key]]
    refused = {k: v for k, v in differences.items() if k not in allow_drift}
    if refused:
        key, (old, new) = next(iter(refused.items()))
        more = f" (and {len(refused) - 1} more: {', '.join(list(refused)[1:4])})" if len(refused) > 1 else ""
        raise ResumeRefused(f"resume refused: {where} was made with {key}={old!r}, now {new!r}{more}; "
                            f"restore it, use another run.dir, or pass --allow-drift {key}")
    return differences


# --- the run-level recovery file ---------------------------------------------------------------

def recovery_path(run_dir: Path) -> Path:
    return run_dir / "skip_list.json"


def read_recovery(run_dir: Path) -> dict:
    path = recovery_path(run_dir)
    if not path.is_file():
        return {"skip_list": [], "rewinds": [], "lr_scale": None}
    return json.loads(path.read_text())


def write_recovery(run_dir: Path, run: RunState) -> None:
    """Atomically replace skip_list.json: the one record of bad data that any resume merges."""
    write_json_atomic(recovery_path(run_dir),
                      {"skip_list": run.skip_list, "rewinds": run.rewinds, "lr_scale": run.lr_scale})
