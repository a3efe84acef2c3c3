"""dsslm.report on synthetic run dirs: a clean run and one with every kind of incident."""
import json
import math
import random
import struct
import subprocess
import sys

import numpy as np
import pytest

from dsslm import report
from dsslm.observe import plots
from helpers import ROOT

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
T0 = 1_764_000_000.0
RNG = random.Random(0)
CONFIG = {"optim": {"clip": 1.0, "peak_lr": 3e-4}, "train": {"total_steps": 100}}


def step_record(step, lr_scale=1.0, verdict="ok", loss=None, **extra):
    base = 2.5 + 8.0 * math.exp(-step / 15)
    return {"step": step, "loss": loss if loss is not None else base + RNG.gauss(0, 0.05),
            "gnorm": 0.4 + RNG.random() * 0.8, "lr": 3e-4 * min(1.0, step / 10) * lr_scale,
            "lr_scale": lr_scale, "tokens": step * 8192, "tokens_per_s": 40_000 + RNG.gauss(0, 500),
            "step_time_s": 0.2, "clip_frac": 0.1, "verdict": verdict, "data_batch": step} | extra


def val_record(step):
    return {"step": step, "val_loss": {"web": 2.7 + 6 * math.exp(-step / 15),
                                       "code": 2.2 + 5 * math.exp(-step / 15)}}


def event(name, step, **fields):
    return {"event": name, "time": T0 + step * 0.5, "step": step, **fields}


def write_run(run_dir, metrics, events, truncated_tail=""):
    run_dir.mkdir(parents=True, exist_ok=True)
    lines = [json.dumps(r) for r in metrics]
    (run_dir / "metrics.jsonl").write_text("\n".join(lines) + "\n" + truncated_tail)
    (run_dir / "events.jsonl").write_text("".join(json.dumps(e) + "\n" for e in events))
    return run_dir


def clean_run(run_dir):
    metrics, events = [], [event("start", 0, world_size=2, engine="ddp", config_hash="abc", n_params=1_000_000)]
    for step in range(1, 101):
        metrics.append(step_record(step))
        if step % 25 == 0:
            metrics.append(val_record(step))
            events.append(event("save", step, checkpoint=f"step-{step:08d}", seconds=0.3))
    events.append(event("end", 100))
    return write_run(run_dir, metrics, events)


def segment(steps, lr_scale, metrics, specials=None):
    specials = specials or {}
    for step in steps:
        ratios = {g: 1e-3 * (1 + i) * math.exp(-step / 50) for i, g in enumerate(["embed", "layer0", "head"])}
        metrics.append(specials.get(step) or step_record(step, lr_scale, update_ratio=ratios))
        if step % 10 == 0:
            metrics.append(val_record(step))


def incident_run(run_dir):
    """Skip at 20, rewind at 40 back to 25 (lr_scale 1 -> 0.5), crash at 62, resume from 50,
    killed while writing step 101. Executed 40 + 37 + 50 = 127 steps; 27 of them abandoned."""
    metrics = []
    events = [event("start", 0, world_size=2, engine="zero", config_hash="def", n_params=2_000_000,
                    config=CONFIG)]
    segment(range(1, 41), 1.0, metrics, {20: step_record(20, verdict="skip_step", loss=14.0, gnorm=30.0),
                                         40: step_record(40, verdict="rewind", loss=16.0, gnorm=50.0)})
    events += [event("skip", 20), event("save", 25, checkpoint="step-00000025", seconds=0.4),
               event("alert", 38, reason="loss z-score 6.1"),
               event("rewind", 40, to_step=25, window=[38, 41]), event("lr_scale", 40, old=1.0, new=0.5)]
    segment(range(26, 63), 0.5, metrics)
    events += [event("save", 50, checkpoint="step-00000050", seconds=0.5)]
    events += [event("resume", 50, checkpoint="step-00000050")]
    events[-1]["time"] = T0 + 62 * 0.5 + 30  # the restart came 30 s after the crash
    segment(range(51, 101), 0.5, metrics)
    return write_run(run_dir, metrics, events, truncated_tail='{"step": 101, "loss": 2.6, "gn')


def assert_png(path):
    data = path.read_bytes()
    assert data[:8] == PNG_MAGIC and len(data) > 1000
    width, height = struct.unpack(">II", data[16:24])  # IHDR
    assert width == 9 * 120 and 400 <= height <= 900


def test_clean_run_writes_plots_and_summary(tmp_path, capsys):
    run_dir = clean_run(tmp_path / "clean")
    assert report.main([str(run_dir)]) == 0
    out = run_dir / "report"
    for name in ["loss.png", "lr.png", "gnorm.png", "throughput.png"]:
        assert_png(out / name)
    assert not (out / "update_ratio.png").exists()  # no record carries update_ratio
    summary = (out / "summary.md").read_text()
    assert "- status: finished" in summary
    assert "- steps: 100 (100 executed, 0 abandoned" in summary
    assert "- tokens: 819,200 (819k)" in summary
    assert "- wall time: 0:00:50 (first to last event)" in summary
    assert "| 0 | 0 | 0 | 0 | 0 | 0 | 0 | 4 | 0 |" in summary
    assert "No skips, rewinds, resumes" in summary
    assert "Unreadable" not in summary


@pytest.mark.slow
def test_incident_run_counts_and_table(tmp_path):
    run_dir = incident_run(tmp_path / "incident")
    out = tmp_path / "elsewhere"
    assert report.main([str(run_dir), "--out", str(out)]) == 0
    for name in ["loss.png", "lr.png", "gnorm.png", "throughput.png", "update_ratio.png"]:
        assert_png(out / name)
    summary = (out / "summary.md").read_text()
    assert "- status: no end event" in summary
    assert "- steps: 100 (127 executed, 27 abandoned" in summary
    assert "- tokens: 819,200 (819k)" in summary
    assert "- wall time: 0:01:01 (first to last event)" in summary  # start at T0, resume at T0 + 61 s
    assert "  - code: 2.206 (step 100)" in summary and "  - web: 2.708 (step 100)" in summary
    # skips, rewinds, resumes, lr_scale changes, alerts, escalations, passed over, saves, non-finite
    assert "| 1 | 1 | 1 | 1 | 1 | 0 | 0 | 2 | 0 |" in summary
    table = summary.split("## Events")[1]
    events = [line.split("|")[4].strip() for line in table.splitlines()[4:] if line.startswith("|")]
    assert events == ["skip", "alert", "rewind", "lr_scale", "resume"]
    assert "to_step=25, window=[38, 41]" in table and "old=1, new=0.5" in table
    assert "metrics.jsonl: 1" in summary  # the truncated last line


def test_kept_flags_mark_rolled_back_steps():
    steps = [1, 2, 3, 4, 2, 3, 4, 5, 4, 5, 6]
    metrics = [{"step": s} for s in steps] + [{"step": 6, "val_loss": {}}]
    kept = plots.kept_flags(metrics, [True] * len(steps) + [False])
    assert kept == [True, False, False, False, True, True, False, False, True, True, True, True]


def test_incident_run_abandoned_records(tmp_path):
    run = plots.load_run(incident_run(tmp_path / "incident"))
    kept_steps = [r["step"] for r, k in zip(run.train, run.train_kept) if k]
    assert kept_steps == list(range(1, 101))
    assert sum(~run.train_kept) == 27
    assert [r["step"] for r, k in zip(run.val, run.val_kept) if not k] == [30, 40, 60]
    assert plots.clip_threshold(run) == 1.0


def test_smooth_is_centered_and_keeps_length():
    y = np.array([0.0, 0, 0, 3, 0, 0, 0])
    assert np.allclose(plots.smooth(y, 3), [0, 0, 1, 1, 1, 0, 0])


def test_missing_metrics_exits_2(tmp_path, capsys):
    assert report.main([str(tmp_path)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "metrics.jsonl" in err[0]
    assert not (tmp_path / "report").exists()


@pytest.mark.slow
def test_module_entry_point(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "dsslm.report", str(tmp_path / "nope")],
                          capture_output=True, text=True, timeout=60, cwd=ROOT)
    assert proc.returncode == 2 and len(proc.stderr.strip().splitlines()) == 1


def test_missing_events_and_optional_fields(tmp_path):
    run_dir = tmp_path / "bare"
    run_dir.mkdir()
    lines = [{"step": s, "loss": 3.0 - s / 100, "verdict": "ok", "extra_field": [1]} for s in range(1, 30)]
    lines[5] |= {"loss": "nan", "gnorm": "inf", "verdict": "skip_step"}  # how metrics.py writes non-finite
    (run_dir / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in lines))
    assert report.main([str(run_dir)]) == 0
    summary = (run_dir / "report" / "summary.md").read_text()
    assert "- steps: 29 (29 executed" in summary and "- final val loss: none recorded" in summary
    assert "| 1 | 0 | 0 | 0 | 0 | 0 | 0 | 0 | 1 |" in summary
    assert "- engine: ? (no start event)" in summary and "- wall time: ?" in summary


def test_downstream_records_get_their_figure_and_summary_lines(tmp_path):
    """eval.tasks records: evals.png (accuracy against chance, bits per byte) and the last
    surviving evaluation in summary.md; a rolled-back evaluation is not the last one."""
    run_dir = clean_run(tmp_path / "evals")
    metrics = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    for step in (0, 50, 100):
        metrics.append({"step": step, "eval_acc": {"hellaswag": 0.25 + step / 1000}, "eval_acc_norm": {"hellaswag": 0.26},
                        "eval_acc_per_token": {"hellaswag": 0.25}, "eval_bpb": {"hellaswag": 8.0 - step / 50},
                        "eval_chance": {"hellaswag": 0.25}, "eval_examples": {"hellaswag": 500}, "eval_time_s": 1.0})
    write_run(run_dir, metrics, [event("start", 0), event("end", 100)])
    assert report.main([str(run_dir)]) == 0
    assert_png(run_dir / "report" / "evals.png")
    summary = (run_dir / "report" / "summary.md").read_text()
    assert "- downstream tasks at step 100:" in summary and "hellaswag: acc 0.35, acc_norm 0.26, chance 0.25, bpb 6" in summary
    assert not (plots.plot_evals(plots.load_run(clean_run(tmp_path / "none")), tmp_path)) and \
        not (tmp_path / "evals.png").exists()


def test_a_damaged_line_is_reported_around_not_raised(tmp_path, capsys):
    """A record whose eval_acc_norm is a number, not a {task: value} map, and an event whose time
    is past any date: AttributeError and OverflowError before (exit 1, a report/ without its
    summary). The summary is written, with None or "?" where a value cannot be read."""
    run_dir = clean_run(tmp_path / "damaged")
    metrics = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    metrics.append({"step": 100, "eval_acc": {"hellaswag": 0.3}, "eval_acc_norm": 7})
    write_run(run_dir, metrics, [event("start", 0), {**event("alert", 50, reason="x"), "time": 1e20}, event("end", 100)])
    assert report.main([str(run_dir)]) == 0
    summary = (run_dir / "report" / "summary.md").read_text()
    assert "hellaswag: acc 0.3, acc_norm None" in summary and "| ? | ? | 50 | alert |" in summary


def test_a_report_into_a_checkpoint_folder_is_refused(tmp_path, capsys):
    run_dir = clean_run(tmp_path / "run")
    (run_dir / "checkpoints" / "step-00000003").mkdir(parents=True)
    assert report.main([str(run_dir), "--out", str(run_dir / "checkpoints" / "step-00000003")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "inside the checkpoint folder" in err[0]
    assert list((run_dir / "checkpoints" / "step-00000003").iterdir()) == []


def test_the_wall_time_is_the_jobs_own_not_the_hours_between_them(tmp_path):
    """A run preempted after 50 s and requeued 3 hours later for 25 s more said 3:01:15 of wall
    time; a start on the finished run a day later added that day too."""
    metrics = [step_record(step) for step in range(1, 151)]
    later, day = 3 * 3600, 24 * 3600
    events = [event("start", 0), *[event("save", s, checkpoint=f"step-{s:08d}") for s in (50, 100)],
              event("preempt_save", 100, signal="SIGTERM"),
              *[e | {"time": e["time"] + later} for e in (event("lock_takeover", 100, previous={}, reason="gone"),
                                                         event("resume", 100, checkpoint="step-00000100"),
                                                         event("start", 100), event("end", 150))],
              *[e | {"time": e["time"] + later + day} for e in (event("resume", 150, checkpoint="step-00000150"),
                                                               event("data_verified", 150), event("finished", 150))]]
    run = plots.load_run(write_run(tmp_path / "run", metrics, events))
    assert report.wall_time(run) == ("0:01:15 in 3 jobs (each one's first to last event; the time between jobs "
                                     "left out)")


def test_status_is_the_newest_jobs_own_end():
    """An older job's end or escalation said "finished" of a run extended and then killed."""
    start = event("start", 0)
    assert report.status_of([start, event("end", 30), start]) == "no end event (still running, or killed)"
    assert report.status_of([start, event("escalation", 9), start, event("end", 40)]) == "finished"
    assert report.status_of([start, event("end", 30), start, event("escalation", 33)]) == "escalated to a human"
    assert report.status_of([start, event("preempt_save", 7, signal="SIGTERM")]).startswith(
        "stopped by SIGTERM at step 7")
    assert report.status_of([start, event("end", 30), event("finished", 30)]) == "finished"


def test_a_step_skipped_again_after_a_resume_is_one_skip_and_triage_replays_are_no_rewinds(tmp_path):
    metrics = [step_record(s, verdict="skip_step" if s == 5 else "ok") for s in range(1, 8)]
    metrics += [step_record(s, verdict="skip_step" if s == 5 else "ok") for s in range(4, 11)]  # resumed from 3
    events = [event("start", 0), event("skip", 5), event("start", 3), event("skip", 5),
              event("rewind", 9, to_step=4, window=[]),
              event("rewind", 9, to_step=4, window=[], triage_phase="skip_window"), event("end", 10)]
    run_dir = write_run(tmp_path / "run", metrics, events)
    assert report.main([str(run_dir)]) == 0
    summary = (run_dir / "report" / "summary.md").read_text()
    assert "| 1 | 1 | 0 | 0 | 0 | 0 | 0 | 0 | 0 |" in summary, summary


HUGE_INT = "9" * 400  # json reads it; float() and math.isfinite() raise OverflowError on it


@pytest.mark.parametrize("which, line, where", [
    ("events", '{"event": "start", "time": NaN, "step": 0}', "first"),
    ("events", '{"event": "alert", "time": Infinity, "step": 3}', "last"),
    ("metrics", '{"step": %s, "loss": 1.0}' % HUGE_INT, "last"),
    ("metrics", '{"step": 101, "loss": %s, "tokens": %s}' % (HUGE_INT, HUGE_INT), "last"),
    ("metrics", '{"step": 101, "loss": 3.0, "lr_scale": "inf"}', "last"),  # how the sinks write inf
    ("metrics", '{"step": 101, "loss": 3.0, "lr_scale": 1.7e308, "step_time_s": Infinity}', "last"),
    # Near float's maximum matplotlib's own tick arithmetic overflows.
    ("metrics", '{"step": 101, "loss": 1.7e308}\n{"step": 102, "loss": -1.7e308}', "last"),
    ("metrics", '{"step": 1.7e308, "loss": 3.0, "lr": 1.7e308, "gnorm": 1.7e308, "tokens_per_s": 1.7e308}', "last"),
    ("events", '{"event": "rewind", "time": %r, "step": 1.7e308, "to_step": -1.7e308}' % (T0 + 10), "last"),
])
def test_non_finite_or_huge_numbers_are_reported_around(tmp_path, which, line, where):
    """Lines json accepts (NaN, Infinity, an int past float's range; another tool or a killed writer
    left them): ValueError, OverflowError or matplotlib's "Axis limits cannot be NaN or Inf" before
    (exit 1). Every figure and the summary are written; the damaged number counts as none."""
    run_dir = clean_run(tmp_path / "run")
    path = run_dir / f"{which}.jsonl"
    text = path.read_text()
    path.write_text(line + "\n" + text if where == "first" else text + line + "\n")
    assert report.main([str(run_dir)]) == 0
    for name in ["loss.png", "lr.png", "gnorm.png", "throughput.png"]:
        assert_png(run_dir / "report" / name)
    summary = (run_dir / "report" / "summary.md").read_text()
    assert "- wall time: 0:00:50 (first to last event)" in summary, summary
    if "Infinity" in line and which == "events":
        assert "| ? | ? | 3 | alert |" in summary


def test_is_number_and_as_float_take_only_what_a_float_can_hold():
    assert plots.is_number(3) and plots.is_number(2.5) and not plots.is_number(True)
    assert not any(plots.is_number(v) for v in (math.nan, math.inf, -math.inf, 10**400, 1.7e308, "1"))
    assert math.isnan(plots.as_float(10**400)) and plots.as_float("inf") == math.inf
    assert plots.as_float(-1.7e308) == -math.inf and plots.as_float(1e30) == 1e30
    assert report.fmt_duration(math.nan) == report.fmt_duration(math.inf) == "?"
    assert report.fmt_count(10**400) == "?"


def test_an_event_not_named_by_a_string_is_skipped_and_deep_values_are_cut(tmp_path):
    """`"event": ["skip"]` was a TypeError (unhashable list) and a value nested ~900 deep a
    RecursionError in fmt_value (exit 1). The first is skipped as a bad line; the second is shown
    down to a few levels."""
    deep_dict = '{"a": ' * 900 + "1" + "}" * 900
    deep_list = "[" * 900 + "1" + "]" * 900
    run_dir = clean_run(tmp_path / "run")
    with open(run_dir / "events.jsonl", "a") as f:
        f.write('{"event": ["skip"], "time": %r, "step": 5}\n' % (T0 + 5))
        f.write('{"event": {"a": 1}, "time": %r, "step": 6}\n' % (T0 + 6))
        f.write('{"event": "alert", "time": %r, "step": 7, "x": %s, "y": %s}\n' % (T0 + 7, deep_dict, deep_list))
    with open(run_dir / "metrics.jsonl", "a") as f:
        f.write('{"step": 100, "val_loss": {"web": %s}}\n' % deep_dict)
    assert report.main([str(run_dir)]) == 0
    summary = (run_dir / "report" / "summary.md").read_text()
    assert "| 7 | alert | x={a: {a: {a: {a: {a: {a: {...}}}}}}}, y=[[[[[[[...]]]]]]] |" in summary, summary
    assert "  - web: {a: {a: {a: {a: {a: {a: {...}}}}}}} (step 100)" in summary
    assert "Unreadable lines skipped (a write cut short by a kill): events.jsonl: 2" in summary
    assert report.fmt_value([1, "a", 2.5]) == "[1, 'a', 2.5]"  # a flat list reads as before


def test_the_summary_is_built_and_replaced_before_any_figure(tmp_path, monkeypatch):
    """A summary that cannot be built left new figures beside the last report's summary.md; a write
    that fails midway left a truncated one. Now nothing changes in either case."""
    run_dir = clean_run(tmp_path / "run")
    out = run_dir / "report"
    out.mkdir()
    (out / "loss.png").write_bytes(b"old figure")
    (out / "summary.md").write_text("old summary")

    def broken(run):
        raise RuntimeError("cannot describe this run")
    with monkeypatch.context() as m:
        m.setattr(report, "summary_lines", broken)
        with pytest.raises(RuntimeError):
            report.main([str(run_dir)])
    assert (out / "loss.png").read_bytes() == b"old figure" and (out / "summary.md").read_text() == "old summary"

    def no_rename(src, dst):
        raise OSError(28, "No space left on device")
    with monkeypatch.context() as m:
        m.setattr(report.os, "replace", no_rename)
        with pytest.raises(OSError):
            report.main([str(run_dir)])
    assert (out / "summary.md").read_text() == "old summary"
    assert sorted(p.name for p in out.iterdir()) == ["loss.png", "summary.md"]  # no temporary file left


def test_a_lone_surrogate_is_written_as_its_escape(tmp_path):
    """JSON's "\\udcff" reads as a str UTF-8 cannot encode: UnicodeEncodeError (exit 1) before."""
    run_dir = clean_run(tmp_path / "run")
    with open(run_dir / "events.jsonl", "a") as f:
        f.write(json.dumps(event("alert", 60, reason="bad byte \udcff")) + "\n")
    assert report.main([str(run_dir)]) == 0
    assert "reason=bad byte \\udcff |" in (run_dir / "report" / "summary.md").read_text()


@pytest.mark.parametrize("out", ["a_file", "a_file/sub", "/proc/dsslm-report"])
def test_an_out_that_cannot_be_a_folder_is_one_line_and_exit_2(tmp_path, capsys, out):
    """An existing file, a path under a file, or a place no folder can be made (/proc): a
    FileExistsError / NotADirectoryError / FileNotFoundError traceback (exit 1) from out.mkdir before."""
    run_dir = clean_run(tmp_path / "run")
    (tmp_path / "a_file").write_text("not a folder")
    out = out if out.startswith("/") else str(tmp_path / out)
    assert report.main([str(run_dir), "--out", out]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(f"error: cannot write the report to {out}: ") and "--out" in err[0], err
    assert (tmp_path / "a_file").read_text() == "not a folder"


def test_a_run_without_step_records_leaves_no_report_folder(tmp_path, capsys):
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (run_dir / "metrics.jsonl").write_text('{"step": 1, "val_loss": {"web": 3.0}}\n')
    assert report.main([str(run_dir)]) == 2
    assert "no step records" in capsys.readouterr().err and not (run_dir / "report").exists()
    # Nor the folders above a nested --out (only the last one was removed).
    assert report.main([str(run_dir), "--out", str(tmp_path / "a" / "b" / "c")]) == 2
    assert not (tmp_path / "a").exists()


def test_the_throughput_legend_reads_like_a_number(tmp_path, monkeypatch):
    """It read `median 1.26681 k`."""
    labels = []
    monkeypatch.setattr(plots, "finish", lambda fig, path, ax: labels.extend(ax.get_legend_handles_labels()[1]))
    metrics = [step_record(step, tokens_per_s=1266.81 + (step % 3)) for step in range(1, 31)]
    plots.plot_throughput(plots.load_run(write_run(tmp_path / "run", metrics, [event("start", 0)])), tmp_path)
    assert "median 1,268 tokens/s" in labels, labels


@pytest.mark.slow
def test_the_straggler_reports_get_their_figure_and_the_nodes_their_lines(tmp_path):
    """The straggler report's records: phases.png (each rank's time a step in each phase, the named
    one marked) and summary.md's Nodes section, with the check before the first step (nodes.json)."""
    from dsslm.health.nodes import write_nodes
    run_dir = clean_run(tmp_path / "nodes")
    metrics = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    for step in (50, 100):
        metrics.append({"step": step, "hosts": ["a", "b"], "phase_s": {
            "data": [0.0001, 0.03], "forward_backward": [0.02, 0.02], "collective_wait": [0.031, 0.001],
            "optimizer": [0.002, 0.002], "loop": [0.0, 0.0], "checkpoint": [0.0, 0.0], "evaluation": [0.0, 0.0]},
            "stragglers": [{"rank": 1, "host": "b", "phase": "data", "factor": 300.0, "reports": step // 50}]})
    write_run(run_dir, metrics, [event("start", 0), event("end", 100)])
    write_nodes(run_dir, {"schema": 1, "time": T0, "seconds": 0.08, "stragglers": [], "nodes": {
        "a": {"host": "a", "slurm_node": None, "ranks": [0], "verdict": "ok", "why": [], "checks": {}},
        "b": {"host": "b", "slurm_node": None, "ranks": [1], "verdict": "ok", "why": [], "checks": {}}}})
    assert report.main([str(run_dir)]) == 0
    data = (run_dir / "report" / "phases.png").read_bytes()
    assert data[:8] == PNG_MAGIC and struct.unpack(">II", data[16:24])[0] == 9 * 120  # a panel per phase: taller
    summary = (run_dir / "report" / "summary.md").read_text()
    assert "- checked before the first step of the newest job in 0.08 s: a ok; b ok" in summary, summary
    assert "- rank 1 (b) named a straggler in data in 2 report(s), steps 50-100, up to 300x the other ranks' " \
           "median" in summary, summary
    assert plots.plot_phases(plots.load_run(clean_run(tmp_path / "none")), tmp_path) is None
