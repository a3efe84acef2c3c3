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
