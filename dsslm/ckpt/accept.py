"""Accepting a checkpoint: what it must pass before anything of it is used, on top of its hashes.

Anyone who can write a run.dir can also rewrite a MANIFEST, so a checkpoint that verifies is
checked against the table of parts (every field's type and range), against the model (every
tensor's name, shape and dtype, and no NaN/inf) and for consistency; one that fails is passed over
like a hash mismatch (`NotAccepted`). One made by another config, data or tokenizer is refused
outright (`ResumeRefused`). `resume.Checkpointer` holds these checks (`Acceptance`).
"""
from __future__ import annotations

from typing import Any

import torch

from dsslm.ckpt.drift import from_dict
from dsslm.ckpt.format import Checkpoint, CheckpointError
from dsslm.ckpt.train_state import FINGERPRINT_SPEC, ResumeRefused, check_fingerprint
from dsslm.config import ConfigError, shuffle_spec
from dsslm.data.permute import parse_shuffle
from dsslm.engine.base import STATE_KINDS, OptimState, optim_kinds
from dsslm.fields import MAX_STEP, Fields, Int, MapOf, Json, StateError, Str, validate

SCHEMA_VERSION = 2
HEADER = ("schema", "step", "skip_list", "world_size", "engine", "fingerprint", "config")
TENSOR_GROUPS = ("model", "optim")

# The parts a config value adds to the table (job.build): a checkpoint made under another value
# lacks or holds them, which its fingerprint, not its parts, must explain.
SWITCHED_BY = {"scaler": "train.precision", "clip": "optim.clip_mode"}


class NotAccepted(CheckpointError):
    """A checkpoint that verified but was refused by its contents (config, shapes, fields)."""


def kept_per_rank(value: Any) -> bool:
    """A part's entry in state.json that says its state is in each rank's own file (a sharded save)."""
    return isinstance(value, dict) and set(value) == {"per_rank"}


class Acceptance:
    """The checks of a loaded checkpoint, for a class holding `engine`, `parts`, `fingerprint`,
    `cfg` and `allow_drift` (resume.Checkpointer)."""

    def accept(self, ckpt: Checkpoint, parent: bool = False, values: bool = True) -> dict[str, Any]:
        """Check a loaded checkpoint before anything of it is used; returns the allowed drift.

        StateError / CheckpointError name what is malformed (the store passes such a folder
        over); ResumeRefused says the checkpoint is well formed but from another run (another
        config, data or tokenizer), which is refused outright: passing over every checkpoint of a
        changed run would start it afresh and, by retention, delete what it had saved.
        `parent`: a branch's parent, whose schedule, length and data may differ on purpose.
        `values`: also scan every tensor for NaN/inf (once per checkpoint is enough: it reads all).
        Upgrades an old state.json in place."""
        ckpt.state = upgrade_state(ckpt.state)
        self.check_header(ckpt.state)
        if ckpt.state["step"] != ckpt.step:  # chosen by its name: restored, it would be another step
            raise StateError(f"state.step: {ckpt.state['step']}, the folder name says {ckpt.step}")
        try:  # read as describe() and the drift checks read it, before anything of it is loaded
            from_dict(ckpt.state["config"], f"checkpoint {ckpt.path.name}: state.config", rules=None)
        except ConfigError as exc:
            # Refused, not passed over: this dsslm may not read an older version's config (a key
            # since removed), and passing over every checkpoint would start the run afresh.
            raise ResumeRefused(f"resume refused: {exc}") from None
        saved = ckpt.state["fingerprint"]
        allowed = self.allow_drift
        where = f"checkpoint {ckpt.path.name}"
        if parent:
            allowed += tuple(k for k in saved["config_items"] if not k.startswith("model.")) + ("data", "global_batch_size")
            where = f"parent checkpoint {ckpt.path}"
        # Before the parts: a changed key that adds or removes one (SWITCHED_BY) is refused by
        # its name, or, allowed, lets that part start afresh.
        drifted = check_fingerprint(saved, self.fingerprint, self.cfg, where, allowed)
        self.check_parts(ckpt.state, drifted)
        if not parent:  # a branch may read its parent's stream in another order on purpose
            self.check_shuffle(ckpt.state["train"], where)
        sharded = ckpt.reader is not None and bool(ckpt.reader.index["save"])  # "": gathered (no rank files)
        for name in self.parts:
            if kept_per_rank(ckpt.state.get(name)) and not sharded:
                raise StateError(f"state.{name}: kept in rank files, which a gathered checkpoint does not have")
        if ckpt.reader is not None:
            self.check_index(ckpt.reader)  # values were scanned while the folder was hashed
        else:
            self.check_tensors(ckpt.tensors, values)
        return drifted

    def check_shuffle(self, train: dict, where: str) -> None:
        """The order the checkpoint's run read its epochs in (TrainState.shuffle, "" = array) is the
        one data.shuffle asks for, or data.shuffle is auto (then the resume keeps it): another order
        continues at the same position over other chunks, re-reading some and never reading others."""
        saved = train.get("shuffle") or "array"
        try:
            parse_shuffle(saved)
        except ValueError as exc:
            raise StateError(f"state.train.shuffle: {exc}") from None
        wanted = shuffle_spec(self.cfg.data)
        if wanted and wanted != saved and "data.shuffle" not in self.allow_drift:
            raise ResumeRefused(
                f"resume refused: {where} read its epochs in data.shuffle={saved} order, now {wanted}; drop "
                f"data.shuffle (auto: a resume keeps its checkpoint's order), or pass --allow-drift data.shuffle "
                "to read the rest of the run in the new order (the current epoch then repeats some chunks and "
                "leaves out others)")

    def check_header(self, state: Any) -> None:
        header = Fields(open=True, schema=Int(SCHEMA_VERSION, SCHEMA_VERSION), step=Int(0, MAX_STEP),
                        skip_list=Json(), world_size=Int(1, 1 << 20), engine=Str(64),
                        fingerprint=FINGERPRINT_SPEC, config=MapOf(Json()))
        validate(state, header, "state")

    def check_parts(self, state: dict, drifted: dict) -> None:
        """Every part of this run in state.json, and no other: but for a part whose key changed
        with the user's leave (--allow-drift), which starts afresh (missing) or is left (extra)."""
        switched = {name for name, key in SWITCHED_BY.items() if key in drifted}
        missing = [name for name in self.parts if name not in state and name not in switched]
        extra = sorted(set(state) - set(HEADER) - set(self.parts) - switched)
        if missing or extra:
            field = f"state.{(missing or extra)[0]}"
            raise StateError(f"{field}: {'missing' if missing else 'not a part of this run'} (the parts are "
                             f"{', '.join(self.parts)})")
        for name, part in self.parts.items():
            if name in state:
                validate(state[name], part.state_spec, f"state.{name}")
        train = state["train"]
        if state["step"] != train["step"] or state["skip_list"] != train["skip_list"]:
            raise StateError("state.step / state.skip_list: differ from state.train's copies")
        rng = state["rng"]
        ranks = rng["per_rank"] if isinstance(rng, dict) else len(rng)
        if ranks != state["world_size"]:
            raise StateError(f"state.rng: {ranks} ranks' streams for world_size {state['world_size']}")

    def check_index(self, reader: Any) -> None:
        """Every tensor a checkpoint's index names against this model, before any is read: model
        weights exactly this model's, fp32; per-parameter optimizer states (any name: AdamW's
        moments, Muon's momentum) of their parameter's shape, fp32, for the parameters that have
        a step count (shape (1,) float64, a whole number of steps)."""
        shapes = self.engine.param_shapes
        tensors = reader.index["tensors"]
        model = {k[len("model/"):]: v for k, v in tensors.items() if k.startswith("model/")}
        others = [k for k in tensors if not k.startswith(("model/", "optim/"))]
        if others:
            raise CheckpointError(f"tensor {others[0]!r} is neither model/ nor optim/")
        kinds = optim_kinds(reader)
        entries = {"model": model, **{f"optim {kind}": {n: tensors[f"optim/{kind}/{n}"] for n in names}
                                      for kind, names in kinds.items()}}
        steps = kinds.get("step", set())
        self.check_optimizer(set(kinds) - {"step"})
        for group, table in entries.items():
            unknown = sorted(set(table) - set(shapes))
            missing = sorted(set(shapes) - set(table)) if group == "model" else []
            if unknown or missing:
                what = f"unknown parameter {unknown[0]!r}" if unknown else f"no tensor for {missing[0]!r}"
                raise CheckpointError(f"{group}: {what}; check model.* against the checkpoint's config")
            if group not in ("model", "optim step") and not set(table) <= steps:
                raise CheckpointError(f"optim: {group.split()[1]} and step name different parameters")
            for name, entry in table.items():
                want = ([1], "F64") if group == "optim step" else (list(shapes[name]), "F32")
                if (entry["shape"], entry["dtype"]) != want:
                    raise CheckpointError(f"{group} {name}: shape {entry['shape']} {entry['dtype']}, expected "
                                          f"{want[0]} {want[1]}")
        # As check_tensors: AdamW's parameters have both moments, Muon's a momentum, each a step
        # (under optim.name=muon the moments name the AdamW subset alone, not every stepped one).
        adam, momentum = kinds.get("exp_avg", set()), kinds.get("momentum", set())
        if adam != kinds.get("exp_avg_sq", set()) or adam & momentum or adam | momentum != steps:
            raise CheckpointError("optim: exp_avg, exp_avg_sq, momentum and step name different parameters")
        _check_complete(steps, shapes)
        for name in steps:
            step = float(reader.read(f"optim/step/{name}")[0])
            if not 0 <= step <= MAX_STEP or step != int(step):
                raise CheckpointError(f"optim step/{name}: {step} is not a step count")

    def check_optimizer(self, kinds: set[str]) -> None:
        """The checkpoint's optimizer state is this run's optimizer's: Muon's momentum where
        optim.name=muon, AdamW's moments alone where adamw. A switch passed with --allow-drift
        optim.name would otherwise load state the optimizer cannot read (a KeyError on the first
        step) or, worse, that it reads as fresh; no optimizer's state converts into the other's. It
        refuses the resume (the run exits 2), as a config difference does: passed over as a
        malformed folder, it would leave an older checkpoint without optimizer state (the start)
        to be resumed from instead."""
        saved = "muon" if "momentum" in kinds else "adamw" if kinds else None
        if saved is not None and saved != self.cfg.optim.name:
            raise ResumeRefused(f"resume refused: the checkpoint holds {saved}'s optimizer state and this run has "
                                f"optim.name={self.cfg.optim.name}; resume with optim.name={saved}, or start from "
                                f"its weights alone (python -m dsslm.export, then run.init_from=hf:DIR)")

    def check_tensors(self, tensors: dict[str, dict[str, torch.Tensor]], values: bool = True) -> None:
        """Every tensor's name, shape and dtype against this model, before any is loaded: a
        broadcastable wrong shape would otherwise load silently."""
        if sorted(tensors) != sorted(TENSOR_GROUPS):  # a Checkpoint loaded whole (load_checkpoint)
            raise CheckpointError(f"tensor files are {sorted(tensors)}, expected {list(TENSOR_GROUPS)}")
        shapes = self.engine.param_shapes
        check_table("model", tensors["model"], shapes, exact=True)
        try:
            optim = OptimState.from_tensors(tensors["optim"])
        except ValueError as exc:
            raise CheckpointError(f"optim: {exc}") from None
        for kind in STATE_KINDS:
            check_table(f"optim {kind}", getattr(optim, kind), shapes, exact=False)
        self.check_optimizer({kind for kind in STATE_KINDS if getattr(optim, kind)})
        # AdamW's parameters have both moments, Muon's (optim.name=muon) a momentum; each has a step.
        if set(optim.exp_avg) != set(optim.exp_avg_sq) or set(optim.exp_avg) & set(optim.momentum) \
                or set(optim.exp_avg) | set(optim.momentum) != set(optim.step):
            raise CheckpointError("optim: exp_avg, exp_avg_sq, momentum and step name different parameters")
        for key, tensor in tensors["optim"].items():
            if key.startswith("step/") and (tensor.shape != (1,) or tensor.dtype != torch.float64):
                raise CheckpointError(f"optim {key}: shape {tuple(tensor.shape)} {tensor.dtype}, expected (1,) float64")
        _check_complete(set(optim.step), shapes)
        for name, step in optim.step.items():
            if not 0 <= step <= MAX_STEP or step != int(step):
                raise CheckpointError(f"optim step/{name}: {step} is not a step count")
        if values:
            _check_values(tensors["model"], optim)


def check_table(group: str, tensors: dict[str, torch.Tensor], shapes: dict[str, tuple], exact: bool) -> None:
    unknown = sorted(set(tensors) - set(shapes))
    missing = sorted(set(shapes) - set(tensors)) if exact else []
    if unknown or missing:
        what = f"unknown parameter {unknown[0]!r}" if unknown else f"no tensor for {missing[0]!r}"
        raise CheckpointError(f"{group}: {what}; check model.* against the checkpoint's config")
    for name, tensor in tensors.items():
        if tuple(tensor.shape) != shapes[name] or tensor.dtype != torch.float32:
            raise CheckpointError(f"{group} {name}: shape {tuple(tensor.shape)} {tensor.dtype}, this model has "
                                  f"{shapes[name]} float32")


def _check_complete(stepped: set[str], shapes: dict[str, tuple]) -> None:
    """Every parameter has optimizer state once any has: each step updates them all (every
    parameter is used in the forward), so a checkpoint with some of it missing was damaged, and
    resumed it would restart those parameters' moments from zero, off the bitwise path. None at
    all is a run that has applied no update yet (step 0, a branch start, only skipped steps)."""
    missing = sorted(set(shapes) - stepped)
    if stepped and missing:
        raise CheckpointError(f"optim: no optimizer state for {missing[0]!r} ({len(missing)} of {len(shapes)} "
                              "parameters), which the others have")


def _check_values(model_sd: dict[str, torch.Tensor], optim: OptimState) -> None:
    """No NaN or inf in weights or moments, and no negative second moment: a run saves only states
    it reached through applied steps (the spike policy never applies a non-finite one), so such a
    checkpoint was damaged after the fact and would poison every step trained from it."""
    tables = [("model", model_sd), ("optim exp_avg", optim.exp_avg), ("optim exp_avg_sq", optim.exp_avg_sq),
              ("optim momentum", optim.momentum)]
    for group, table in tables:
        for name, tensor in table.items():
            bad = int((~torch.isfinite(tensor)).sum())
            if bad:
                raise CheckpointError(f"{group} {name}: {bad} non-finite value(s)")
    for name, tensor in optim.exp_avg_sq.items():
        if bool((tensor < 0).any()):
            raise CheckpointError(f"optim exp_avg_sq {name}: negative values (a second moment is >= 0)")


def upgrade_state(state: Any) -> Any:
    """state.json of schema 1 in today's layout; anything else is returned unchanged for the
    checks to judge.

    Schema 1 counted a spike by its 0-based step index (now the step count) and the data stream
    in data batches of the run's global batch B (now in global sequences): batch d was sequences
    [d*B, (d+1)*B), so windows and the position convert exactly with the B the checkpoint
    recorded in its fingerprint."""
    if not isinstance(state, dict) or state.get("format") != 1 or "schema" in state:
        return state
    try:
        old = dict(state)
        batch = int(old["fingerprint"]["global_batch_size"])
        train = dict(old.pop("run"))
        train["tokens_seen"] = train.pop("tokens")
        train["skip_list"] = [[a * batch, b * batch] for a, b in train["skip_list"]]
        train["next_sequence"] = int(old["loader"]["next_data_batch"]) * batch
        train["rewinds"] = [{**r, "step": r["step"] + 1, "window": [r["window"][0] * batch, r["window"][1] * batch]}
                            for r in train["rewinds"]]
        monitor = dict(old["monitor"])
        if monitor.get("spike_start") is not None:
            monitor["spike_start"] += 1
        new = {k: v for k, v in old.items() if k not in ("format", "loader", "scaler", "skip_list")}
        new.update(schema=SCHEMA_VERSION, train=train, monitor=monitor, skip_list=train["skip_list"])
        if old.get("scaler") is not None:
            new["scaler"] = old["scaler"]
        return new
    except (KeyError, TypeError, AttributeError, ValueError) as exc:
        raise StateError(f"state (schema 1): cannot be read ({type(exc).__name__}: {exc})") from None
