"""Tokenizers, `python -m dsslm.data prepare` on every input kind, the manifest, bad input, the corpus."""
from __future__ import annotations

import json
import os
import stat
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from dsslm.data import DataError, load_manifest, manifest_hash, prepare
from dsslm.data.__main__ import main
from dsslm.data.tokenizer import ByteTokenizer, load_tokenizer

from helpers import ROOT
TEXT = "héllo wörld, 日本語 🙂\n\tdef f(x):\n        return x * 2\n"


def shard_tokens(data_dir: Path, domain: str, split: str = "train") -> np.ndarray:
    manifest = load_manifest(data_dir)
    parts = [np.fromfile(data_dir / e["path"], dtype=manifest["dtype"]) for e in manifest["domains"][domain][split]]
    return np.concatenate(parts) if parts else np.empty(0, dtype=manifest["dtype"])


def documents(data_dir: Path, domain: str = "default") -> list[str]:
    """The documents of a byte domain prepared with --val-fraction 0, split at EOS."""
    tokens = shard_tokens(data_dir, domain)
    assert tokens[-1] == 256
    cuts = np.flatnonzero(tokens == 256)
    starts = np.concatenate([[0], cuts[:-1] + 1])
    return [bytes(tokens[s:e].astype(np.uint8)).decode() for s, e in zip(starts, cuts)]


def words(n_lines: int, seed: int) -> str:
    rng = np.random.default_rng(seed)
    vocab = np.array(["alpha", "beta", "gamma", "delta", "λx", "naïve", "def", "return", "(", ")"])
    return "".join(" ".join(rng.choice(vocab, 10)) + "\n" for _ in range(n_lines))


def no_leftovers(data_dir: Path) -> bool:
    return not data_dir.exists() or not any(p.name.startswith(".") for p in data_dir.iterdir())


def test_byte_tokenizer_roundtrips_non_ascii():
    tok = ByteTokenizer()
    ids = tok.encode(TEXT)
    assert max(ids) < 256 and len(ids) == len(TEXT.encode())
    assert tok.decode(ids + [tok.eos_id]) == TEXT
    assert (tok.vocab_size, tok.eos_id) == (257, 256)
    assert tok.sha256 == ByteTokenizer().sha256


def test_bpe_trains_and_roundtrips(tmp_path):
    (tmp_path / "a.txt").write_text(words(400, 0) + TEXT)
    manifest = prepare([tmp_path / "a.txt"], tmp_path / "d", tokenizer="bpe", vocab_size=400, val_fraction=0)
    tok = load_tokenizer(tmp_path / "d", manifest)
    assert manifest["tokenizer"]["kind"] == "bpe" and manifest["dtype"] == "uint16"
    assert 257 < tok.vocab_size <= 400 and manifest["tokenizer"]["eos_id"] == tok.eos_id
    assert tok.decode(tok.encode(TEXT + " <|endoftext|> ok")) == TEXT + " <|endoftext|> ok"
    tokens = shard_tokens(tmp_path / "d", "default")
    assert list(tokens).count(tok.eos_id) == 1 and tokens[-1] == tok.eos_id
    assert tok.decode(tokens) == words(400, 0) + TEXT
    assert len(tokens) < len((words(400, 0) + TEXT).encode()) / 2  # merges were learned


def test_prepare_text_file(tmp_path):
    (tmp_path / "a.txt").write_text(TEXT)
    (tmp_path / "b.txt").write_text("second\r\nfile")  # universal newlines, no final newline
    prepare([tmp_path / "a.txt", tmp_path / "b.txt"], tmp_path / "d", val_fraction=0)
    assert documents(tmp_path / "d") == [TEXT, "second\nfile"]


def test_prepare_jsonl_default_and_custom_field(tmp_path):
    records = [{"text": "first doc", "body": "b1"}, {"text": "é second", "body": "b2"}, {"text": "", "body": "b3"}]
    (tmp_path / "a.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    prepare([tmp_path / "a.jsonl"], tmp_path / "d1", val_fraction=0)
    assert documents(tmp_path / "d1") == ["first doc", "é second"]  # an empty record is no document
    prepare([tmp_path / "a.jsonl"], tmp_path / "d2", val_fraction=0, text_field="body")
    assert documents(tmp_path / "d2") == ["b1", "b2", "b3"]


def test_prepare_parquet(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.table({"content": ["p one", "p two"], "n": [1, 2]}), tmp_path / "a.parquet")
    prepare([tmp_path / "a.parquet"], tmp_path / "d", val_fraction=0, text_field="content")
    assert documents(tmp_path / "d") == ["p one", "p two"]


def test_prepare_folder_is_recursive_sorted_and_skips_hidden(tmp_path):
    src = tmp_path / "src"
    (src / "sub" / "__pycache__").mkdir(parents=True)
    (src / ".git").mkdir()
    (src / "b.md").write_text("# bee")
    (src / "a.py").write_text("print('a')\n")
    (src / "sub" / "c.jsonl").write_text('{"text": "json c"}\n')
    (src / "sub" / "d.rst").write_text("dee")
    (src / ".git" / "HEAD").write_text("hidden")
    (src / "sub" / "__pycache__" / "a.pyc").write_bytes(b"\0\1\2")
    (src / "sub" / "e.bin").write_bytes(b"binary\0data")
    prepare([src], tmp_path / "d", val_fraction=0)
    assert documents(tmp_path / "d") == ["print('a')\n", "# bee", "json c", "dee"]


def test_prepare_save_to_disk_dataset(tmp_path):
    import datasets

    datasets.Dataset.from_dict({"text": ["s one", "s two", "s three"]}).save_to_disk(str(tmp_path / "saved"))
    prepare([tmp_path / "saved"], tmp_path / "d", val_fraction=0)
    assert documents(tmp_path / "d") == ["s one", "s two", "s three"]


def test_two_domains_each_with_its_own_val_split(tmp_path, capsys):
    (tmp_path / "a.txt").write_text(words(2000, 1))
    (tmp_path / "b.txt").write_text(words(1000, 2))
    out = tmp_path / "d"
    prepare([tmp_path / "a.txt"], out, domain="prose", tokenizer="bpe", vocab_size=300, val_fraction=0.05)
    tokenizer_bytes = (out / "tokenizer.json").read_bytes()
    capsys.readouterr()
    manifest = prepare([tmp_path / "b.txt"], out, domain="code", vocab_size=512, val_fraction=0.05)
    assert "--vocab-size 512 is not used" in capsys.readouterr().err  # it was ignored without a word
    assert (out / "tokenizer.json").read_bytes() == tokenizer_bytes  # reused, not retrained
    assert sorted(manifest["domains"]) == ["code", "prose"]
    for domain in ("code", "prose"):
        train, val = shard_tokens(out, domain), shard_tokens(out, domain, "val")
        assert len(val) > 0 and 0.02 < len(val) / (len(train) + len(val)) < 0.1
    assert load_manifest(out) == manifest


def test_tiny_input_still_gets_a_val_block(tmp_path):
    (tmp_path / "a.txt").write_text(words(30, 3))  # ~20 blocks of 64 tokens: f=0.01 routes none
    manifest = prepare([tmp_path / "a.txt"], tmp_path / "d", val_fraction=0.01)
    assert manifest["domains"]["default"]["val"][0]["tokens"] > 0


def test_split_is_deterministic_and_hash_ignores_paths(tmp_path):
    (tmp_path / "a.txt").write_text(words(3000, 4))
    (tmp_path / "copy").mkdir()
    (tmp_path / "copy" / "a.txt").write_text(words(3000, 4))
    m1 = prepare([tmp_path / "a.txt"], tmp_path / "d1", val_fraction=0.1, shard_tokens=10_000)
    m2 = prepare([tmp_path / "copy" / "a.txt"], tmp_path / "d2", val_fraction=0.1, shard_tokens=10_000)
    assert len(m1["domains"]["default"]["train"]) > 1  # several shards
    assert manifest_hash(m1) == manifest_hash(m2)
    m3 = prepare([tmp_path / "a.txt"], tmp_path / "d3", val_fraction=0.2)
    assert manifest_hash(m3) != manifest_hash(m1)


def test_manifest_catches_one_flipped_byte(tmp_path):
    (tmp_path / "a.txt").write_text(words(200, 5))
    manifest = prepare([tmp_path / "a.txt"], tmp_path / "d", val_fraction=0)
    shard = tmp_path / "d" / manifest["domains"]["default"]["train"][0]["path"]
    data = bytearray(shard.read_bytes())
    data[100] ^= 1
    shard.write_bytes(bytes(data))
    load_manifest(tmp_path / "d", verify=False)  # sizes still match
    with pytest.raises(DataError, match="train-00000.bin"):
        load_manifest(tmp_path / "d")
    shard.write_bytes(bytes(data[:-2]))
    with pytest.raises(DataError, match="train-00000.bin"):
        load_manifest(tmp_path / "d", verify=False)
    with pytest.raises(DataError, match="no manifest.json"):
        load_manifest(tmp_path)


@pytest.mark.parametrize("case", ["empty_file", "missing_file", "missing_field", "unknown_tokenizer", "bad_fraction",
                                  "binary_file", "mixed_types", "out_is_a_file"])
def test_bad_input_exits_2_and_leaves_nothing(tmp_path, capsys, case):
    (tmp_path / "empty.txt").write_text("")
    # A text field of mixed types: datasets re-serialised every value as JSON text (the documents
    # quoted in the shards), exit 0. (Found by review.)
    (tmp_path / "mixed.jsonl").write_text('{"text": "first doc"}\n{"text": {"a": 1}}\n')
    if case == "out_is_a_file":  # a NotADirectoryError traceback before
        (tmp_path / "d").write_text("my notes")
    (tmp_path / "model.bin").write_bytes(bytes(range(256)) * 4)  # a NUL byte: not text
    (tmp_path / "a.jsonl").write_text('{"body": "no text field"}\n')
    (tmp_path / "a.txt").write_text("fine")
    argv = {
        "empty_file": ["--input", str(tmp_path / "empty.txt")],
        "missing_file": ["--input", str(tmp_path / "nope.txt")],
        "missing_field": ["--input", str(tmp_path / "a.jsonl")],
        "unknown_tokenizer": ["--input", str(tmp_path / "a.txt"), "--tokenizer", "wordpiece"],
        "bad_fraction": ["--input", str(tmp_path / "a.txt"), "--val-fraction", "1.5"],
        "binary_file": ["--input", str(tmp_path / "model.bin")],  # given directly, as a folder's would be skipped
        "mixed_types": ["--input", str(tmp_path / "mixed.jsonl")],
        "out_is_a_file": ["--input", str(tmp_path / "a.txt")],
    }[case]
    assert main(["prepare", *argv, "--out", str(tmp_path / "d")]) == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1, err
    hint = {"empty_file": "no text", "missing_file": "does not exist", "missing_field": "--text-field",
            "unknown_tokenizer": "--tokenizer", "bad_fraction": "--val-fraction", "binary_file": "binary",
            "mixed_types": "changed from string to object", "out_is_a_file": "is a file"}[case]
    assert hint in err
    if case == "out_is_a_file":
        assert (tmp_path / "d").read_text() == "my notes"
    else:
        assert not (tmp_path / "d").exists()


def test_bad_input_into_existing_data_dir_keeps_it_valid(tmp_path, capsys):
    (tmp_path / "a.txt").write_text(words(100, 6))
    (tmp_path / "b.jsonl").write_text('{"text": "fine"}\n{"text": "broken\n')
    out = tmp_path / "d"
    assert main(["prepare", "--input", str(tmp_path / "a.txt"), "--out", str(out)]) == 0
    before = (out / "manifest.json").read_bytes()
    cases = [
        ["--input", str(tmp_path / "a.txt"), "--domain", "x", "--tokenizer", "bpe"],  # byte DATA_DIR
        ["--input", str(tmp_path / "a.txt")],  # domain "default" exists
        ["--input", str(tmp_path / "a.txt"), str(tmp_path / "b.jsonl"), "--domain", "y"],  # fails mid-way
    ]
    for argv in cases:
        capsys.readouterr()
        assert main(["prepare", *argv, "--out", str(out)]) == 2
        err = capsys.readouterr().err
        assert len(err.strip().splitlines()) == 1 and ("--tokenizer" in err or "--domain" in err or "b.jsonl" in err)
    assert (out / "manifest.json").read_bytes() == before
    assert sorted(p.name for p in out.iterdir()) == ["default", "manifest.json"]


def folder_state(folder: Path) -> dict:
    """Every entry under `folder`: its kind and, for a file, its bytes (a link: where it points)."""
    return {str(p.relative_to(folder)): (os.readlink(p) if p.is_symlink() else p.read_bytes() if p.is_file()
                                         else stat.S_IFMT(p.lstat().st_mode)) for p in sorted(folder.rglob("*"))}


@pytest.mark.parametrize("manifest", ["torn", "folder", "dangling_link", "fifo"])
def test_prepare_into_an_unreadable_manifest_leaves_the_folder_as_it_was(tmp_path, capsys, manifest):
    """Refused (exit 2, one line), but the refusal came after the leftovers of a killed prepare were
    removed; a manifest.json that was not a file (a folder, a broken link, a FIFO) was taken for
    none, and a link was replaced by a new manifest (a folder: a traceback)."""
    (tmp_path / "a.txt").write_text(words(100, 6))
    out = tmp_path / "d"
    out.mkdir()
    path = out / "manifest.json"
    {"torn": lambda: path.write_text('{"format": 1, "tokeni'), "folder": path.mkdir,
     "dangling_link": lambda: path.symlink_to("gone.json"), "fifo": lambda: os.mkfifo(path)}[manifest]()
    (out / ".dsslm-verified.json").write_text('{"format": 1, "shards": {}}')
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    leftover = out / f".tmp-web-{int(dead.stdout)}"  # a killed prepare's, on this host
    leftover.mkdir()
    (leftover / "train-00000.bin").write_bytes(b"\0" * 100)
    before = folder_state(out)
    assert main(["prepare", "--input", str(tmp_path / "a.txt"), "--out", str(out)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "manifest.json" in err[0], err
    assert folder_state(out) == before


@pytest.mark.slow
def test_cli_runs_as_a_module(tmp_path):
    (tmp_path / "a.txt").write_text(TEXT)
    cmd = [sys.executable, "-m", "dsslm.data", "prepare", "--input", str(tmp_path / "a.txt"),
           "--out", str(tmp_path / "d")]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert "prepared domain 'default'" in proc.stdout
    assert load_manifest(tmp_path / "d")["tokenizer"]["kind"] == "byte"


RSS_SCRIPT = """
import resource, sys
from dsslm.data.prepare import prepare, quiet_datasets
quiet_datasets()
prepare([sys.argv[1]], sys.argv[2] + "/warm", val_fraction=0.01)  # load datasets' machinery first
before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
prepare([sys.argv[3]], sys.argv[2] + "/big", val_fraction=0.01)
print((resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before) // 1024)
"""


@pytest.mark.slow
def test_prepare_streams_in_bounded_memory(tmp_path):
    block = words(2000, 7).encode()
    n_blocks = (50 << 20) // len(block) + 1
    with open(tmp_path / "big.txt", "wb") as f:
        for _ in range(n_blocks):
            f.write(block)
    (tmp_path / "small.txt").write_text(TEXT)
    cmd = [sys.executable, "-c", RSS_SCRIPT, str(tmp_path / "small.txt"), str(tmp_path), str(tmp_path / "big.txt")]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    growth_mb = int(proc.stdout.split()[-1])
    assert growth_mb < 300, f"peak RSS grew {growth_mb} MB preparing 50 MB"
    # Every byte once; the EOS tokens are the document's own and one per split where a block of the
    # other split cut it off (SplitRouter): at most two per val block.
    from dsslm.data.prepare import _block_tokens
    from dsslm.data.sources import find_sources
    train, val = shard_tokens(tmp_path / "big", "default"), shard_tokens(tmp_path / "big", "default", "val")
    assert (train != 256).sum() + (val != 256).sum() == n_blocks * len(block) and train[-1] == 256
    val_blocks = -(-(val != 256).sum() // _block_tokens(find_sources([tmp_path / "big.txt"]), "byte"))
    assert 1 <= (train == 256).sum() + (val == 256).sum() <= 1 + 2 * val_blocks


CORPUS_SCRIPT = "from dsslm.data.corpus import default_data_dir; print(default_data_dir())"


@pytest.mark.slow
def test_default_corpus_builds_once_when_two_processes_race(tmp_path, monkeypatch):
    monkeypatch.setenv("DSSLM_CACHE", str(tmp_path))
    procs = [subprocess.Popen([sys.executable, "-c", CORPUS_SCRIPT], cwd=ROOT, stdout=subprocess.PIPE, text=True)
             for _ in range(2)]
    outs = [p.communicate(timeout=300)[0].strip() for p in procs]
    assert all(p.returncode == 0 for p in procs)
    assert outs[0] == outs[1] == str(tmp_path / "stdlib-v2")
    assert [p.name for p in tmp_path.iterdir()] == ["stdlib-v2"]  # the loser's copy is gone
    from dsslm.data.corpus import default_data_dir

    manifest = load_manifest(default_data_dir())
    assert "code" in manifest["domains"] and manifest["tokenizer"]["kind"] == "byte"
    assert sum(e["tokens"] for e in manifest["domains"]["code"]["train"]) > 2_000_000
    assert all(d["val"] for d in manifest["domains"].values())


def test_no_span_between_two_eos_holds_text_of_two_documents(tmp_path):
    """Val blocks are cut at token offsets: the train blocks either side of one were written back
    to back, so the tail of one document and the head of another became one EOS-delimited span,
    and the document mask let them attend to each other (so in val). Each split's document cut
    off by a block of the other split now ends with an EOS; the byte count stays exact (EOS is
    0 bytes). 20 documents of 150 letters, one letter each. (Before: 4 such spans in train.)"""
    letters = [chr(ord("A") + i) * 150 for i in range(20)]
    (tmp_path / "d.jsonl").write_text("".join(json.dumps({"text": t}) + "\n" for t in letters))
    manifest = prepare([tmp_path / "d.jsonl"], tmp_path / "out", val_fraction=0.2)
    spans = {}
    for split in ("train", "val"):
        tokens = shard_tokens(tmp_path / "out", "default", split)
        spans[split] = bytes(np.where(tokens == 256, ord("|"), tokens).astype(np.uint8)).decode().split("|")
        assert all(len(set(span)) <= 1 for span in spans[split]), [s for s in spans[split] if len(set(s)) > 1]
    assert len(spans["train"]) > 15 and len(spans["val"]) > 3
    assert sum(e["bytes"] for e in manifest["domains"]["default"]["train"] + manifest["domains"]["default"]["val"]) \
        == 20 * 150  # each document's text, counted exactly: an EOS is no text


def test_a_killed_prepares_temp_folder_is_removed_by_the_next(tmp_path, capsys):
    """A prepare killed mid-write left .tmp-DOMAIN-PID (a partial shard) for good: later
    prepares and trainers never removed it. A live process's folder, or another host's, stays."""
    import os
    import socket
    (tmp_path / "a.txt").write_text(words(200, 0))
    data = tmp_path / "data"
    data.mkdir()
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    pid = int(dead.stdout)  # a process that has exited
    killed, alive, other = data / f".tmp-web-{pid}", data / f".tmp-web-{os.getpid()}", data / f".tmp-code-{pid}"
    for folder, host in ((killed, socket.gethostname()), (alive, socket.gethostname()), (other, "elsewhere")):
        folder.mkdir()
        (folder / "train-00000.bin").write_bytes(b"\0" * 1000)
        (folder / ".owner").write_text(host)
    prepare([tmp_path / "a.txt"], data, domain="prose")
    assert not killed.exists() and alive.exists() and other.exists()
    assert f"removed {killed}" in capsys.readouterr().err
    assert sorted(p.name for p in (data / "prose").iterdir() if p.name.startswith(".")) == []  # no owner file
