"""Alerts: fed numbers directly, and end to end through events.jsonl and run.alert_command."""
from __future__ import annotations

import json
import math
import random
import shlex
from pathlib import Path

from dsslm.observe.alerts import Alerts
from dsslm.train import train
from helpers import events, read_jsonl, tiny_cfg


def feed_throughput(alerts: Alerts, series: list[float]) -> list[tuple[int, dict]]:
    return [(i, a) for i, tps in enumerate(series) for a in alerts.check_step(3.0, 1.0, tps)]


def noisy(n: int, level: float, seed: int = 0, spread: float = 0.2) -> list[float]:
    rng = random.Random(seed)
    return [level * (1 + rng.uniform(-spread, spread)) for _ in range(n)]


def test_throughput_drop_alerts_once_per_episode():
    series = noisy(60, 1000.0) + noisy(10, 300.0, 1) + noisy(60, 1000.0, 2) + noisy(8, 200.0, 3)
    fired = feed_throughput(Alerts(), series)
    # The 5th slow step of each drop (index 64 and 134), once each; none during the recovery.
    assert [i for i, _ in fired] == [64, 134]
    first = fired[0][1]
    assert first["reason"] == "slow_throughput" and first["slow_steps"] == 5
    assert 800 < first["median_tokens_per_s"] < 1200 and first["tokens_per_s"] < 400
    assert "tokens/s" in first["message"]


def test_throughput_steady_or_briefly_slow_does_not_alert():
    steady = noisy(500, 1000.0, spread=0.3)
    assert feed_throughput(Alerts(), steady) == []
    # A checkpoint save or a measured step every 10 steps, and one 4-step stall: no alert.
    hiccups = [0.2 * v if i % 10 == 0 else v for i, v in enumerate(steady)]
    hiccups[200:204] = [100.0] * 4
    assert feed_throughput(Alerts(), hiccups) == []
    # A few absurdly fast steps (a timer hiccup) must not raise the baseline: a median, not a mean.
    spikes = list(steady)
    spikes[100:103] = [50_000.0] * 3
    assert feed_throughput(Alerts(), spikes) == []
    # A permanent slowdown alerts once, then becomes the new normal.
    slower = steady[:100] + noisy(300, 300.0, 4)
    assert len(feed_throughput(Alerts(), slower)) == 1


def test_non_finite_loss_or_gnorm_alerts_once_per_run_of_bad_steps():
    alerts = Alerts()
    values = [(3.0, 1.0), (math.nan, 1.0), (math.nan, math.nan), (3.0, 1.0), (3.0, math.inf)]
    fired = [(i, a) for i, (loss, gnorm) in enumerate(values) for a in alerts.check_step(loss, gnorm, 1000.0)]
    assert [(i, a["reason"], a["fields"]) for i, a in fired] == [(1, "non_finite", ["loss"]),
                                                                 (4, "non_finite", ["gnorm"])]
    # Skipped or rewound (the monitor's event already alerts), or an fp16 overflow the scaler skipped.
    assert Alerts().check_step(math.nan, math.inf, 1000.0, applied=False) == []


def feed_val(alerts: Alerts, evals: list[dict]) -> list[tuple[int, dict]]:
    return [(i, a) for i, losses in enumerate(evals) for a in alerts.check_val(losses)]


def test_val_divergence_on_one_domain_while_others_fall():
    evals = [{"code": 3.0, "prose": 4.0}, {"code": 2.8, "prose": 3.8},   # both fall; prose best 3.8
             {"code": 2.6, "prose": 3.9},                                 # +2.6%: 1st eval above margin
             {"code": 2.5, "prose": 3.95},                                # 2nd in a row: alert
             {"code": 2.4, "prose": 4.0},                                 # same episode: quiet
             {"code": 2.3, "prose": 3.8},                                 # back at best: episode over
             {"code": 2.2, "prose": 3.9}, {"code": 2.1, "prose": 3.9}]    # a new episode: alert again
    fired = feed_val(Alerts(), evals)
    assert [i for i, _ in fired] == [3, 7]
    alert = fired[0][1]
    assert alert["reason"] == "val_divergence" and alert["domain"] == "prose"
    assert alert["best"] == 3.8 and alert["val_loss"] == 3.95 and alert["others"] == {"code": 2.5}


def test_val_no_alert_when_steady_within_margin_or_everything_rises():
    rng = random.Random(0)
    steady = [{"code": 3.0 - 0.01 * i + rng.uniform(-0.02, 0.02), "prose": 4.0 - 0.01 * i} for i in range(50)]
    assert feed_val(Alerts(), steady) == []
    within = [{"a": 3.0, "b": 4.0}] + [{"a": 3.0 - 0.1 * i, "b": 4.0 * 1.015} for i in range(1, 6)]
    assert feed_val(Alerts(), within) == []  # 1.5% above best: inside the 2% margin
    everything = [{"a": 3.0, "b": 4.0}] + [{"a": 3.0 * (1 + 0.05 * i), "b": 4.0 * (1 + 0.05 * i)} for i in range(1, 6)]
    assert feed_val(Alerts(), everything) == []  # the whole run diverging is the spike monitor's business
    assert feed_val(Alerts(), [{"only": 3.0}, {"only": 4.0}, {"only": 5.0}]) == []  # needs another domain


def test_non_finite_step_reaches_events_and_alert_command(tmp_path):
    run_dir = tmp_path / "run"
    received = tmp_path / "received.jsonl"
    command = f"cat >> {shlex.quote(str(received))} && echo >> {shlex.quote(str(received))}"  # one JSON a line
    cfg = tiny_cfg(run_dir, "train.total_steps=6", "ckpt.every=100", "faults.nan_steps=[3]",
                   "monitor.enabled=false", "observe.every=0", f"run.alert_command={command}")
    assert train(cfg) == 0
    alerts = events(run_dir, "alert")
    # Step 3 is NaN and so is every step after it (NaN weights); one alert.
    assert [(a["step"], a["reason"]) for a in alerts] == [(3, "non_finite")]
    assert [r["loss"] for r in read_jsonl(run_dir / "metrics.jsonl")][2:] == ["nan"] * 4
    sent = [json.loads(line) for line in received.read_text().splitlines() if line.strip()]
    assert [(s["event"], s["reason"], s["step"]) for s in sent] == [("alert", "non_finite", 3)]
    assert Path(run_dir / "events.jsonl").read_text().count('"alert"') == 1


def test_a_slowdown_on_an_oversubscribed_machine_names_the_cause_and_what_to_set():
    from dsslm.observe.alerts import cpu_contention
    busy = cpu_contention(threads=2, ranks_here=1, load=5.2, cores=2)  # a busy process beside the run
    assert "load 5.2 on 2 cores" in busy["cause"] and "another process uses ~3.2 cores" in busy["cause"]
    assert busy["load"] == 5.2 and busy["cores"] == 2
    crowded = cpu_contention(threads=8, ranks_here=4, load=3.0, cores=8)  # 4 ranks x 8 threads on 8 cores
    assert "4 rank(s) x 8 torch threads = 32 on 8 cores" in crowded["cause"] and "OMP_NUM_THREADS=2" in crowded["cause"]
    assert cpu_contention(threads=2, ranks_here=1, load=2.1, cores=2) == {}  # the job's own load alone
