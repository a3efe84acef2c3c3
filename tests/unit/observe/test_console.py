"""The console a person reads in a Slurm file: a line every run.log_every steps, one line for every
event a person should see, a summary at the end; only rank 0; level and format through logging."""
from __future__ import annotations

import logging
import random
import re

import pytest

from dsslm.observe import console as console_module
from dsslm.observe.sinks import Sinks
from helpers import run_train


@pytest.fixture(autouse=True)
def fresh_logger():
    """Each test starts from an unconfigured "dsslm" logger, as a new process does."""
    log = logging.getLogger("dsslm")
    saved = (log.level, list(log.handlers), log.propagate, log.disabled)
    log.setLevel(logging.NOTSET)
    log.handlers.clear()
    log.disabled = False
    # The handler dsslm adds to an unconfigured logger, added here: pytest's logging plugin may
    # attach its own capture handlers to loggers during a session, and dsslm respects any handler.
    handler = console_module._Stderr()
    handler.setFormatter(logging.Formatter(console_module.FORMAT))
    log.addHandler(handler)
    log.propagate = False
    yield log
    log.setLevel(saved[0])
    log.handlers[:] = saved[1]
    log.propagate, log.disabled = saved[2], saved[3]


def sinks(tmp_path, is_main=True, log_every=5, total=20):
    return Sinks(tmp_path, is_main, total, tensorboard=False, config={"run": {"log_every": log_every}})


def record(step, loss=3.0):
    return {"step": step, "loss": loss, "gnorm": 0.5, "lr": 1e-3, "tokens_per_s": 1000.0, "step_time_s": 0.5}


def test_a_file_gets_a_step_line_every_log_every_steps_and_the_events(tmp_path, capsys):
    s = sinks(tmp_path)
    for step in range(1, 21):
        s.log_step(record(step, loss=4.0 - step / 10))
        if step == 10:
            s.log_val({"step": 10, "val_loss": {"web": 3.5}})
            s.emit("save", checkpoint="step-00000010", step=10, seconds=0.1, bytes=2_000_000)
        if step == 12:
            s.emit("skip", step=12, loss=9.0, gnorm=40.0, data_position=48, reason="loss z=7")
            s.emit("rewind", step=13, to_step=10, window=[40, 56], checkpoint="x", reason="hard spike")
            s.emit("triage", step=13, verdict="state", scope="window", spike_start=12, target=13, from_step=10,
                   replay_steps=3, window=[], lr_scale=0.7, lr_factor=0.7, escalated=False, evidence={})
            s.emit("lr_scale", step=13, old=1.0, new=0.7, recover_steps=0)
            s.emit("alert", step=13, reason="slow_throughput", message="tokens/s fell to 40% of its median")
    s.log_val({"step": 20, "val_loss": {"web": 3.7}})
    s.emit("end", step=20, tokens=2560, skipped_steps=1)
    s.close()
    lines = capsys.readouterr().err.splitlines()
    steps = [line for line in lines if " dsslm: step " in line and "/20" in line]
    assert [line.split("step ")[1].split("/")[0] for line in steps] == ["1", "5", "10", "15", "20"]
    assert all(k in steps[1] for k in ("loss 3.5000", "gnorm 0.5", "lr 0.001", "1,000 tok/s", "eta 0m07s"))
    text = "\n".join(lines)
    for expected in ("saved step-00000010 (step 10, 2.0 MB", "step 12: update skipped (loss z=7)",
                     "rewound to step 10; skips sequences [40, 56]",
                     "triage of the spike at step 12: caused by the model's state", "lr_scale x0.7",
                     "learning rate scale 1 -> 0.7 at step 13 from here on",
                     "alert at step 13: slow_throughput: tokens/s fell", "validation loss web 3.5000"):
        assert expected in text, expected
    summary = lines[-1]
    assert "finished: step 20 of 20, 2,560 tokens" in summary and "final loss 2.0000" in summary
    assert "web 3.7000 (best 3.5000)" in summary and "step 12: skipped" in summary and "step 12: state" in summary
    assert f"checkpoints in {tmp_path / 'checkpoints'}" in summary


def test_a_resumed_jobs_eta_and_summary_are_its_own(tmp_path, capsys):
    # A requeued job resumes at step 11 and compiles in its first step (60 s); steps take 0.5 s.
    s = sinks(tmp_path)
    for step in range(11, 21):
        s.log_step(record(step) | {"step_time_s": 60.0 if step == 11 else 0.5})
        if step == 13:
            s.emit("skip", step=13, loss=9.0, gnorm=40.0, data_position=48, reason="loss z=7")
    s.emit("end", step=20, tokens=2560, skipped_steps=1)
    lines = capsys.readouterr().err.splitlines()
    steps = {line.split("step ")[1].split("/")[0]: line for line in lines if " dsslm: step " in line}
    assert "eta ?" in steps["11"]            # one step says nothing yet of the next ones' time
    assert "eta 0m02s" in steps["15"]        # 5 steps of 0.5 s, not the first step's minute
    summary = lines[-1]
    assert "step 20 of 20, 2,560 tokens in all; this job trained steps 11-20 in " in summary, summary
    assert "1 spike event(s) in this job: step 13: skipped" in summary


def test_the_eta_counts_the_time_between_steps_not_only_the_steps(tmp_path, capsys, monkeypatch):
    """Steps of 0.5 s with validation between them: 2 s of wall time per step. The ETA counted the
    steps' own time only, and with frequent validation said 0m00s for a run with most of its time
    to go. A rewind (the step goes back) is not taken as progress."""
    clock = [1000.0]
    monkeypatch.setattr(console_module.time, "monotonic", lambda: clock[0])
    s = sinks(tmp_path, log_every=1, total=100)
    for step in (1, 2, 3, 4, 5, 6, 3, 4):
        clock[0] += 2.0
        s.log_step(record(step))
    lines = [line for line in capsys.readouterr().err.splitlines() if " dsslm: step " in line]
    assert "eta 3m08s" in lines[5], lines[5]   # step 6: 94 steps x 2 s, not x 0.5 s (0m47s)
    assert "eta 3m12s" in lines[7], lines[7]   # after the rewind: step 4, 96 steps x 2 s

def test_each_evaluation_is_a_line_and_the_last_one_is_in_the_summary(tmp_path, capsys):
    """eval.tasks results reached metrics.jsonl only: no line, nothing in the final summary."""
    s = sinks(tmp_path, total=10)
    for step, acc in ((5, 0.25), (10, 0.3)):
        s.log_step(record(step))
        s.log_val({"step": step, "eval_acc": {"hellaswag": acc, "arc_easy": 0.4}, "eval_acc_norm": {"hellaswag": 0.26,
                   "arc_easy": 0.41}, "eval_chance": {"hellaswag": 0.25, "arc_easy": 0.2495},
                   "eval_bpb": {"hellaswag": 3.5, "arc_easy": 3.7}, "eval_examples": {"hellaswag": 20, "arc_easy": 20}})
    s.emit("end", step=10, tokens=1280, skipped_steps=0)
    lines = [line.split(" dsslm: ", 1)[1] for line in capsys.readouterr().err.splitlines()]
    evaluations = [line for line in lines if "evaluation" in line]
    assert evaluations[0] == ("step 5: evaluation: arc_easy acc 0.400, per-char 0.410 (chance 0.249), bpb 3.700; "
                              "hellaswag acc 0.250, per-char 0.260 (chance 0.250), bpb 3.500")
    assert "last evaluation (step 10): arc_easy acc 0.400" in lines[-1] and "hellaswag acc 0.300" in lines[-1]


def test_the_eta_holds_steady_under_a_varying_load(tmp_path, capsys, monkeypatch):
    """Steps of 0.2 s, 1 s or 8 s at random, and phases three times slower: the ETA swung 3.6x from
    one line to the next (10-60x on a shared machine). It moves with the job's pace, not each burst."""
    clock, rng = [1000.0], random.Random(0)
    monkeypatch.setattr(console_module.time, "monotonic", lambda: clock[0])
    s = sinks(tmp_path, log_every=10, total=1000)
    for step in range(1, 1001):
        u = rng.random()
        dt = (0.2 if u < 0.7 else 1.0 if u < 0.95 else 8.0) * (3 if (step // 50) % 3 == 2 else 1)
        clock[0] += dt
        s.log_step(record(step) | {"step_time_s": dt})
    rates = []  # seconds per remaining step, as each line plans them
    for line in capsys.readouterr().err.splitlines():
        step, eta = re.search(r"step (\d+)/1000 .* eta (\S+)$", line).groups()
        if 50 <= int(step) < 1000:
            h, m, sec = re.fullmatch(r"(?:(\d+)h)?(\d+)m(\d+)?s?", eta).groups()
            rates.append((int(h or 0) * 3600 + int(m) * 60 + int(sec or 0)) / (1000 - int(step)))
    swings = [max(a, b) / min(a, b) for a, b in zip(rates, rates[1:])]
    assert max(swings) < 1.5, max(swings)


def test_a_spike_decided_within_its_step_is_named_before_its_verdict(tmp_path, capsys):
    """An outlier re-run in place: its triage verdict ("caused by a transient fault") was the first
    line about it, and for data the "update skipped" line came after the verdict."""
    s = sinks(tmp_path)
    evidence = [{"phase": "original", "steps": [[30, 9.1, 1000.0, "skip_step"]], "reason": "grad norm 50x the median"},
                {"phase": "rerun_in_place", "steps": [[30, 9.1, 1000.0, "skip_step"]]}]
    for verdict in ("transient", "data"):
        s.emit("triage", step=30, verdict=verdict, scope="step", spike_start=30, target=30, replay_steps=1,
               skip=[{"shard": "a.bin", "tokens": [0, 9]}] if verdict == "data" else [], evidence=evidence)
    s.emit("skip", step=30, loss=9.1, gnorm=1000.0, data_position=116, reason="grad norm 50x the median")
    lines = [line.split(" dsslm: ", 1)[1] for line in capsys.readouterr().err.splitlines()]
    assert lines == [
        "spike at step 30 (grad norm 50x the median), re-run in place: caused by a transient fault: training "
        "continues unchanged",
        "spike at step 30 (grad norm 50x the median), re-run in place: caused by the data; skips the data it read "
        "(1 span(s) of documents)",
        "step 30: update skipped (grad norm 50x the median); loss 9.1, grad norm 1000"]


def test_a_grad_norm_surge_is_one_info_line_and_counted_apart_from_spikes(tmp_path, capsys):
    s = sinks(tmp_path)
    s.emit("gnorm_surge", step=32, loss=3.53, gnorm=31.4, reason="loss z=-0.8, gnorm 15.6x its reference",
           held_out_gnorm=30.0, rerun_gnorm=31.4)
    s.emit("end", step=40, tokens=100, skipped_steps=0, domain_tokens={}, prefetch={})
    lines = [line.split(" dsslm: ", 1)[1] for line in capsys.readouterr().err.splitlines()]
    assert lines[0] == ("step 32: grad norm 31.4 with a normal loss (loss z=-0.8, gnorm 15.6x its reference; a "
                        "held-out batch's 30 too): applied, clipped; a surge, not a spike")
    assert "no spikes, 1 grad-norm surge(s) applied" in lines[-1]


def test_a_lock_takeover_and_the_memory_line_are_words_not_python_dicts(tmp_path, capsys):
    s = sinks(tmp_path)
    s.emit("lock_takeover", previous={"host": "node7", "pid": 4242, "started": "2026-12-03T10:00:00+0000",
                                      "slurm_job_id": "123", "token": "ab"}, reason="pid 4242 is not running on node7")
    line = capsys.readouterr().err.strip().split(" dsslm: ", 1)[1]
    assert line == ("took run.dir over from a dead holder, process 4242 on node7, Slurm job 123 (started "
                    "2026-12-03T10:00:00+0000): pid 4242 is not running on node7")
    said = console_module.memory_line({"param_bytes": 2**20, "grad_bytes": 2**20, "optim_bytes": 2**21,
                                       "rewind_point_bytes": 3 * 2**20, "rewind_bytes": 6 * 2**20})
    assert said == ("1.0 MiB parameters, 1.0 MiB gradients, 2.0 MiB optimizer state, 3.0 MiB per rewind point, "
                    "6.0 MiB rewind points in all")


def test_triage_lines_say_what_is_skipped_and_nothing_when_nothing_is(tmp_path, capsys):
    s = sinks(tmp_path)
    # A non-data verdict writes an empty window [a, a]: "skips sequences [276, 276]" was printed.
    s.emit("triage", step=71, verdict="transient", scope="window", spike_start=70, target=71, from_step=65,
           replay_steps=5, window=[276, 276], skip=[], escalated=False)
    s.emit("triage", step=71, verdict="data", scope="window", spike_start=70, target=71, from_step=65,
           replay_steps=5, window=[280, 312], skip=[{"shard": "a.bin", "tokens": [0, 9]}] * 2, escalated=False)
    s.emit("triage", step=71, verdict="unknown", scope="window", spike_start=70, target=71, from_step=65,
           replay_steps=5, window=[280, 280], skip=[], escalated=False)
    # The widening past the spike steps is a window of positions (random text: this pass only).
    s.emit("rewind", step=71, to_step=65, window=[280, 312], skip=[[284, 312], {"shard": "a.bin", "tokens": [0, 9]}],
           checkpoint="x", reason="loss z=30")
    # A triage replay's rewind is one of its phases, not a second spike.
    s.emit("rewind", step=73, to_step=65, window=[], skip=[{"shard": "a.bin", "tokens": [0, 9]}],
           checkpoint="x", reason="3 outliers in a row", triage_phase="skip_window", lr_scale=1.0)
    lines = [line.split(" dsslm: ", 1)[1] for line in capsys.readouterr().err.splitlines()]
    assert lines == [
        "triage of the spike at step 70: caused by a transient fault: training continues unchanged "
        "(after replaying 5 step(s) from step 65)",
        "triage of the spike at step 70: caused by the data (after replaying 5 step(s) from step 65); "
        "skips the data it read (2 span(s) of documents)",
        "triage of the spike at step 70: cause unknown (the replays told neither data nor state) "
        "(after replaying 5 step(s) from step 65)",
        "spike at step 71 (loss z=30): rewound to step 65; skips the data it read (1 span(s) of documents) and "
        "sequences [284, 312) of this pass",
        "triage of the spike at step 73: skip_window replay from step 65; its data left out"], lines


def test_a_preemption_save_says_where_the_next_run_resumes(tmp_path, capsys):
    s = sinks(tmp_path)
    s.emit("preempt_save", step=7, signal="SIGTERM")
    err = capsys.readouterr().err
    assert f"stopped by SIGTERM after step 7: saved {tmp_path / 'checkpoints' / 'step-00000007'}" in err
    assert "resume from step 7" in err


def test_other_ranks_print_nothing(tmp_path, capsys):
    s = sinks(tmp_path, is_main=False)
    s.log_step(record(5))
    s.emit("escalation", step=5, reason="x")
    s.emit("end", step=20, tokens=1)
    assert capsys.readouterr().err == ""


@pytest.mark.parametrize("level", ["raiseExceptions", "verbose"])
def test_an_unknown_log_level_is_said_and_info_is_used(tmp_path, capsys, monkeypatch, level):
    """getattr(logging, NAME) took any int attribute: "raiseExceptions" set level 1 (every debug
    line), and a misspelt level fell back to info without a word."""
    monkeypatch.setenv("DSSLM_LOG_LEVEL", level)
    s = sinks(tmp_path, log_every=1)
    s.log_step(record(1))
    err = capsys.readouterr().err
    assert f"DSSLM_LOG_LEVEL={level!r} is not one of debug, info, warning, error; logging at info" in err
    assert logging.getLogger("dsslm").level == logging.INFO and "step 1/20" in err

def test_an_empty_log_level_is_unset(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("DSSLM_LOG_LEVEL", "")  # exported but empty, as a script that clears it leaves it
    s = sinks(tmp_path, log_every=1)
    s.log_step(record(1))
    err = capsys.readouterr().err
    assert "DSSLM_LOG_LEVEL" not in err and "step 1/20" in err

def test_level_and_format_are_the_users(tmp_path, capsys, monkeypatch, fresh_logger):
    monkeypatch.setenv("DSSLM_LOG_LEVEL", "warning")
    s = sinks(tmp_path, log_every=1)
    s.log_step(record(1))
    s.emit("alert", step=1, reason="slow_throughput", message="slow")
    err = capsys.readouterr().err
    assert "step 1/20" not in err and "alert at step 1" in err
    # A handler the user set up is used as it is, and dsslm adds none of its own.
    fresh_logger.handlers.clear()
    fresh_logger.setLevel(logging.INFO)  # as a user would configure it
    seen = []
    handler = logging.Handler()
    handler.emit = lambda rec: seen.append(rec.getMessage())
    fresh_logger.addHandler(handler)
    s = sinks(tmp_path, log_every=1)
    s.log_step(record(1))
    assert not any(isinstance(h, console_module._Stderr) for h in fresh_logger.handlers)
    assert seen[0].startswith("step 1/20")


def test_a_terminal_gets_the_bar_and_event_lines_start_on_their_own_line(tmp_path, capsys):
    c = console_module.Console(tmp_path, True, 20, log_every=5, tty=True)
    c.step(record(1))
    c.event("save", {"checkpoint": "step-00000001", "step": 1, "seconds": 0.1, "bytes": 10})
    err = capsys.readouterr().err
    assert err.startswith("\rstep 1/20  loss 3.0000")
    assert "   \n" in err and err.rstrip().endswith("saved step-00000001 (step 1, 0.0 MB in 0.1 s)")


@pytest.mark.slow
def test_a_run_logged_to_a_file_reads_like_a_log(tmp_path):
    """As under nohup or Slurm: stderr a file; the step lines, saves and the summary are there."""
    proc = run_train(tmp_path / "run", "train.total_steps=12", "ckpt.every=6", "run.log_every=4",
                     "run.val_every=6")
    lines = proc.stderr.splitlines()
    assert [line.split(" dsslm: ")[1].split()[1] for line in lines if " dsslm: step " in line and "/12" in line] \
        == ["1/12", "4/12", "8/12", "12/12"]
    assert any("saved step-00000006" in line for line in lines)
    assert any("validation loss" in line for line in lines)
    # The run's summary, then where this job's time went (the goodput ledger's line) last.
    assert "finished: step 12 of 12" in lines[-2] and "Traceback" not in proc.stderr
    assert " dsslm: goodput: this job: " in lines[-1]


def test_a_gpu_sized_config_on_the_cpu_and_a_too_short_run_are_warned_about(capsys):
    from dsslm.config import load
    cfg = load("configs/125m.yaml", [])
    lines = console_module.warn_at_start(cfg, "cpu", 124_000_000, 8 * 4 * 2048, threads=2)
    assert len(lines) == 1 and "runs on the CPU: about" in lines[0] and "configs/tiny.yaml" in lines[0]
    assert console_module.warn_at_start(cfg, "cuda", 124_000_000, 8 * 4 * 2048, threads=2) == []
    short = load(None, ["train.total_steps=200", "optim.warmup_steps=10"])  # tiny.yaml: both every 250
    lines = console_module.warn_at_start(short, "cpu", 800_000, 768, threads=2)
    assert [line.split("=")[0] for line in lines] == ["ckpt.every", "run.val_every"]
    assert "ckpt.every=50" in lines[0] and "run.val_every=50" in lines[1]
    assert console_module.warn_at_start(load(None, []), "cpu", 800_000, 768, threads=2) == []


def test_mup_with_tied_embeddings_is_warned_about_above_the_base_width():
    """On held-out prose, width 512 against a base of 64 at the rate that transferred (3e-3): val
    loss 2.445 tied, 2.108 untied; tied widths 64-512 were no better than width 64 at any rate."""
    from dsslm.config import load
    for width, tied, warned in ((512, True, True), (512, False, False), (64, True, False)):
        cfg = load(None, [f"model.d_model={width}", "model.mup_base_width=64", f"model.tie_embeddings={str(tied).lower()}"])
        lines = console_module.warn_at_start(cfg, "cuda", 800_000, 12 * 64, threads=2)
        assert any("model.tie_embeddings=false" in line for line in lines) == warned, (width, tied, lines)


def test_a_step_larger_than_the_corpus_is_warned_about():
    from dsslm.config import load
    cfg = load(None, [])  # 12 sequences of 64 tokens a step
    lines = console_module.warn_at_start(cfg, "cuda", 800_000, 12 * 64, threads=2, corpus_sequences=3)
    assert len(lines) == 1 and "4.0x the corpus's 3" in lines[0] and "every step repeats all of it" in lines[0]
    assert console_module.warn_at_start(cfg, "cuda", 800_000, 12 * 64, threads=2, corpus_sequences=12) == []


def test_the_eta_follows_a_lasting_change_of_pace(tmp_path, capsys, monkeypatch):
    """A busy process beside the run for its first 600 steps (1 s a step), then gone (0.07 s): the
    whole job's average said 20m59s with 55 s left. The recent window's rate takes over within ~100
    steps; the other way round (the machine gets busy) too."""
    for before, after in ((1.0, 0.07), (0.07, 1.0)):
        clock = [1000.0]
        monkeypatch.setattr(console_module.time, "monotonic", lambda clock=clock: clock[0])
        s = sinks(tmp_path / str(before), log_every=10, total=1000)
        for step in range(1, 1001):
            dt = before if step <= 600 else after
            clock[0] += dt
            s.log_step(record(step) | {"step_time_s": dt})
        etas = {}
        for line in capsys.readouterr().err.splitlines():
            found = re.search(r"step (\d+)/1000 .* eta (\d\S*)$", line)
            if not found:  # not a step's line, or its ETA not measured yet ("?")
                continue
            step, eta = found.groups()
            h, m, sec = re.fullmatch(r"(?:(\d+)h)?(\d+)m(\d+)?s?", eta).groups()
            etas[int(step)] = int(h or 0) * 3600 + int(m) * 60 + int(sec or 0)
        truth = {step: (1000 - step) * after for step in etas if step >= 700}
        assert all(abs(etas[step] - truth[step]) <= max(1, 0.25 * truth[step]) for step in truth), \
            {step: (etas[step], truth[step]) for step in truth}


def test_the_summary_names_the_stragglers_reported_in_the_run(tmp_path, capsys):
    s = sinks(tmp_path, total=10)
    s.log_step(record(1))
    for reports in (3, 4):
        s.emit("straggler", step=5 * reports, rank=1, host="vm", phase="data", factor=3.2, reports=reports,
               own_s=0.02, median_s=0.006, line="rank 1 (vm) is a straggler in data")
    s.emit("end", step=10, tokens=1280, skipped_steps=0)
    last = capsys.readouterr().err.strip().splitlines()[-1]
    assert "stragglers: rank 1 (vm) in data, 3.2x, reported 4 time(s) in a row (run.dir/nodes.json)" in last, last
