"""Every random stream a step draws from (Python, numpy, torch CPU, CUDA), as JSON and back.

Saved per rank in every checkpoint, so dropout and any sampling replay identically on resume.
"""
from __future__ import annotations

import base64
import random

import numpy as np
import torch

from dsslm.fields import Fields, Float, Int, Json, ListOf, Optional, Str


def _b64(t: torch.Tensor) -> str:
    return base64.b64encode(t.cpu().numpy().tobytes()).decode()


def _unb64(s: str) -> torch.Tensor:
    return torch.from_numpy(np.frombuffer(base64.b64decode(s, validate=True), dtype=np.uint8).copy())


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


def step_streams() -> tuple:
    """The streams a training step draws from (dropout: torch's CPU and current CUDA generator),
    cheaply, for re-running the step in place. Python's and numpy's global streams are left out:
    no step draws from them (the loader seeds its own Generator per epoch), and copying numpy's
    state costs ~0.1 ms, a few percent of a small model's step."""
    cuda = torch.cuda.get_rng_state() if torch.cuda.is_available() and torch.cuda.is_initialized() else None
    return torch.get_rng_state(), cuda


def set_step_streams(streams: tuple) -> None:
    cpu, cuda = streams
    torch.set_rng_state(cpu)
    if cuda is not None:
        torch.cuda.set_rng_state(cuda)


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


# One rank's streams. The exact contents (a Mersenne Twister's 625 words, a torch state blob) are
# checked by the libraries themselves on load; this pins the types and sizes a reader relies on.
RNG_SPEC = Fields(
    optional=("cuda",),
    python=ListOf(Json(), length=3),
    numpy=ListOf(Json(), length=5),
    torch=Str(max_len=1 << 16),
    cuda=ListOf(Str(max_len=1 << 16), max_len=64),
)
_PYTHON_MT = ListOf(Int(0, 2**32 - 1), length=625)
_NUMPY_KEYS = ListOf(Int(0, 2**32 - 1), length=624)


def check_rng_state(state: dict, path: str) -> None:
    RNG_SPEC.validate(state, path)
    Int(1, 3).validate(state["python"][0], f"{path}.python[0]")
    _PYTHON_MT.validate(state["python"][1], f"{path}.python[1]")
    Optional(Float()).validate(state["python"][2], f"{path}.python[2]")
    Str(max_len=16).validate(state["numpy"][0], f"{path}.numpy[0]")
    _NUMPY_KEYS.validate(state["numpy"][1], f"{path}.numpy[1]")
    Int(0, 624).validate(state["numpy"][2], f"{path}.numpy[2]")
