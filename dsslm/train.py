"""`python -m dsslm.train [--config FILE.yaml] [--allow-drift KEY] [dotted.key=value ...]`

The same entry point under plain python, torchrun, accelerate launch and srun. Exit codes:
0 finished (or saved on SIGTERM/SIGUSR1), 2 bad input or config, 3 escalated to a human.

`step` everywhere is the number of optimizer steps completed: the record of the step whose
update was just applied carries the same number as the checkpoint taken right after it.
"""
from __future__ import annotations

import argparse
import dataclasses
import functools
import math
import signal
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from dsslm.ckpt.resume import Checkpointer, RngStreams, Stateful
from dsslm.ckpt.store import CheckpointStore
from dsslm.ckpt.train_state import TrainState, fingerprint
from dsslm.config import Config, ConfigError, load, to_dict
from dsslm.data import DataError, Loader, load_manifest, manifest_hash
from dsslm.data.corpus import default_data_dir
from dsslm.data.prefetch import Prefetcher
from dsslm.data.stream import StepSlice, batch_size_at
from dsslm.data.verify import cache_path, check_digests, hash_shards, plan_hashing, share_of, update_cache
from dsslm.engine import Engine, build_engine
from dsslm.loss import accumulate, token_losses
from dsslm.model import build_model
from dsslm.observe.diagnostics import Diagnostics
from dsslm.observe.sinks import Sinks
from dsslm.optim import lr_at
from dsslm.precision import autocast
from dsslm.recovery.faults import DrillAbort, Drills
from dsslm.recovery.monitor import SpikeMonitor, Verdict
from dsslm.recovery.rewind import Escalation, Rewinder, recovery_pins
from dsslm.rng import seed_everything

EXIT_OK, EXIT_BAD_INPUT, EXIT_ESCALATED = 0, 2, 3


class StopFlag:
    """SIGTERM / SIGUSR1 (Slurm preemption, time limit) ask for a save at the next step boundary."""

    def __init__(self) -> None:
        self.requested = False
        for sig in (signal.SIGTERM, signal.SIGUSR1):
            signal.signal(sig, self._handle)

    def _handle(self, signum: int, frame: object) -> None:
        self.requested = True


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
    monitor: SpikeMonitor
    rewinder: Rewinder
    drills: Drills
    sinks: Sinks


@dataclass
class StepRecord:
    """One line of metrics.jsonl: the step whose update was just applied (or refused)."""
    step: int
    loss: float
    gnorm: float                 # global, before clipping
    lr: float
    lr_scale: float
    verdict: str                 # ok | skip_step | rewind
    data_position: int           # the global sequence index of the step's first sequence
    batch_sequences: int         # the step's global batch (smaller while train.batch_ramp ramps)
    batch_tokens: int            # real target tokens in this step
    reason: str = ""
    tokens: int = 0              # tokens_seen after this step: the running total (the contract's name)
    step_time_s: float = 0.0
    tokens_per_s: float = 0.0
    clip_frac: float = 0.0
    data_wait_s: float = 0.0     # time the step waited for its batch (0 when the prefetch was ready)

    def to_json(self) -> dict:
        record = dataclasses.asdict(self)
        if not self.reason:
            del record["reason"]
        return record


def setup(cfg: Config, allow_drift: tuple[str, ...]) -> Job:
    data_dir = Path(cfg.data.dir) if cfg.data.dir else default_data_dir()
    manifest = load_manifest(data_dir, verify=False)  # sizes; the hashes are checked below
    cfg.model.vocab_size = cfg.model.vocab_size or manifest["tokenizer"]["vocab_size"]
    seed_everything(cfg.run.seed)  # identical initial weights on every rank
    engine = build_engine(cfg, build_model(cfg.model))
    verified = verify_data(cfg, engine, data_dir, manifest) if cfg.data.verify else None
    global_batch = cfg.train.micro_batch_size * cfg.train.grad_accum * engine.world_size
    loader = Loader(data_dir, cfg.model.seq_len, cfg.run.seed, manifest=manifest, mix=cfg.data.mix)
    feed = Prefetcher(loader, engine.rank, engine.world_size, cfg.train.grad_accum,
                      batch_schedule(cfg, engine.world_size), pin_memory=engine.device.type == "cuda",
                      enabled=cfg.data.prefetch)
    run_dir = Path(cfg.run.dir)
    sinks = Sinks(run_dir, engine.is_main, cfg.train.total_steps, cfg.run.tensorboard, cfg.run.alert_command,
                  cfg.observe, to_dict(cfg))
    if verified is not None:
        sinks.emit("data_verified", **verified)
    store = CheckpointStore(run_dir, keep_last=cfg.ckpt.keep_last, keep_every=cfg.ckpt.keep_every,
                            on_event=sinks.emit if engine.is_main else None)
    drills = Drills(cfg.faults, run_dir, engine.rank, engine.is_main, cfg.run.seed, cfg.model.vocab_size,
                    global_batch)
    drills.arm(store)
    state, monitor = TrainState(), SpikeMonitor(cfg.monitor)
    parts: dict[str, Stateful] = {"train": state, "monitor": monitor, "rng": RngStreams(engine, cfg.run.seed, state)}
    if engine.scaler is not None:
        parts["scaler"] = engine.scaler
    prints = fingerprint(cfg, manifest_hash(manifest), manifest["tokenizer"]["sha256"], global_batch)
    checkpointer = Checkpointer(engine, store, parts, prints, cfg, sinks.emit, allow_drift)
    rewinder = Rewinder(cfg, engine, checkpointer, monitor, global_batch, run_dir, sinks.emit)
    return Job(cfg, run_dir, engine, loader, feed, store, checkpointer, state, monitor, rewinder, drills, sinks)


def verify_data(cfg: Config, engine: Engine, data_dir: Path, manifest: dict) -> dict:
    """Hash the shards their cached verification cannot vouch for (all of them for
    data.verify=full), split over the ranks and each rank's threads. Every rank reaches the same
    verdict (a DataError on every rank); rank 0 updates the cache."""
    started = time.perf_counter()
    cache = cache_path(data_dir, Path(cfg.run.dir))
    plan = engine.decide(lambda: plan_hashing(data_dir, manifest, cache, full=cfg.data.verify == "full"))
    mine = share_of(plan["hash"], engine.rank, engine.world_size)
    hashed_bytes = sum(size for _, size in plan["hash"])
    parts = engine.gather_long(lambda progress: hash_shards(data_dir, mine, progress), "hashing the data shards",
                               total_units=hashed_bytes)
    found = {path: digest for part in parts for path, digest in part.items()}
    if engine.is_main and found:
        try:
            update_cache(cache, manifest, found)
        except OSError as exc:
            print(f"dsslm: cannot write {cache} ({exc}); the next start hashes these shards again", file=sys.stderr)
    check_digests(data_dir, manifest, found)
    summary = {"hashed_shards": len(found), "hashed_per_rank": [len(part) for part in parts],
               "hashed_bytes": hashed_bytes, "cached_shards": plan["cached"],
               "cached_bytes": plan["cached_bytes"], "full": cfg.data.verify == "full", "cache": str(cache),
               "seconds": round(time.perf_counter() - started, 3)}
    if engine.is_main:
        print(f"dsslm: data verified: hashed {len(found)} shards ({hashed_bytes / 1e9:.2f} GB) in "
              f"{summary['seconds']:.1f} s; {plan['cached']} unchanged since their cached verification", flush=True)
    return summary


def judge(job: Job, step: int, loss: float, gnorm: float) -> tuple[Verdict, str]:
    """One verdict (and why) for every rank: an fp16 overflow is the scaler's skip; spikes are
    rank 0's call, followed by all."""
    scaler = job.engine.scaler
    if scaler is not None and scaler.update(gnorm) and math.isfinite(loss):
        return Verdict.SKIP, f"fp16_overflow (loss scale now {scaler.scale:g})"
    if not job.cfg.monitor.enabled:
        return Verdict.OK, ""
    verdict, reason = job.engine.decide(lambda: (job.monitor.check(step, loss, gnorm), job.monitor.last_reason))
    return verdict, reason if verdict is not Verdict.OK else ""


@torch.no_grad()
def evaluate(job: Job) -> dict[str, float]:
    """Mean loss per real token on each domain's held-out split (every rank runs every batch,
    so sharded engines see matching collectives)."""
    job.engine.train_mode(False)
    out = {}
    for domain in job.loader.domains:
        ce, tokens = 0.0, 0
        for inputs, targets in job.loader.val_batches(domain, job.cfg.run.val_batches,
                                                      job.cfg.train.micro_batch_size):
            with autocast(job.cfg.train.precision, job.engine.device):
                logits = job.engine.forward(inputs.to(job.engine.device))
            ce += float(token_losses(logits, targets.to(job.engine.device))[0])
            tokens += int((targets != -100).sum())
        if tokens:
            out[domain] = ce / tokens
    job.engine.train_mode(True)
    return out


def batch_schedule(cfg: Config, world_size: int):
    """The global batch in sequences of the step starting at a position: the full one, or less
    while train.batch_ramp ramps."""
    t = cfg.train
    return functools.partial(batch_size_at, full=t.micro_batch_size * t.grad_accum * world_size,
                             granule=t.grad_accum * world_size, ramp_start=t.batch_ramp.start,
                             ramp_tokens=t.batch_ramp.tokens, seq_len=cfg.model.seq_len)


def train_step(job: Job, stop: StopFlag) -> tuple[Verdict, StepRecord, StepSlice, bool]:
    """Forward, backward and the verdict for the step that makes `state.step + 1`."""
    cfg, engine, state = job.cfg, job.engine, job.state
    step = state.step + 1
    lr = lr_at(state.step, cfg) * state.lr_scale
    fed, batches = job.feed.step(state.next_sequence, state.skip_list)  # read ahead during the last step
    job.rewinder.note(step, fed.first, fed.end)
    batches = job.drills.poison(batches, fed.indices)
    result = accumulate(engine, batches, cfg.train.precision, cfg.train.z_loss, cfg.optim.clip, stop.requested,
                        job.drills.loss_multiplier(step))
    verdict, reason = judge(job, step, result.loss, result.gnorm)
    if verdict is Verdict.OK:
        engine.step(lr)
    else:
        engine.skip_step()  # a rewind drops this step's gradients too, or they leak into the next
    record = StepRecord(step=step, loss=result.loss, gnorm=result.gnorm, lr=lr, lr_scale=state.lr_scale,
                        verdict=verdict.value, data_position=fed.first, batch_sequences=fed.batch_size,
                        batch_tokens=result.batch_tokens, reason=reason, data_wait_s=job.feed.wait_s)
    return verdict, record, fed, result.stop_requested


def train(cfg: Config, allow_drift: tuple[str, ...] = ()) -> int:
    # First thing: a preemption signal during setup or resume must not kill the process.
    stop = StopFlag()
    job = setup(cfg, allow_drift)
    try:
        return run_loop(job, stop)
    except DrillAbort:
        job.store.wait()  # an in-process drill models a kill between saves, not a torn write
        raise
    finally:
        job.feed.close()
        job.sinks.close()
        job.engine.close()


def start(job: Job) -> None:
    """Resume, branch or start fresh; fold in the run-level skip list; say so."""
    cfg, engine = job.cfg, job.engine
    job.checkpointer.resume_or_init()
    job.rewinder.merge_run_file(job.state)
    job.sinks.emit("start", step=job.state.step, world_size=engine.world_size, engine=engine.name,
                   config_hash=job.checkpointer.fingerprint["config_hash"], n_params=engine.n_params,
                   clip=cfg.optim.clip, config=to_dict(cfg))
    if engine.is_main:
        tokens_per_step = cfg.train.micro_batch_size * cfg.train.grad_accum * engine.world_size * cfg.model.seq_len
        print(f"dsslm: {engine.n_params:,} parameters, {engine.name} on {engine.world_size} "
              f"rank(s), {tokens_per_step:,} tokens/step, starting at step {job.state.step} "
              f"(sequence {job.state.next_sequence})", flush=True)


def run_loop(job: Job, stop: StopFlag) -> int:
    cfg, sinks, state = job.cfg, job.sinks, job.state
    start(job)
    diagnostics = Diagnostics(cfg, job.engine, sinks, job.loader)
    first_step = state.step
    while state.step < cfg.train.total_steps:
        job.drills.maybe_crash(state.step)
        before = diagnostics.snapshot(state.step)  # weights before the update, on measured steps only
        started = time.perf_counter()
        verdict, record, fed, stop_requested = train_step(job, stop)
        if verdict is Verdict.REWIND:
            sinks.log_step(diagnostics.observe(timed(record, started, state), before))
            job.rewinder.rewind(state, record.step)
            continue
        account(job, verdict, record, fed)
        if state.step == first_step + 1:
            report_memory(job)  # after one step: AdamW allocates its moments lazily
        sinks.log_step(diagnostics.observe(timed(record, started, state), before))
        if cfg.run.val_every and state.step % cfg.run.val_every == 0:
            val_loss = evaluate(job)
            sinks.log_val({"step": state.step, "val_loss": val_loss, "domain_tokens": dict(state.domain_tokens)})
            diagnostics.check_val(state.step, val_loss)
        if stop_requested:
            # Preemption: save where we are, exit 0; the requeued job resumes from here.
            save(job, sync=True)
            sinks.emit("preempt_save", step=state.step)
            return EXIT_OK
        if state.step % cfg.ckpt.every == 0 or state.step == cfg.train.total_steps:
            save(job)
        job.store.check()
    job.store.wait()
    sinks.emit("end", step=state.step, tokens=state.tokens_seen, skipped_steps=state.skipped_steps,
               domain_tokens=state.domain_tokens, prefetch={"hits": job.feed.hits, "misses": job.feed.misses})
    return EXIT_OK


def save(job: Job, sync: bool = False) -> None:
    """Keep what a rewind would need, then checkpoint (every rank gathers, rank 0 writes)."""
    if job.engine.is_main:
        job.store.pin(recovery_pins(job.state.step, job.store.valid_steps(), job.cfg))
    job.checkpointer.save(sync=sync, async_save=job.cfg.ckpt.async_save)


def report_memory(job: Job) -> None:
    """Bytes of parameters, gradients and optimizer state on every rank, as measured."""
    per_rank = job.engine.all_gather(job.engine.memory_report())
    job.sinks.emit("memory", step=job.state.step, per_rank=per_rank)
    if job.engine.is_main:
        mib = {k: f"{v / 2**20:.1f}" for k, v in per_rank[0].items()}
        print(f"dsslm: rank 0 holds (MiB) {mib}; all ranks in events.jsonl", flush=True)


def account(job: Job, verdict: Verdict, record: StepRecord, fed: StepSlice) -> None:
    """A step was applied or skipped: either way its data is consumed (a skipped batch is not replayed)."""
    state = job.state
    count_domains(job, fed)
    state.step += 1
    state.next_sequence = fed.end
    state.tokens_seen += record.batch_tokens
    state.clipped_steps += int(record.gnorm > job.cfg.optim.clip)
    if verdict is Verdict.SKIP:
        state.skipped_steps += 1
        job.sinks.emit("skip", step=state.step, loss=record.loss, gnorm=record.gnorm,
                       data_position=record.data_position, reason=record.reason)


def count_domains(job: Job, fed: StepSlice) -> None:
    """Add the step's tokens per domain; a `domain_epoch` event when a domain starts another pass
    over its chunks (under data.mix each domain repeats on its own schedule)."""
    state, loader = job.state, job.loader
    if state.domain_tokens is None:  # restored from a checkpoint that predates the count
        state.domain_tokens = loader.domain_tokens_before(state.next_sequence, state.skip_list)
    for domain, tokens in fed.domain_tokens.items():
        state.domain_tokens[domain] = state.domain_tokens.get(domain, 0) + tokens
    before, after = loader.epochs_before(fed.first), loader.epochs_before(fed.end)
    for domain in sorted(after):
        if after[domain] > before[domain]:
            job.sinks.emit("domain_epoch", step=state.step + 1, domain=domain, epoch=after[domain],
                           data_position=fed.first)


def timed(record: StepRecord, started: float, state: TrainState) -> dict:
    step_time_s = time.perf_counter() - started
    return dataclasses.replace(record, tokens=state.tokens_seen, step_time_s=step_time_s,
                               tokens_per_s=record.batch_tokens / max(step_time_s, 1e-9),
                               clip_frac=state.clipped_steps / max(state.step, 1)).to_json()


def parse_args(argv: list[str] | None) -> tuple[argparse.Namespace, list[str]]:
    parser = argparse.ArgumentParser(prog="python -m dsslm.train", description=__doc__)
    parser.add_argument("--config", default=None, help="YAML config (default: configs/tiny.yaml)")
    parser.add_argument("--allow-drift", action="append", default=[], metavar="KEY",
                        help="accept a difference from the checkpoint's config/data/tokenizer on resume")
    return parser.parse_known_args(argv)


def main(argv: list[str] | None = None) -> int:
    args, overrides = parse_args(argv)
    try:
        cfg = load(args.config, overrides)
        return train(cfg, tuple(args.allow_drift))
    except (ConfigError, DataError) as err:
        print(f"dsslm: {err}", file=sys.stderr)
        return EXIT_BAD_INPUT
    except Escalation as err:
        print(f"dsslm: escalated to a human: {err}", file=sys.stderr)
        return EXIT_ESCALATED


if __name__ == "__main__":
    sys.exit(main())
