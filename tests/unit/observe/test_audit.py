"""dsslm.observe.audit: which records a resume is compared with, and the verdicts."""
from __future__ import annotations

import json

import pytest

from dsslm.observe.audit import ResumeAudit, _why_not_exact, recorded_after, run_env

ENV = run_env("cpu", 1, "ddp", 4, 1, "2.13.0+cpu", 1)


def record(step: int, loss: float = None, verdict: str = "ok", **fields) -> dict:
    loss = 10.0 - step / 10 if loss is None else loss
    gnorm = fields.pop("gnorm", loss / 4 if isinstance(loss, float) else loss)
    return {"step": step, "loss": loss, "gnorm": gnorm, "lr": 1e-3, "data_batch": step - 1, "verdict": verdict,
            **fields}


def write(path, records, torn: bool = False):
    text = "".join(json.dumps(r) + "\n" for r in records)
    path.write_text(text + ('{"step": 99, "lo' if torn else ""))
    return path


def steps_after(tmp_path, records, from_step, **kw):
    return sorted(recorded_after(write(tmp_path / "metrics.jsonl", records, **kw), from_step))


def test_the_trajectory_that_left_the_checkpoint_is_chosen(tmp_path):
    plain = [record(s) for s in range(1, 18)]
    assert steps_after(tmp_path, plain, 10) == list(range(11, 18))
    # Validation records between steps, and a torn last line, change nothing.
    with_val = plain[:12] + [{"step": 12, "val_loss": {"code": 3.0}}] + plain[12:]
    assert steps_after(tmp_path, with_val, 10, torn=True) == list(range(11, 18))
    # A rewind at 13 back to 5, then steps 6..15: only the run after the rewind left checkpoint 10.
    rewound = [record(s) for s in range(1, 13)] + [record(13, verdict="rewind")] + [record(s) for s in range(6, 16)]
    assert steps_after(tmp_path, rewound, 10) == list(range(11, 16))
    # A job that resumed from 10 and died before saving again: its records, not the older job's.
    twice = [record(s) for s in range(1, 16)] + [record(s, loss=1.0) for s in range(11, 14)]
    got = recorded_after(write(tmp_path / "metrics.jsonl", twice), 10)
    assert sorted(got) == [11, 12, 13] and {r["loss"] for r in got.values()} == {1.0}
    # The newest checkpoint belongs to a trajectory abandoned by a rewind: nothing to compare.
    abandoned = [record(s) for s in range(1, 52)] + [record(52, verdict="rewind")] + [record(s) for s in range(41, 46)]
    assert steps_after(tmp_path, abandoned, 50) == []
    # Records that start after the checkpoint's next step did not leave it.
    assert steps_after(tmp_path, [record(s) for s in range(30, 41)], 10) == []
    assert steps_after(tmp_path, [], 10) == []


def audit_of(records, exact_why: str = "", tol: float = 0.0, last_step: int = 100):
    emitted = []
    expected = {r["step"]: r for r in records}
    audit = ResumeAudit(lambda event, **f: emitted.append((event, f)), expected, 10, exact_why, tol, last_step)
    return audit, emitted


def test_equal_steps_are_exact_and_one_differing_bit_is_an_alert():
    audit, emitted = audit_of([record(11), record(12)])
    audit.compare(record(11))
    assert emitted == []  # reports once, when the window is done
    audit.compare(record(12))
    assert emitted[0][0] == "resume_audit" and emitted[0][1]["verdict"] == "exact"
    assert emitted[0][1]["steps"] == [11, 12] and emitted[0][1]["max_loss_diff"] == 0.0
    audit, emitted = audit_of([record(11), record(12)])
    audit.compare(record(11))
    audit.compare(record(12, loss=record(12)["loss"] + 1e-12, gnorm=record(12)["gnorm"]))
    assert [e for e, _ in emitted] == ["resume_audit", "alert"] and emitted[0][1]["verdict"] == "mismatch"
    assert emitted[1][1]["reason"] == "resume_audit" and emitted[1][1]["at_step"] == 12


def test_a_tolerance_applies_where_results_are_not_reproducible():
    audit, emitted = audit_of([record(11)], exact_why="cuda kernels are not bitwise deterministic", tol=0.05)
    audit.compare(record(11, loss=record(11)["loss"] * 1.01, gnorm=record(11)["gnorm"] * 0.99))
    assert emitted[0][1]["verdict"] == "within_tolerance" and "cuda" in emitted[0][1]["expected"]
    for loss in (record(11)["loss"] * 1.2, float("nan")):
        audit, emitted = audit_of([record(11)], exact_why="world_size 1 -> 2", tol=0.05)
        audit.compare(record(11, loss=loss, gnorm=record(11)["gnorm"]))
        assert [e for e, _ in emitted] == ["resume_audit", "alert"]


def test_steps_fed_other_inputs_are_counted_not_compared_and_nan_equals_nan():
    audit, emitted = audit_of([record(11), record(12, loss="nan", gnorm="nan")], last_step=12)
    audit.compare(record(11, lr=5e-4, loss=0.0))  # another schedule (train.total_steps changed)
    audit.compare(record(12, loss=float("nan"), gnorm=float("nan")))
    fields = emitted[0][1]
    assert fields["incomparable"] == 1 and fields["compared"] == 1 and fields["verdict"] == "exact"


def test_a_run_shorter_than_the_window_reports_at_its_end_and_a_rewind_ends_it():
    audit, emitted = audit_of([record(s) for s in range(11, 20)], last_step=13)
    for s in (11, 12, 13):
        audit.compare(record(s))
    assert emitted[0][1]["steps"] == [11, 13]
    audit, emitted = audit_of([record(11, verdict="rewind")] + [record(s) for s in range(12, 20)])
    audit.compare(record(11, verdict="rewind"))
    assert emitted[0][1]["compared"] == 1 and len(emitted) == 1 and emitted[0][1]["verdict"] == "exact"


def test_exactness_needs_the_same_environment():
    assert _why_not_exact(ENV, ENV) == ""
    assert "world_size 1 -> 2" in _why_not_exact(ENV, {**ENV, "world_size": 2})
    assert "torch_threads" in _why_not_exact(ENV, {**ENV, "torch_threads": 2})
    assert "not bitwise" in _why_not_exact({**ENV, "device": "cuda"}, {**ENV, "device": "cuda"})
    assert "did not record" in _why_not_exact(None, ENV)


def decision(step, verdict="data", window=(800, 928), **kw):
    return {"event": "triage", "step": step, "verdict": verdict, "scope": "window", "spike_start": step - 2,
            "target": step, "window": list(window), "lr_scale": 1.0, "escalated": False, **kw}


def test_the_triage_decisions_after_the_checkpoint_must_come_again(tmp_path):
    """The interrupted job decided data at 53 and state at 60 after holding checkpoint 52; a
    resume that decides otherwise did not restore recovery state (the feed record of an open
    streak, a replay in progress), however equal its losses."""
    from dsslm.observe.audit import recorded_decisions
    events = [{"event": "save", "step": 48}, decision(40), {"event": "save", "step": 52},
              decision(53, "transient"), decision(53), {"event": "rewind", "step": 53}, decision(60, "state")]
    path = write(tmp_path / "events.jsonl", events)
    recorded = recorded_decisions(path, 52)
    assert [(d["step"], d["verdict"]) for d in recorded] == [(53, "data"), (60, "state")]
    assert recorded_decisions(path, 44) == []  # the log does not reach back to that checkpoint
    # The same decisions: one report, exact.
    audit, emitted = audit_of([])
    audit.decisions = recorded
    audit.observe({**decision(53, "transient")})  # a fault that struck once is not compared
    audit.observe(decision(53))
    assert emitted == []
    audit.observe(decision(60, "state"))
    assert [(e, f["scope"], f["verdict"], f["compared"]) for e, f in emitted] == [("resume_audit", "recovery", "exact", 2)]
    # A window planned one step late: a mismatch and an alert naming the field.
    audit, emitted = audit_of([])
    audit.decisions = recorded_decisions(path, 52)
    audit.observe(decision(53, window=(816, 944)))
    assert [e for e, _ in emitted] == ["resume_audit", "alert"] and emitted[1][1]["field"] == "window"
    audit.observe(decision(60, "state"))
    assert len(emitted) == 2  # reported once


def test_a_recomputed_step_with_another_verdict_is_a_mismatch():
    audit, emitted = audit_of([record(11, verdict="skip_step"), record(12)])
    audit.compare(record(11))
    audit.compare(record(12))
    assert emitted[0][1]["verdict"] == "mismatch" and emitted[1][1]["field"] == "verdict"


def test_nothing_to_compare_says_whether_the_last_job_stopped_there_or_died(tmp_path):
    write(tmp_path / "metrics.jsonl", [record(s) for s in range(1, 11)])
    log = tmp_path / "events.jsonl"

    def reason(*events) -> str:
        log.write_text("".join(json.dumps(e) + "\n" for e in events))
        emitted = []
        ResumeAudit.after_resume(tmp_path, 10, ENV, 0.0, 100, lambda event, **f: emitted.append((event, f)))
        assert [(e, f["verdict"]) for e, f in emitted] == [("resume_audit", "nothing_to_compare")]
        return emitted[0][1]["reason"]

    start = {"event": "start", "step": 0, "env": ENV}
    assert reason(start, {"event": "save", "step": 10}, {"event": "preempt_save", "step": 10, "signal": "SIGTERM"}) \
        == "the last job stopped by SIGTERM and saved this checkpoint; no step after it was trained"
    assert reason(start, {"event": "end", "step": 10}) == "the last job finished at this checkpoint; no step after it was trained"
    died = "no records of steps after the checkpoint (it was taken at the crash, or the log lost them)"
    assert reason(start, {"event": "save", "step": 10}) == died
    # A stop of an older job, followed by a job that started and died, is not this one's.
    assert reason({"event": "preempt_save", "step": 10}, start) == died
    assert reason(start, {"event": "preempt_save", "step": 8}) == died


def test_steps_run_with_other_inputs_are_named_not_an_empty_reason():
    """A resume that raised train.total_steps changes every later lr: 'nothing to compare ()'."""
    audit, emitted = audit_of([record(11), record(12)], last_step=12)
    audit.compare(record(11) | {"lr": 2e-3})
    audit.compare(record(12) | {"lr": 2e-3})
    ((event, f),) = emitted
    assert f["verdict"] == "nothing_to_compare" and f["incomparable"] == 2
    assert f["reason"] == "2 recorded step(s) ran with other inputs (lr from step 11): a config changed at the resume"


def test_a_record_without_a_grad_norm_is_not_compared_and_never_raises():
    """A record another writer left without `gnorm` (or an edit) was a KeyError in the audit, on
    rank 0 alone: the run died (events said failed) on every resume, and a second rank lost its
    peer. Now it is counted as not compared, with the reason, and no alert."""
    malformed = record(12)
    del malformed["gnorm"]
    audit, emitted = audit_of([record(11), malformed], last_step=12)
    audit.compare(record(11))
    audit.compare(record(12))
    ((event, f),) = emitted
    assert event == "resume_audit" and f["verdict"] == "exact" and f["compared"] == 1
    assert f["reason"] == "recorded steps without a number for gnorm (from step 12) were not compared"


def test_an_audit_that_cannot_compare_says_so_and_stops_instead_of_raising():
    audit, emitted = audit_of([record(11), record(12)], last_step=12)
    audit.compare({"loss": 3.0})  # no step: a record this audit cannot place
    audit.compare(record(12))
    ((event, f),) = emitted
    assert f["verdict"] == "nothing_to_compare" and "could not be compared (KeyError('step'))" in f["reason"]


@pytest.mark.parametrize("recorded_wd, now_wd, compared", [(0.1, 0.9, False), (0.5, 0.1, False), (0.5, 0.5, True)],
                         ids=["this-resume-drifts", "the-recording-job-drifted", "both-drift-alike"])
def test_the_records_are_compared_only_when_they_ran_this_config(tmp_path, recorded_wd, now_wd, compared):
    """--allow-drift optim.weight_decay: the recomputed steps run another config than the records.
    That was an alert ("the resume did not restore everything") for a change a user asked for. The
    config the records ran is the recording job's `start` event's, not the checkpoint's: a job that
    resumed with the drift and died, then a resume without it, was an exact-expected mismatch too;
    and two jobs with the same drift compare as usual."""
    def config(wd):
        return {"optim": {"weight_decay": wd, "impl": "auto"}, "train": {"total_steps": 100}}
    write(tmp_path / "metrics.jsonl", [record(s) for s in range(1, 15)])
    start = {"event": "start", "step": 10, "env": ENV, "config": config(recorded_wd) | {"train": {"total_steps": 50}}}
    (tmp_path / "events.jsonl").write_text(json.dumps(start) + "\n")
    emitted = []
    audit = ResumeAudit.after_resume(tmp_path, 10, ENV, 0.0, 14, lambda event, **f: emitted.append((event, f)),
                                     config(now_wd), ("train.total_steps",))  # mutable: not a change
    for s in (11, 12, 13, 14):
        audit.compare(record(s))
    ((event, f),) = emitted
    if compared:
        assert f["verdict"] == "exact" and f["compared"] == 4
    else:
        assert f["verdict"] == "nothing_to_compare" and f["reason"] == (
            "the job that recorded the steps after the checkpoint ran another config (optim.weight_decay)")


def test_a_changed_optimizer_implementation_is_within_tolerance_not_exact():
    """optim.impl (and train.compile, activation checkpointing, ...) may change at a resume: the
    same math scheduled another way, equal within rounding. The audit expected the bit, and a 1e-7
    grad-norm difference paged someone."""
    before = run_env("cpu", 1, "ddp", 4, 1, "2.13.0+cpu", 1, {"optim.impl": "foreach", "train.compile": False})
    now = run_env("cpu", 1, "ddp", 4, 1, "2.13.0+cpu", 1, {"optim.impl": "single", "train.compile": False})
    assert _why_not_exact(before, now) == "optim.impl 'foreach' -> 'single'"
    # A job of an older version recorded none of these: not taken as a change.
    assert _why_not_exact(ENV, now) == ""
    assert _why_not_exact({k: v for k, v in ENV.items() if k != "engine"}, ENV) == "engine None -> 'ddp'"
