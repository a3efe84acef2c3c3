"""`python -m dsslm.train [--config FILE.yaml] [--allow-drift KEY] [dotted.key=value ...]`

The same entry point under plain python, torchrun, accelerate launch and srun. Exit codes:
0 finished (or saved on SIGTERM/SIGUSR1), 2 bad input or config, 3 escalated to a human.

`step` everywhere is the number of optimizer steps completed: the record of the step whose
update was just applied carries the same number as the checkpoint taken right after it.
"""
from __future__ import annotations

import argparse
import dataclasses
import math
import signal
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from dsslm.ckpt.resume import Checkpointer, RngStreams, Stateful
from dsslm.clip import Clipper, build_clipper
from dsslm.ckpt.store import CheckpointStore
from dsslm.ckpt.train_state import TrainState, fingerprint
from dsslm.config import Config, ConfigError, load, to_dict
from dsslm.data import DataError, Loader, load_manifest, manifest_hash
from dsslm.data.corpus import default_data_dir
from dsslm.data.stream import StepSlice, batch_size_at
from dsslm.engine import Engine, build_engine
from dsslm.loss import StepResult, accumulate, token_losses
from dsslm.model import build_model
from dsslm.observe.diagnostics import Diagnostics
from dsslm.observe.sinks import Sinks
from dsslm.optim import lr_at
from dsslm.precision import autocast
from dsslm.recovery.faults import DrillAbort, Drills
from dsslm.recovery.forensics import Forensics
from dsslm.recovery.monitor import SpikeMonitor, Verdict
from dsslm.recovery.rewind import Escalation, Rewinder
from dsslm.recovery.triage import Progress, Triage
from dsslm.rng import seed_everything, set_step_streams, step_streams

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
    store: CheckpointStore
    checkpointer: Checkpointer   # save / restore over the table of stateful parts
    state: TrainState            # the table's "train" part: the loop mutates it in place
    monitor: SpikeMonitor
    rewinder: Rewinder
    triage: Triage               # the spike policy: replays that tell data / state / transient apart
    forensics: Forensics         # run.dir/spikes/step-XXXXXXXX/
    clipper: Clipper             # optim.clip_mode: the clip bound, and what it learns from applied steps
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

    def to_json(self) -> dict:
        record = dataclasses.asdict(self)
        if not self.reason:
            del record["reason"]
        return record


def setup(cfg: Config, allow_drift: tuple[str, ...]) -> Job:
    data_dir = Path(cfg.data.dir) if cfg.data.dir else default_data_dir()
    manifest = load_manifest(data_dir, verify=False)  # sizes; the hashes are checked once below
    cfg.model.vocab_size = cfg.model.vocab_size or manifest["tokenizer"]["vocab_size"]
    seed_everything(cfg.run.seed)  # identical initial weights on every rank
    engine = build_engine(cfg, build_model(cfg.model))
    if cfg.data.verify:  # rank 0 hashes every shard and tells the others: one read per job, not per rank
        engine.decide(lambda: load_manifest(data_dir, verify=True) and None)
    global_batch = cfg.train.micro_batch_size * cfg.train.grad_accum * engine.world_size
    loader = Loader(data_dir, cfg.model.seq_len, cfg.run.seed, manifest=manifest)
    run_dir = Path(cfg.run.dir)
    sinks = Sinks(run_dir, engine.is_main, cfg.train.total_steps, cfg.run.tensorboard, cfg.run.alert_command,
                  cfg.observe, to_dict(cfg))
    store = CheckpointStore(run_dir, keep_last=cfg.ckpt.keep_last, keep_every=cfg.ckpt.keep_every,
                            on_event=sinks.emit if engine.is_main else None)
    drills = Drills(cfg.faults, run_dir, engine.rank, engine.is_main, cfg.run.seed, cfg.model.vocab_size,
                    global_batch, loader)
    drills.arm(store)
    state, monitor, clipper = TrainState(), SpikeMonitor(cfg.monitor), build_clipper(cfg.optim)
    forensics = Forensics(cfg, engine, run_dir, {**manifest["tokenizer"], "data_dir": str(data_dir)}, sinks.emit)
    progress = Progress()
    parts: dict[str, Stateful] = {"train": state, "monitor": monitor, "triage": progress,
                                  "rng": RngStreams(engine, cfg.run.seed, state)}
    if engine.scaler is not None:
        parts["scaler"] = engine.scaler
    if cfg.optim.clip_mode == "zclip":
        parts["clip"] = clipper
    prints = fingerprint(cfg, manifest_hash(manifest), manifest["tokenizer"]["sha256"], global_batch)
    checkpointer = Checkpointer(engine, store, parts, prints, cfg, sinks.emit, allow_drift)
    rewinder = Rewinder(cfg, engine, checkpointer, monitor, global_batch, run_dir, sinks.emit)
    triage = Triage(cfg, engine, rewinder, monitor, forensics, progress, sinks.emit)
    return Job(cfg, run_dir, engine, loader, store, checkpointer, state, monitor, rewinder, triage, forensics,
               clipper, drills, sinks)


FP16_OVERFLOW = "fp16_overflow"


def judge(job: Job, step: int, loss: float, gnorm: float, rerun: bool = False) -> tuple[Verdict, str]:
    """One verdict (and why) for every rank: an fp16 overflow is the scaler's skip; spikes are
    rank 0's call, followed by all. `rerun`: the in-place re-run of the step just judged."""
    scaler = job.engine.scaler
    if not rerun and scaler is not None and scaler.update(gnorm) and math.isfinite(loss):
        return Verdict.SKIP, f"{FP16_OVERFLOW} (loss scale now {scaler.scale:g})"
    if not job.cfg.monitor.enabled:
        return Verdict.OK, ""
    check = job.monitor.recheck if rerun else job.monitor.check
    verdict, reason = job.engine.decide(lambda: (check(step, loss, gnorm), job.monitor.last_reason))
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


def batch_size(job: Job) -> int:
    """This step's global batch in sequences: the full one, or less while train.batch_ramp ramps."""
    t, world_size = job.cfg.train, job.engine.world_size
    full = t.micro_batch_size * t.grad_accum * world_size
    return batch_size_at(job.state.next_sequence, full, t.grad_accum * world_size, t.batch_ramp.start,
                         t.batch_ramp.tokens, job.cfg.model.seq_len)


def train_step(job: Job, stop: StopFlag) -> tuple[Verdict, StepRecord, StepSlice, bool]:
    """Forward, backward and the verdict for the step that makes `state.step + 1`."""
    cfg, engine, state = job.cfg, job.engine, job.state
    step = state.step + 1
    lr = lr_at(state.step, cfg) * state.lr_scale * job.triage.lr_factor(state, step) * job.drills.lr_multiplier(step)
    fed, batches = job.loader.step(state.next_sequence, state.skip_list, batch_size(job), engine.rank,
                                   engine.world_size, cfg.train.grad_accum)
    job.rewinder.note(step, fed.first, fed.end)
    batches = job.drills.corrupt(batches, fed.indices)
    streams = step_streams()  # a re-run in place draws the same dropout masks
    result = compute(job, step, batches, stop.requested)
    verdict, reason = judge(job, step, result.loss, result.gnorm)
    spike = verdict is not Verdict.OK and not reason.startswith(FP16_OVERFLOW)
    if spike and not job.triage.replaying(step):  # a replay's evidence goes to its triage decision
        job.forensics.capture(step, fed, batches, result, verdict.value, reason, job.monitor.window())
    if spike and verdict is Verdict.SKIP and job.triage.may_rerun(step):
        verdict, reason, result = rerun_in_place(job, step, batches, streams, result, reason, stop)
    if verdict is Verdict.OK:
        engine.step(lr)
        job.clipper.commit()
    else:
        engine.skip_step()  # a rewind drops this step's gradients too, or they leak into the next
    record = StepRecord(step=step, loss=result.loss, gnorm=result.gnorm, lr=lr, lr_scale=state.lr_scale,
                        verdict=verdict.value, data_position=fed.first, batch_sequences=fed.batch_size,
                        batch_tokens=result.batch_tokens, reason=reason)
    return verdict, record, fed, result.stop_requested


def compute(job: Job, step: int, batches: list, stop_requested: bool) -> StepResult:
    """Forward and backward of one step's micro-batches, clipped (the drills' faults applied)."""
    t = job.cfg.train
    return accumulate(job.engine, batches, t.precision, t.z_loss, job.clipper.limit, stop_requested,
                      job.drills.loss_multiplier(step), job.drills.grad_multiplier(step))


def rerun_in_place(job: Job, step: int, batches: list, streams: tuple, first: StepResult, reason: str,
                   stop: StopFlag) -> tuple[Verdict, str, StepResult]:
    """Megatron-LM's rerun: the outlier's step once more with the same weights, batch and random
    state, its gradients dropped first. A normal result means the first was a transient fault,
    and the re-run's update is applied; a reproduced outlier is skipped as before."""
    job.engine.drop_gradients()
    set_step_streams(streams)
    result = compute(job, step, batches, stop.requested or first.stop_requested)
    verdict, rerun_reason = judge(job, step, result.loss, result.gnorm, rerun=True)
    job.triage.note_rerun(step, (first.loss, first.gnorm, reason), (result.loss, result.gnorm), verdict)
    return verdict, rerun_reason, result


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
        job.sinks.close()
        job.engine.close()


def start(job: Job) -> None:
    """Resume, branch or start fresh; fold in the run-level skip list; say so."""
    cfg, engine = job.cfg, job.engine
    job.checkpointer.resume_or_init()
    job.rewinder.merge_run_file(job.state)
    if cfg.monitor.enabled:
        job.rewinder.ensure_start_checkpoint(job.state, lambda: save(job))  # a spike at step 7 can rewind
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
        verdict = job.triage.review(state, verdict, record)  # during a replay: did the spike come back?
        if verdict is Verdict.REWIND:
            sinks.log_step(diagnostics.observe(timed(record, started, state), before))
            job.triage.rewind(state, record)  # the next replay, or today's rewind
            continue
        account(job, verdict, record, fed)
        if first_step is not None and state.step == first_step + 1:
            report_memory(job)  # after one step: AdamW allocates its moments lazily
            first_step = None   # once: a rewind to the start does not report again
        sinks.log_step(diagnostics.observe(timed(record, started, state), before))
        if cfg.run.val_every and state.step % cfg.run.val_every == 0:
            val_loss = evaluate(job)
            sinks.log_val({"step": state.step, "val_loss": val_loss})
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
    sinks.emit("end", step=state.step, tokens=state.tokens_seen, skipped_steps=state.skipped_steps)
    return EXIT_OK


def save(job: Job, sync: bool = False) -> None:
    """Keep what a rewind would need, then checkpoint (every rank gathers, rank 0 writes)."""
    if job.engine.is_main:
        job.store.pin(job.triage.pins(job.state.step, job.store.valid_steps()))
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
    state.step += 1
    state.next_sequence = fed.end
    state.tokens_seen += record.batch_tokens
    state.clipped_steps += int(record.gnorm > job.cfg.optim.clip)
    if verdict is Verdict.SKIP:
        state.skipped_steps += 1
        job.sinks.emit("skip", step=state.step, loss=record.loss, gnorm=record.gnorm,
                       data_position=record.data_position, reason=record.reason)


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
