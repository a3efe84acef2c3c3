"""dsslm.drill's verdict and its reading of a killed run's metrics, without running the drill.

The drill itself (three training jobs, a real SIGKILL, or torchrun) is slow: it runs in
tests/scenarios/test_lifecycle.py. These keep the module in the fast tier (`pytest -m "not slow"`).
"""
import math

from dsslm.drill import CLOSE, losses, main, verdict


def test_verdict_passes_to_the_bit_is_close_within_tolerance_and_fails_otherwise():
    ref = {1: 3.0, 2: 2.5, 3: 2.25}
    text, worst = verdict(ref, dict(ref))
    assert text.startswith("PASS") and worst == 0.0
    text, worst = verdict(ref, {**ref, 2: 2.5 + CLOSE / 2})
    assert text.startswith("CLOSE") and 0.0 < worst <= CLOSE
    text, worst = verdict(ref, {**ref, 3: 2.0})
    assert text.startswith("FAIL") and worst == 0.25
    text, worst = verdict(ref, {1: 3.0, 2: 2.5})
    assert text.startswith("FAIL") and "[3]" in text and math.isinf(worst)
    assert verdict({}, {})[0].startswith("FAIL")


def test_losses_keep_a_resumed_steps_last_record_and_skip_a_torn_line(tmp_path):
    (tmp_path / "metrics.jsonl").write_text(
        '{"step": 1, "loss": 3.0}\n{"step": 2, "loss": 2.9}\n{"step": 2, "val_loss": 2.8}\n'
        '{"step": 2, "loss": 2.5}\n{"step": 3, "loss": 2.4')
    assert losses(tmp_path) == {1: 3.0, 2: 2.5}


def test_a_bad_override_exits_2_before_any_job_starts(tmp_path, capsys):
    assert main(["resume", "--workdir", str(tmp_path), "train.no_such_key=1"]) == 2
    assert "train.no_such_key" in capsys.readouterr().err
    assert list(tmp_path.iterdir()) == []


def test_a_drill_that_could_kill_nothing_is_refused(tmp_path, capsys):
    """--kill-at past the run, a --workdir holding an earlier drill's finished runs, or --nproc 0:
    each printed PASS (or a torchrun traceback) without killing anything."""
    (tmp_path / "old" / "killed-and-resumed").mkdir(parents=True)
    short = ["train.total_steps=40", "optim.warmup_steps=4"]
    for argv, says in ((["--kill-at", "100", *short], "--kill-at 100 must be a step inside"),
                       (["--kill-at", "-3", *short], "--kill-at -3"),
                       (["--nproc", "0"], "--nproc 0 must be >= 1"),
                       (["--workdir", str(tmp_path / "old")], "holds an earlier drill's runs")):
        argv = argv if "--workdir" in argv else ["--workdir", str(tmp_path / "new"), *argv]
        assert main(["resume", *argv]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and says in err[0], err
    assert not (tmp_path / "new").exists()
