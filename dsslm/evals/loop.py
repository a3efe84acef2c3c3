"""`eval.*` in the training loop: the tasks prepared at setup, evaluated and logged as metrics records."""
from __future__ import annotations

import time
from typing import Any, Callable

from dsslm.evals.scoring import Prepared
from dsslm.evals.tasks import load_tasks

METRICS = ("acc", "acc_norm", "acc_per_token", "bpb")


def record(step: int, by_task: dict[str, dict], seconds: float) -> dict:
    """The metrics.jsonl line of one evaluation: `{metric: {task: value}}` like val_loss."""
    out: dict[str, Any] = {"step": step}
    for metric in (*METRICS, "chance", "examples"):
        out[f"eval_{metric}"] = {name: r[metric] for name, r in by_task.items()}
    out["eval_time_s"] = round(seconds, 3)
    return out


class TaskEvals:
    """`eval.*` for one job: the tasks prepared at setup (a bad task exits 2 before the first step),
    evaluated at the start (eval.at_start, a run starting at step 0), every eval.every steps and at
    the last step (train.total_steps, whatever eval.every: a run extended on resume ends measured)."""

    def __init__(self, cfg=None, engine=None, sinks=None, prepared: Prepared | None = None):
        self.cfg, self.engine, self.sinks, self.prepared = cfg, engine, sinks, prepared
        # The watchdog hears of each evaluation and counts the batches it scores (job.setup).
        self.watch: Callable[[int, Callable], Callable] = lambda step, forward: forward

    @classmethod
    def off(cls) -> "TaskEvals":
        return cls()

    @classmethod
    def for_job(cls, cfg, engine, sinks, tokenizer: Callable[[], Any]) -> "TaskEvals":
        """Rank 0 reads and tokenizes the tasks; every rank gets the same rows (or the same error)."""
        if not cfg.eval.tasks:
            return cls.off()

        def prepare() -> Prepared:
            tasks = load_tasks(list(cfg.eval.tasks), cfg.eval.max_examples)
            return Prepared.build(tasks, tokenizer(), cfg.model.seq_len)
        return cls(cfg, engine, sinks, engine.decide(prepare))

    def at_start(self, step: int) -> None:
        if self.prepared is not None and self.cfg.eval.at_start and step == 0:
            self.run(step)

    def after_step(self, step: int) -> None:
        if self.prepared is None:
            return
        every = self.cfg.eval.every
        if (every and step % every == 0) or step == self.cfg.train.total_steps:
            self.run(step)

    def run(self, step: int) -> dict:
        engine, cfg = self.engine, self.cfg
        forward = self.watch(step, engine.forward)
        started = time.perf_counter()
        engine.train_mode(False)
        try:
            by_task = self.prepared.evaluate(forward, cfg.train.micro_batch_size * cfg.model.seq_len,
                                             cfg.train.precision, engine.device, engine.rank, engine.world_size,
                                             engine.all_gather)
        finally:
            engine.train_mode(True)
        line = record(step, by_task, time.perf_counter() - started)
        self.sinks.log_val(line)
        return line
