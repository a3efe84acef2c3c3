"""`python -m dsslm.train [--config FILE.yaml] [--allow-drift KEY] [dotted.key=value ...]`

The same entry point under plain python, torchrun, accelerate launch and srun. Exit codes: the
table in dsslm/exits.py (docs/run-folder.md#exit-codes); with DSSLM_STATUS_FILE set, rank 0 also
writes `finished` or `preempted` there as it leaves with exit 0 (for slurm/train.sbatch).

Read top-down: `main` -> `train` -> `run_loop` -> `train_step` and its verbs. The job and its
setup are in `job.py`.

`step` everywhere is the number of optimizer steps completed: the record of the step whose
update was just applied carries the same number as the checkpoint taken right after it.
"""
from __future__ import annotations

if __name__ == "__main__":  # before the 2-3 s of imports below: a SIGTERM in them must not end in -15,
    from dsslm import exits
    exits.catch_early()
    from dsslm import preflight
    try:
        preflight.check_or_exit()  # and --help, or a typo in the config, is answered at once
    except SystemExit as refused:
        if refused.code:  # this node's refusal (its data.dir, say), for the agent as any exit code
            exits.tell_agent(int(refused.code))
        raise

import contextlib
import dataclasses
import math
import os
import sys
import time
from dataclasses import dataclass
from typing import Callable

from dsslm.ckpt.drift import check_allow_drift
from dsslm.ckpt.lock import LockLost
from dsslm.ckpt.store import CheckpointError
from dsslm.ckpt.train_state import NothingToResume, TrainState
from dsslm.config import Config, ConfigError
from dsslm.data import DataError
from dsslm.data.skips import active_at
from dsslm.data.stream import StepSlice
from dsslm.exits import (EXIT_BAD_INPUT, EXIT_ESCALATED, EXIT_INTERRUPTED, EXIT_NOTHING_TO_RESUME, EXIT_OK,
                         EXIT_WRITE_FAILED, Preempted, StopFlag, ignore_from_now, note_status, tell_agent)
from dsslm.health.door import (CHECKPOINT, COLLECTIVE, DATA, EVALUATION, FORWARD_BACKWARD, OPTIMIZER, BadNode,
                               OutOfMemory)
from dsslm.job import Job, save, setup, start
from dsslm.loss import StepResult, accumulate, validation_sums
from dsslm.observe.console import memory_line
from dsslm.observe.diagnostics import Diagnostics
from dsslm.observe.sinks import LogWriteError
from dsslm.optim import lr_at
from dsslm.preflight import load_checked, parse_args
from dsslm.recovery.monitor import Verdict
from dsslm.recovery.policy import FP16_OVERFLOW
from dsslm.recovery.rewind import Escalation
from dsslm.rng import set_step_streams, step_streams

# Rank 0's failures to write into run.dir, raised on every rank at a step boundary (EXIT_WRITE_FAILED).
WRITE_FAILURES = (CheckpointError, LogWriteError, LockLost)


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


def say(err: BaseException, line: str) -> None:
    """The one line a failure ends with, unless rank 0 raised it for every rank and prints it."""
    if not getattr(err, "echoed", False):
        print(line, file=sys.stderr)


def main(argv: list[str] | None = None) -> int:
    args, overrides = parse_args(argv)
    cfg = None  # a Ctrl-C while the config is read finds none
    try:
        cfg = load_checked(args, overrides)
        return train(cfg, check_allow_drift(args.allow_drift))
    except (ConfigError, DataError) as err:
        say(err, f"dsslm: {err}")
        return EXIT_BAD_INPUT
    except Escalation as err:
        say(err, f"dsslm: escalated to a human: {err}")
        return EXIT_ESCALATED
    except NothingToResume as err:
        say(err, f"dsslm: {err}")
        return EXIT_NOTHING_TO_RESUME
    except WRITE_FAILURES as err:
        say(err, f"dsslm: {err}")
        return EXIT_WRITE_FAILED
    except (BadNode, OutOfMemory) as err:  # 76: requeue elsewhere; 77: at half the micro-batch (7: a person)
        say(err, f"dsslm: {err}")
        return err.code
    except Preempted as stopped:
        refused = stopped.__cause__ or stopped.__context__
        if isinstance(refused, (ConfigError, DataError)):
            # A refusal on its way out when the signal came: torchrun ends the other ranks as soon
            # as one exits. The refusal is the news (said once, by the rank that raised it).
            say(refused, f"dsslm: {refused}")
            return EXIT_BAD_INPUT
        say(stopped, f"dsslm: {stopped.signal} before the first step: nothing trained, nothing to save")
        # Requeued all the same: the launcher's log then says so, not "no word from rank 0".
        note_status("preempted", int(os.environ.get("RANK", "0")) == 0)
        return EXIT_OK
    except KeyboardInterrupt:
        where = f" in {cfg.run.dir}/checkpoints" if cfg is not None else ""
        print(f"dsslm: interrupted; the save in flight, if any, was finished; the next run resumes from the "
              f"newest checkpoint{where}", file=sys.stderr)
        return EXIT_INTERRUPTED


def train(cfg: Config, allow_drift: tuple[str, ...] = ()) -> int:
    stop = StopFlag()  # first: from here a SIGTERM/SIGUSR1 before the first step is a clean exit 0
    with contextlib.ExitStack() as cleanup:  # saves finished, events recorded, lock released, group left
        cleanup.callback(stop.close)
        job = None
        try:
            job = setup(cfg, allow_drift, cleanup)
            return run_loop(job, stop)
        except Exception as exc:
            if stop.stopped_in_setup:  # a peer that left on the same signal broke a collective
                raise Preempted(stop.signum) from exc
            if job is not None:
                job.health.failed(exc)  # a dead peer or the collectives' timeout: diagnosed, exit 75 there
            raise


def run_loop(job: Job, stop: StopFlag) -> int:
    cfg, sinks, state = job.cfg, job.sinks, job.state
    if start(job) == "finished":
        note_status("finished", job.engine.is_main)
        return EXIT_OK  # said so; nothing to train
    # Setup ends in one collective. Rank 0 does work of its own after setup's other collectives
    # (events, the audit, the start checkpoint's snapshot), so the others wait here for it. Each
    # rank records signals from the moment it enters the barrier: one raised after the barrier
    # returned (a handler runs only then) left that rank alone, while the others went on into
    # step 1 (gloo: exit 1; NCCL: the collective timeout). A signal recorded now is agreed at
    # step 1's all-reduce (a save after step 1); a peer that left with Preempted before the
    # barrier breaks it, and the ranks still here leave as preempted too (stopped_in_setup).
    stop.save_on_signal()  # from here on, a stop signal (or Ctrl-C) saves at the end of the step
    job.engine.barrier()
    diagnostics = Diagnostics(cfg, job.engine, sinks, job.loader)
    first_step = state.step
    while state.step < cfg.train.total_steps:
        job.drills.maybe_crash(state.step)
        before = diagnostics.snapshot(state.step)  # weights before the update, on measured steps only
        started = time.perf_counter()
        verdict, record, fed, stop_requested = train_step(job, stop)
        stop.stepped = True  # a failure from now on is no longer a peer that left before step 1
        job.audit.compare(record)  # after a resume: the steps trained again must equal their records
        if verdict is not Verdict.REWIND:
            account(job, verdict, record, fed)
        sinks.log_step(diagnostics.observe(timed(record, started, state), before))
        if verdict is Verdict.REWIND:  # the next replay, or a plain rewind: a checkpoint load, judged as one
            with job.health.load(state.step, f"checkpoint load of a rewind from step {state.step}"):
                job.spikes.after_step(state, verdict, record)
            continue
        if first_step is not None and state.step == first_step + 1:
            report_memory(job)  # after one step: AdamW allocates its moments lazily
            first_step = None   # once: a rewind to the start does not report again
        # A replayed step (a rewind's, a triage's) was validated and evaluated when first reached:
        # once per step, so replays neither pay for it again nor write a second record of a step.
        fresh, state.reached = state.step > state.reached, max(state.reached, state.step)
        if fresh and cfg.run.val_every and (state.step % cfg.run.val_every == 0 or state.step == cfg.train.total_steps):
            validate(job, diagnostics)
        if fresh:
            job.evals.after_step(state.step)  # downstream tasks every eval.every steps (dsslm/evals/loop.py)
        if stop_requested and state.step < cfg.train.total_steps:  # in the last step, finishing wins
            # Preemption: save where we are, exit 0; the requeued job resumes from here.
            save(job, sync=True)
            sinks.emit("preempt_save", step=state.step, signal=stop.name)
            check_health(job)
            note_status("preempted", job.engine.is_main)
            return stop.exit_code
        if state.step % cfg.ckpt.every == 0 or (state.step == cfg.train.total_steps and cfg.ckpt.at_end):
            save(job)
        job.spikes.after_step(state, verdict, record)  # a rewind point in memory, every monitor.rewind_every steps
        check_health(job, between_steps=True)
        job.health.after_step(state.step)  # every observe.stragglers.every steps: who holds the others back
    stop.finishing = True  # a Ctrl-C from here waits for the last save, not for a step
    job.health.phase(state.step, CHECKPOINT)
    job.health.wait_write(state.step, job.store, "the run's end")
    check_health(job, wait=True)
    sinks.emit("end", step=state.step, tokens=state.tokens_seen, skipped_steps=state.skipped_steps,
               domain_tokens=state.domain_tokens, prefetch={"hits": job.feed.hits, "misses": job.feed.misses})
    check_health(job)
    note_status("finished", job.engine.is_main)
    return EXIT_OK


def train_step(job: Job, stop: StopFlag) -> tuple[Verdict, StepRecord, StepSlice, bool]:
    """Forward, backward, the verdict, and the update (or not) for the step that makes `state.step + 1`."""
    cfg, engine, state = job.cfg, job.engine, job.state
    step = state.step + 1
    factor = job.spikes.before_step(state, step)  # a triage replay's data left out from its base on
    scheduled = lr_at(state.step, cfg)  # lr_at counts the steps completed before this one
    lr = scheduled * state.lr_scale * factor * job.drills.lr_multiplier(step)
    job.health.phase(step, DATA)
    # Each entry from the step it applies from (data.skips.active_at): a catch-up after a restart
    # feeds what the run fed before a verdict. Read ahead during the last step.
    fed, batches = job.feed.step(state.next_sequence, active_at(state.skip_list, step))
    batches = job.drills.corrupt(batches, fed.indices)
    streams = step_streams()  # a re-run in place draws the same dropout masks
    # Every target of a training batch is real: the step's token count needs no collective.
    tokens = fed.batch_size * cfg.model.seq_len
    job.health.phase(step, FORWARD_BACKWARD)
    result = compute(job, step, batches, tokens, lambda: stop.requested)  # read after the backward
    first = result

    def again() -> StepResult:  # the step once more: same weights, batch and random state, judged as a forward/backward
        engine.drop_gradients()
        set_step_streams(streams)
        with job.health.during(step, FORWARD_BACKWARD):
            return compute(job, step, batches, tokens, lambda: stop.requested or first.stop_requested)

    job.health.phase(step, COLLECTIVE)
    verdict, reason, result = job.spikes.decide(state, step, fed, batches, result, again,
                                                lambda: probe(job, step, fed.batch_size))
    job.health.phase(step, OPTIMIZER)
    if verdict is Verdict.OK:
        engine.step(lr)
        job.clipper.commit()
    else:
        engine.skip_step()  # a rewind drops this step's gradients too, or they leak into the next
        if reason == FP16_OVERFLOW:  # after skip_step: DeepSpeed's scaler backs off inside it
            reason = f"{FP16_OVERFLOW} (loss scale now {engine.scaler.scale:g})"
    record = StepRecord(step=step, loss=result.loss, gnorm=result.gnorm, lr=lr, lr_scale=state.lr_scale,
                        verdict=verdict.value, data_position=fed.first, batch_sequences=fed.batch_size,
                        batch_tokens=result.batch_tokens, reason=reason, data_wait_s=job.feed.wait_s)
    return verdict, record, fed, result.stop_requested


def probe(job: Job, step: int, global_batch: int) -> float | None:
    """The grad norm of a held-out batch of the step's global size, laid out as the step is
    (Loader.held_out_share), at the current weights, its gradients dropped after: the same at any
    split of the batch, and comparable with the step's (a mean's grad norm shrinks with its batch).
    None without a validation split or with monitor.gnorm_probe off. Not clipped."""
    if not job.cfg.monitor.gnorm_probe:
        return None
    t, engine = job.cfg.train, job.engine
    batches, real = job.loader.held_out_share(global_batch, t.grad_accum, engine.rank, engine.world_size)
    if not real:
        return None
    engine.drop_gradients()
    with job.health.during(step, FORWARD_BACKWARD):  # a forward/backward's work inside the step's decision
        result = accumulate(engine, batches, t.precision, t.z_loss, math.inf, real,
                            grad_multiplier=job.drills.surge_multiplier(step))
    job.engine.drop_gradients()
    return result.gnorm if math.isfinite(result.gnorm) else None


def compute(job: Job, step: int, batches: list, tokens: int, stop_requested: Callable[[], bool]) -> StepResult:
    """Forward and backward of one step's micro-batches (`tokens` real targets over every rank),
    clipped, the drills' faults applied."""
    t = job.cfg.train
    job.health.compute(step)  # the drills' slow step (faults.step_s)
    job.drills.maybe_oom(step)
    result = accumulate(job.engine, batches, t.precision, t.z_loss, job.clipper.limit, tokens, stop_requested,
                        job.drills.loss_multiplier(step), job.drills.grad_multiplier(step),
                        failed=job.failure is not None)
    if result.failed:  # rank 0's check at the last step boundary: raised on every rank, before the update
        job.engine.decide(lambda: raise_failure(job))
    return result


def account(job: Job, verdict: Verdict, record: StepRecord, fed: StepSlice) -> None:
    """A step was applied or skipped: either way its data is consumed (a skipped batch is not replayed)."""
    state = job.state
    count_domains(job, fed)
    state.step += 1
    state.next_sequence = fed.end
    state.tokens_seen += record.batch_tokens
    state.clipped_steps += int(record.gnorm > job.clipper.last_bound)  # ZClip's bound moves with the norms
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


def validate(job: Job, diagnostics: Diagnostics) -> None:
    """Validation loss and bits per byte per domain, logged and checked for a diverging domain."""
    state = job.state
    forward = job.health.scoring(state.step, EVALUATION, job.engine.forward, f"validation at step {state.step}")
    val_loss, val_bpb = evaluate(job, forward)
    job.sinks.log_val({"step": state.step, "val_loss": val_loss, "val_bpb": val_bpb,
                       "domain_tokens": dict(state.domain_tokens)})
    diagnostics.check_val(state.step, val_loss)


def evaluate(job: Job, forward: Callable | None = None) -> tuple[dict[str, float], dict[str, float]]:
    """Mean loss per real token (nats) and bits per byte on each domain's held-out split (every
    rank runs every batch, so sharded engines see matching collectives); `forward`: the engine's,
    counted (the watchdog's evidence that a long validation is working)."""
    job.engine.train_mode(False)
    losses, bpb = {}, {}
    for domain in job.loader.domains:
        batches = job.loader.val_batches(domain, job.cfg.run.val_batches, job.cfg.train.micro_batch_size)
        sums = validation_sums(forward or job.engine.forward, batches, job.cfg.train.precision, job.engine.device,
                               lambda targets: job.byte_counter.count(domain, targets))  # noqa: B023 (used here)
        if sums.tokens:
            losses[domain] = sums.loss
            if sums.bits_per_byte is not None:
                bpb[domain] = sums.bits_per_byte
    job.engine.train_mode(True)
    return losses, bpb


def check_health(job: Job, wait: bool = False, between_steps: bool = False) -> None:
    """What only rank 0 can see fail (its checkpoint writer, its metrics and event logs, its lock on
    run.dir) is raised on every rank, so the job exits together and with one code. `wait`: first
    let the save in flight finish (before leaving).

    `between_steps`: no collective of its own. Rank 0 keeps what failed in `job.failure`, and the
    next step's one all-reduce carries the flag (`accumulate(failed=...)`), so every rank raises
    it there, after that step's backward and before its update; nothing of that step is logged
    or saved. One process raises at once."""
    def rank0() -> None:
        raise_failure(job)
        if wait:
            job.store.wait()
        job.store.check()
        job.sinks.check()
        job.lock.check()
    if between_steps and job.engine.distributed:
        if job.engine.is_main and job.failure is None:
            try:
                rank0()
            except BaseException as exc:  # noqa: BLE001 - raised on every rank at the next step
                job.failure = exc
        return
    job.engine.raise_together(rank0)


def raise_failure(job: Job) -> None:
    """Raise what check_health kept from rank 0's last step-boundary check, if anything."""
    if job.failure is not None:
        failure, job.failure = job.failure, None
        raise failure


def report_memory(job: Job) -> None:
    """Bytes of parameters, gradients and optimizer state on every rank, as measured."""
    per_rank = job.engine.all_gather({**job.engine.memory_report(), **job.spikes.memory()})
    job.sinks.emit("memory", step=job.state.step, per_rank=per_rank)
    if job.engine.is_main:
        print(f"dsslm: rank 0 holds {memory_line(per_rank[0])}; every rank's in events.jsonl", flush=True)


if __name__ == "__main__":
    code = main()
    ignore_from_now()  # the exit code is decided: a SIGTERM while the interpreter shuts down must not change it
    if code:
        tell_agent(code)  # for dsslm.engine.agent, should torchrun's own shutdown fail after this rank leaves
    sys.exit(code)
