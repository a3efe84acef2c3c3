"""Byte counts (what bits per byte divides by) and `prepare --tokenizer PATH` (a tokenizer.json
someone else made, such as a Hugging Face model's)."""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from dsslm.data import DataError, load_manifest, prepare
from dsslm.data.__main__ import main
from dsslm.data.bytecount import ByteCounter
from dsslm.loss import bits_per_byte
from dsslm.data.tokenizer import load_tokenizer, token_byte_lengths
from dsslm.durable import file_sha256

TEXT = "héllo wörld, 日本語 🙂 naïve ß\n\tdef f(x):\n        return x * 2\n"


def corpus(folder: Path, n: int = 60) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    for i in range(3):
        (folder / f"{i}.txt").write_text("".join(f"{TEXT} {i} {j} λ→{j * i}\n" for j in range(n)))
    return folder


def text_bytes(folder: Path) -> int:
    return sum(len(p.read_text().encode()) for p in folder.iterdir())


def all_tokens(data_dir: Path, domain: str = "default") -> np.ndarray:
    manifest = load_manifest(data_dir)
    entries = manifest["domains"][domain]["train"] + manifest["domains"][domain]["val"]
    return np.concatenate([np.fromfile(data_dir / e["path"], dtype=manifest["dtype"]) for e in entries])


def foreign_tokenizer(folder: Path, eos: str = "</s>", config: bool = True) -> Path:
    """A byte-level BPE made the way Hugging Face model folders ship one, EOS named </s>."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    folder.mkdir(parents=True, exist_ok=True)
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=320, special_tokens=["<unk>", eos, "<|endoftext|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator([TEXT * 20], trainer=trainer)
    tok.save(str(folder / "tokenizer.json"))
    if config:
        (folder / "tokenizer_config.json").write_text(json.dumps({"eos_token": {"content": eos}}))
    return folder


@pytest.mark.parametrize("kind", ["byte", "bpe"])
def test_shard_bytes_add_up_to_the_text_and_to_the_byte_table(tmp_path, kind):
    src = corpus(tmp_path / "src")
    manifest = prepare([src], tmp_path / "d", tokenizer=kind, vocab_size=300 if kind == "bpe" else None,
                       val_fraction=0.2)
    domain = manifest["domains"]["default"]
    entries = domain["train"] + domain["val"]
    assert domain["text_bytes"] == text_bytes(src)
    assert sum(e["bytes"] for e in entries) == text_bytes(src)
    table = token_byte_lengths(load_tokenizer(tmp_path / "d", manifest))
    for entry in entries:
        assert int(table[np.fromfile(tmp_path / "d" / entry["path"], dtype=manifest["dtype"])].sum()) == entry["bytes"]
    if kind == "byte":  # every id is one byte, EOS none
        eos = sum(int((np.fromfile(tmp_path / "d" / e["path"], dtype=manifest["dtype"]) == 256).sum()) for e in entries)
        assert eos >= 3 and sum(e["bytes"] for e in entries) == sum(e["tokens"] for e in entries) - eos


def test_bpe_byte_table_is_each_tokens_utf8_bytes(tmp_path):
    src = corpus(tmp_path / "src")
    manifest = prepare([src], tmp_path / "d", tokenizer="bpe", vocab_size=300, val_fraction=0)
    tok = load_tokenizer(tmp_path / "d", manifest)
    table = token_byte_lengths(tok)
    ids = tok.encode(TEXT)
    assert int(table[ids].sum()) == len(TEXT.encode())
    assert table[tok.eos_id] == 0 and table.shape == (tok.vocab_size,)
    multi = [i for i in range(tok.vocab_size) if table[i] > 1]
    assert multi, "merges make multi-byte tokens"


def test_counter_counts_real_targets_and_bpb_is_loss_bits_times_tokens_over_bytes(tmp_path):
    prepare([corpus(tmp_path / "src")], tmp_path / "d", val_fraction=0.2)
    counter = ByteCounter(tmp_path / "d", load_manifest(tmp_path / "d"))
    targets = torch.tensor([[104, 195, 169, 256], [32, -100, -100, 256]])
    assert counter.count("default", targets) == 4  # two EOS stand for no byte; ignored targets are no target
    loss_sum, tokens = 7.5, 6
    assert bits_per_byte(loss_sum, 4) == pytest.approx(loss_sum / tokens / np.log(2) * tokens / 4, rel=1e-15)
    assert bits_per_byte(loss_sum, 0) is None and bits_per_byte(loss_sum, None) is None


def test_a_manifest_from_before_byte_counts_is_counted_exactly_for_byte_and_bpe(tmp_path):
    prepare([corpus(tmp_path / "src")], tmp_path / "d", val_fraction=0.2)
    path = tmp_path / "d" / "manifest.json"
    manifest = json.loads(path.read_text())
    del manifest["domains"]["default"]["text_bytes"]
    for entry in manifest["domains"]["default"]["train"] + manifest["domains"]["default"]["val"]:
        del entry["bytes"]
    path.write_text(json.dumps(manifest))
    assert ByteCounter(tmp_path / "d", load_manifest(tmp_path / "d")).exact == {"default": True}


def test_a_tokenizer_that_cannot_count_bytes_records_none(tmp_path):
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {w: i for i, w in enumerate(["<unk>", "</s>", *sorted(set(TEXT.split()))])}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()  # drops the whitespace: no byte table
    tok.save(str(tmp_path / "tokenizer.json"))
    manifest = prepare([corpus(tmp_path / "src")], tmp_path / "d", tokenizer=str(tmp_path / "tokenizer.json"))
    domain = manifest["domains"]["default"]
    assert all("bytes" not in e for e in domain["train"] + domain["val"]) and domain["text_bytes"] > 0
    counter = ByteCounter(tmp_path / "d", load_manifest(tmp_path / "d"))
    assert counter.exact == {"default": False} and counter.count("default", torch.tensor([[2, 3]])) is None


@pytest.mark.parametrize("given", ["file", "folder"])
def test_prepare_with_a_tokenizer_json_pins_it_and_reuses_it(tmp_path, given):
    folder = foreign_tokenizer(tmp_path / "hf")
    path = folder / "tokenizer.json" if given == "file" else folder
    manifest = prepare([corpus(tmp_path / "src")], tmp_path / "d", tokenizer=str(path), val_fraction=0.2)
    spec = manifest["tokenizer"]
    assert spec["kind"] == "file" and spec["sha256"] == file_sha256(folder / "tokenizer.json")
    assert (tmp_path / "d" / "tokenizer.json").read_bytes() == (folder / "tokenizer.json").read_bytes()
    tok = load_tokenizer(tmp_path / "d", manifest)
    assert spec["eos_token"] == "</s>" and spec["eos_id"] == tok.eos_id == 1
    assert manifest["tokenizer_source"] == str((folder / "tokenizer.json").resolve())
    # Each of 3 documents ends with the model's own EOS, and so does each piece of one that a block
    # of the other split cut off: at least 3, and the last document's closes the train split.
    assert (all_tokens(tmp_path / "d") == 1).sum() >= 3
    last = manifest["domains"]["default"]["train"][-1]
    assert np.fromfile(tmp_path / "d" / last["path"], dtype=manifest["dtype"])[-1] == 1
    domain = manifest["domains"]["default"]
    assert sum(e["bytes"] for e in domain["train"] + domain["val"]) == text_bytes(tmp_path / "src")
    again = prepare([tmp_path / "src"], tmp_path / "d", domain="more", tokenizer=str(path))
    assert again["tokenizer"] == spec
    prepare([tmp_path / "src"], tmp_path / "d", domain="plain")  # omitted: the pinned one is reused
    other = foreign_tokenizer(tmp_path / "other", eos="<|endoftext|>")
    with pytest.raises(DataError, match="another tokenizer"):
        prepare([tmp_path / "src"], tmp_path / "d", domain="x", tokenizer=str(other))


def test_a_bare_tokenizer_json_falls_back_to_a_known_eos(tmp_path):
    folder = foreign_tokenizer(tmp_path / "hf", eos="</s>", config=False)
    manifest = prepare([corpus(tmp_path / "src")], tmp_path / "d", tokenizer=str(folder / "tokenizer.json"))
    assert manifest["tokenizer"]["eos_token"] == "<|endoftext|>"  # first of the known names it has


@pytest.mark.parametrize("case", ["no_tokenizer_json", "not_json", "vocab_size", "no_eos"])
def test_bad_tokenizer_path_exits_2_with_one_line(tmp_path, capsys, case):
    corpus(tmp_path / "src")
    (tmp_path / "empty").mkdir()
    (tmp_path / "bad.json").write_text("{not json")
    if case == "no_eos":
        from tokenizers import Tokenizer, models
        Tokenizer(models.WordLevel({"<unk>": 0, "a": 1}, unk_token="<unk>")).save(str(tmp_path / "noeos.json"))
    given, extra = {"no_tokenizer_json": (tmp_path / "empty", []), "not_json": (tmp_path / "bad.json", []),
                    "vocab_size": (foreign_tokenizer(tmp_path / "hf"), ["--vocab-size", "500"]),
                    "no_eos": (tmp_path / "noeos.json", [])}[case]
    rc = main(["prepare", "--input", str(tmp_path / "src"), "--out", str(tmp_path / "d"), "--tokenizer", str(given),
               *extra])
    err = capsys.readouterr().err
    assert rc == 2 and len(err.strip().splitlines()) == 1, err
    assert {"no_tokenizer_json": "no tokenizer.json", "not_json": "tokenizers", "vocab_size": "--vocab-size",
            "no_eos": "ends a document"}[case] in err
    assert not (tmp_path / "d").exists()


def test_manifest_refuses_a_byte_count_that_is_not_a_count(tmp_path):
    prepare([corpus(tmp_path / "src")], tmp_path / "d")
    path = tmp_path / "d" / "manifest.json"
    manifest = json.loads(path.read_text())
    manifest["domains"]["default"]["train"][0]["bytes"] = -5
    path.write_text(json.dumps(manifest))
    with pytest.raises(DataError, match="bytes"):
        load_manifest(tmp_path / "d")


@pytest.mark.parametrize("pinned", ["other", "same"])
def test_a_corrupt_tokenizer_json_in_data_dir_is_one_line_not_a_traceback(tmp_path, pinned):
    """A truncated tokenizer.json in DATA_DIR was parsed before its hash was checked: the Rust
    parser's Exception (not a ValueError) escaped as a traceback, exit 1. Now a file that is not
    the pinned one is refused by its hash, unparsed; one whose hash was pinned too (both edited)
    but does not parse is refused by name. Either way one DataError line (exit 2 in the CLIs)."""
    from dsslm.data.manifest import verify_tokenizer
    folder = foreign_tokenizer(tmp_path / "hf")
    manifest = prepare([corpus(tmp_path / "src")], tmp_path / "d", tokenizer=str(folder / "tokenizer.json"))
    path = tmp_path / "d" / "tokenizer.json"
    path.write_text(path.read_text()[:25])
    if pinned == "same":
        manifest["tokenizer"]["sha256"] = file_sha256(path)
    with pytest.raises(DataError) as raised:
        verify_tokenizer(tmp_path / "d", manifest)
    assert "\n" not in str(raised.value)
    assert ("does not match its manifest.json" if pinned == "other" else "is not a tokenizer") in str(raised.value)
