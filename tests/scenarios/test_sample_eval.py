"""`dsslm.sample` and `dsslm.eval` on tiny trained runs: repeatable text, and the validation loss
and bits per byte that training logged, reproduced from the checkpoint."""
from __future__ import annotations

import json
import math
import subprocess
from pathlib import Path

import numpy as np
import pytest

from dsslm import eval as eval_cli
from dsslm import sample as sample_cli
from dsslm.data import load_manifest, prepare
from dsslm.data.tokenizer import load_tokenizer, token_byte_lengths
from dsslm.train import train
from helpers import PYTHON, ROOT, read_jsonl, tiny_cfg

STEPS, EVERY = 6, 3


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict[str, Path]:
    import pydoc_data.topics
    import textwrap
    root = tmp_path_factory.mktemp("tools")
    (root / "prose.txt").write_text("\n\n".join(pydoc_data.topics.topics.values())[:20_000] + " naïve 日本 🙂")
    (root / "code.txt").write_text(Path(textwrap.__file__).read_text()[:20_000])
    out = {}
    for kind in ("byte", "bpe"):
        data = root / f"{kind}_data"
        prepare([root / "prose.txt"], data, domain="prose", tokenizer=kind, vocab_size=400 if kind == "bpe" else None,
                val_fraction=0.1)
        prepare([root / "code.txt"], data, domain="code", val_fraction=0.1)
        cfg = tiny_cfg(root / kind, f"data.dir={data}", f"train.total_steps={STEPS}", f"ckpt.every={EVERY}",
                       f"run.val_every={EVERY}", "run.val_batches=2", "ckpt.async_save=false", "ckpt.keep_last=5")
        assert train(cfg) == 0
        out[kind], out[f"{kind}_data"] = root / kind, data
    return out


def run_cli(cli, capsys, *argv) -> tuple[int, str, str]:
    try:
        rc = cli.main([*map(str, argv)])
    except SystemExit as exc:  # an argument error: argparse's exit
        rc = exc.code
    captured = capsys.readouterr()
    return rc, captured.out, captured.err


def logged_val(run_dir: Path, step: int) -> dict:
    (record,) = [r for r in read_jsonl(run_dir / "metrics.jsonl") if "val_loss" in r and r["step"] == step]
    return record


@pytest.mark.parametrize("kind", ["byte", "bpe"])
@pytest.mark.parametrize("step", [EVERY, STEPS])
def test_eval_reproduces_training_val_loss_and_bits_per_byte(runs, capsys, kind, step):
    rc, out, err = run_cli(eval_cli, capsys, runs[kind] / "checkpoints" / f"step-{step:08d}", "--device", "cpu")
    assert rc == 0, err
    result = json.loads(out.strip().splitlines()[-1])
    logged = logged_val(runs[kind], step)
    assert result["step"] == step and set(result["domains"]) == {"code", "prose"}
    for domain, d in result["domains"].items():
        assert d["loss"] == logged["val_loss"][domain]  # the same pass, to the bit (CPU, fp32)
        assert d["bpb"] == logged["val_bpb"][domain]
        assert d["bpb"] == pytest.approx(d["loss"] / math.log(2) * d["tokens"] / d["bytes"], rel=1e-12)
        assert d["tokens"] == 2 * 4 * 32
        if kind == "byte":  # one byte per target; an EOS (a document's end, or a cut one's) stands for none
            from dsslm.data.loader import Loader
            targets = Loader(runs["byte_data"], 32, 0).val_batches(domain, 2, 4)
            assert d["bytes"] == d["tokens"] - sum(int((t == 256).sum()) for _, t in targets)
        else:
            assert d["bytes"] > 1.5 * d["tokens"]  # a BPE token stands for several bytes
    assert "bits/byte" in out.splitlines()[1]


def test_eval_of_a_run_dir_takes_its_newest_checkpoint_and_writes_json(runs, tmp_path, capsys):
    rc, out, _ = run_cli(eval_cli, capsys, runs["bpe"], "--batches", "1", "--batch-size", "2",
                         "--json", tmp_path / "eval.json")
    assert rc == 0
    result = json.loads((tmp_path / "eval.json").read_text())
    assert result == json.loads(out.strip().splitlines()[-1])
    assert result["step"] == STEPS and all(d["tokens"] == 2 * 32 for d in result["domains"].values())


def test_eval_counts_the_bytes_of_exactly_the_targets_it_scored(runs, capsys):
    """Every whole chunk of each val split, counted again here from the shard files."""
    for kind in ("byte", "bpe"):
        rc, out, _ = run_cli(eval_cli, capsys, runs[kind], "--batches", "1000", "--batch-size", "1")
        data = runs[f"{kind}_data"]
        manifest = load_manifest(data)
        table = token_byte_lengths(load_tokenizer(data, manifest))
        for domain, d in json.loads(out.strip().splitlines()[-1])["domains"].items():
            targets = []
            for entry in manifest["domains"][domain]["val"]:
                tokens = np.fromfile(data / entry["path"], dtype=manifest["dtype"])
                n_chunks = (len(tokens) - 1) // 32
                targets.append(tokens[1 : n_chunks * 32 + 1])  # chunk i's targets: tokens [32i+1, 32i+33)
            targets = np.concatenate(targets)
            assert d["tokens"] == len(targets) and d["bytes"] == int(table[targets].sum())


def test_eval_on_data_of_another_tokenizer_exits_2(runs, capsys):
    rc, out, err = run_cli(eval_cli, capsys, runs["byte"], "--data", runs["bpe_data"])
    assert rc == 2 and out == "" and len(err.strip().splitlines()) == 1 and "another tokenizer" in err


def test_eval_refuses_a_val_shard_that_does_not_match_the_manifest(runs, tmp_path, capsys):
    import shutil
    data = tmp_path / "data"
    shutil.copytree(runs["byte_data"], data)
    shard = data / load_manifest(data)["domains"]["code"]["val"][0]["path"]
    raw = bytearray(shard.read_bytes())
    raw[10] ^= 1
    shard.write_bytes(bytes(raw))
    rc, _, err = run_cli(eval_cli, capsys, runs["byte"], "--data", data)
    assert rc == 2 and len(err.strip().splitlines()) == 1 and "val-00000.bin" in err


def test_eval_refuses_a_val_shard_with_ids_beyond_the_vocabulary_even_when_hashed_right(runs, tmp_path, capsys):
    """A manifest's writer can put any id in a shard and hash it: an IndexError out of the model's
    embedding before (exit 1). Training refused the same folder; eval now does too."""
    import hashlib
    import json
    import shutil
    data = tmp_path / "data"
    shutil.copytree(runs["byte_data"], data)
    manifest = json.loads((data / "manifest.json").read_text())
    entry = manifest["domains"]["code"]["val"][0]
    tokens = np.fromfile(data / entry["path"], dtype=manifest["dtype"])
    tokens[10] = 60000
    tokens.tofile(data / entry["path"])
    entry["sha256"] = hashlib.sha256((data / entry["path"]).read_bytes()).hexdigest()
    (data / "manifest.json").write_text(json.dumps(manifest))
    rc, _, err = run_cli(eval_cli, capsys, runs["byte"], "--data", data)
    assert rc == 2 and len(err.strip().splitlines()) == 1 and "token id 60000" in err


def test_eval_json_into_a_missing_folder_exits_2_before_evaluating(runs, tmp_path, capsys):
    rc, out, err = run_cli(eval_cli, capsys, runs["byte"], "--json", tmp_path / "nowhere" / "x.json")
    assert rc == 2 and out == "" and len(err.strip().splitlines()) == 1 and "does not exist" in err


@pytest.mark.parametrize("where", ["metrics", "folder", "checkpoint", "checkpoints"])
def test_eval_json_never_replaces_a_file_nor_writes_among_checkpoints_and_says_so_before_evaluating(
        runs, tmp_path, capsys, where):
    """--json replaced whatever was there: a run's metrics.jsonl, or (an eval.json written into
    checkpoints/step-N/, which its MANIFEST does not list) a valid checkpoint the next resume then set
    aside. A folder crashed with IsADirectoryError after the work (exit 1)."""
    run = runs["byte"]
    target, says = {"metrics": (run / "metrics.jsonl", "exists (a file)"), "folder": (tmp_path, "exists (a folder)"),
                    "checkpoint": (run / "checkpoints" / f"step-{STEPS:08d}" / "eval.json", "inside the checkpoint"),
                    "checkpoints": (run / "checkpoints" / "eval.json", "among the checkpoints")}[where]
    before = target.read_bytes() if target.is_file() else None
    rc, out, err = run_cli(eval_cli, capsys, run, "--json", target)
    assert rc == 2 and out == "" and len(err.strip().splitlines()) == 1 and says in err, err
    assert (target.read_bytes() if target.is_file() else None) == before
    assert sorted(p.name for p in tmp_path.iterdir()) == []


def test_eval_json_that_appears_while_evaluating_is_kept(runs, tmp_path, capsys, monkeypatch):
    target, real = tmp_path / "eval.json", eval_cli.evaluate
    monkeypatch.setattr(eval_cli, "evaluate", lambda *a: target.write_text("theirs") and real(*a))
    rc, out, err = run_cli(eval_cli, capsys, runs["byte"], "--batches", "1", "--json", target)
    assert rc == 2 and json.loads(out.strip().splitlines()[-1])["step"] == STEPS  # the result is printed
    assert len(err.strip().splitlines()) == 1 and "appeared while evaluating" in err, err
    assert target.read_text() == "theirs" and sorted(p.name for p in tmp_path.iterdir()) == ["eval.json"]


def test_sample_bad_prompt_bytes_and_seed_exit_2_in_one_line(runs, capsys):
    for argv, says in (((runs["byte"], "--prompt", "ab\udcffcd"), "not valid UTF-8"),
                       ((runs["bpe"], "--prompt", "ab\udcffcd"), "not valid UTF-8"),  # `tokenizers`: TypeError
                       ((runs["byte"], "--prompt", "ab", "--seed", str(2**70)), "--seed")):
        rc, out, err = run_cli(sample_cli, capsys, *argv, "--device", "cpu")
        assert rc == 2 and out == "" and len(err.strip().splitlines()) == 1 and says in err, err


def test_eval_of_a_missing_checkpoint_exits_2(tmp_path, capsys):
    rc, _, err = run_cli(eval_cli, capsys, tmp_path / "nope")
    assert rc == 2 and len(err.strip().splitlines()) == 1


@pytest.mark.parametrize("kind", ["byte", "bpe"])
def test_sample_with_the_same_seed_prints_the_same_text(runs, capsys, kind):
    argv = (runs[kind], "--prompt", "def wrap(", "--max-new-tokens", "30", "--device", "cpu")
    first = run_cli(sample_cli, capsys, *argv, "--seed", "7")
    second = run_cli(sample_cli, capsys, *argv, "--seed", "7")
    other = run_cli(sample_cli, capsys, *argv, "--seed", "8", "--temperature", "1.5", "--top-k", "0")
    assert first[0] == second[0] == other[0] == 0
    assert first[1] == second[1] and first[1].startswith("def wrap(") and len(first[1]) > len("def wrap(\n")
    assert other[1] != first[1]


def test_a_tiny_temperature_is_greedy(runs, capsys):
    """logits / 1e-300 overflowed float32 to inf, softmax gave NaN, and multinomial raised."""
    argv = (runs["byte"], "--prompt", "def wrap(", "--max-new-tokens", "12", "--device", "cpu")
    greedy = run_cli(sample_cli, capsys, *argv, "--temperature", "0")
    tiny = run_cli(sample_cli, capsys, *argv, "--temperature", "1e-300")
    assert greedy[0] == tiny[0] == 0 and greedy[1] == tiny[1]


@pytest.mark.slow
def test_sample_as_a_command_repeats_and_bad_arguments_exit_2(runs):
    cmd = [PYTHON, "-m", "dsslm.sample", str(runs["byte"]), "--prompt", "Th", "--max-new-tokens", "12", "--seed", "3"]
    outs = [subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=120) for _ in range(2)]
    assert [o.returncode for o in outs] == [0, 0] and outs[0].stdout == outs[1].stdout != ""
    bad = subprocess.run(cmd + ["--temperature", "-1"], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert bad.returncode == 2 and len(bad.stderr.strip().splitlines()) == 1 and "--temperature" in bad.stderr
