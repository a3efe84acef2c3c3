"""Skip lists that name data (dsslm.data.skips): the narrowing rule, entries in the loader (every
epoch, every world size and micro-batch split), scattered documents, old windows, and the
checkpoint / skip_list.json round trip with hostile entries refused."""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from dsslm.ckpt.train_state import TrainState
from dsslm.data import prepare
from dsslm.data.loader import Loader
from dsslm.data.skips import DOCUMENT_TOKENS, chunk_range, concentrated, entries_of, merge_skip_list, offending
from dsslm.fields import StateError, validate
from dsslm.recovery.rewind import RECOVERY_FILE, merge_recovery, read_recovery, write_recovery

SEQ_LEN, BATCH = 16, 8
BAD = ord("Z")  # the byte of the bad document's text; no other document has it


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory) -> Path:
    """One byte domain of 300 short documents (one JSONL record each, so each ends with EOS) and
    one bad document of ~40 chunks among them: the scattered document."""
    root = tmp_path_factory.mktemp("skips")
    rng = np.random.default_rng(0)
    words = ["alpha", "beta", "gamma", "delta", "eps", "zeta"[1:], "eta", "theta"]
    docs = [" ".join(rng.choice(words, rng.integers(20, 60))) for _ in range(300)]
    docs.insert(150, "Z" * (40 * SEQ_LEN))
    with open(root / "docs.jsonl", "w") as f:
        for d in docs:
            f.write(json.dumps({"text": d}) + "\n")
    prepare([root / "docs.jsonl"], root / "d", domain="web", val_fraction=0.0001, shard_tokens=20_000)
    return root / "d"


def loader(data_dir: Path, **kw) -> Loader:
    return Loader(data_dir, SEQ_LEN, seed=0, **kw)


def rows(lo: Loader, indices) -> np.ndarray:
    inputs, targets = lo.read(np.asarray(indices))
    return np.concatenate([inputs.numpy(), targets.numpy()[:, -1:]], axis=1)


def steps(lo: Loader, position: int, skip_list: list, n: int, batch: int = BATCH):
    """n consecutive steps from `position`: [(first, end, indices)]."""
    out = []
    for _ in range(n):
        fed, _ = lo.step(position, skip_list, batch, 0, 1, 1)
        out.append(fed)
        position = fed.end
    return out


# --- the narrowing rule (pure) ------------------------------------------------------------------

def test_offending_names_the_outliers_either_side_and_non_finite():
    rng = np.random.default_rng(1)
    losses = 2.0 + 0.05 * rng.standard_normal(16)
    losses[3], losses[11] = 5.5, 0.2  # random tokens far above, a repeated n-gram far below
    assert np.flatnonzero(offending(losses)).tolist() == [3, 11]
    losses[7] = np.nan
    assert np.flatnonzero(offending(losses)).tolist() == [3, 7, 11]


def test_offending_names_nothing_in_a_clean_or_a_mostly_bad_batch():
    rng = np.random.default_rng(2)
    assert not offending(2.0 + 0.05 * rng.standard_normal(64)).any()       # a clean batch's spread
    assert not offending(np.full(16, 5.5)).any()                           # all alike: the whole batch
    mostly = np.r_[np.full(9, 5.5), 2.0 + 0.05 * rng.standard_normal(7)]
    assert not offending(mostly).any()  # a median cannot stand for a batch that is mostly bad
    assert not offending(np.r_[np.full(5, 5.5), 2.0 + 0.05 * rng.standard_normal(11)]).any()  # > a quarter
    assert not offending(np.full(4, np.nan)).any()  # all non-finite: nothing singles one out
    assert offending(np.r_[np.full(15, 2.0), 9.0]).tolist() == [False] * 15 + [True]  # MAD 0
    noise = 5.55 + 0.01 * rng.standard_normal(16)
    noise[4] = 5.7  # all poisoned: one a little further out is no lone outlier (the scale's floor)
    assert not offending(noise).any()
    assert not offending(np.r_[2.0, 2.01, 9.0, 2.02]).any()  # too few sequences to narrow


def test_concentrated_tells_a_few_bad_sequences_from_a_batch_that_rose_everywhere():
    """Synthetic per-sequence losses of one spiking step, judged against a monitor whose clean
    steps average 2.0 nats and that calls a step an outlier above 2.1."""
    rng = np.random.default_rng(3)
    clean = 2.0 + 0.05 * rng.standard_normal(16)
    outlier = lambda mean: mean > 2.1
    data = clean.copy()
    data[[3, 11]] = 5.5, 0.2                      # random tokens far above, a repeated n-gram far below
    assert concentrated(data, outlier)           # the rest of the batch is a normal step: data
    data[7] = np.inf
    assert concentrated(data, outlier)           # a non-finite sequence is one of the few
    assert not concentrated(clean + 0.8, outlier)  # a learning-rate burst: every sequence up, no one stands out
    hit_hardest = clean + 0.8
    hit_hardest[[2, 9]] += 4.0                    # ... and the few hit hardest stand out,
    assert offending(hit_hardest).sum() == 2      # but the rest still fails the monitor's test: state
    assert not concentrated(hit_hardest, outlier)
    assert not concentrated(np.full(16, 3.0), outlier)  # the same poisoned text everywhere: a replay must tell
    assert not concentrated(clean, outlier)              # nothing stands out (a spike by its grad norm alone)
    few = np.r_[2.0, 2.01, 9.0, 2.02]
    assert not concentrated(few, outlier)         # too few sequences to tell: not narrowed, not data


def test_chunk_range_takes_the_chunks_with_a_prediction_inside():
    # Chunk j holds tokens [16j, 16j + 17): its own range names it alone, not the neighbours
    # that share one token with it.
    assert chunk_range(32, 49, 16, 100) == (2, 3)
    assert chunk_range(32, 33, 16, 100) == (2, 2)   # one token: no prediction, no chunk
    assert chunk_range(47, 49, 16, 100) == (2, 3)   # the pair (47, 48) is chunk 2's last
    assert chunk_range(48, 50, 16, 100) == (3, 4)
    assert chunk_range(0, 10**9, 16, 100) == (0, 100)


def test_entries_merge_overlaps_but_not_touching_ranges():
    skip = [{"shard": "b", "tokens": [0, 17]}, [5, 9], {"shard": "a", "tokens": [16, 33]},
            {"shard": "a", "tokens": [0, 17]}, [8, 12], {"shard": "a", "tokens": [33, 50]}, {"shard": "a", "tokens": [3, 4]}]
    assert merge_skip_list(skip) == [[5, 12], {"shard": "a", "tokens": [0, 33]}, {"shard": "a", "tokens": [33, 50]},
                                     {"shard": "b", "tokens": [0, 17]}]
    assert merge_skip_list(merge_skip_list(skip)) == merge_skip_list(skip)


# --- the loader ----------------------------------------------------------------------------------

def test_poisoned_chunks_skipped_in_epoch_1_are_never_fed_in_epoch_2(data_dir):
    lo = loader(data_dir)
    n = lo.n_chunks
    poisoned = np.arange(40, 46)  # six sequences of data batch 5
    skip = lo.data_entries(poisoned)
    bad_chunks = set(lo.chunk_ids(poisoned).tolist())
    assert set(lo.skipped_chunks(skip).tolist()) == bad_chunks  # exactly those chunks, no neighbour
    fed = np.concatenate([s.indices for s in steps(lo, n, skip, (n // BATCH) + 2)])
    assert fed[0] == n and fed[-1] >= 2 * n  # the whole second epoch, and into the third
    assert not bad_chunks & set(lo.chunk_ids(fed).tolist())
    # Every other chunk of the epoch is fed exactly once: the slots went to the next chunks.
    second = lo.chunk_ids(fed[fed < 2 * n])
    assert len(second) == len(set(second.tolist())) == n - len(bad_chunks)


def test_a_scattered_document_is_never_trained_on_after_its_first_spike(data_dir):
    """One bad document spread over many batches: the first batch that feeds it spikes, the
    per-sequence losses single out its sequences, and the document is skipped whole."""
    lo = loader(data_dir)
    skip: list = []
    position, spikes, batches_with_it = 0, 0, 0
    for _ in range(3 * lo.n_chunks // BATCH):  # three epochs
        fed, _ = lo.step(position, skip, BATCH, 0, 1, 1)
        data = rows(lo, fed.indices)
        bad_tokens = (data == BAD).sum(axis=1)
        if bad_tokens.any():
            batches_with_it += 1
            # The "model": a sequence of the bad document has a loss far above the others.
            losses = 2.0 + 0.01 * np.arange(BATCH) + 4.0 * (bad_tokens > 0)
            hit = offending(losses)
            assert hit.tolist() == (bad_tokens > 0).tolist()
            skip = merge_skip_list(skip + lo.data_entries(fed.indices[hit], np.ones(int(hit.sum()), dtype=bool)))
            spikes += 1
        position = fed.end
    assert spikes == batches_with_it == 1
    # Without it, the document is spread over many batches of every epoch.
    scattered = sum((rows(lo, s.indices) == BAD).any(axis=1).any() for s in steps(lo, 0, [], lo.n_chunks // BATCH))
    assert scattered > 10


def test_a_batch_with_two_poisoned_sequences_skips_only_those(data_dir):
    lo = loader(data_dir)
    position = 10 * BATCH
    before, _ = lo.step(position, [], BATCH, 0, 1, 1)
    losses = np.full(BATCH, 2.0) + 0.01 * np.arange(BATCH)
    losses[[2, 5]] = 8.0
    hit = offending(losses)
    skip = lo.data_entries(before.indices[hit])  # their chunks (whole documents: see above)
    after, _ = lo.step(position, skip, BATCH, 0, 1, 1)
    kept = np.delete(before.indices, [2, 5])
    # The other six are trained, and the two slots go to the next two sequences of the stream.
    assert after.indices.tolist() == kept.tolist() + [before.end, before.end + 1]
    assert after.end == before.end + 2


@pytest.mark.parametrize("mix", [None, {"web": 1.0}])
@pytest.mark.parametrize("world_size,grad_accum", [(1, 1), (1, 4), (2, 1), (2, 2), (4, 2)])
def test_a_data_skip_list_feeds_the_same_batch_at_every_world_size_and_split(data_dir, world_size, grad_accum, mix):
    lo = loader(data_dir, mix=mix)
    # Entries of chunks fed in this epoch and the next, with an old window among them.
    skip = lo.data_entries(np.r_[83, 85, 86, 90, 97, 120, lo.n_chunks + 81, lo.n_chunks + 90]) + [[100, 104]]
    for position in (80, lo.n_chunks + 80):
        whole_fed, whole = lo.step(position, skip, 16, 0, 1, 1)
        assert not set(lo.chunk_ids(whole_fed.indices).tolist()) & set(lo.skipped_chunks(skip).tolist())
        shares, inputs = [], []
        for rank in range(world_size):
            fed, micro = lo.step(position, skip, 16, rank, world_size, grad_accum)
            assert (fed.first, fed.end, fed.domain_tokens) == (whole_fed.first, whole_fed.end, whole_fed.domain_tokens)
            assert len(micro) == grad_accum
            shares.append(fed.indices)
            inputs += [x.numpy() for x, _ in micro]
        assert np.concatenate(shares).tolist() == whole_fed.indices.tolist()
        assert np.array_equal(np.concatenate(inputs), whole[0][0].numpy())


def test_old_windows_still_load_and_mean_what_they_meant(data_dir, tmp_path):
    lo = loader(data_dir)
    windows = [[83, 86], [90, 91]]
    fed, batch = lo.step(80, windows, BATCH, 0, 1, 1)
    assert fed.indices.tolist() == [80, 81, 82, 86, 87, 88, 89, 91]
    # A skip_list.json an earlier version wrote, and one holding both kinds.
    (tmp_path / RECOVERY_FILE).write_text(json.dumps({"schema": 2, "skip_list": windows, "rewinds": [], "lr_scale": None}))
    assert read_recovery(tmp_path, BATCH)["skip_list"] == windows
    mixed = windows + lo.data_entries(np.array([87]))
    again, _ = lo.step(80, mixed, BATCH, 0, 1, 1)
    assert again.indices.tolist() == [80, 81, 82, 86, 88, 89, 91, 92]
    # With no data entry, the batch is today's, bit for bit.
    state = TrainState(skip_list=[])
    merge_recovery(state, read_recovery(tmp_path, BATCH))
    same, same_batch = lo.step(80, state.skip_list, BATCH, 0, 1, 1)
    assert same.indices.tolist() == fed.indices.tolist() and (same_batch[0][0] == batch[0][0]).all()


def test_skip_entries_round_trip_through_the_checkpoint_spec_and_skip_list_json(data_dir, tmp_path):
    lo = loader(data_dir)
    skip = merge_skip_list([[3, 9]] + lo.data_entries(np.array([12, 40]), np.array([True, False])))
    state = TrainState(step=5, skip_list=skip)
    validate(json.loads(json.dumps(state.state_dict())), TrainState.state_spec, "state.train")
    write_recovery(tmp_path, state)
    back = read_recovery(tmp_path, BATCH)
    assert back["skip_list"] == skip
    fresh = TrainState()
    merge_recovery(fresh, back)
    assert fresh.skip_list == skip and lo.step(0, fresh.skip_list, BATCH, 0, 1, 1)[0].indices.tolist() == \
        lo.step(0, skip, BATCH, 0, 1, 1)[0].indices.tolist()


HOSTILE = {
    "path outside": {"shard": "../../etc/passwd", "tokens": [0, 10]},
    "absolute path": {"shard": "/etc/passwd", "tokens": [0, 10]},
    "backwards": {"shard": "web/train-00000.bin", "tokens": [10, 2]},
    "negative": {"shard": "web/train-00000.bin", "tokens": [-5, 2]},
    "extra key": {"shard": "web/train-00000.bin", "tokens": [0, 2], "exec": "rm -rf /"},
    "no tokens": {"shard": "web/train-00000.bin"},
    "string": "web/train-00000.bin",
    "float window": [1.5, 3],
    "huge": {"shard": "web/train-00000.bin", "tokens": [0, 2**70]},
}


@pytest.mark.parametrize("name", sorted(HOSTILE))
def test_hostile_skip_entries_are_refused(name, tmp_path):
    entry = HOSTILE[name]
    with pytest.raises(StateError, match="skip_list"):
        validate({**TrainState().state_dict(), "skip_list": [[1, 2], entry]}, TrainState.state_spec, "state.train")
    (tmp_path / RECOVERY_FILE).write_text(json.dumps({"schema": 2, "skip_list": [entry], "rewinds": [], "lr_scale": None}))
    with pytest.raises(StateError, match="skip_list"):
        read_recovery(tmp_path, BATCH)


def test_entries_the_data_does_not_have_exit_with_a_message(data_dir):
    from dsslm.data import DataError
    lo = loader(data_dir)
    with pytest.raises(DataError, match="not a train shard"):
        lo.step(0, [{"shard": "web/nope.bin", "tokens": [0, 40]}], BATCH, 0, 1, 1)
    shard, tokens = lo.manifest["domains"]["web"]["train"][0]["path"], lo.manifest["domains"]["web"]["train"][0]["tokens"]
    with pytest.raises(DataError, match="holds"):
        lo.step(0, [{"shard": shard, "tokens": [0, tokens + 1]}], BATCH, 0, 1, 1)
    with pytest.raises(DataError, match="every chunk"):
        lo.step(0, [{"shard": e["path"], "tokens": [0, e["tokens"]]} for e in lo.manifest["domains"]["web"]["train"]],
                BATCH, 0, 1, 1)
    # A schema-1 file (batches) holds windows only.
    assert entries_of([[1, 2]]) == []


def test_a_document_is_named_whole_but_never_more_than_its_reach(data_dir):
    lo = loader(data_dir)
    bad_position = next(g for g in range(lo.n_chunks) if (rows(lo, [g]) == BAD).sum() > SEQ_LEN)
    entries = lo.data_entries(np.array([bad_position]), np.array([True]))
    named = lo.skipped_chunks(entries)
    # Every chunk with a prediction inside the document, none beyond: the document is ~40 chunks.
    every = np.arange(lo.n_chunks)
    inside = [g for g in every if (rows(lo, [g]) == BAD).any()]  # holds a prediction of the document
    assert set(named.tolist()) == set(lo.chunk_ids(np.array(inside)).tolist())
    assert 38 <= len(named) <= 2 * DOCUMENT_TOKENS // SEQ_LEN + 1


@pytest.mark.parametrize("shard_tokens", [1000, 1300])
def test_a_document_cut_by_a_shard_boundary_is_named_in_both_shards(tmp_path, shard_tokens):
    """`prepare` cuts shards at token counts: the bad document (~40 chunks) crosses from one
    shard into the next at these sizes. Named from a chunk on either side of the cut, every chunk
    holding a prediction of it is skipped, and no other. (Before: the part in the other shard
    was fed again.)"""
    rng = np.random.default_rng(1)
    words = ["alpha", "beta", "gamma", "delta"]
    docs = [" ".join(rng.choice(words, 12)) for _ in range(20)]
    docs.insert(12, "Z" * (40 * SEQ_LEN))
    (tmp_path / "docs.jsonl").write_text("".join(json.dumps({"text": d}) + "\n" for d in docs))
    prepare([tmp_path / "docs.jsonl"], tmp_path / "d", domain="web", val_fraction=0, shard_tokens=shard_tokens)
    lo = loader(tmp_path / "d")
    shard_of = lambda g: int(np.searchsorted(lo._first_chunk, lo.chunk_ids(np.array([g]))[0], side="right")) - 1
    inside = [g for g in range(lo.n_chunks) if (rows(lo, [g]) == BAD).any()]
    assert len({shard_of(g) for g in inside}) == 2  # the document crosses a shard boundary
    want = set(lo.chunk_ids(np.array(inside)).tolist())
    for g in (min(inside, key=shard_of), max(inside, key=shard_of)):  # named from either side
        named = lo.skipped_chunks(lo.data_entries(np.array([g]), np.array([True])))
        assert set(named.tolist()) == want


def test_an_entry_applies_from_its_step_and_a_new_pass_applies_it_from_its_first():
    """`from_step`: the data a verdict names was trained on before it, so a catch-up from an
    older checkpoint feeds it where the run did; a rewind's new pass never feeds known bad data."""
    from dsslm.data.skips import active_at, restamp, stamp
    old = {"shard": "a.bin", "tokens": [0, 100]}
    new = stamp([{"shard": "a.bin", "tokens": [50, 300]}, [7, 9]], 41)
    assert new == [{"shard": "a.bin", "tokens": [50, 300], "from_step": 41}, [7, 9]]  # windows are positions
    skip_list = merge_skip_list([old] + new)
    # Overlapping ranges of different steps stay apart: merged, the old one would start at 41 too.
    assert skip_list == [[7, 9], old, new[0]]
    assert active_at(skip_list, 40) == [[7, 9], old]
    assert active_at(skip_list, 40) is active_at(skip_list, 12)  # one list per threshold: the loader's view stays cached
    assert active_at(skip_list, 41) is skip_list
    again = restamp(skip_list, 30)  # a rewind to step 29: from step 30 on
    assert again[2]["from_step"] == 30 and restamp(skip_list, 45) == skip_list
    assert stamp([new[0]], 99) == [new[0]]  # a stamped entry keeps its step
