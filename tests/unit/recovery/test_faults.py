"""The scattered-document drill (faults.repeat_chunks): it names chunks, not positions."""
import numpy as np
import torch

from dsslm.config import FaultsCfg
from dsslm.data.loader import Loader
from dsslm.data.prepare import prepare
from dsslm.recovery.faults import Drills


def test_repeat_chunks_corrupts_the_named_chunks_wherever_and_whenever_they_are_fed(tmp_path):
    src = tmp_path / "src"
    src.mkdir()
    words = [f"word{i % 97} " * (1 + i % 5) for i in range(600)]  # ~9 KB of varied bytes
    (src / "a.txt").write_text("".join(words))
    prepare([src], tmp_path / "data", val_fraction=0.05)
    loader = Loader(tmp_path / "data", 16, 7)
    n = loader.n_chunks
    assert n > 40
    first, end = 10, 20
    drills = Drills(FaultsCfg(repeat_chunks=[[first, end]], repeat_ngram=3), tmp_path / "run", 0, True, 7,
                    256, 8, loader)
    unit = torch.from_numpy(loader._read_chunk(first)[:3].astype(np.int64))
    indices = np.arange(0, 2 * n + 5, dtype=np.int64)  # two epochs and a bit: every chunk fed 2-3 times
    clean = loader.read(indices)
    # Two micro-batches, as a rank with gradient accumulation gets them.
    half = len(indices) // 2
    batches = [(clean[0][:half], clean[1][:half]), (clean[0][half:], clean[1][half:])]
    out = drills.corrupt(batches, indices)
    inputs, targets = torch.cat([b[0] for b in out]), torch.cat([b[1] for b in out])
    hit = (loader.chunk_ids(indices) >= first) & (loader.chunk_ids(indices) < end)
    assert hit.sum() >= 2 * (end - first)  # the range is fed in each epoch, at shuffled positions
    expected = unit.repeat(7)[:17]
    for i in np.flatnonzero(hit):
        assert torch.equal(inputs[i], expected[:-1]) and torch.equal(targets[i], expected[1:])
    assert torch.equal(inputs[~hit], clean[0][~hit]) and torch.equal(targets[~hit], clean[1][~hit])
    assert torch.equal(batches[0][0], clean[0][:half])  # the caller's tensors are not written to
    # A step feeding none of the range: the same batches back.
    miss = indices[~hit][:8]
    plain = [loader.read(miss)]
    assert drills.corrupt(plain, miss) is plain


def test_poison_chunks_gives_each_named_chunk_its_own_noise_in_every_epoch(tmp_path):
    src = tmp_path / "src"
    src.mkdir()
    (src / "a.txt").write_text("".join(f"line {i} of text\n" for i in range(500)))
    prepare([src], tmp_path / "data", val_fraction=0.05)
    loader = Loader(tmp_path / "data", 16, 3)
    n = loader.n_chunks
    drills = Drills(FaultsCfg(poison_chunks=[[5, 9]]), tmp_path / "run", 0, True, 3, 257, 8, loader)
    indices = np.arange(0, 2 * n, dtype=np.int64)
    clean = loader.read(indices)
    (inputs, targets), = drills.corrupt([clean], indices)
    chunks = loader.chunk_ids(indices)
    hit = (chunks >= 5) & (chunks < 9)
    assert hit.sum() == 8  # each of the four chunks once per epoch
    assert torch.equal(inputs[~hit], clean[0][~hit]) and torch.equal(targets[~hit], clean[1][~hit])
    rows = {c: [i for i in np.flatnonzero(hit) if chunks[i] == c] for c in range(5, 9)}
    for one, two in rows.values():  # the same noise wherever the chunk is fed, another for another chunk
        assert torch.equal(inputs[one], inputs[two]) and not torch.equal(inputs[one], clean[0][one])
        assert torch.equal(inputs[one][1:], targets[one][:-1])
    assert not torch.equal(inputs[rows[5][0]], inputs[rows[6][0]])
