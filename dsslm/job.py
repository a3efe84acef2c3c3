"""One run's job: everything the loop's verbs share (`Job`), built by `setup` and brought to its
first step by `start` (resume, branch or start fresh). `train.py` holds the loop that uses it.

`setup` builds in the order things may fail and be taken down: the engine (and its process
group), run.dir's lock before anything is written there, the data verified, the loader and its
prefetch, the sinks, the checkpoint store; `cleanup` (an ExitStack) takes them down in reverse,
saves finished first.
"""
from __future__ import annotations

import contextlib
import dataclasses
import functools
import logging
import os
import socket
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch

from dsslm.ckpt.drift import RESUME_MUTABLE_KEYS
from dsslm.ckpt.lock import LockLost, RunLock
from dsslm.ckpt.resume import Checkpointer, RngStreams, Stateful
from dsslm.ckpt.store import CheckpointError, CheckpointStore
from dsslm.ckpt.train_state import NothingToResume, TrainState, epoch_order, fingerprint
from dsslm.clip import Clipper, build_clipper
from dsslm.config import Config, ConfigError, mix_of, to_dict
from dsslm.data import DataError, Loader, load_manifest, manifest_hash
from dsslm.data.bytecount import ByteCounter
from dsslm.data.corpus import default_data_dir
from dsslm.data.manifest import verify_tokenizer
from dsslm.data.prefetch import Prefetcher
from dsslm.data.stream import batch_size_at
from dsslm.data.tokenizer import load_tokenizer
from dsslm.data.verify import (cache_path, digest_problem, hash_shards, node_of, plan_hashing, share_of,
                               update_cache)
from dsslm.engine import Engine, build_engine
from dsslm.engine.compile_cache import kept_with_run
from dsslm.evals.loop import TaskEvals
from dsslm.exits import note_exit, process_started
from dsslm.hf.folder import HFWeights, apply_shape, hf_dir_of
from dsslm.model import build_model, count_params
from dsslm.optim import role_table
from dsslm.health.door import (CHECKPOINT, DOWNSTREAM, FORWARD_BACKWARD, Health, OutOfMemory, check_nodes, refuse_unfit,
                               fold_failures, out_of_memory_retry)
from dsslm.observe.audit import ResumeAudit, last_start, run_env
from dsslm.observe.console import warn_at_start
from dsslm.observe.goodput import job_end_line
from dsslm.observe.sinks import LogWriteError, Sinks
from dsslm.optim import older_muon, older_muon_note
from dsslm.recovery.faults import Drills
from dsslm.recovery.policy import SpikePolicy
from dsslm.recovery.rewind import Escalation
from dsslm.rng import seed_everything


@dataclass
class Job:
    """Everything the loop's verbs share for one run."""
    cfg: Config
    run_dir: Path
    engine: Engine
    loader: Loader
    feed: Prefetcher             # the loader's steps, the next one read in the background
    store: CheckpointStore
    checkpointer: Checkpointer   # save / restore over the table of stateful parts
    state: TrainState            # the table's "train" part: the loop mutates it in place
    spikes: SpikePolicy          # the one door to spike recovery (monitor, triage, rewinds, forensics)
    clipper: Clipper             # optim.clip_mode: the clip bound, and what it learns from applied steps
    drills: Drills
    sinks: Sinks
    byte_counter: ByteCounter    # bytes of text per validation target: the bits-per-byte denominator
    lock: RunLock                # rank 0 holds run.dir/LOCK; checked at every step boundary
    verified: dict | None         # what verify_data hashed: reported by start(), once nothing can refuse the run
    audit: ResumeAudit = dataclasses.field(default_factory=ResumeAudit.off)  # set by start() on a resume
    failure: BaseException | None = None  # what rank 0's last step-boundary check saw fail, until raised
    evals: TaskEvals = dataclasses.field(default_factory=TaskEvals.off)  # eval.tasks, read and checked by setup
    started: list = dataclasses.field(default_factory=list)  # [True] once start() began the job: its goodput is said
    began: float = 0.0           # when this job's process started (or, called in-process, its setup)
    health: Health = dataclasses.field(default_factory=Health)  # the one door to the watchdog and the straggler report
    roles: dict = dataclasses.field(default_factory=dict)  # each parameter role's count, rate and decay (optim.role_table)


def setup(cfg: Config, allow_drift: tuple[str, ...], cleanup: contextlib.ExitStack) -> Job:
    """Build what the loop needs; `cleanup` takes it down again in reverse, saves finished first."""
    began = process_started() or time.time()  # read at the call: catch_early sets it in `python -m`
    data_dir = Path(cfg.data.dir) if cfg.data.dir else default_data_dir()
    manifest = load_manifest(data_dir, verify=False)  # sizes; the hashes are checked below
    verify_tokenizer(data_dir, manifest)  # before anything is built or written: eos_id splits documents
    if hf_dir_of(cfg.run.init_from):  # the model's shape is the Hugging Face folder's
        apply_shape(cfg, hf_dir_of(cfg.run.init_from), data_dir, manifest)
    cfg.model.vocab_size = cfg.model.vocab_size or manifest["tokenizer"]["vocab_size"]
    data_vocab = manifest["tokenizer"]["vocab_size"]
    if cfg.model.vocab_size < data_vocab:  # an embedding lookup past its table, on the first step
        where = f"run.init_from={cfg.run.init_from}'s vocab_size" if hf_dir_of(cfg.run.init_from) else "model.vocab_size"
        raise ConfigError(f"{where}={cfg.model.vocab_size} is below the {data_vocab} token ids of {data_dir}'s "
                          f"tokenizer; drop model.vocab_size (it follows the data) or set it >= {data_vocab}")
    data_eos = manifest["tokenizer"]["eos_id"]
    if cfg.model.document_mask and cfg.model.eos_id < 0:  # documents end with the tokenizer's EOS
        cfg.model.eos_id = data_eos
    if cfg.model.eos_id >= cfg.model.vocab_size:  # config checks it only against a vocab_size set there
        raise ConfigError(f"model.eos_id={cfg.model.eos_id} is not a token id of {data_dir}'s tokenizer "
                          f"({cfg.model.vocab_size} ids): no document would ever end; drop model.eos_id "
                          f"(it follows the data's, {data_eos})")
    if cfg.model.document_mask and cfg.model.eos_id != data_eos:  # prepare ends documents with data_eos
        raise ConfigError(f"model.eos_id={cfg.model.eos_id} but {data_dir}'s documents end with its tokenizer's "
                          f"EOS, id {data_eos}: the mask would split them elsewhere; drop model.eos_id")
    retry = out_of_memory_retry(cfg, Path(cfg.run.dir))  # after an out-of-memory error: half the micro-batch
    if retry is not None:
        print(f"dsslm: {retry}", flush=True)
    with torch.device("meta"):  # its size and its roles, from its shapes: nothing allocated
        shapes = build_model(cfg.model)
        size, roles = count_params(shapes), role_table(shapes, cfg.optim)
    on_gpu = cfg.train.device == "cuda" or (cfg.train.device == "auto" and torch.cuda.is_available())
    refuse_unfit(cfg, size, "cuda" if on_gpu else "cpu", int(os.environ.get("WORLD_SIZE", "1") or 1))
    seed_everything(cfg.run.seed)  # identical initial weights on every rank
    engine = build_engine(cfg, build_model(cfg.model))
    cleanup.callback(engine.close)
    run_dir, state = Path(cfg.run.dir), TrainState()
    lock = RunLock(run_dir, cfg.run.lock_stale_s)
    cleanup.callback(lock.release)  # first: a stop signal once LOCK is linked (in decide's broadcast) removes it
    takeover = engine.decide(lock.acquire)  # before anything is written there; exit 2 naming a live holder
    cleanup.enter_context(kept_with_run(cfg, engine.world_size, engine.device))  # train.compile's caches, with the run
    failures = engine.decide(lambda: fold_failures(run_dir))  # the crash-loop count, under the lock
    nodes = check_nodes(cfg, engine, data_dir, manifest) if cfg.run.preflight else None  # a bad node: exit 76, now
    verified = verify_data(cfg, engine, data_dir, manifest) if cfg.data.verify else None
    health = Health.start(cfg, engine, run_dir, lock, failures)  # after the hashing: it has its own wait
    cleanup.callback(health.close)  # after finish_saves: the last save is watched too
    global_batch = cfg.train.micro_batch_size * cfg.train.grad_accum * engine.world_size
    loader = Loader(data_dir, cfg.model.seq_len, cfg.run.seed, manifest=manifest, mix=mix_of(cfg.data))
    feed = Prefetcher(loader, engine.rank, engine.world_size, cfg.train.grad_accum,
                      batch_schedule(cfg, engine.world_size), pin_memory=engine.device.type == "cuda",
                      enabled=cfg.data.prefetch)
    cleanup.callback(feed.close)
    sinks = Sinks(run_dir, engine.is_main, cfg.train.total_steps, cfg.run.tensorboard, cfg.run.alert_command,
                  cfg.observe, to_dict(cfg))
    cleanup.callback(sinks.close)
    # After the saves and the exit events, before the sinks close: this job's and the run's goodput,
    # once the job has started (`started`): a refused start writes nothing and ends on its one line.
    started: list = []
    cleanup.callback(lambda: engine.is_main and started and (line := job_end_line(run_dir))
                     and sinks.say(line, logging.INFO))
    # No event for a refusal (its own stderr line), an escalation (its own event) or a lost lock (not ours to
    # write); a failed write is recorded, and said once, by main's last line.
    cleanup.push(note_exit(sinks.emit, lambda: state.step, said=(CheckpointError, LogWriteError),
                           quiet=(ConfigError, DataError, Escalation, LockLost, NothingToResume, OutOfMemory)))
    store = CheckpointStore(run_dir, keep_last=cfg.ckpt.keep_last, keep_every=cfg.ckpt.keep_every,
                            on_event=sinks.emit if engine.is_main else None, fence=lambda: lock.check(fresh=True))
    health.learn_writes(store)
    cleanup.push(finish_saves(store, lambda: health.wait_write(state.step, store, "before leaving")))
    report_claim(sinks, takeover, engine.decide(store.remove_leftovers))
    drills = Drills(cfg.faults, run_dir, engine.rank, engine.is_main, cfg.run.seed, cfg.model.vocab_size,
                    global_batch, loader)
    drills.arm(store)
    clipper = build_clipper(cfg.optim)
    spikes = SpikePolicy(cfg, engine, run_dir, sinks.emit, loader, {**manifest["tokenizer"], "data_dir": str(data_dir)})
    spikes.forensics.read_chunks = drills.read_chunks  # a document's other chunks, as training would read them
    parts: dict[str, Stateful] = {"train": state, **spikes.parts(), "rng": RngStreams(engine, cfg.run.seed, state)}
    if engine.scaler is not None:
        parts["scaler"] = engine.scaler
    if cfg.optim.clip_mode == "zclip":
        parts["clip"] = clipper
    prints = fingerprint(cfg, manifest_hash(manifest), manifest["tokenizer"]["sha256"], global_batch)
    checkpointer = Checkpointer(engine, store, parts, prints, cfg, sinks.emit, allow_drift)
    job = Job(cfg, run_dir, engine, loader, feed, store, checkpointer, state, spikes,
              clipper, drills, sinks, ByteCounter(data_dir, manifest), lock, verified,
              evals=TaskEvals.for_job(cfg, engine, sinks, lambda: load_tokenizer(data_dir, manifest)),
              health=health, started=started, began=began, roles=roles)
    # An escalating triage's base, held only in memory, is saved before exit 3.
    spikes.bind(checkpointer, global_batch, save_base=lambda: save(job, sync=True))
    health.watch_stragglers(cfg, engine, sinks, run_dir, nodes, feed)  # faults.slow_*: the straggler drill
    cleanup.callback(health.stragglers.close)  # its stall sampler's thread
    job.evals.watch = lambda step, forward: health.scoring(step, DOWNSTREAM, forward, f"downstream evals at step {step}")
    spikes.busy = lambda step: health.during(step, FORWARD_BACKWARD)  # forensics: a forward/backward's kind of work
    return job


def start(job: Job) -> str:
    """Resume, branch or start fresh; fold in the run-level skip list; say so. Returns how it
    started ("resume", "import", "branch", "fresh"), or "finished": a resumed run with nothing
    left to train, which says so and is not started again."""
    cfg, engine = job.cfg, job.engine
    job.health.starting(job.state.step)  # the watchdog allows observe.watchdog.first_s until the first step
    hf_dir = hf_dir_of(cfg.run.init_from)
    how = job.checkpointer.resume_or_init(HFWeights(hf_dir, cfg.model, engine.param_shapes) if hf_dir else None)
    if how == "resume" and (hang := job.health.last_hang()) is not None:
        job.sinks.say(hang)  # rank 0's line, beside the resume's
    job.state.shuffle = epoch_order(cfg, how, job.state)
    job.loader.set_shuffle(job.state.shuffle)  # before the first read: the prefetcher starts with step 1
    if how == "resume" and job.state.step >= cfg.train.total_steps:
        if job.verified is not None:  # what was checked is still worth recording
            job.sinks.emit("data_verified", **job.verified)
        job.sinks.emit("finished", step=job.state.step, total_steps=cfg.train.total_steps)
        return "finished"
    job.spikes.resume(job.state)  # run.dir/skip_list.json: what any earlier job learnt
    # The mutable keys that schedule the same math another way: a resume may change them, and the
    # recomputed steps are then equal within rounding, not to the bit (the audit's tolerance).
    schedule = {"optim.impl": engine.optim_impl, "train.compile": cfg.train.compile,
                "train.activation_checkpointing": cfg.train.activation_checkpointing,
                "train.activation_checkpointing_every": cfg.train.activation_checkpointing_every,
                "train.tf32": cfg.train.tf32, "optim.muon_ns_dtype": cfg.optim.muon_ns_dtype}
    env = run_env(engine.device.type, engine.world_size, engine.name, cfg.train.micro_batch_size,
                  cfg.train.grad_accum, torch.__version__, torch.get_num_threads(), schedule)
    if how == "resume" and engine.is_main:  # read what the interrupted job recorded, before we record anything
        recorded = last_start(job.run_dir / "events.jsonl")
        if cfg.optim.name == "muon" and older_muon(recorded.get("config")):
            print(older_muon_note(cfg.optim, job.state.step), flush=True)
        job.audit = ResumeAudit.after_resume(job.run_dir, job.state.step, env, cfg.observe.audit_tol,
                                             cfg.train.total_steps, job.sinks.emit, to_dict(cfg), RESUME_MUTABLE_KEYS,
                                             start=recorded)
        job.sinks.listeners.append(job.audit.observe)  # the triage decisions must come again too
    job.spikes.protect_start(job.state, lambda: save(job))  # a spike at step 7 can rewind
    job.sinks.emit("start", step=job.state.step, world_size=engine.world_size, engine=engine.name,
                   config_hash=job.checkpointer.fingerprint["config_hash"], n_params=engine.n_params,
                   optim_impl=engine.optim_impl, clip=cfg.optim.clip, env=env, config=to_dict(cfg),
                   process_started=job.began, shuffle=job.state.shuffle, roles=job.roles)
    if job.verified is not None:
        job.sinks.emit("data_verified", **job.verified)
    job.started.append(True)
    if engine.is_main:
        tokens_per_step = cfg.train.micro_batch_size * cfg.train.grad_accum * engine.world_size * cfg.model.seq_len
        print(f"dsslm: {engine.n_params:,} parameters, {engine.name} on {engine.world_size} "
              f"rank(s), {tokens_per_step:,} tokens/step, starting at step {job.state.step} "
              f"(sequence {job.state.next_sequence})", flush=True)
        warn_at_start(cfg, engine.device.type, engine.n_params, tokens_per_step, torch.get_num_threads(),
                      job.loader.n_chunks)
    job.evals.at_start(job.state.step)  # the starting weights' downstream accuracy (eval.at_start)
    job.health.first_step(job.state.step + 1)
    return how


def save(job: Job, sync: bool = False) -> None:
    """Keep what a rewind would need, then checkpoint (every rank gathers, rank 0 writes).
    Escalation instead of a checkpoint whose skip list a resume would refuse (too many entries)."""
    # The write in flight is waited for first, judged by the writer's own times and progress;
    # the snapshot after it is `checkpoint`.
    job.health.wait_write(job.state.step, job.store, f"waited for by the save of step {job.state.step}")
    job.health.phase(job.state.step, CHECKPOINT)
    pins = job.spikes.before_save(job.state, job.store.valid_steps)
    if job.engine.is_main:
        job.store.pin(pins)
    job.checkpointer.save(sync=sync, async_save=job.cfg.ckpt.async_save,
                          waiting=lambda: job.health.wait_write(job.state.step, job.store, "a synchronous save"))


def report_claim(sinks: Sinks, takeover: dict | None, removed: list[str]) -> None:
    """Say what taking run.dir over cleared: a dead holder's lock, and its half-written saves."""
    if takeover is not None:
        sinks.emit("lock_takeover", **takeover)
    if removed:
        sinks.emit("leftovers_removed", folders=removed, reason="temp folders of saves a kill cut short")


def finish_saves(store: CheckpointStore, waiting: Callable[[], None]):
    """An ExitStack exit callback: every way out waits for the save in flight, so it is published,
    not lost with the process (`waiting` tells the watchdog first). Its own failure is the error
    unless another one is on its way."""
    def on_exit(exc_type, exc, tb) -> bool:
        try:
            waiting()
            store.close()
        except CheckpointError as err:
            if exc_type is None:
                raise
            print(f"dsslm: also: {err}", file=sys.stderr, flush=True)
        return False
    return on_exit


def verify_data(cfg: Config, engine: Engine, data_dir: Path, manifest: dict) -> dict:
    """Hash the shards their cached verification cannot vouch for (all of them for
    data.verify=full), split over each node's ranks and their threads. Each node checks its own
    copy of DATA_DIR (a node-local copy can differ from rank 0's): the node's first rank plans from
    its own cache, and writes it. Every rank reaches the same verdict (a DataError on every rank)."""
    started = time.perf_counter()
    cache = cache_path(data_dir, Path(cfg.run.dir))
    hosts = engine.all_gather(socket.gethostname())
    node = node_of(hosts, engine.rank)
    plan = None
    if engine.rank == node[0]:
        try:
            plan = plan_hashing(data_dir, manifest, cache, full=cfg.data.verify == "full")
        except DataError as exc:
            plan = f"on {hosts[engine.rank]}: {exc}"
    plans = engine.all_gather(plan)
    if any(isinstance(p, str) for p in plans):
        raise DataError(next(p for p in plans if isinstance(p, str)))
    plan = plans[node[0]]
    mine = share_of(plan["hash"], node.index(engine.rank), len(node))
    hashed_bytes = sum(size for _, size in plan["hash"])
    every_node = sum(size for p in plans if p is not None for _, size in p["hash"])  # the node leaders' plans
    parts = engine.gather_long(lambda progress: hash_shards(data_dir, mine, progress, manifest["dtype"]),
                               "hashing the data shards", total_units=every_node)
    found = {path: digest for r in node for path, digest in parts[r].items()}
    if engine.rank == node[0] and found:
        try:
            update_cache(cache, manifest, found)
        except OSError as exc:
            print(f"dsslm: cannot write {cache} ({exc}); the next start hashes these shards again", file=sys.stderr)
    problems = [p for p in engine.all_gather(digest_problem(data_dir, manifest, found, hosts[engine.rank])) if p]
    if problems:
        raise DataError(problems[0])
    summary = {"hashed_shards": len(found), "hashed_per_rank": [len(part) for part in parts],
               "hashed_bytes": hashed_bytes, "cached_shards": plan["cached"],
               "cached_bytes": plan["cached_bytes"], "full": cfg.data.verify == "full", "cache": str(cache),
               "nodes": len(set(hosts)), "seconds": round(time.perf_counter() - started, 3)}
    if engine.is_main:
        print(f"dsslm: data verified: hashed {len(found)} shards ({hashed_bytes / 1e9:.2f} GB) in "
              f"{summary['seconds']:.1f} s; {plan['cached']} unchanged since their cached verification", flush=True)
    return summary


def batch_schedule(cfg: Config, world_size: int):
    """The global batch in sequences of the step starting at a position: the full one, or less
    while train.batch_ramp ramps."""
    t = cfg.train
    return functools.partial(batch_size_at, full=t.micro_batch_size * t.grad_accum * world_size,
                             granule=t.grad_accum * world_size, ramp_start=t.batch_ramp.start,
                             ramp_tokens=t.batch_ramp.tokens, seq_len=cfg.model.seq_len)
