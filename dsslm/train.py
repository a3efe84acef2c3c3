"""`python -m dsslm.train [--config FILE.yaml] [--allow-drift KEY] [dotted.key=value ...]`

The same entry point under plain python, torchrun, accelerate launch and srun. Exit codes:
0 finished (or saved on SIGTERM/SIGUSR1), 2 bad input or config, 3 escalated to a human.
"""
from __future__ import annotations

import argparse
import math
import signal
import sys
import time
from pathlib import Path

import torch

from dsslm.recovery import faults
from dsslm.ckpt.store import CheckpointManager
from dsslm.config import Config, ConfigError, load, to_dict
from dsslm.data.corpus import default_data_dir
from dsslm.data.prepare import DataError, load_manifest, manifest_hash
from dsslm.observe.diagnostics import Diagnostics
from dsslm.engine import Engine, build_engine
from dsslm.data.loader import Loader
from dsslm.loss import accumulate, token_losses
from dsslm.observe.sinks import Sinks
from dsslm.model import build_model
from dsslm.recovery.monitor import SpikeMonitor, Verdict
from dsslm.optim import lr_at
from dsslm.ckpt.resume import Escalation, Job, resume_or_init, rewind, save
from dsslm.precision import autocast
from dsslm.ckpt.train_state import RunState, fingerprint, seed_everything

EXIT_OK, EXIT_BAD_INPUT, EXIT_ESCALATED = 0, 2, 3


class StopFlag:
    """SIGTERM / SIGUSR1 (Slurm preemption, time limit) ask for a save at the next step boundary."""

    def __init__(self) -> None:
        self.requested = False
        for sig in (signal.SIGTERM, signal.SIGUSR1):
            signal.signal(sig, self._handle)

    def _handle(self, signum: int, frame: object) -> None:
        self.requested = True


def setup(cfg: Config, allow_drift: tuple[str, ...]) -> Job:
    data_dir = Path(cfg.data.dir) if cfg.data.dir else default_data_dir()
    manifest = load_manifest(data_dir, verify=False)  # sizes; the hashes are checked once below
    cfg.model.vocab_size = cfg.model.vocab_size or manifest["tokenizer"]["vocab_size"]
    seed_everything(cfg.run.seed)  # identical initial weights on every rank
    model = build_model(cfg.model)
    engine = build_engine(cfg, model)
    verify_data_once(engine, data_dir, cfg.data.verify)
    global_batch = cfg.train.micro_batch_size * cfg.train.grad_accum * engine.world_size
    loader = Loader(data_dir, cfg.model.seq_len, cfg.run.seed, global_batch, manifest=manifest)
    run_dir = Path(cfg.run.dir)
    sinks = Sinks(run_dir, engine.is_main, cfg.train.total_steps, cfg.run.tensorboard, cfg.run.alert_command,
                  cfg.observe, to_dict(cfg))
    ckpts = CheckpointManager(run_dir, keep_last=cfg.ckpt.keep_last, keep_every=cfg.ckpt.keep_every,
                              on_event=sinks.emit if engine.is_main else None,
                              crash_in_save_step=faults.crash_in_save_step(cfg.faults, run_dir, engine.is_main))
    prints = fingerprint(cfg, manifest_hash(manifest), manifest["tokenizer"]["sha256"], global_batch)
    return Job(cfg, run_dir, engine, loader, ckpts, SpikeMonitor(cfg.monitor), sinks, prints, allow_drift)


def verify_data_once(engine: Engine, data_dir: Path, verify: bool) -> None:
    """Rank 0 hashes every shard and tells the others: one read of the corpus per job, not per rank."""
    problem = None
    if verify and engine.is_main:
        try:
            load_manifest(data_dir, verify=True)
        except DataError as err:
            problem = str(err)
    problem = engine.broadcast(problem)
    if problem:
        raise DataError(problem)


def judge(job: Job, step: int, loss: float, gnorm: float) -> tuple[Verdict, str]:
    """One verdict (and why) for every rank: an fp16 overflow is the scaler's skip; spikes are
    rank 0's call, broadcast."""
    scaler = job.engine.scaler
    if scaler is not None and scaler.update(gnorm) and math.isfinite(loss):
        return Verdict.SKIP, f"fp16_overflow (loss scale now {scaler.scale:g})"
    if not job.cfg.monitor.enabled:
        return Verdict.OK, ""
    decided = None
    if job.engine.is_main:
        decided = (job.monitor.check(step, loss, gnorm).value, job.monitor.last_reason)
    value, reason = job.engine.broadcast(decided)
    return Verdict(value), reason if value != Verdict.OK.value else ""


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


def train_step(job: Job, run: RunState, stop: StopFlag) -> tuple[Verdict, dict, bool]:
    cfg, engine = job.cfg, job.engine
    lr = lr_at(run.step, cfg) * run.lr_scale
    data_batch = job.loader.data_batch_index(run.step, run.skip_list)
    batches = job.loader.micro_batches(run.step, run.skip_list, engine.rank, engine.world_size,
                                       cfg.train.grad_accum)
    batches = faults.poison(batches, data_batch, cfg.faults, cfg.run.seed, cfg.model.vocab_size, engine.rank)
    result = accumulate(engine, batches, cfg.train.precision, cfg.train.z_loss, cfg.optim.clip,
                        faults.is_nan_step(cfg.faults, run.step, engine.rank, job.run_dir), stop.requested)
    verdict, reason = judge(job, run.step, result.loss, result.gnorm)
    if verdict is Verdict.OK:
        engine.step(lr)
    else:
        engine.skip_step()  # a rewind drops this step's gradients too, or they leak into the next
    record = {"step": run.step + 1, "loss": result.loss, "gnorm": result.gnorm, "lr": lr,
              "lr_scale": run.lr_scale, "data_batch": data_batch, "verdict": verdict.value,
              "batch_tokens": result.tokens, **({"reason": reason} if reason else {})}
    return verdict, record, result.stop_requested


def train(cfg: Config, allow_drift: tuple[str, ...] = ()) -> int:
    # First thing: a preemption signal during setup or resume must not kill the process.
    stop = StopFlag()
    job = setup(cfg, allow_drift)
    try:
        return run_loop(job, stop)
    except faults.DrillAbort:
        job.ckpts.wait()  # an in-process drill models a kill between saves, not a torn write
        raise
    finally:
        job.sinks.close()
        job.engine.close()


def run_loop(job: Job, stop: StopFlag) -> int:
    cfg, engine, sinks = job.cfg, job.engine, job.sinks
    run = resume_or_init(job)
    sinks.emit("start", step=run.step, world_size=engine.world_size, engine=engine.name,
               config_hash=job.fingerprint["config_hash"], n_params=engine.n_params,
               clip=cfg.optim.clip, config=to_dict(cfg))
    if engine.is_main:
        print(f"dsslm: {engine.n_params:,} parameters, {engine.name} on {engine.world_size} "
              f"rank(s), {job.loader.global_batch_size * cfg.model.seq_len:,} tokens/step, "
              f"starting at step {run.step}", flush=True)
    diagnostics = Diagnostics(job)
    first_step = run.step
    while run.step < cfg.train.total_steps:
        faults.maybe_crash(cfg.faults, run.step, engine.rank, job.run_dir)
        before = diagnostics.snapshot(run.step)  # weights before the update, on measured steps only
        started = time.perf_counter()
        verdict, record, stop_requested = train_step(job, run, stop)
        if verdict in (Verdict.REWIND, Verdict.ESCALATE):
            sinks.log_step(diagnostics.observe(timed(record, started, run), before))
            run = rewind(job, run, run.step)
            continue
        account(run, verdict, record, job)
        if run.step == first_step + 1:
            report_memory(job, run.step)  # after one step: AdamW allocates its moments lazily
        sinks.log_step(diagnostics.observe(timed(record, started, run), before))
        if cfg.run.val_every and run.step % cfg.run.val_every == 0:
            val_loss = evaluate(job)
            sinks.log_val({"step": run.step, "val_loss": val_loss})
            diagnostics.check_val(run.step, val_loss)
        if stop_requested:
            # Preemption: save where we are, exit 0; the requeued job resumes from here.
            save(job, run, sync=True)
            sinks.emit("preempt_save", step=run.step)
            return EXIT_OK
        if run.step % cfg.ckpt.every == 0 or run.step == cfg.train.total_steps:
            save(job, run)
        job.ckpts.check()
    job.ckpts.wait()
    sinks.emit("end", step=run.step, tokens=run.tokens, skipped_steps=run.skipped_steps)
    return EXIT_OK


def report_memory(job: Job, step: int) -> None:
    """Bytes of parameters, gradients and optimizer state on every rank, as measured."""
    per_rank = job.engine.all_gather(job.engine.memory_report())
    job.sinks.emit("memory", step=step, per_rank=per_rank)
    if job.engine.is_main:
        mib = {k: f"{v / 2**20:.1f}" for k, v in per_rank[0].items()}
        print(f"dsslm: rank 0 holds (MiB) {mib}; all ranks in events.jsonl", flush=True)


def account(run: RunState, verdict: Verdict, record: dict, job: Job) -> None:
    run.step += 1
    run.tokens += record["batch_tokens"]
    run.clipped_steps += int(record["gnorm"] > job.cfg.optim.clip)
    if verdict is Verdict.SKIP:
        run.skipped_steps += 1
        job.sinks.emit("skip", step=run.step, loss=record["loss"], gnorm=record["gnorm"],
                       data_batch=record["data_batch"], reason=record.get("reason", ""))


def timed(record: dict, started: float, run: RunState) -> dict:
    step_time_s = time.perf_counter() - started
    return {**record, "tokens": run.tokens, "step_time_s": step_time_s,
            "tokens_per_s": record["batch_tokens"] / max(step_time_s, 1e-9),
            "clip_frac": run.clipped_steps / max(run.step, 1)}


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
