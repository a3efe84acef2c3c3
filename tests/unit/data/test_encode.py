"""prepare's parallel encoding: batches encoded several at a time in threads, written in input
order, so the shards are byte for byte what encoding one document at a time gives."""
from __future__ import annotations

import json
import random
import threading
import time

import numpy as np
import pytest

from dsslm.data import load_manifest, prepare
from dsslm.data import sources
from dsslm.data.tokenizer import load_tokenizer


@pytest.fixture
def corpus(tmp_path):
    """JSONL records and a folder of text files: several hundred documents in all."""
    rng = random.Random(5)
    words = ["def", "return", "self", "import", "class", "for", "in", "if", "else", "(", ")", ":", "\n", "    ", "é", "日本"]
    docs = ["".join(rng.choice(words) + rng.choice(["", " "]) for _ in range(rng.randint(5, 400))) for _ in range(300)]
    with open(tmp_path / "a.jsonl", "w") as f:
        for doc in docs[:200]:
            f.write(json.dumps({"text": doc}) + "\n")
    (tmp_path / "files").mkdir()
    for i, doc in enumerate(docs[200:]):
        (tmp_path / "files" / f"{i:03d}.txt").write_text(doc)
    return [tmp_path / "a.jsonl", tmp_path / "files"], docs


def train_tokens(data_dir, domain="default") -> np.ndarray:
    manifest = load_manifest(data_dir)
    return np.concatenate([np.fromfile(data_dir / e["path"], dtype=manifest["dtype"])
                           for e in manifest["domains"][domain]["train"]])


@pytest.mark.parametrize("kind", ["byte", "bpe"])
def test_the_shards_are_the_documents_encoded_one_at_a_time(tmp_path, corpus, monkeypatch, kind):
    inputs, docs = corpus
    monkeypatch.setattr(sources, "ENCODE_BATCH_CHARS", 3_000)  # many batches, several in flight at once
    prepare(inputs, tmp_path / "d", tokenizer=kind, vocab_size=400 if kind == "bpe" else None, val_fraction=0)
    tok = load_tokenizer(tmp_path / "d", load_manifest(tmp_path / "d"))
    folder_docs = sorted(range(200, 300), key=lambda i: f"{i - 200:03d}")  # folders are read by name
    expected = [t for i in list(range(200)) + folder_docs for t in list(tok.encode(docs[i])) + [tok.eos_id]]
    assert train_tokens(tmp_path / "d").tolist() == expected


def test_order_is_kept_when_later_batches_finish_first(tmp_path, corpus, monkeypatch):
    inputs, _ = corpus
    monkeypatch.setattr(sources, "ENCODE_BATCH_CHARS", 2_000)
    real_encode = sources._encode
    delays = random.Random(0)
    busy, most = [0], [0]
    lock = threading.Lock()

    def slow_encode(tok, pieces):
        with lock:
            busy[0] += 1
            most[0] = max(most[0], busy[0])
        time.sleep(delays.uniform(0, 0.03))  # batches finish out of order
        try:
            return real_encode(tok, pieces)
        finally:
            with lock:
                busy[0] -= 1

    monkeypatch.setattr(sources, "_encode", slow_encode)
    monkeypatch.setattr(sources, "encode_in_flight", lambda tok: 4)
    prepare(inputs, tmp_path / "parallel", val_fraction=0.1)
    assert most[0] > 1  # batches really were encoded concurrently
    monkeypatch.setattr(sources, "encode_in_flight", lambda tok: 1)
    prepare(inputs, tmp_path / "inline", val_fraction=0.1)
    a, b = load_manifest(tmp_path / "parallel"), load_manifest(tmp_path / "inline")
    assert a["domains"]["default"]["train"] == b["domains"]["default"]["train"]  # paths, sizes and sha256
    assert a["domains"]["default"]["val"] == b["domains"]["default"]["val"]


def test_an_encoding_error_fails_prepare_and_leaves_no_domain(tmp_path, corpus, monkeypatch):
    inputs, _ = corpus
    monkeypatch.setattr(sources, "ENCODE_BATCH_CHARS", 2_000)
    calls = [0]
    real_encode = sources._encode

    def failing(tok, pieces):
        calls[0] += 1
        if calls[0] == 3:
            raise RuntimeError("tokenizer crashed")
        return real_encode(tok, pieces)

    monkeypatch.setattr(sources, "_encode", failing)
    with pytest.raises(RuntimeError, match="tokenizer crashed"):
        prepare(inputs, tmp_path / "d")
    assert not (tmp_path / "d").exists()
