"""dsslm.report on two runs or more (issue 48 item 7): one page overlaying their curves, a table of
their numbers and each run's overview; and the single report's overview, hangs and marked plots
(item 6)."""
import json
import subprocess
import sys

import pytest

from dsslm import report
from dsslm.observe import compare, plots
from helpers import ROOT
from test_report import PNG_MAGIC, T0, clean_run, event, incident_run, write_run

COMPARE_FILES = {"compare.md", "loss.png", "val_loss.png", "throughput.png", "lr.png", "overview-1.png",
                 "overview-2.png"}


def is_png(path):
    return path.read_bytes()[:8] == PNG_MAGIC


def tree(root):
    return sorted(str(p.relative_to(root)) for p in root.rglob("*"))


def with_hang(run_dir, step=80, record=True):
    """A hang at `step`: its event, and its record under hangs/ (as the watchdog writes both)."""
    folder = run_dir / "hangs" / "20251124-160040-abcdef"
    folder.mkdir(parents=True)
    if record:
        (folder / "hang.json").write_text(json.dumps({
            "schema": 1, "cause": "rank_stopped", "why": "no beat", "step": step, "phase": "forward_backward",
            "first": [{"rank": 1, "host": "vm", "pid": 28393, "step": step, "phase": "forward_backward"}],
            "waiting": [], "in_a_row": 1, "exit_code": 75, "time": T0 + 40}))
    with open(run_dir / "events.jsonl", "a") as f:
        f.write(json.dumps(event("hang", step, phase="forward_backward", cause="rank_stopped", exit_code=75,
                                 in_a_row=1, record=str(folder))) + "\n")
    return run_dir


def test_two_runs_make_one_page_in_the_first_runs_report(tmp_path, capsys):
    """`python -m dsslm.report A B` was exit 2 (one RUN_DIR only)."""
    a, b = incident_run(tmp_path / "a"), with_hang(clean_run(tmp_path / "b"))
    before_b = tree(b)
    assert report.main([str(a), str(b)]) == 0
    out = a / "report" / "compare"
    assert {p.name for p in out.iterdir()} == COMPARE_FILES
    assert all(is_png(out / name) for name in COMPARE_FILES - {"compare.md"})
    assert tree(b) == before_b and tree(a / "report") == sorted([f"compare/{n}" for n in COMPARE_FILES] + ["compare"])
    page = (out / "compare.md").read_text()
    assert page.startswith("# Comparing 2 runs\n") and f"- `a`: {a.resolve()}" in page
    head = ("| run | final loss (mean of last 10) | best val loss: code | best val loss: web | tokens | steps | "
            "tokens/s (median) | wall time | hangs | alerts | status |")
    assert head in page
    rows = {line.split(" | ")[0][2:]: line.split(" | ") for line in page.splitlines() if line.startswith("| a |")
            or line.startswith("| b |")}
    assert 2.4 < float(rows["a"][1]) < 2.7 and rows["a"][2:6] == ["2.206 (step 100)", "2.708 (step 100)", "819k", "100"]
    assert rows["a"][7:10] == ["0:01:01", "0", "1"] and rows["b"][7:10] == ["0:00:50", "1", "0"]
    assert "![Validation loss](val_loss.png)" in page and "![overview of b](overview-2.png)" in page
    printed = capsys.readouterr().out.split()
    assert sorted(printed) == sorted(str(out / n) for n in COMPARE_FILES)


def test_runs_that_share_a_folder_name_are_told_apart(tmp_path):
    dirs = [tmp_path / "x" / "run", tmp_path / "y" / "run", tmp_path / "solo"]
    assert compare.run_labels(dirs) == ["x/run", "y/run", "solo"]
    assert compare.run_labels([tmp_path / "p" / "q" / "run", tmp_path / "r" / "q" / "run"]) == ["p/q/run", "r/q/run"]
    a, b = clean_run(dirs[0]), clean_run(dirs[1])
    out = tmp_path / "cmp"
    assert report.main([str(a), str(b), "--out", str(out)]) == 0
    page = (out / "compare.md").read_text()
    assert "| x/run |" in page and "| y/run |" in page and "### x/run" in page
    assert not (a / "report").exists() and not (b / "report").exists()  # --out: nothing in the runs


@pytest.mark.parametrize("bad", ["missing", "no_metrics", "no_steps", "twice"])
def test_a_bad_run_among_several_is_one_line_and_nothing_written(tmp_path, capsys, bad):
    a = clean_run(tmp_path / "a")
    other = {"missing": tmp_path / "nope", "no_metrics": tmp_path / "empty", "no_steps": tmp_path / "val_only",
             "twice": tmp_path / "." / "a"}[bad]
    (tmp_path / "empty").mkdir()
    (tmp_path / "val_only").mkdir()
    (tmp_path / "val_only" / "metrics.jsonl").write_text('{"step": 1, "val_loss": {"web": 3.0}}\n')
    before = tree(tmp_path)
    for argv in ([str(a), str(other)], [str(a), str(other), "--out", str(tmp_path / "o" / "p")]):
        assert report.main(argv) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and err[0].startswith("error: ") and str(other) in err[0], err
        assert tree(tmp_path) == before


def test_the_single_report_has_an_overview_and_counts_marks_and_lists_hangs(tmp_path, monkeypatch):
    """The report counted no hangs and marked neither alerts nor hangs on the loss; a time inside
    an event's details read `1.764e+09`."""
    run_dir = with_hang(incident_run(tmp_path / "run"))
    (run_dir / "hangs" / "20251124-170000-123456").mkdir()  # a job that ended before its hang.json
    with open(run_dir / "events.jsonl", "a") as f:
        f.write(json.dumps(event("alert", 90, reason="slow_throughput", since=T0 + 10)) + "\n")
    metrics = (run_dir / "metrics.jsonl").read_text().rsplit("\n", 1)[0] + "\n"  # without the torn line
    metrics += json.dumps({"step": 100, "hosts": ["a", "b"], "phase_s": {"data": [0.0, 0.03]},
                           "stragglers": [{"rank": 1, "host": "b", "phase": "data", "factor": 300.0}]}) + "\n"
    (run_dir / "metrics.jsonl").write_text(metrics)
    assert report.main([str(run_dir)]) == 0
    out = run_dir / "report"
    assert is_png(out / "overview.png")
    summary = (out / "summary.md").read_text()
    # ..., saves, non-finite losses, hangs, stragglers
    assert "| non-finite losses | hangs | stragglers |" in summary and "| 2 | 0 | 2 | 1 |" in summary, summary
    assert ("- 2025-11-24T16:00:40Z (1764000040.000): step 80, forward_backward, cause rank_stopped, exit 75, "
            "1 in a row; stopped first: rank 1 (vm, pid 28393); hangs/20251124-160040-abcdef/") in summary
    assert "- hangs/20251124-170000-123456/: no readable hang.json" in summary
    assert "since=1764000010.000 (2025-11-24T16:00:10Z)" in summary

    labels = []
    monkeypatch.setattr(plots, "finish", lambda fig, path, *axes: labels.extend(
        lab for ax in axes for lab in ax.get_legend_handles_labels()[1]))
    run = plots.load_run(run_dir)
    run.hangs = report.read_hangs(run_dir)
    plots.plot_loss(run, tmp_path)
    assert "alert (events.jsonl)" in labels and "hang (run.dir/hangs/)" in labels
    # A hang whose event was never written (killed first) is still marked, from its record.
    bare = with_hang(clean_run(tmp_path / "bare"))
    (bare / "events.jsonl").write_text("".join(line + "\n" for line in (bare / "events.jsonl").read_text().splitlines()
                                               if '"hang"' not in line))
    run = plots.load_run(bare)
    run.hangs, labels[:] = report.read_hangs(bare), []
    plots.plot_loss(run, tmp_path)
    assert "hang (run.dir/hangs/)" in labels and report.count(run, "hang", len(run.hangs)) == 1


def test_one_run_is_reported_as_before(tmp_path):
    run_dir = write_run(tmp_path / "run", [{"step": s, "loss": 3.0 - s / 100} for s in range(1, 30)], [])
    assert report.main([str(run_dir)]) == 0
    assert not (run_dir / "report" / "compare").exists() and (run_dir / "report" / "summary.md").is_file()


@pytest.mark.slow
def test_the_module_compares_two_runs(tmp_path):
    a, b = clean_run(tmp_path / "a"), clean_run(tmp_path / "b")
    proc = subprocess.run([sys.executable, "-m", "dsslm.report", str(a), str(b)], capture_output=True, text=True,
                          timeout=120, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr
    assert (a / "report" / "compare" / "compare.md").is_file()
