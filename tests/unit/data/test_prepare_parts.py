"""prepare in parts (dsslm/data/parts.py, vocab.py): the DATA_DIR is the same bytes as one stream of
every input through one split, at 1 and 3 workers and as 2 --part tasks and a merge; a killed or
interrupted prepare continues with the units it finished; a merge refuses while a unit is missing;
the BPE is trained once, on a documented sample, before the parts; bad step arguments exit 2 with
nothing written."""
from __future__ import annotations

import json
import os
import random
from pathlib import Path

import pytest

from dsslm.data import parts, vocab
from dsslm.data.__main__ import main
from dsslm.data.parts import Part
from dsslm.data.prepare import ShardWriter, SplitRouter, _block_tokens, merge, prepare, prepare_part, prepare_tokenizer
from dsslm.data.sources import Source, find_sources, iter_pieces, iter_token_arrays
from dsslm.data.tokenizer import ByteTokenizer, token_byte_lengths, train_bpe
from dsslm.durable import write_json_atomic

SHARD_TOKENS = 3_000  # several shards per split


@pytest.fixture
def corpus(tmp_path):
    """Text files (one empty, one with CRLF), a JSONL, and a folder of small files: every input
    its own unit (UNIT_BYTES 1; the empty file shares the JSONL's), so nothing may carry over from
    one file to the next: 7 units."""
    rng = random.Random(7)
    words = ["def", "return", "self", "(", ")", ":", "\n", "    ", "é", "日本", "the", "data", "<|endoftext|>"]

    def doc(n):
        return "".join(rng.choice(words) + rng.choice(["", " "]) for _ in range(n))
    src = tmp_path / "src"
    (src / "folder").mkdir(parents=True)
    (src / "a.txt").write_text(doc(2000))
    (src / "b.txt").write_text("")
    (src / "c.jsonl").write_text("".join(json.dumps({"text": doc(rng.randint(0, 120))}) + "\n" for _ in range(150)))
    (src / "d.txt").write_text(doc(900) + "\r\nlast line")
    for i in range(4):
        (src / "folder" / f"{i}.md").write_text(doc(300))
    return [src / "a.txt", src / "b.txt", src / "c.jsonl", src / "d.txt", src / "folder"]


@pytest.fixture(autouse=True)
def one_file_a_unit(monkeypatch):
    monkeypatch.setattr(parts, "UNIT_BYTES", 1)


def single_stream(inputs: list[Path], out: Path, kind: str, val_fraction: float = 0.1) -> None:
    """prepare as it was before parts: one token stream of every input, one tokenizer trained on all
    of their text, one split router, one pair of shard writers; the manifest as prepare writes it."""
    sources = find_sources(inputs)
    out.mkdir()
    tok = ByteTokenizer() if kind == "byte" else train_bpe(
        (p for p in iter_pieces(sources, "text") if p), 400, out / "tokenizer.json")
    (out / "default").mkdir()
    lengths = token_byte_lengths(tok)
    train, val = (ShardWriter(out / "default", "default", s, "uint16", SHARD_TOKENS, lengths) for s in ("train", "val"))
    router = SplitRouter(train, val, val_fraction, _block_tokens(sources, kind), tok.eos_id)
    text_bytes = [0]
    for tokens in iter_token_arrays(sources, tok, "text", text_bytes):
        router.write(tokens)
    train_entries, val_entries = router.close()
    assert train.bytes + val.bytes == text_bytes[0]
    entry = {"train": train_entries, "val": val_entries, "text_bytes": text_bytes[0],
             "sources": [str(Path(p).resolve()) for p in inputs]}
    spec = {"kind": tok.kind, "vocab_size": tok.vocab_size, "eos_id": tok.eos_id, "sha256": tok.sha256}
    write_json_atomic(out / "manifest.json", {"format": 1, "tokenizer": spec, "dtype": "uint16",
                                              "domains": {"default": entry}}, indent=1)


def every_file(folder: Path) -> dict[str, bytes]:
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


def cli(inputs: list[Path], out: Path, *args: str) -> int:
    """The CLI's exit code (argparse's refusals included)."""
    try:
        return main(["prepare", "--input", *map(str, inputs), "--out", str(out), "--val-fraction", "0.1", *args])
    except SystemExit as e:
        return e.code


@pytest.mark.parametrize("kind", ["byte", "bpe"])
def test_the_data_dir_is_the_same_bytes_at_any_worker_and_task_count(tmp_path, corpus, kind):
    reference = tmp_path / "reference"
    single_stream(corpus, reference, kind)
    expected = every_file(reference)
    assert len([name for name in expected if name.endswith(".bin")]) > 3
    tok = {"tokenizer": kind, "vocab_size": 400 if kind == "bpe" else None}
    for workers in (1, 3):
        out = tmp_path / f"workers{workers}"
        prepare(corpus, out, val_fraction=0.1, shard_tokens=SHARD_TOKENS, workers=workers, **tok)
        assert every_file(out) == expected, f"--workers {workers}"
    # As the CLI's steps run them (its shard size is not an argument): the tokenizer, two tasks, the merge.
    out = tmp_path / "tasks"
    prepare_tokenizer(corpus, out, **tok)
    for part in (Part(1, 2), Part(0, 2)):
        prepare_part(corpus, out, part, **tok)
    merge(corpus, out, val_fraction=0.1, shard_tokens=SHARD_TOKENS, **tok)
    assert every_file(out) == expected


def made_units(monkeypatch) -> list[int]:
    made: list[int] = []
    real = parts.make_unit

    def counting(folder, unit, *args):
        made.append(unit)
        return real(folder, unit, *args)
    monkeypatch.setattr(parts, "make_unit", counting)
    return made


def test_a_killed_prepare_continues_without_redoing_finished_units(tmp_path, corpus, monkeypatch, capsys):
    """Part 0 of 2 ran to its end, as a prepare killed after some units would leave them; the plain
    command makes only the rest. A changed input file, and a unit file damaged since, are redone."""
    reference = tmp_path / "reference"
    single_stream(corpus, reference, "byte")
    n_units = len(parts.plan_units(find_sources(corpus)))
    out = tmp_path / "d"
    assert cli(corpus, out, "--part", "0/2") == 0
    assert f"prepared part 0/2 of domain 'default' in {out}: 4 of {n_units} units (4 made, 0 reused)" \
        in capsys.readouterr().out
    folder = parts.parts_dir(out, "default")
    assert sorted(p.name for p in folder.iterdir()) == [f"unit-{u:05d}.{ext}" for u in (0, 2, 4, 6) for ext in ("bin", "json")]
    made = made_units(monkeypatch)
    assert prepare(corpus, out, val_fraction=0.1, shard_tokens=SHARD_TOKENS) is not None
    assert n_units == 7 and made == [1, 3, 5]
    assert f"reused 4 of {n_units} units finished before" in capsys.readouterr().err
    assert every_file(out) == every_file(reference) and not folder.exists()

    # Again, with unit 2's input changed (its size and mtime) and unit 4's token file damaged.
    out2 = tmp_path / "d2"
    assert cli(corpus, out2, "--part", "0/2") == 0
    source_of_2 = parts.plan_units(find_sources(corpus))[2][0].path
    source_of_2.write_text(source_of_2.read_text() + "\n")
    bin_4 = parts.unit_files(parts.parts_dir(out2, "default"), 4)[0]
    data = bytearray(bin_4.read_bytes())
    data[10] ^= 1
    bin_4.write_bytes(bytes(data))
    made.clear()
    prepare(corpus, out2, val_fraction=0.1, shard_tokens=SHARD_TOKENS)
    assert made == [1, 2, 3, 4, 5]


def test_an_interrupted_prepare_keeps_its_finished_units(tmp_path, corpus, monkeypatch):
    """Ctrl-C: the tokenizer and the units made so far stay for the next run, which trains no
    tokenizer and makes only the rest (bad input still leaves nothing: the test below)."""
    real = parts.make_unit

    def interrupted(folder, unit, *args):
        if unit == 3:
            raise KeyboardInterrupt
        return real(folder, unit, *args)
    monkeypatch.setattr(parts, "make_unit", interrupted)
    out = tmp_path / "d"
    with pytest.raises(KeyboardInterrupt):
        prepare(corpus, out, tokenizer="bpe", vocab_size=400)
    kept = sorted(p.name for p in out.iterdir())
    assert kept == [".parts-default", ".tokenizer-recipe.json", "tokenizer.json"], kept
    assert len(list(parts.parts_dir(out, "default").glob("*.json"))) == 3
    monkeypatch.setattr(parts, "make_unit", real)
    made = made_units(monkeypatch)
    monkeypatch.setattr(vocab, "train_bpe", lambda *a: pytest.fail("the tokenizer was trained again"))
    prepare(corpus, out, tokenizer="bpe", vocab_size=400)
    assert made == list(range(3, 7))
    assert sorted(p.name for p in out.iterdir()) == ["default", "manifest.json", "tokenizer.json"]


def test_bad_input_in_a_worker_is_one_line_and_leaves_nothing(tmp_path, corpus, capsys):
    """A unit that fails in a worker process is the same one-line DataError as in this one (the
    worker's exception comes back pickled: our own, not user data)."""
    (tmp_path / "src" / "e.jsonl").write_text('{"body": "no text field"}\n')
    assert cli([*corpus, tmp_path / "src" / "e.jsonl"], tmp_path / "d", "--workers", "2") == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "e.jsonl has no field 'text'" in err[0], err
    assert not (tmp_path / "d").exists()


def folder_state(folder: Path) -> dict:
    return {str(p.relative_to(folder)): (p.read_bytes() if p.is_file() else "dir") for p in sorted(folder.rglob("*"))}


def test_merge_refuses_while_a_unit_is_missing_and_writes_nothing(tmp_path, corpus, capsys):
    out = tmp_path / "d"
    assert cli(corpus, out, "--part", "1/2") == 0
    before = folder_state(out)
    capsys.readouterr()
    assert cli(corpus, out, "--merge") == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "4 of 7 units are not prepared" in err[0] and "units 0, 2, 4, 6" in err[0], err
    assert folder_state(out) == before
    assert cli(corpus, out, "--part", "0/2") == 0 and cli(corpus, out, "--merge") == 0
    assert sorted(p.name for p in out.iterdir()) == ["default", "manifest.json"]
    assert cli(corpus, out, "--part", "0/2") == 2  # the domain is done: a late task is refused, not redone
    assert "already exists" in capsys.readouterr().err


@pytest.mark.parametrize("case", ["part_past_count", "part_not_a_fraction", "part_zero_count", "workers_0",
                                  "sample_0", "part_and_merge", "merge_without_parts", "bpe_part_before_tokenizer"])
def test_bad_step_arguments_exit_2_with_one_line_and_nothing_written(tmp_path, corpus, capsys, case):
    args = {"part_past_count": ["--part", "3/2"], "part_not_a_fraction": ["--part", "1"],
            "part_zero_count": ["--part", "0/0"], "workers_0": ["--workers", "0"],
            "sample_0": ["--tokenizer", "bpe", "--tokenizer-sample", "0"], "part_and_merge": ["--part", "0/2", "--merge"],
            "merge_without_parts": ["--merge"], "bpe_part_before_tokenizer": ["--tokenizer", "bpe", "--part", "0/2"]}[case]
    assert cli(corpus, tmp_path / "d", *args) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1, err
    hint = {"part_past_count": "0 <= I < N", "part_not_a_fraction": "is not I/N", "part_zero_count": "0 <= I < N",
            "workers_0": "--workers 0", "sample_0": "--tokenizer-sample 0", "part_and_merge": "not allowed with",
            "merge_without_parts": "run them first", "bpe_part_before_tokenizer": "--tokenizer-only"}[case]
    assert hint in err[0], err
    assert not (tmp_path / "d").exists()


def test_the_bpe_is_trained_once_on_the_sample_before_the_parts(tmp_path, corpus, monkeypatch, capsys):
    sources = find_sources(corpus)
    text = "".join(p for p in iter_pieces(sources, "text") if p).encode()
    for limit in (1, 1000, 1001, 1002, len(text) - 1, len(text), len(text) + 5):
        sample = "".join(vocab.sample_texts(sources, "text", limit)).encode()
        wanted = min(limit, len(text))  # the cut may drop the bytes of a character it splits (at most 3)
        assert text.startswith(sample) and wanted - 3 <= len(sample) <= wanted, limit
    out = tmp_path / "d"
    bpe = ["--tokenizer", "bpe", "--vocab-size", "400", "--tokenizer-sample", "5000"]
    assert cli(corpus, out, *bpe, "--tokenizer-only") == 0
    trained = (out / "tokenizer.json").read_bytes()
    assert "tokenizer for" in capsys.readouterr().out
    monkeypatch.setattr(vocab, "train_bpe", lambda *a: pytest.fail("trained a second time"))
    assert cli(corpus, out, *bpe, "--tokenizer-only") == 0  # again: the same one, not trained again
    assert cli(corpus, out, "--part", "0/2") == 0  # --tokenizer omitted: the tokenizer step's
    assert cli(corpus, out, *bpe, "--part", "1/2") == 0
    assert cli(corpus, out, "--tokenizer", "bpe", "--vocab-size", "500", "--part", "1/2") == 2
    assert "made a bpe tokenizer of --vocab-size 400" in capsys.readouterr().err
    assert cli(corpus, out, "--tokenizer", "byte", "--merge") == 2
    assert cli(corpus, out, *bpe, "--merge") == 0
    assert (out / "tokenizer.json").read_bytes() == trained
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["tokenizer"]["kind"] == "bpe" and not (out / ".tokenizer-recipe.json").exists()
    # (Below the sample size it is the tokenizer trained on all the text: the first test's bpe case.)


def test_units_pack_small_files_and_leave_a_big_one_alone(tmp_path, monkeypatch):
    monkeypatch.setattr(parts, "UNIT_BYTES", 100)
    sizes = [10, 50, 60, 500, 30, 30, 30, 5]
    sources = []
    for i, size in enumerate(sizes):
        (tmp_path / f"{i}.txt").write_text("x" * size)
        sources.append(Source(tmp_path / f"{i}.txt", "text"))
    plan = [[int(s.path.stem) for s in unit] for unit in parts.plan_units(sources)]
    assert plan == [[0, 1, 2], [3], [4, 5, 6, 7]]
    assert parts.Part(1, 3).units(7) == [1, 4] and str(parts.parse_part("2/3")) == "2/3"


def test_each_worker_gets_its_share_of_the_cores(monkeypatch):
    monkeypatch.setenv("RAYON_NUM_THREADS", "0")
    monkeypatch.delenv("RAYON_NUM_THREADS")  # (so that the test's end restores what was there)
    parts._start_worker(3, ("byte", "", None, ByteTokenizer.sha256))
    assert os.environ["RAYON_NUM_THREADS"] == "3" and isinstance(parts._WORKER_TOK, ByteTokenizer)
    monkeypatch.setenv("RAYON_NUM_THREADS", "5")  # the user's own setting stays
    parts._start_worker(3, ("byte", "", None, "another tokenizer"))
    assert os.environ["RAYON_NUM_THREADS"] == "5" and isinstance(parts._WORKER_TOK, Exception)
