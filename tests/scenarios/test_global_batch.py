"""train.global_batch_size: the global batch is the setting, grad_accum follows per world size, and
a resume on another GPU count keeps the batch and the learning-rate plan with no --allow-drift."""
from __future__ import annotations

import re

import pytest

from dsslm.config import load
from dsslm.optim import lr_at
from dsslm.train import main
from helpers import TINY, events, read_jsonl, run_train


def test_setting_both_global_batch_and_grad_accum_exits_2_with_one_line(tmp_path, capsys):
    assert main([f"run.dir={tmp_path / 'run'}", *TINY, "train.global_batch_size=8", "train.grad_accum=2"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "train.global_batch_size=8" in err[0] and "train.grad_accum=2" in err[0], err
    assert not (tmp_path / "run").exists()


def test_global_batch_not_a_multiple_of_micro_batch_times_world_exits_2_naming_the_numbers(tmp_path, capsys):
    assert main([f"run.dir={tmp_path / 'run'}", *TINY, "train.global_batch_size=10", "train.micro_batch_size=4"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "train.global_batch_size=10" in err[0] and "train.micro_batch_size=4" in err[0] \
        and "world size 1 = 4" in err[0], err
    assert not (tmp_path / "run" / "checkpoints").exists()


def test_shipped_gpu_configs_set_the_global_batch_not_grad_accum():
    import yaml
    from helpers import ROOT
    for name in ("125m", "350m", "1b"):
        raw = yaml.safe_load((ROOT / "configs" / f"{name}.yaml").read_text())
        assert raw["train"].get("global_batch_size", 0) > 0 and "grad_accum" not in raw["train"], name
        load(ROOT / "configs" / f"{name}.yaml")  # and it validates


@pytest.mark.slow
def test_resume_2_ranks_to_1_keeps_global_batch_and_lr_plan_without_allow_drift(tmp_path):
    run_dir = tmp_path / "run"
    batch = ["train.global_batch_size=8", "train.micro_batch_size=2"]
    # 2 ranks x 2 sequences x grad_accum 2 for 4 steps, then 1 rank x 2 x grad_accum 4 to step 8.
    run_train(run_dir, *batch, "train.total_steps=8", "ckpt.every=4", "faults.crash_at_step=5",
              "faults.crash_mode=raise", nproc=2, check=False)
    assert [r["step"] for r in read_jsonl(run_dir / "metrics.jsonl") if "loss" in r][:4] == [1, 2, 3, 4]
    # A refused resume on 2 ranks: rank 0 refuses for both, and says so once, not once per rank.
    refused = run_train(run_dir, *batch, "train.total_steps=8", "ckpt.every=4", "train.z_loss=0.5", nproc=2,
                        check=False)
    lines = [line for line in refused.stderr.splitlines() if line.startswith("dsslm: ") and "train.z_loss" in line]
    assert refused.returncode != 0 and len(lines) == 1, refused.stderr[-3000:]
    assert main([f"run.dir={run_dir}", *TINY, *batch, "train.total_steps=8", "ckpt.every=4"]) == 0  # no drift flag
    starts = events(run_dir, "start")
    assert [(s["world_size"], s["env"]["grad_accum"]) for s in starts] == [(2, 2), (1, 4)]
    assert [e["step"] for e in events(run_dir, "resume")] == [4]
    records = {r["step"]: r for r in read_jsonl(run_dir / "metrics.jsonl") if "loss" in r}
    assert sorted(records) == list(range(1, 9))
    assert [(records[s]["data_position"], records[s]["batch_sequences"]) for s in range(1, 9)] == \
        [(8 * (s - 1), 8) for s in range(1, 9)]  # one stream of 8-sequence steps, nothing repeated or skipped
    cfg = load(None, [*TINY, *batch, "train.total_steps=8"])
    for step, record in records.items():  # the schedule continues where it was, not restarted
        assert record["lr"] == pytest.approx(lr_at(step - 1, cfg), rel=1e-12), step
    # The same global batch on one rank from the start: the same math summed in another order.
    reference = tmp_path / "reference"
    assert main([f"run.dir={reference}", *TINY, *batch, "train.total_steps=8", "ckpt.every=8"]) == 0
    ref = {r["step"]: r["loss"] for r in read_jsonl(reference / "metrics.jsonl") if "loss" in r}
    for step in range(1, 9):
        assert records[step]["loss"] == pytest.approx(ref[step], rel=1e-4), step  # fp32 reduction order


def test_a_changed_product_names_the_keys_that_keep_the_global_batch(tmp_path, capsys):
    """A run made without train.global_batch_size, resumed with another product (here grad_accum;
    on another world size the same): the advice was "restore it", of a key that does not exist.
    It names the keys that keep the old batch, and they resume as written, appended to the command."""
    run = [f"run.dir={tmp_path / 'run'}", *TINY, "train.total_steps=6", "train.micro_batch_size=2"]
    assert main([*run, "train.grad_accum=2"]) == 0
    capsys.readouterr()
    resume = [*run, "train.grad_accum=1", "train.total_steps=8"]
    assert main(resume) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "set train.grad_accum=2 (or drop train.grad_accum and set train.global_batch_size=4)" \
        in err[0], err
    assert main([*resume, "train.grad_accum=2"]) == 0


@pytest.mark.slow
def test_a_resume_on_2_processes_is_refused_once_last_and_its_advice_resumes_under_torchrun(tmp_path):
    """1 process of micro-batch 4, resumed on 2: the advice was train.global_batch_size=4, which
    2 x 4 refused again, once per process. Now one line, the last dsslm prints (torchrun's report
    follows, with the ranks' exit code 2), and the keys it names resume as written."""
    run_dir = tmp_path / "run"
    more = ("train.total_steps=4", "ckpt.every=2", "optim.warmup_steps=1")
    assert main([f"run.dir={run_dir}", *TINY, "train.total_steps=2", "ckpt.every=2", "optim.warmup_steps=1"]) == 0
    proc = run_train(run_dir, *more, nproc=2, check=False)
    lines = proc.stderr.splitlines()
    said = [i for i, line in enumerate(lines) if line.startswith("dsslm:")]
    refusals = [i for i in said if "refused" in lines[i]]
    assert len(refusals) == 1 and refusals[0] == said[-1], proc.stderr[-3000:]
    assert re.search(r"exitcode\s*:\s*2", "\n".join(lines[said[-1]:])), proc.stderr[-3000:]
    advice = re.search(r"; set ((?:train\.[a-z_]+=\d+ ?)+)", lines[said[-1]]).group(1).split()
    assert advice == ["train.global_batch_size=4", "train.micro_batch_size=2"]
    run_train(run_dir, *more, *advice, nproc=2)
    assert [s["world_size"] for s in events(run_dir, "start")] == [1, 2]
