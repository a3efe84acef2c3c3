"""What a data verdict names, and how far (`recovery.reach`, `Forensics.data_entries`): only text
that stands out; a lone sequence of ordinary text names nothing; a document only by its own
other chunks; a repeated n-gram by its text, whatever its loss."""
from __future__ import annotations

import collections
import json
from pathlib import Path

import numpy as np
import pytest
import torch

from dsslm.config import Config
from dsslm.data import prepare
from dsslm.data.loader import Loader
from dsslm.data.skips import is_window
from dsslm.recovery import forensics as forensics_module
from dsslm.recovery.forensics import Forensics
from dsslm.recovery.monitor import SpikeMonitor, Verdict
from dsslm.recovery.reach import repeated, step_repeated
from helpers import stdlib_sources

SEQ = 32


@pytest.fixture(scope="module")
def loader(tmp_path_factory) -> Loader:
    """~30 KB of stdlib source, one document per file."""
    root = tmp_path_factory.mktemp("reach")
    prepare([stdlib_sources(root / "src")], root / "data", domain="code", val_fraction=0.0)
    return Loader(root / "data", SEQ, 1337)


def test_repeated_text_is_told_from_prose_code_and_noise(loader):
    x, y = loader.read(np.arange(loader.n_chunks))
    rows = torch.cat([x, y[:, -1:]], dim=1)
    kinds = repeated(rows)
    # Every chunk of the corpus (code, docstrings) is no n-gram; a few are runs of indentation.
    assert not (kinds == 1).any() and 0 < (kinds == 2).sum() <= 5
    assert not step_repeated(kinds).any()  # counted only where runs fill a quarter of a step
    assert not repeated(torch.randint(0, 257, (64, SEQ + 1))).any()
    for unit in ([101, 102, 103, 104], [32, 32, 32, 120], [101, 32] * 4, list(range(97, 113))[:8]):
        assert (repeated(torch.tensor(unit).repeat(SEQ)[:SEQ + 1][None]) == 1).all(), unit
    # A run of one token (indentation, a rule of '-') is a run: text only as a quarter of a step.
    for run in (torch.full((SEQ + 1,), 32), torch.tensor([32] * 7 + [10]).repeat(5)[:SEQ + 1]):
        assert (repeated(run[None]) == 2).all()
    assert step_repeated(np.array([2] + [0] * 15)).sum() == 0
    assert step_repeated(np.array([2] * 4 + [0] * 12)).sum() == 4 and step_repeated(np.array([1] + [0] * 15)).sum() == 1
    # A 16-gram in 33 tokens is two repeats: a document quoted twice, not the spike signature.
    assert not repeated(rows[5, :16].repeat(3)[:SEQ + 1][None]).any()


class _Engine:
    is_main, device = True, torch.device("cpu")

    def decide(self, fn):
        return fn()


def _monitor() -> SpikeMonitor:
    """A monitor whose history of sequence losses is 2.0 +- 0.1, and that calls a step of mean 3.0 an outlier."""
    cfg = Config()
    cfg.monitor.min_history, cfg.monitor.window = 10, 20
    monitor = SpikeMonitor(cfg.monitor)
    rng = np.random.default_rng(0)
    for step in range(1, 80):
        losses = 2.0 + 0.1 * rng.standard_normal(16)
        assert monitor.judge(step, float(losses.mean()), 1.0, losses) is Verdict.OK
    return monitor


def _forensics(loader, monkeypatch, captured: dict, doc_loss: float) -> tuple[Forensics, list]:
    """Forensics holding `captured` (step -> (indices, losses, repeated)); a document's other
    chunks evaluate at `doc_loss` each (what the collective forward would give)."""
    asked = []

    def document_losses(engine, read_chunks, docs, precision, micro):
        asked.append([list(map(int, d)) for d in docs])
        return [np.full(len(d), doc_loss) for d in docs]
    monkeypatch.setattr(forensics_module, "document_losses", document_losses)
    f = Forensics(Config(), _Engine(), Path("/nonexistent"), {}, lambda *a, **k: None, loader)
    f.sequences = collections.OrderedDict(captured)
    return f, asked


def _step(indices, high=(), rep=()):
    losses = np.full(len(indices), 2.0)
    losses[list(high)] = 9.0
    flags = np.zeros(len(indices), dtype=bool)
    flags[list(rep)] = True
    return np.asarray(indices, dtype=np.int64), losses, flags


def _spans(entries):
    return [e["tokens"][1] - e["tokens"][0] for e in entries if not is_window(e)]


def test_a_lone_outlier_of_ordinary_text_names_nothing_for_good(loader, monkeypatch):
    """One sequence of 16 stands out by its loss; its document's other chunks are ordinary (loss
    2.0, the history's median): its position is left out of this pass, no text is named."""
    f, asked = _forensics(loader, monkeypatch, {51: _step(range(800, 816), high=[3])}, doc_loss=2.0)
    entries = f.data_entries([51], _monitor())
    assert entries == [[803, 804]]
    assert asked and len(asked[0][0]) >= 2  # its document was asked


def test_a_lone_outlier_whose_document_stands_out_names_the_document(loader, monkeypatch):
    f, _ = _forensics(loader, monkeypatch, {51: _step(range(800, 816), high=[3])}, doc_loss=9.0)
    entries = f.data_entries([51], _monitor())
    assert entries and not any(is_window(e) for e in entries)
    assert max(_spans(entries)) > SEQ + 1  # beyond its own chunk: the document


def test_two_ordinary_outliers_name_nothing_and_a_second_strike_in_another_pass_names_the_chunk(loader, monkeypatch):
    """Two sequences of ordinary documents stand out in one spike (a base32 alphabet and a row of
    digits did so on the long bench): each is left out of this pass and becomes a suspect; they
    prove nothing together. The same chunk standing out again in another pass (the next epoch)
    is its second strike: named, by its chunk alone. Read again in the same pass (a replay), it
    is not."""
    f, _ = _forensics(loader, monkeypatch, {51: _step(range(800, 816), high=[3]), 52: _step(range(816, 832), high=[0])},
                      doc_loss=2.0)
    monitor = _monitor()
    assert f.data_entries([51, 52], monitor) == [[803, 804], [816, 817]]
    chunk = int(loader.chunk_ids(np.array([803]))[0])
    assert f.suspects[chunk] == 0 and len(f.suspects) == 2
    assert f.data_entries([51], monitor) == [[803, 804]]  # the same pass: no second strike
    # The next epoch: the position where the order puts that chunk again.
    later = loader.n_chunks + int(np.flatnonzero(loader.chunk_ids(np.arange(loader.n_chunks, 2 * loader.n_chunks))
                                                 == chunk)[0])
    f.sequences[90] = _step([later] + list(range(later + 1, later + 16)), high=[0])
    entries = f.data_entries([90], monitor)
    assert not any(is_window(e) for e in entries) and _spans(entries) == [SEQ + 1]
    assert set(loader.skipped_chunks(entries).tolist()) == {chunk}


def test_a_step_bad_throughout_names_its_chunks_at_first_sight(loader, monkeypatch):
    """Every sequence random tokens (loss 9 against 2.0 +- 0.1): a poisoned batch, no clean step
    puts half its sequences beyond 4 sigmas. Its chunks are named at once, not their documents."""
    f, _ = _forensics(loader, monkeypatch, {51: _step(range(800, 816), high=range(16))}, doc_loss=2.0)
    entries = f.data_entries([51], _monitor())
    assert set(loader.skipped_chunks(entries).tolist()) == set(loader.chunk_ids(np.arange(800, 816)).tolist())
    assert sum(_spans(entries)) <= 16 * (SEQ + 1) and not f.suspects  # chunks (merged where adjacent), no documents


def test_a_repeated_ngram_is_named_whatever_its_loss_and_a_step_of_nothing_names_nothing(loader, monkeypatch):
    f, _ = _forensics(loader, monkeypatch, {51: _step(range(800, 816), rep=[7]), 52: _step(range(816, 832))},
                      doc_loss=2.0)
    monitor = _monitor()
    # The repeated sequence's loss is the history's (2.0): blame alone names nothing.
    assert not monitor.blame(f.sequences[51][1]).any()
    entries = f.data_entries([51], monitor)
    assert set(loader.skipped_chunks(entries).tolist()) == set(loader.chunk_ids(np.array([807])).tolist())
    assert f.data_entries([52], monitor) == []  # no whole-step fallback
    assert f.data_entries([40], monitor) == []  # a step not captured names nothing


def test_a_batch_bad_throughout_stands_out_whole_and_a_state_rise_does_not():
    """Random tokens in every sequence: each stands out on its own (blame's minimal explanation,
    at most half the step, named none of them, and the verdict named nothing). A state spike
    raises every sequence by a fraction of the history's spread: none stands out, though the
    step is an outlier; nor does anything of a step whose loss is no outlier."""
    monitor = _monitor()
    garbage = np.full(16, 5.5)
    assert not monitor.blame(garbage).any() and monitor.standing_out(garbage).all()
    risen = 2.3 + 0.05 * np.random.default_rng(1).standard_normal(16)
    assert monitor.loss_outlier(float(risen.mean())) and not monitor.standing_out(risen).any()
    one = np.full(16, 2.0)
    one[4] = 2.9  # 9 sigmas, but the step's mean passes
    assert not monitor.loss_outlier(float(one.mean())) and not monitor.standing_out(one).any()


def test_the_suspects_and_repeated_flags_travel_in_the_triage_part_and_are_checked():
    from dsslm.fields import StateError
    from dsslm.recovery.replay import ReplayProgress
    fed, sequences, suspects = collections.OrderedDict({51: (800, 816)}), collections.OrderedDict(), \
        collections.OrderedDict({1234: 0, 77: 2})
    sequences[51] = _step(range(800, 816), rep=[5])
    progress = ReplayProgress()
    progress.bind(fed, collections.deque(), sequences, suspects)
    saved = json.loads(json.dumps(progress.state_dict()))
    progress.state_spec.validate(saved, "state.triage")
    assert saved["suspects"] == [[1234, 0], [77, 2]] and saved["repeated"] == [[51, [805]]]
    mine, theirs = collections.OrderedDict(), collections.OrderedDict()
    restored = ReplayProgress()
    restored.bind(collections.OrderedDict(), collections.deque(), mine, theirs)
    restored.load_state_dict(saved)
    assert theirs == suspects and mine[51][2].tolist() == sequences[51][2].tolist()
    with pytest.raises(StateError, match="suspects"):
        progress.state_spec.validate({**saved, "suspects": [[1234, -1]]}, "state.triage")
    # A part written before either field existed loads with none.
    restored.load_state_dict({"format": 1, "replay": None})
    assert not theirs and not mine


def test_a_documents_chunks_are_evaluated_in_micro_batches_in_eval_mode(loader):
    """`document_losses` runs the real forward a micro-batch at a time (all at once would hold
    every chunk's logits) and hands each candidate its own chunks' mean losses; the model is back
    in train mode after."""
    from dsslm.config import ModelCfg
    from dsslm.model import build_model
    from dsslm.recovery.reach import document_losses
    torch.manual_seed(0)
    model = build_model(ModelCfg(d_model=32, n_layers=1, n_heads=2, seq_len=SEQ, vocab_size=257))

    class Engine:
        device = torch.device("cpu")
        modes = []

        def forward(self, x):
            return model(x)

        def train_mode(self, training):
            self.modes.append(training)
            model.train(training)

    docs = [np.arange(3, 8), np.array([], dtype=np.int64), np.arange(40, 43)]
    engine = Engine()
    by_three = document_losses(engine, loader.read_chunks, docs, "fp32", 3)
    at_once = document_losses(engine, loader.read_chunks, docs, "fp32", 100)
    x, y = loader.read_chunks(np.arange(40, 43))
    with torch.no_grad():
        direct = torch.nn.functional.cross_entropy(model(x).flatten(0, 1), y.flatten(), reduction="none").view(y.shape)
    assert [len(d) for d in by_three] == [5, 0, 3] and engine.modes == [False, True, False, True] and model.training
    for a, b in zip(by_three, at_once):
        np.testing.assert_allclose(a, b, rtol=1e-6)
    np.testing.assert_allclose(by_three[2], direct.mean(-1).double().numpy(), rtol=1e-5)
