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
from pathlib import Path
from typing import Any, Callable, Protocol

import torch

from dsslm.ckpt.format import STATE_FILE, Checkpoint, CheckpointError, load_checkpoint, load_verified
from dsslm.fields import MAX_STEP, Fields, Int, ListOf, MapOf, Json, Spec, StateError, Str, validate
from dsslm.ckpt.store import CheckpointStore
from dsslm.ckpt.train_state import FINGERPRINT_SPEC, TrainState, check_fingerprint
from dsslm.config import Config, ConfigError, to_dict
from dsslm.engine.base import STATE_KINDS, Engine, OptimState
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
        if len(rngs) == self.engine.world_size:
            set_rng_state(rngs[self.engine.rank])
        else:
            # Another world size: per-rank streams cannot map one to one; derive fresh ones.
            seed_everything(self.seed + 7919 * self.engine.rank + self.train.step)


class _RngList(Spec):
    def validate(self, value: Any, path: str) -> None:
        ListOf(Json(), max_len=1 << 16).validate(value, path)
        if not value:
            raise StateError(f"{path}: no rank's random state")
        for i, one in enumerate(value):
            check_rng_state(one, f"{path}[{i}]")


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
    def save(self, sync: bool = False, async_save: bool = True) -> None:
        """Snapshot on every rank (sharded engines gather, RNG is gathered); rank 0 writes."""
        model_sd, optim = self.engine.full_state()
        parts = {name: part.state_dict() for name, part in self.parts.items()}  # collectives inside
        if not self.engine.is_main:
            if sync or not async_save:
                self.engine.decide(self.store.wait)
            return
        state = {"schema": SCHEMA_VERSION, "step": self.train.step, "skip_list": self.train.skip_list,
                 **parts, "world_size": self.engine.world_size, "engine": self.engine.name,
                 "fingerprint": self.fingerprint, "config": self.config}
        tensors = {"model": model_sd, "optim": optim.to_tensors()}
        self.store.save_async(self.train.step, tensors, state)
        if sync or not async_save:
            self.engine.decide(self.store.wait)  # a failed write reaches every rank, not rank 0 alone

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
        self.check_state(ckpt.state)
        saved = ckpt.state["fingerprint"]
        allowed = self.allow_drift
        where = f"checkpoint {ckpt.path.name}"
        if parent:
            allowed += tuple(k for k in saved["config_items"] if not k.startswith("model.")) + ("data", "global_batch_size")
            where = f"parent checkpoint {ckpt.path}"
        drifted = check_fingerprint(saved, self.fingerprint, self.cfg, where, allowed)
        self.check_tensors(ckpt.tensors, values)
        return drifted

    def check_state(self, state: Any) -> None:
        header = Fields(open=True, schema=Int(SCHEMA_VERSION, SCHEMA_VERSION), step=Int(0, MAX_STEP),
                        skip_list=Json(), world_size=Int(1, 1 << 20), engine=Str(64),
                        fingerprint=FINGERPRINT_SPEC, config=MapOf(Json()))
        validate(state, header, "state")
        missing = [name for name in self.parts if name not in state]
        extra = sorted(set(state) - set(HEADER) - set(self.parts))
        if missing or extra:
            field = f"state.{(missing or extra)[0]}"
            raise StateError(f"{field}: {'missing' if missing else 'not a part of this run'} (the parts are "
                             f"{', '.join(self.parts)})")
        for name, part in self.parts.items():
            validate(state[name], part.state_spec, f"state.{name}")
        train = state["train"]
        if state["step"] != train["step"] or state["skip_list"] != train["skip_list"]:
            raise StateError("state.step / state.skip_list: differ from state.train's copies")
        if len(state["rng"]) != state["world_size"]:
            raise StateError(f"state.rng: {len(state['rng'])} ranks' streams for world_size {state['world_size']}")

    def check_tensors(self, tensors: dict[str, dict[str, torch.Tensor]], values: bool = True) -> None:
        """Every tensor's name, shape and dtype against this model, before any is loaded: a
        broadcastable wrong shape would otherwise load silently."""
        if sorted(tensors) != sorted(TENSOR_GROUPS):
            raise CheckpointError(f"tensor files are {sorted(tensors)}, expected {list(TENSOR_GROUPS)}")
        shapes = self.engine.param_shapes
        check_table("model", tensors["model"], shapes, exact=True)
        try:
            optim = OptimState.from_tensors(tensors["optim"])
        except ValueError as exc:
            raise CheckpointError(f"optim: {exc}") from None
        for kind in STATE_KINDS:
            check_table(f"optim {kind}", getattr(optim, kind), shapes, exact=False)
        # AdamW's parameters have both moments, Muon's (optim.name=muon) a momentum; each has a step.
        if set(optim.exp_avg) != set(optim.exp_avg_sq) or set(optim.exp_avg) & set(optim.momentum) \
                or set(optim.exp_avg) | set(optim.momentum) != set(optim.step):
            raise CheckpointError("optim: exp_avg, exp_avg_sq, momentum and step name different parameters")
        for key, tensor in tensors["optim"].items():
            if key.startswith("step/") and (tensor.shape != (1,) or tensor.dtype != torch.float64):
                raise CheckpointError(f"optim {key}: shape {tuple(tensor.shape)} {tensor.dtype}, expected (1,) float64")
        for name, step in optim.step.items():
            if not 0 <= step <= MAX_STEP or step != int(step):
                raise CheckpointError(f"optim step/{name}: {step} is not a step count")
        if values:
            _check_values(tensors["model"], optim)

    # --- restore ----------------------------------------------------------------------------
    def restore(self, ckpt: Checkpoint) -> None:
        """Load weights, optimizer and every part from an accepted checkpoint, on every rank."""
        self.engine.load_full_state(ckpt.tensors["model"], OptimState.from_tensors(ckpt.tensors["optim"]))
        for name, part in self.parts.items():
            part.load_state_dict(ckpt.state[name])

    def latest(self, before_step: int = MAX_STEP) -> Checkpoint | None:
        """Rank 0 picks the newest valid, accepted checkpoint at or before `before_step`; every
        rank loads that same folder (hashed once, on rank 0)."""
        picked: list[Checkpoint] = []

        def pick() -> str | None:
            ckpt = self.store.latest_before(before_step, self.accept)
            picked.append(ckpt)
            return None if ckpt is None else str(ckpt.path)

        path = self.engine.decide(pick)
        if path is None:
            return None
        return picked[0] if picked else self.open(Path(path), verified=True)

    def open(self, path: Path, verified: bool = False, parent: bool = False) -> Checkpoint:
        """A folder named by the user or chosen by rank 0: verified (unless it just was), accepted."""
        try:
            ckpt = load_verified(path) if verified else load_checkpoint(path)
            self.accept(ckpt, parent)
        except (CheckpointError, StateError) as exc:
            raise CheckpointError(f"{path} cannot be used: {exc}") from None
        return ckpt

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
        ckpt = self.latest()
        if ckpt is not None:
            allowed = self.accept(ckpt, values=False)  # pure and cheap: again on every rank, for the event
            self.restore(ckpt)
            self.emit("resume", step=self.train.step, checkpoint=str(ckpt.path), drift=allowed)
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
        opened: list[Checkpoint] = []

        def open_parent() -> None:
            if not path.is_dir():
                raise ConfigError(f"run.init_from={path}: no such folder; name a checkpoint folder "
                                  f"(RUN_DIR/checkpoints/step-XXXXXXXX)")
            try:
                opened.append(self.open(path, parent=True))
            except CheckpointError as exc:
                raise ConfigError(f"run.init_from={path}: {exc}; name a checkpoint folder that verifies") from None

        self.engine.decide(open_parent)  # hashed on rank 0; refused there means refused on every rank
        parent_ckpt = opened[0] if opened else self.open(path, verified=True, parent=True)
        drifted = self.accept(parent_ckpt, parent=True, values=False)
        self.restore(parent_ckpt)
        train = self.train
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
