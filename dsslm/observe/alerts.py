"""What a human should hear about beyond the spike policy: non-finite values, a throughput drop,
one validation domain diverging. Pure; the loop emits what it returns as `alert` events."""
from __future__ import annotations

import math
import os
import statistics
from collections import deque

from dsslm.config import ObserveCfg


class Alerts:
    """What a human should hear about that the spike monitor does not act on; pure.

    Fed numbers by the loop, it returns alerts as `{"reason", "message", ...}` dicts for the
    caller to emit as `alert` events. Reasons:
    - `non_finite`: a NaN/inf loss or grad norm on a step that was applied (once per run of such
      steps). A step the spike monitor skipped or rewound, or an fp16 overflow the loss scaler
      skipped, is not alerted again: its `skip`/`rewind` event already reaches the alert command;
    - `slow_throughput`: tokens/s below `slow_fraction` of the median of the last `slow_window`
      steps for `slow_steps` steps in a row (once per episode: the next alert needs a normal
      step first). The median is a recent one: a slowdown that lasts half a window becomes the
      new normal, and so ends its episode without further alerts;
    - `val_divergence`: one domain's val loss above its best by more than `val_margin` (relative)
      for `val_evals` evaluations in a row, while every other domain fell since the evaluation
      before (one domain forgetting while the mix trains on, not the run diverging as a whole).
    The state is a window of floats and a few counters: a resume starts it afresh.
    """

    def __init__(self, slow_fraction: float = 0.5, slow_window: int = 50, slow_steps: int = 5,
                 val_margin: float = 0.02, val_evals: int = 2):
        self.slow_fraction, self.slow_steps = slow_fraction, slow_steps
        self.val_margin, self.val_evals = val_margin, val_evals
        # A median over fewer than 10 steps would be mostly start-up (allocator, caches).
        self.min_history = min(slow_window, 10)
        self._tokens_per_s: deque[float] = deque(maxlen=slow_window)
        self._slow_streak = 0
        self._non_finite = False
        self._best: dict[str, float] = {}
        self._last: dict[str, float] = {}
        self._rising: dict[str, int] = {}   # domain -> evaluations in a row above best + margin
        self._diverging: set[str] = set()   # domains alerted on in their current episode

    @classmethod
    def from_config(cls, cfg: ObserveCfg) -> "Alerts":
        return cls(cfg.slow_fraction, cfg.slow_window, cfg.slow_steps, cfg.val_margin, cfg.val_evals)

    def check_step(self, loss: float, gnorm: float, tokens_per_s: float, applied: bool = True) -> list[dict]:
        """`applied`: the optimizer step went ahead (verdict ok), so nothing else reported it."""
        alerts = []
        bad = [name for name, value in (("loss", loss), ("gnorm", gnorm)) if applied and not math.isfinite(value)]
        if bad and not self._non_finite:
            alerts.append({"reason": "non_finite", "fields": bad, "loss": loss, "gnorm": gnorm,
                           "message": f"non-finite {' and '.join(bad)} (loss {loss}, grad norm {gnorm})"})
        self._non_finite = bool(bad)
        return alerts + self._check_throughput(tokens_per_s)

    def _check_throughput(self, tokens_per_s: float) -> list[dict]:
        history = self._tokens_per_s
        median = statistics.median(history) if len(history) >= self.min_history else None
        history.append(tokens_per_s)
        if median is None or tokens_per_s >= self.slow_fraction * median:
            self._slow_streak = 0
            return []
        self._slow_streak += 1
        if self._slow_streak != self.slow_steps:
            return []
        return [{"reason": "slow_throughput", "tokens_per_s": tokens_per_s, "median_tokens_per_s": median,
                 "slow_steps": self._slow_streak,
                 "message": f"throughput {tokens_per_s:,.0f} tokens/s for {self._slow_streak} steps, below "
                            f"{self.slow_fraction:g} x the recent median {median:,.0f}"}]

    def check_val(self, val_loss: dict[str, float]) -> list[dict]:
        alerts = []
        finite = {d: v for d, v in val_loss.items() if math.isfinite(v)}  # NaN alerts on its own step
        falling = {d: d in self._last and v < self._last[d] for d, v in finite.items()}
        for domain, value in finite.items():
            best = self._best.get(domain, math.inf)
            if value <= best + self.val_margin * abs(best):
                self._rising[domain] = 0
                self._diverging.discard(domain)  # back within the margin: a later rise is a new episode
                continue
            self._rising[domain] = self._rising.get(domain, 0) + 1
            others = [d for d in val_loss if d != domain]
            if (self._rising[domain] >= self.val_evals and domain not in self._diverging
                    and others and all(falling.get(d, False) for d in others)):
                self._diverging.add(domain)
                alerts.append({"reason": "val_divergence", "domain": domain, "val_loss": value, "best": best,
                               "others": {d: val_loss[d] for d in others},
                               "message": f"val loss on {domain} {value:.4f} is {value / best - 1:.1%} above "
                                          f"its best {best:.4f} for {self._rising[domain]} evaluations "
                                          f"while {', '.join(others)} keep falling"})
        for domain, value in finite.items():
            self._best[domain] = min(self._best.get(domain, math.inf), value)
            self._last[domain] = value
        return alerts


def cpu_contention(threads: int, ranks_here: int, load: float | None = None, cores: int | None = None) -> dict:
    """Why a CPU-bound job may have slowed: this machine's 1-minute load against its cores, and the
    torch threads this job's ranks run here. Oversubscribed when the ranks alone ask for more
    threads than there are cores, or the load (this job's threads included) is above the cores:
    then `cause` says so and what to set (a busy process beside the default run made it 14x slower
    with no word of why). {} where nothing is oversubscribed."""
    load = os.getloadavg()[0] if load is None else load
    if cores is None:
        cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    ours = threads * ranks_here
    fields = {"load": round(load, 2), "cores": cores, "threads": threads, "ranks_here": ranks_here}
    if ours > cores:
        fix = (f"set OMP_NUM_THREADS={max(1, cores // ranks_here)} (cores / ranks), or run fewer ranks on this "
               "machine")
        return {**fields, "cause": f"this machine is oversubscribed: {ranks_here} rank(s) x {threads} torch threads "
                                   f"= {ours} on {cores} cores; {fix}"}
    if load > cores + 0.5:
        other = max(0.0, load - ours)
        fix = (f"another process uses ~{other:.1f} cores (see top): stop it, or give this job "
               f"OMP_NUM_THREADS={max(1, int((cores - other) // ranks_here))}")
        return {**fields, "cause": f"this machine is oversubscribed: load {load:.1f} on {cores} cores, this job "
                                   f"{ranks_here} rank(s) x {threads} threads; {fix}"}
    return {}
