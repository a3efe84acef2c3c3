"""save / restore / resume_or_init / branch, over one table of stateful parts.

What goes into a checkpoint and what comes out of it is one table, name -> object with
`state_dict()` / `load_state_dict()` / `state_spec`, built once by the loop:

    parts = {"train": TrainState, "monitor": SpikeMonitor, "rng": RngStreams,
             "scaler": LossScaler (fp16 only)}

A save writes `state.json` = {"schema": 2, "step", "skip_list", <every part's state_dict()>,
"world_size", "engine", "fingerprint", "config"} next to the engine's full tensors (weights by
parameter name, and the AdamW state in `engine.base.OptimState`'s layout); a restore hands every
part its own entry back. `step` and `skip_list` at the top are the contract's copies of the train
part's, for scripts. Before anything is loaded, a checkpoint is accepted (`accept.py`: the table,
the model, consistency); one that fails is passed over like a hash mismatch. Every engine hands
over the same full tensors, so a ZeRO checkpoint resumes under FSDP, DDP or one process.
"""
from __future__ import annotations

import json
import os
import stat
from pathlib import Path
from typing import Any, Callable, Protocol

import torch

from dsslm.ckpt.accept import (HEADER, SCHEMA_VERSION, Acceptance, NotAccepted, check_table, kept_per_rank,
                               upgrade_state)
from dsslm.ckpt.format import STATE_FILE, Checkpoint, CheckpointError, invalid_reason, read_manifest
from dsslm.ckpt.shards import check_headers, open_folder, read_rank_file, split_files, verify_share
from dsslm.fields import MAX_STEP, Fields, Int, ListOf, Json, Spec, StateError, validate
from dsslm.ckpt.drift import describe
from dsslm.ckpt.store import CheckpointStore
from dsslm.ckpt.train_state import NothingToResume, TrainState
from dsslm.config import Config, ConfigError, to_dict
from dsslm.engine.base import Engine, OptimState
from dsslm.rng import check_rng_state, rng_state, seed_everything, set_rng_state


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


class Checkpointer(Acceptance):
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

    def save(self, sync: bool = False, async_save: bool = True, waiting: Callable[[], None] = lambda: None) -> None:
        """Snapshot on every rank; gathered: sharded engines gather, RNG is gathered, rank 0
        writes; sharded: every rank writes its own shard and random streams, rank 0 the rest.
        `waiting`: called once the snapshot is taken, before a synchronous save waits for its
        write (the watchdog judges that wait by the writer's times, not the snapshot's)."""
        # The previous save's failure reaches every rank here. Its writer can fail after the last
        # step-boundary check (a write longer than ckpt.every steps; ckpt.every=1), and the next
        # save then raised it on rank 0 alone, inside save_async's own wait: the other ranks went
        # on into the next step's collectives and waited there for the collective timeout.
        self.engine.decide(self.store.wait)
        if self.format == "sharded":
            self._save_sharded(sync or not async_save, waiting)
            return
        model_sd, optim = self.engine.full_state()
        parts = {name: part.state_dict() for name, part in self.parts.items()}  # collectives inside
        if not self.engine.is_main:
            if sync or not async_save:
                waiting()
                self.engine.decide(self.store.wait)
            return
        tensors = {"model": model_sd, "optim": optim.to_tensors()}
        self.store.save_async(self.train.step, tensors, self._state(parts))
        if sync or not async_save:
            waiting()
            self.engine.decide(self.store.wait)  # a failed write reaches every rank, not rank 0 alone

    def _state(self, parts: dict) -> dict:
        return {"schema": SCHEMA_VERSION, "step": self.train.step, "skip_list": self.train.skip_list,
                **parts, "world_size": self.engine.world_size, "engine": self.engine.name,
                "fingerprint": self.fingerprint, "config": self.config}

    def _save_sharded(self, sync: bool, waiting: Callable[[], None]) -> None:
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
            waiting()
            if not engine.is_main:
                self.store.wait()  # this rank's files; its failures are rank 0's to raise
            engine.decide(self.store.wait)  # rank 0 waits for every rank: published, or failed everywhere


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
                self.engine.decide(lambda: self.store.refuse(path, reason))  # noqa: B023

    def _nothing_lost(self) -> None:
        """Rank 0, when no checkpoint can be resumed: NothingToResume where run.dir's logs show a run
        past step 0, unless run.restart_from_scratch (then said in an event). A start at step 0 would
        append a second history to the first's logs, whether the checkpoints were damaged, purged with
        the scratch space, deleted, or never published (a job killed before its first save)."""
        recorded = recorded_step(self.store.run_dir)
        if recorded is None:
            return
        step, source = recorded
        damaged = self.store.not_resumable()
        if self.cfg.run.restart_from_scratch:
            self.emit("restart_from_scratch", step=0, recorded_step=step, not_resumable=damaged)
            return
        ckpt_dir = self.store.ckpt_dir
        if damaged:
            names = ", ".join(damaged[:3]) + (f" and {len(damaged) - 3} more" if len(damaged) > 3 else "")
            why = f"not resumable, kept: {names}; the passed_over events in events.jsonl say why"
        elif ckpt_dir.is_dir():
            why = "no step-XXXXXXXX folder in it: deleted, or the run stopped before its first save"
        else:
            why = "it is missing: deleted or purged, or the run stopped before its first save"
        raise NothingToResume(f"{self.store.run_dir} was trained to step {step} ({self.store.run_dir / source} "
                              f"says so) but {ckpt_dir} holds no checkpoint that can be resumed ({why}); to start "
                              f"over on purpose, use another run.dir, or add run.restart_from_scratch=true to train "
                              f"this one again from step 0")

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
