"""Downstream evaluation (eval.*): in the training loop at the start and every eval.every steps,
without changing what training computes; from `dsslm.eval --tasks` on the checkpoint, the same
numbers; on 2 gloo ranks under DDP, ZeRO-3 and FSDP2, the same counts as on one; a bad task
refused at start with exit 2 and nothing written."""
from __future__ import annotations

import json
import random
import textwrap
from pathlib import Path

import pytest
import torch

from dsslm import eval as eval_cli
from dsslm.train import main as train_main, train
from helpers import TINY, read_jsonl, run_distributed, tiny_cfg

pytestmark = pytest.mark.slow
STEPS, EVERY = 6, 3


def make_task(path: Path, n: int = 24, seed: int = 0, max_len: int = 1000) -> Path:
    """Lines of real Python source: the context is a line's first half, the gold its second half,
    the distractors other lines' second halves (a trained model prefers the gold; a fresh one cannot)."""
    lines = [ln.strip() for ln in Path(textwrap.__file__).read_text().splitlines() if 30 < len(ln.strip()) <= max_len]
    rng = random.Random(seed)
    examples = []
    for line in rng.sample(lines, n):
        cut = len(line) // 2
        others = [o[len(o) // 2:] for o in rng.sample(lines, 3)]
        gold = rng.randrange(4)
        choices = others[:gold] + [line[cut:]] + others[gold:]
        examples.append({"context": line[:cut], "choices": choices, "gold": gold})
    path.write_text("".join(json.dumps(e) + "\n" for e in examples))
    return path


def eval_records(run_dir: Path) -> list[dict]:
    return [r for r in read_jsonl(run_dir / "metrics.jsonl") if "eval_acc" in r]


def test_evals_in_the_loop_change_nothing_and_the_cli_reproduces_them(tmp_path, capsys):
    task = make_task(tmp_path / "textwrap_lines.jsonl")
    common = (f"train.total_steps={STEPS}", f"ckpt.every={EVERY}", "ckpt.async_save=false", "ckpt.keep_last=5")
    assert train(tiny_cfg(tmp_path / "plain", *common)) == 0
    assert train(tiny_cfg(tmp_path / "evals", *common, f"eval.tasks=[{task}]", f"eval.every={EVERY}",
                          "eval.max_examples=20")) == 0
    plain, evals = (read_jsonl(tmp_path / name / "metrics.jsonl") for name in ("plain", "evals"))
    # Evaluating reads the weights and no random stream: training is the same to the bit.
    assert [r["loss"] for r in plain if "loss" in r] == [r["loss"] for r in evals if "loss" in r]
    records = eval_records(tmp_path / "evals")
    assert [r["step"] for r in records] == [0, EVERY, STEPS]
    for r in records:
        assert r["eval_examples"] == {"textwrap_lines": 20} and r["eval_chance"]["textwrap_lines"] == 0.25
        assert 0 <= r["eval_acc"]["textwrap_lines"] <= 1 and r["eval_bpb"]["textwrap_lines"] > 0
    assert records[-1]["eval_bpb"]["textwrap_lines"] < records[0]["eval_bpb"]["textwrap_lines"]  # it learns

    capsys.readouterr()
    rc = eval_cli.main([str(tmp_path / "evals" / "checkpoints" / f"step-{EVERY:08d}"), "--tasks", str(task),
                        "--device", "cpu"])
    out = capsys.readouterr().out
    assert rc == 0
    result = json.loads(out.strip().splitlines()[-1])
    logged = records[1]
    for metric in ("acc", "acc_norm", "acc_per_token", "bpb"):  # the same batches, the same bits (CPU, fp32)
        assert result["tasks"]["textwrap_lines"][metric] == logged[f"eval_{metric}"]["textwrap_lines"]
    assert "acc_norm" in out.splitlines()[1]

    from dsslm.report import main as report_main
    assert report_main([str(tmp_path / "evals")]) == 0
    assert (tmp_path / "evals" / "report" / "evals.png").stat().st_size > 0


@pytest.mark.parametrize("bad, message", [
    ("missing.jsonl", "no such file"),
    ("hellaswag_not_unpacked", "DSSLM_EVAL_DATA=1 scripts/setup.sh"),
    ("gold.jsonl", "line 1): gold 3 is out of range"),
])
def test_a_bad_task_exits_2_at_start_and_writes_nothing(tmp_path, capsys, monkeypatch, bad, message):
    (tmp_path / "gold.jsonl").write_text(json.dumps({"context": "a", "choices": [" b", " c"], "gold": 3}) + "\n")
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr("dsslm.evals.tasks.olmo_dir", lambda: tmp_path / "oe_eval_tasks")
    rc = train_main([f"run.dir={tmp_path / 'run'}", *TINY, "train.total_steps=6", f"eval.tasks=[{bad}]"])
    err = capsys.readouterr().err.strip()
    assert rc == 2 and len(err.splitlines()) == 1 and message in err, err
    assert not (tmp_path / "run").exists()  # not even a fresh run.dir


def engine_eval_worker(rank: int, world_size: int, kind: str, stage: int, task: str, run_dir: str) -> dict:
    from dsslm.data.tokenizer import ByteTokenizer
    from dsslm.evals.loop import TaskEvals
    from dsslm.engine import build_engine
    from dsslm.model import build_model

    cfg = tiny_cfg(Path(run_dir), f"engine.kind={kind}", f"engine.zero_stage={stage}", f"eval.tasks=[{task}]",
                   "train.micro_batch_size=2")  # a small budget: several batches per rank
    cfg.model.vocab_size = ByteTokenizer.vocab_size
    torch.manual_seed(cfg.run.seed)
    engine = build_engine(cfg, build_model(cfg.model))
    logged = []

    class Sinks:
        log_val = staticmethod(logged.append)
    try:
        line = TaskEvals.for_job(cfg, engine, Sinks, ByteTokenizer).run(0)
    finally:
        engine.close()
    return {**line, "logged": len(logged)}


@pytest.mark.parametrize("kind, stage", [("ddp", 1), ("zero", 3), ("fsdp", 1)], ids=["ddp", "zero3", "fsdp"])
def test_the_result_does_not_depend_on_the_world_size_or_engine(tmp_path, kind, stage):
    task = str(make_task(tmp_path / "lines.jsonl", n=30))
    (one,) = run_distributed(engine_eval_worker, 1, ("ddp", 1, task, str(tmp_path / "one")))
    ranks = run_distributed(engine_eval_worker, 2, (kind, stage, task, str(tmp_path / "two")), timeout_s=900)
    assert ranks[0]["eval_examples"] == {"lines": 30}
    for key in ("eval_acc", "eval_acc_norm", "eval_acc_per_token"):  # the same counts of correct examples
        assert ranks[0][key] == ranks[1][key] == one[key]
    if kind == "ddp":  # the same model, batches and math: the same bits
        assert ranks[0]["eval_bpb"] == one["eval_bpb"]
    else:  # sharded engines gather the weights their own way: rounding-level differences
        assert ranks[0]["eval_bpb"]["lines"] == pytest.approx(one["eval_bpb"]["lines"], rel=1e-5)


LM_EVAL_SCRIPT = """
import json, sys
from lm_eval import simple_evaluate
from lm_eval.tasks import TaskManager
hf_dir, task_dir, out = sys.argv[1:4]
res = simple_evaluate(model="hf", model_args=f"pretrained={hf_dir},dtype=float32,device=cpu",
                      tasks=["dsslm_parity"], task_manager=TaskManager(include_path=task_dir), batch_size=4,
                      log_samples=True)
samples = sorted(res["samples"]["dsslm_parity"], key=lambda s: s["doc_id"])
json.dump({"acc": res["results"]["dsslm_parity"]["acc,none"], "acc_norm": res["results"]["dsslm_parity"]["acc_norm,none"],
           "lls": [[float(r[0]) for r in s["filtered_resps"]] for s in samples]}, open(out, "w"))
"""

# The same examples as an lm-eval custom task: the fields by name, no delimiter added (the
# choices carry their space), zero-shot.
LM_EVAL_TASK = """task: dsslm_parity
dataset_path: json
dataset_kwargs:
  data_files:
    test: {path}
test_split: test
output_type: multiple_choice
doc_to_text: context
doc_to_choice: choices
doc_to_target: gold
target_delimiter: ""
num_fewshot: 0
metric_list:
  - metric: acc
  - metric: acc_norm
"""


@pytest.mark.parametrize("kind", ["byte", "bpe"])
def test_the_same_counts_as_lm_eval_harness_on_an_exported_model(tmp_path, capsys, kind):
    pytest.importorskip("lm_eval", reason="lm-eval is not installed: pip install -e '.[evals]'")
    import subprocess
    import sys

    import numpy as np

    from dsslm.data import prepare
    from dsslm.evals.scoring import Prepared, score_rows
    from dsslm.evals.tasks import load_tasks
    from dsslm.hf.causal_lm import open_hf
    from dsslm.export import main as export_main
    text = Path(textwrap.__file__).read_text()
    prepare([_write(tmp_path / "text.txt", text)], tmp_path / "data", tokenizer=kind,
            vocab_size=400 if kind == "bpe" else None, val_fraction=0.05)
    # lm-eval refuses a continuation longer than the context length (max_position_embeddings).
    assert train(tiny_cfg(tmp_path / "run", f"data.dir={tmp_path / 'data'}", "train.total_steps=20",
                          "model.seq_len=64", "ckpt.async_save=false")) == 0
    assert export_main([str(tmp_path / "run"), "--out", str(tmp_path / "hf")]) == 0
    task = make_task(tmp_path / "parity.jsonl", n=40, seed=1, max_len=100)
    # Contexts that end in a space (lm-eval moves it into the continuation) and an empty one (EOS).
    extra = [{"context": "import ", "choices": ["re", "textwrap", "os"], "gold": 1},
             {"context": "", "choices": ["def wrap(text):", "zzz qqq"], "gold": 0}]
    with open(task, "a") as f:
        f.write("".join(json.dumps(e) + "\n" for e in extra))
    (tmp_path / "lm_tasks").mkdir()
    (tmp_path / "lm_tasks" / "dsslm_parity.yaml").write_text(LM_EVAL_TASK.format(path=task))

    capsys.readouterr()
    assert eval_cli.main([str(tmp_path / "hf"), "--tasks", str(task), "--max-examples", "0", "--device", "cpu"]) == 0
    ours = json.loads(capsys.readouterr().out.strip().splitlines()[-1])["tasks"]["parity"]
    env = {"HF_DATASETS_OFFLINE": "1", "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
           "HF_DATASETS_CACHE": str(tmp_path / "ds_cache"), "HF_HOME": str(tmp_path / "hf_home"),
           "PATH": "/usr/bin:/bin", "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([sys.executable, "-c", LM_EVAL_SCRIPT, str(tmp_path / "hf"), str(tmp_path / "lm_tasks"),
                           str(tmp_path / "lm.json")], env=env, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    theirs = json.loads((tmp_path / "lm.json").read_text())
    n = ours["examples"]
    assert n == 42
    assert ours["correct_acc"] == round(theirs["acc"] * n) and ours["correct_acc_norm"] == round(theirs["acc_norm"] * n)
    # ...because every choice's log-likelihood agrees (fp32; other batch shapes and kernels).
    forward, tok, seq_len, prefix_id = open_hf(tmp_path / "hf", torch.device("cpu"))
    assert prefix_id == tok.eos_id  # an export's BOS is its EOS
    prepared = Prepared.build(load_tasks([str(task)]), tok, seq_len, prefix_id)
    lls = score_rows(forward, prepared.rows, 8 * seq_len, "fp32", torch.device("cpu"), prepared.pad_id)
    per_choice = np.zeros(len(prepared.rows.choices))
    np.add.at(per_choice, prepared.rows.owner, lls)
    np.testing.assert_allclose(per_choice, [ll for doc in theirs["lls"] for ll in doc], rtol=1e-4, atol=1e-3)


def _write(path: Path, text: str) -> Path:
    path.write_text(text)
    return path
