"""save / restore / resume_or_init / branch, over one table of stateful parts.

What goes into a checkpoint and what comes out of it is one table, name -> object with
`state_dict()` / `load_state_dict()` / `state_spec`, built once by the loop:

    parts = {"train": TrainState, "monitor": SpikeMonitor, "rng": RngStreams,
             "scaler": LossScaler (fp16 only)}

A save writes `state.json` = {"schema": 2, "step", "skip_list", <every part's state_dict()>,
"world_size", "engine", "fingerprint", "config"} next to the engine's full tensors (weights by
parameter name, and the AdamW state in `engine.base.OptimState`'s layout); a restore hands every
part its own entry back. `step` and `skip_list` at the top are the contract's copies of the train
part's, for scripts. Before anything is loaded, a checkpoint is checked against the table (every
field's type and range), against the model (every tensor's name, shape and dtype) and for
consistency; one that fails is passed over like a hash mismatch. Every engine hands over the
same full tensors, so a ZeRO checkpoint resumes under FSDP, DDP or one process.
"""
from __future__ import annotations

import json
import os
import stat
from pathlib import Path
from typing import Any, Callable, Protocol

import torch

from dsslm.ckpt.format import STATE_FILE, Checkpoint, CheckpointError, invalid_reason, read_manifest
from dsslm.ckpt.shards import check_headers, open_folder, read_rank_file, split_files, verify_share
from dsslm.fields import MAX_STEP, Fields, Int, ListOf, MapOf, Json, Spec, StateError, Str, validate
from dsslm.ckpt.drift import describe, from_dict
from dsslm.ckpt.store import CheckpointStore
from dsslm.ckpt.train_state import FINGERPRINT_SPEC, NothingToResume, ResumeRefused, TrainState, check_fingerprint
from dsslm.config import Config, ConfigError, to_dict
from dsslm.engine.base import STATE_KINDS, Engine, OptimState, optim_kinds
from dsslm.rng import check_rng_state, rng_state, seed_everything, set_rng_state

SCHEMA_VERSION = 2
HEADER = ("schema", "step", "skip_list", "world_size", "engine", "fingerprint", "config")
TENSOR_GROUPS = ("model", "optim")


class WeightSource(Protocol):
    """Weights made elsewhere (`run.init_from=hf:HF_DIR`): `read(expect)` returns them by dsslm
    parameter name with a lineage record; `expect` is the record rank 0 read, for the others."""

    def read(self, expect: dict | None = None) -> tuple[dict[str, torch.Tensor], dict]: ...


class Stateful(Protocol):
    state_spec: Spec

    def state_dict(self) -> Any: ...

    def load_state_dict(self, state: Any) -> None: ...


class RngStreams:
    """Every rank's random streams: gathered to rank 0 on save, handed back by rank on load."""

    def __init__(self, engine: Engine, seed: int, train: TrainState):
        self.engine, self.seed, self.train = engine, seed, train
        self.state_spec = _RngList()

    def state_dict(self) -> list[dict]:
        return self.engine.all_gather(rng_state())  # a collective: every rank saves

    def load_state_dict(self, rngs: list[dict]) -> None:
        self.load_local_state_dict(rngs[self.engine.rank] if len(rngs) == self.engine.world_size else None)

    # A sharded save keeps each rank's streams in that rank's own file (state.json says
    # {"per_rank": W}): no gather, and state.json the same size at any world size.
    def local_state_dict(self) -> dict:
        return rng_state()

    def load_local_state_dict(self, own: dict | None) -> None:
        """This rank's streams, or None: saved at another world size, where per-rank streams
        cannot map one to one; derive fresh ones."""
        if own is not None:
            set_rng_state(own)
        else:
            seed_everything(self.seed + 7919 * self.engine.rank + self.train.step)

    @staticmethod
    def check_local(value: Any, path: str) -> None:
        check_rng_state(value, path)


class _RngList(Spec):
    def validate(self, value: Any, path: str) -> None:
        if isinstance(value, dict):
            Fields(per_rank=Int(1, 1 << 20)).validate(value, path)
            return
        ListOf(Json(), max_len=1 << 16).validate(value, path)
        if not value:
            raise StateError(f"{path}: no rank's random state")
        for i, one in enumerate(value):
            check_rng_state(one, f"{path}[{i}]")


# The parts a config value adds to the table (job.build): a checkpoint made under another value
# lacks or holds them, which its fingerprint, not its parts, must explain.
SWITCHED_BY = {"scaler": "train.precision", "clip": "optim.clip_mode"}


class NotAccepted(CheckpointError):
    """A checkpoint that verified but was refused by its contents (config, shapes, fields)."""


def kept_per_rank(value: Any) -> bool:
    """A part's entry in state.json that says its state is in each rank's own file (a sharded save)."""
    return isinstance(value, dict) and set(value) == {"per_rank"}


class Checkpointer:
    """The loop's checkpoint verbs over the table of parts (every rank holds one)."""

    def __init__(self, engine: Engine, store: CheckpointStore, parts: dict[str, Stateful], fingerprint: dict,
                 cfg: Config, emit: Callable[..., Any], allow_drift: tuple[str, ...] = ()):
        if "train" not in parts or next(iter(parts)) != "train":
            raise ValueError("the part table must start with 'train': later parts read its step on load")
        clash = set(parts) & set(HEADER)
        if clash:
            raise ValueError(f"part names {sorted(clash)} clash with state.json's header")
        self.engine, self.store, self.parts = engine, store, parts
        self.fingerprint, self.cfg, self.emit, self.allow_drift = fingerprint, cfg, emit, allow_drift
        self.config = to_dict(cfg)

    @property
    def train(self) -> TrainState:
        return self.parts["train"]  # type: ignore[return-value]

    # --- save -------------------------------------------------------------------------------
    @property
    def format(self) -> str:
        """ckpt.format, with auto resolved: sharded from 2 ranks up."""
        fmt = self.cfg.ckpt.format
        if fmt == "auto":
            return "sharded" if self.engine.world_size > 1 else "gathered"
        return fmt

    def save(self, sync: bool = False, async_save: bool = True) -> None:
        """Snapshot on every rank; gathered: sharded engines gather, RNG is gathered, rank 0
        writes; sharded: every rank writes its own shard and random streams, rank 0 the rest."""
        # The previous save's failure reaches every rank here. Its writer can fail after the last
        # step-boundary check (a write longer than ckpt.every steps; ckpt.every=1), and the next
        # save then raised it on rank 0 alone, inside save_async's own wait: the other ranks went
        # on into the next step's collectives and waited there for the collective timeout.
        self.engine.decide(self.store.wait)
        if self.format == "sharded":
            self._save_sharded(sync or not async_save)
            return
        model_sd, optim = self.engine.full_state()
        parts = {name: part.state_dict() for name, part in self.parts.items()}  # collectives inside
        if not self.engine.is_main:
            if sync or not async_save:
                self.engine.decide(self.store.wait)
            return
        tensors = {"model": model_sd, "optim": optim.to_tensors()}
        self.store.save_async(self.train.step, tensors, self._state(parts))
        if sync or not async_save:
            self.engine.decide(self.store.wait)  # a failed write reaches every rank, not rank 0 alone

    def _state(self, parts: dict) -> dict:
        return {"schema": SCHEMA_VERSION, "step": self.train.step, "skip_list": self.train.skip_list,
                **parts, "world_size": self.engine.world_size, "engine": self.engine.name,
                "fingerprint": self.fingerprint, "config": self.config}

    def _save_sharded(self, sync: bool) -> None:
        engine = self.engine
        shards = engine.local_state()
        own = {name: part.local_state_dict() for name, part in self.parts.items() if hasattr(part, "local_state_dict")}
        parts = {name: {"per_rank": engine.world_size} if name in own else part.state_dict()
                 for name, part in self.parts.items()}
        # Rank 0 makes the temp folder every rank writes into: one name, drawn once.
        tmp = engine.decide(lambda: self.store.make_tmp(self.train.step))
        state = self._state(parts) if engine.is_main else None
        self.store.save_shard_async(self.train.step, tmp, engine.rank, engine.world_size, shards, own,
                                    engine.exchange(tmp), state)
        if sync:
            if not engine.is_main:
                self.store.wait()  # this rank's files; its failures are rank 0's to raise
            engine.decide(self.store.wait)  # rank 0 waits for every rank: published, or failed everywhere

    # --- checks before anything is loaded ----------------------------------------------------
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
        sharded = ckpt.reader is not None and bool(ckpt.reader.index["save"])  # "": gathered (no rank files)
        for name in self.parts:
            if kept_per_rank(ckpt.state.get(name)) and not sharded:
                raise StateError(f"state.{name}: kept in rank files, which a gathered checkpoint does not have")
        if ckpt.reader is not None:
            self.check_index(ckpt.reader)  # values were scanned while the folder was hashed
        else:
            self.check_tensors(ckpt.tensors, values)
        return drifted

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

    # --- restore ----------------------------------------------------------------------------
    def leave_after(self, step: int) -> None:
        """A rewind to `step`: rank 0 sets the left trajectory's newer checkpoints aside (store)."""
        self.engine.decide(lambda: self.store.leave_after(step))

    def restore(self, ckpt: Checkpoint) -> None:
        """Load weights, optimizer and every part from an accepted checkpoint, on every rank: each
        rank reads only the spans it holds (engine.load_local_state), and its own random streams."""
        if ckpt.reader is None:  # a Checkpoint loaded whole
            self.engine.load_full_state(ckpt.tensors["model"], OptimState.from_tensors(ckpt.tensors["optim"]))
        else:
            self.engine.load_local_state(ckpt.reader)
        for name, part in self.parts.items():
            if name not in ckpt.state:  # added by an allowed drift (check_parts): starts afresh
                continue
            value = ckpt.state[name]
            if kept_per_rank(value) and hasattr(part, "load_local_state_dict"):
                saved = value["per_rank"]
                own = (read_rank_file(ckpt.path, self.engine.rank, saved)[name]
                       if saved == self.engine.world_size else None)
                part.load_local_state_dict(own)
            else:
                part.load_state_dict(value)

    def latest(self, before_step: int = MAX_STEP, resuming: bool = False) -> Checkpoint | None:
        """The newest checkpoint at or before `before_step` that verifies and is accepted, the same
        one on every rank: rank 0 names candidates newest first (MANIFEST and sizes checked), all
        ranks hash it together, each its share; a refused one is passed over by one decision.

        `resuming`: a run.dir whose checkpoints all verify but are all refused is refused too
        (ConfigError on every rank), never started afresh beside them: a new model would be saved
        next to the old one's newer checkpoints."""
        tried: set[str] = set()
        refusals: list[str] = []
        while True:
            path = self.engine.decide(
                lambda: next((p for p in self.store.candidates(before_step) if p not in tried), None))
            if path is None:
                if resuming and refusals:
                    raise ConfigError(f"{self.store.ckpt_dir} holds checkpoints but none can be resumed ("
                                      f"{refusals[0]}); fix the config to match them, or use a new run.dir")
                if resuming:
                    self.engine.decide(self._nothing_lost)
                return None
            tried.add(path)
            try:
                return self._open(Path(path))
            except (CheckpointError, StateError) as exc:  # malformed; a refused resume (ResumeRefused) propagates
                reason = str(exc)
                if isinstance(exc, NotAccepted):
                    refusals.append(f"{Path(path).name}: {reason}")
                self.engine.decide(lambda: self.store.refuse(path, reason))

    def _nothing_lost(self) -> None:
        """Rank 0, when no checkpoint can be resumed: NothingToResume where run.dir's logs show a run
        past step 0 and a checkpoint was passed over or set aside, unless run.restart_from_scratch
        (then said in an event). A start at step 0 would append a second history to the first's logs."""
        damaged = self.store.not_resumable()
        recorded = recorded_step(self.store.run_dir) if damaged else None
        if recorded is None:
            return
        step, source = recorded
        if self.cfg.run.restart_from_scratch:
            self.emit("restart_from_scratch", step=0, recorded_step=step, not_resumable=damaged)
            return
        names = ", ".join(damaged[:3]) + (f" and {len(damaged) - 3} more" if len(damaged) > 3 else "")
        raise NothingToResume(f"{self.store.run_dir} was trained to step {step} ({source}) but no checkpoint in "
                              f"{self.store.ckpt_dir} can be resumed: {names} (kept; the passed_over events in "
                              f"events.jsonl say why); to start over on purpose, use another run.dir, or add "
                              f"run.restart_from_scratch=true to train this one again from step 0")

    def open(self, path: Path, verified: bool = False, parent: bool = False) -> Checkpoint:
        """A folder named by the user: verified, accepted (every rank calls: the hashing is split)."""
        try:
            return self._open(Path(path), parent)
        except (CheckpointError, StateError) as exc:
            raise CheckpointError(f"{path} cannot be used: {exc}") from None

    def _open(self, path: Path, parent: bool = False) -> Checkpoint:
        """Verify `path` with every rank hashing its share of the files (the values scanned on the
        way), then accept it on rank 0; what fails, fails on every rank. Returns it, tensors
        unread."""
        engine = self.engine

        def manifest() -> dict:
            reason = invalid_reason(path, hash_files=False)
            if reason is not None:
                raise CheckpointError(reason)
            return read_manifest(path)["files"]

        files = engine.decide(manifest)
        mine = split_files(files, engine.world_size)[engine.rank]
        results = engine.gather_long(
            lambda progress: verify_share(path, files, mine, progress, self._check_rank_file),
            f"verifying checkpoint {path.name}", total_units=sum(f["size"] for f in files.values()))
        bad = next((r["bad"] for r in results if r["bad"]), None)
        if bad is not None:
            raise CheckpointError(bad)
        headers = {name: header for r in results for name, header in r["headers"].items()}

        def accept() -> None:
            ckpt = open_folder(path, files)
            check_headers(ckpt.reader.index, headers)
            try:
                self.accept(ckpt, parent)
            except (CheckpointError, StateError) as exc:  # whole and hashed right, but not this run's
                raise NotAccepted(str(exc)) from None

        engine.decide(accept)
        ckpt = open_folder(path, files)
        ckpt.state = upgrade_state(ckpt.state)
        return ckpt

    def _check_rank_file(self, value: Any, name: str) -> None:
        """One rank's own state file: the per-rank parts' entries, each checked by its part."""
        locals_ = {n: p for n, p in self.parts.items() if hasattr(p, "check_local")}
        validate(value, Fields(**{n: Json() for n in locals_}), name)
        for n, part in locals_.items():
            part.check_local(value[n], f"{name}.{n}")

    def saved_train_states(self) -> list[dict]:
        """The train part of every valid checkpoint's state.json that passes its checks (rank 0)."""
        out = []
        for path in self.store.valid_paths():
            try:
                state = upgrade_state(json.loads((path / STATE_FILE).read_text()))
                validate(state["train"], self.train.state_spec, "state.train")
            except (OSError, ValueError, KeyError, TypeError):
                continue  # not one to rebuild from; reading it for a resume reports why
            out.append(state["train"])
        return out

    def resume_or_init(self, weights: WeightSource | None = None) -> str:
        """Continue from this run's newest checkpoint, else start from `weights` (an import) or
        branch from `run.init_from`, else start at step 0. Returns which: "resume", "import",
        "branch" or "fresh"."""
        ckpt = self.latest(resuming=True)
        if ckpt is not None:
            allowed = self.accept(ckpt, values=False)  # pure and cheap: again on every rank, for the event
            self.restore(ckpt)
            changes = describe(allowed, ckpt.state["config"], self.cfg, self.train.step, self.train.next_sequence)
            self.emit("resume", step=self.train.step, checkpoint=str(ckpt.path), drift=allowed, changes=changes,
                      total_steps=self.cfg.train.total_steps)
            return "resume"
        if weights is not None:
            self.start_from(weights)
            return "import"
        if self.cfg.run.init_from:
            self.branch(Path(self.cfg.run.init_from))
            return "branch"
        return "fresh"

    def start_from(self, weights: WeightSource) -> None:
        """Step 0 with weights made elsewhere: a fresh optimizer, the source in the lineage."""
        read: list[dict] = []

        def read_first() -> dict:
            model_sd, record = weights.read()
            read.append(model_sd)
            return record

        record = self.engine.decide(read_first)  # rank 0 validates; its refusal is every rank's
        model_sd, problem = (read[0], None) if read else (None, None)
        if not read:
            try:
                model_sd = weights.read(expect=record)[0]
            except ConfigError as exc:  # the files changed under us: every rank must hear of it
                problem = str(exc)
        problems = [p for p in self.engine.all_gather(problem) if p]
        if problems:
            raise ConfigError(problems[0])
        check_table("model", model_sd, self.engine.param_shapes, exact=True)
        self.engine.load_full_state(model_sd, OptimState())
        self.train.lineage = self.train.lineage + [record]
        self.emit("import", step=self.train.step, source=record)

    def branch(self, path: Path) -> None:
        """Start from another run's checkpoint (a WSD cooldown, an extension), recording lineage.

        Schedule, length and data may differ on purpose; the tokenizer and model shape may not.
        """
        def check_path() -> None:
            if not path.is_dir():
                raise ConfigError(f"run.init_from={path}: no such folder; name a checkpoint folder "
                                  f"(RUN_DIR/checkpoints/step-XXXXXXXX)")

        self.engine.decide(check_path)
        try:  # hashed by every rank, its share; refused on rank 0 means refused on every rank
            parent_ckpt = self._open(path, parent=True)
        except (CheckpointError, StateError) as exc:
            raise ConfigError(f"run.init_from={path}: {path} cannot be used: {exc}; name a checkpoint folder "
                              f"that verifies") from None
        drifted = self.accept(parent_ckpt, parent=True, values=False)
        self.restore(parent_ckpt)
        train = self.train
        if train.step >= self.cfg.train.total_steps:  # the loop would save the parent's weights and end
            raise ConfigError(f"run.init_from={path} is at step {train.step} and train.total_steps="
                              f"{self.cfg.train.total_steps} leaves nothing to train; set train.total_steps "
                              f"above {train.step}")
        data = "continues the parent's stream"
        if "data" in drifted:
            # Positions and skip windows name sequences of the parent's corpus, not of this one.
            data = (f"another corpus: starts at its sequence 0; the parent's position {train.next_sequence} "
                    f"and {len(train.skip_list)} skip windows are not carried over")
            train.next_sequence, train.skip_list, train.rewinds = 0, [], []
        elif any(key.startswith("data.mix") for key in drifted):
            # A mixture is a function of its weights: other weights draw other domains at each position.
            data = (f"continues at the parent's position {train.next_sequence} under another data.mix: each "
                    "domain's sequence numbers follow the new weights, so a domain may repeat or pass over "
                    "some of its sequences in the current pass")
        train.lineage = train.lineage + [{"run_dir": str(path.parent.parent), "step": train.step,
                                          "checkpoint": str(path)}]
        self.emit("branch", step=train.step, parent=str(path), drift=drifted, data=data)


# How much of each log a start reads to tell whether a run trained in run.dir: the last records
# say how far it got, and a long run's metrics.jsonl holds gigabytes.
LOG_TAIL_BYTES = 1 << 16


def recorded_step(run_dir: Path) -> tuple[int, str] | None:
    """The furthest step recorded in `run_dir`'s logs, with the file's name: a trained step's
    record in metrics.jsonl, or an event naming its step in events.jsonl, from the last 64 KiB of
    each. None when neither shows a step past 0; a line that is not such a record (a torn line,
    another tool's) is no evidence."""
    best = None
    for name, kind in (("metrics.jsonl", "loss"), ("events.jsonl", "event")):
        for record in _last_records(run_dir / name):
            step = record.get("step")
            if kind in record and type(step) is int and 0 < step <= MAX_STEP and (best is None or step > best[0]):
                best = (step, name)
    return best


def _last_records(path: Path) -> list[dict]:
    """The JSON objects among the lines of `path`'s last LOG_TAIL_BYTES (a regular file only: a
    FIFO would block the start)."""
    try:
        if not stat.S_ISREG(os.stat(path).st_mode):
            return []
        with open(path, "rb") as f:
            start = max(0, f.seek(0, os.SEEK_END) - LOG_TAIL_BYTES)
            f.seek(start)
            lines = f.read(LOG_TAIL_BYTES).split(b"\n")[1 if start else 0:]  # the first may be cut
    except OSError:
        return []
    records = []
    for line in lines:
        try:
            record = json.loads(line)
        except (ValueError, RecursionError):
            continue
        if isinstance(record, dict):
            records.append(record)
    return records


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
