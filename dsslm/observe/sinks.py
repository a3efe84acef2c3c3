"""Rank-0 sinks: metrics.jsonl, events.jsonl, TensorBoard, Weights & Biases, alerts, progress bar.

Every sink is a no-op on other ranks, so the loop calls them unconditionally. `Alerts` decides
what a human should hear about beyond the spike monitor's own events (non-finite values, a
throughput drop, one validation domain diverging); it is pure, and the loop emits what it returns.
"""
from __future__ import annotations

import hashlib
import importlib.util
import json
import math
import statistics
import subprocess
import sys
import threading
import time
from collections import deque
from pathlib import Path
from typing import Any

from dsslm.config import ConfigError, ObserveCfg

ALERT_EVENTS = ("skip", "rewind", "lr_scale", "escalation", "alert")
ALERT_TIMEOUT_S = 30


def _clean(value: Any) -> Any:
    # JSON has no NaN/inf; write them as strings so every line stays parseable.
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    if isinstance(value, dict):
        return {k: _clean(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_clean(v) for v in value]
    return value


class JsonlLog:
    def __init__(self, path: Path, enabled: bool):
        self.enabled = enabled
        self.file = None
        if enabled:
            path.parent.mkdir(parents=True, exist_ok=True)
            self.file = open(path, "a", encoding="utf-8")

    def write(self, record: dict) -> None:
        if self.file is not None:
            self.file.write(json.dumps(_clean(record)) + "\n")
            self.file.flush()  # a killed run keeps every line written before the kill

    def close(self) -> None:
        if self.file is not None:
            self.file.close()
            self.file = None


class EventLog(JsonlLog):
    """events.jsonl, plus the user's alert command for the events a human should hear about."""

    def __init__(self, run_dir: Path, enabled: bool, alert_command: str = ""):
        super().__init__(run_dir / "events.jsonl", enabled)
        self.alert_command = alert_command
        self.alert_threads: list[threading.Thread] = []

    def emit(self, event: str, **fields: Any) -> dict:
        record = {"event": event, "time": time.time(), **fields}
        self.write(record)
        if self.enabled and self.alert_command and event in ALERT_EVENTS:
            thread = threading.Thread(target=self._run_alert, args=(record,), daemon=True)
            thread.start()
            self.alert_threads.append(thread)
        return record

    def _run_alert(self, record: dict) -> None:
        # In a thread with a timeout: a hung webhook must never stall training.
        try:
            subprocess.run(self.alert_command, shell=True, input=json.dumps(_clean(record)),
                           text=True, timeout=ALERT_TIMEOUT_S, capture_output=True)
        except (subprocess.TimeoutExpired, OSError) as err:
            print(f"dsslm: alert command failed: {err}", file=sys.stderr)

    def close(self) -> None:
        for thread in self.alert_threads:
            thread.join(timeout=ALERT_TIMEOUT_S)
        super().close()


class TensorBoard:
    def __init__(self, run_dir: Path, enabled: bool):
        self.writer = None
        if enabled:
            try:
                from torch.utils.tensorboard import SummaryWriter
            except ImportError:  # the tensorboard extra is optional
                return
            self.writer = SummaryWriter(str(run_dir / "tensorboard"))

    def write(self, record: dict) -> None:
        if self.writer is None:
            return
        step = record["step"]
        for key, value in record.items():
            if isinstance(value, dict):
                for sub, v in value.items():
                    if isinstance(v, (int, float)):
                        self.writer.add_scalar(f"{key}/{sub}", v, step)
            elif isinstance(value, (int, float)) and not isinstance(value, bool) and key != "step":
                self.writer.add_scalar(f"train/{key}", value, step)

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()


class WandB:
    """Optional mirror of metrics.jsonl in Weights & Biases (`pip install dsslm[wandb]`).

    One W&B run per run.dir (its id is a hash of the folder), so a resumed job appends to the same
    run. Steps repeat after a rewind and W&B's own step must only grow, so the optimizer step is
    logged as the `step` metric and used as every chart's x axis instead.
    """

    def __init__(self, run_dir: Path, enabled: bool, project: str = "dsslm", mode: str = "",
                 config: dict | None = None):
        self.run = None
        if not enabled:
            return
        import wandb  # imported only when asked for: W&B is never a requirement

        run_id = hashlib.sha256(str(run_dir.resolve()).encode()).hexdigest()[:16]
        self.run = wandb.init(project=project, dir=str(run_dir), id=run_id, name=run_dir.resolve().name,
                              resume="allow", config=config or {}, mode=mode or None)
        self.run.define_metric("*", step_metric="step")

    def write(self, record: dict) -> None:
        if self.run is None:
            return
        flat: dict[str, float] = {}
        for key, value in record.items():
            if isinstance(value, dict):
                flat.update({f"{key}/{sub}": v for sub, v in value.items() if _is_number(v)})
            elif _is_number(value):
                flat[key] = value
        self.run.log(flat)

    def close(self) -> None:
        if self.run is not None:
            self.run.finish()
            self.run = None


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


class Progress:
    """A one-line bar on a terminal; silent when stderr is a file (Slurm logs, CI)."""

    def __init__(self, total_steps: int, enabled: bool):
        self.total_steps = total_steps
        self.enabled = enabled and sys.stderr.isatty()

    def update(self, step: int, loss: float, tokens_per_s: float, step_time_s: float) -> None:
        if not self.enabled:
            return
        eta_s = max(0, self.total_steps - step) * step_time_s
        sys.stderr.write(f"\rstep {step}/{self.total_steps}  loss {loss:.4f}  "
                         f"{tokens_per_s:,.0f} tok/s  eta {eta_s / 60:.1f} min   ")
        sys.stderr.flush()

    def close(self) -> None:
        if self.enabled:
            sys.stderr.write("\n")


class Sinks:
    """Everything rank 0 writes about a run, behind one object the loop holds."""

    def __init__(self, run_dir: Path, is_main: bool, total_steps: int, tensorboard: bool,
                 alert_command: str = "", observe: ObserveCfg | None = None, config: dict | None = None):
        observe = observe or ObserveCfg()
        # Checked on every rank: rank 0 failing alone would leave the others waiting in a collective.
        if observe.wandb and importlib.util.find_spec("wandb") is None:
            raise ConfigError("observe.wandb=true needs the wandb package; pip install 'dsslm[wandb]' "
                              "or set observe.wandb=false")
        self.metrics = JsonlLog(run_dir / "metrics.jsonl", is_main)
        self.events = EventLog(run_dir, is_main, alert_command)
        self.tensorboard = TensorBoard(run_dir, is_main and tensorboard)
        self.wandb = WandB(run_dir, is_main and observe.wandb, observe.wandb_project, observe.wandb_mode, config)
        self.progress = Progress(total_steps, is_main)

    def log_step(self, record: dict) -> None:
        self.metrics.write(record)
        self.tensorboard.write(record)
        self.wandb.write(record)
        self.progress.update(record["step"], record["loss"], record["tokens_per_s"], record["step_time_s"])

    def log_val(self, record: dict) -> None:
        """A `{"step", "val_loss": {domain: float}}` record, to every sink but the progress bar."""
        self.metrics.write(record)
        self.tensorboard.write(record)
        self.wandb.write(record)

    def emit(self, event: str, **fields: Any) -> dict:
        return self.events.emit(event, **fields)

    def close(self) -> None:
        self.progress.close()
        self.wandb.close()
        self.tensorboard.close()
        self.events.close()
        self.metrics.close()


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
