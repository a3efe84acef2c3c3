"""The prefetcher: the batch a rank sees is the synchronous read's, bit for bit, on a hit and on
every kind of miss (a rewind, a grown skip list, a batch-size change by position)."""
from __future__ import annotations

import json
import threading

import numpy as np
import pytest
import torch

from dsslm.data import prepare
from dsslm.data.loader import Loader
from dsslm.data.prefetch import Prefetcher
from dsslm.data.stream import batch_size_at

SEQ_LEN = 16


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory):
    root = tmp_path_factory.mktemp("prefetch")
    rng = np.random.default_rng(1)
    (root / "t.txt").write_text("".join(" ".join(map(str, rng.integers(0, 10**6, 8))) + "\n" for _ in range(600)))
    prepare([root / "t.txt"], root / "d", val_fraction=0.05, shard_tokens=9_000)
    return root / "d"


def same(a, b) -> bool:
    (fa, ba), (fb, bb) = a, b
    return ((fa.first, fa.end, fa.batch_size, fa.domain_tokens) == (fb.first, fb.end, fb.batch_size, fb.domain_tokens)
            and np.array_equal(fa.indices, fb.indices) and len(ba) == len(bb)
            and all(torch.equal(x, y) and torch.equal(u, v) for (x, u), (y, v) in zip(ba, bb)))


@pytest.mark.parametrize("rank,world_size,grad_accum", [(0, 1, 2), (1, 2, 1), (3, 4, 2)])
def test_hits_and_misses_return_the_synchronous_batches_bitwise(data_dir, rank, world_size, grad_accum):
    loader = Loader(data_dir, SEQ_LEN, seed=3)
    granule = world_size * grad_accum
    schedule = lambda p: batch_size_at(p, 4 * granule, granule, granule, 40 * SEQ_LEN, SEQ_LEN)  # noqa: E731
    feed = Prefetcher(loader, rank, world_size, grad_accum, schedule)
    skip: list = []
    position, seen = 0, []
    script = ["go"] * 6 + ["rewind"] + ["go"] * 3 + ["grow"] + ["go"] * 2
    for action in script:
        if action == "rewind":  # back to an older position, the spike's window skipped from now on
            skip.append([seen[-2][0], seen[-1][1]])
            position = seen[-4][0]
        elif action == "grow":  # a window over the very step the prefetcher read ahead
            skip.append([position, position + 3])
        got = feed.step(position, skip)
        want = loader.step(position, skip, schedule(position), rank, world_size, grad_accum)
        assert same(got, want), action
        seen.append((got[0].first, got[0].end))
        position = got[0].end
    feed.close()
    assert feed.misses == 3 and feed.hits == len(script) - 3  # the first step, the rewind, the grown list
    assert len({schedule(p) for p, _ in seen}) > 1  # the ramp changed the batch size by position


def test_disabled_reads_synchronously_and_counts_no_misses(data_dir):
    loader = Loader(data_dir, SEQ_LEN, seed=3)
    feed = Prefetcher(loader, 0, 1, 1, lambda p: 4, enabled=False)
    fed, _ = feed.step(0, [])
    assert (feed.hits, feed.misses) == (0, 0) and same(feed.step(fed.end, []), loader.step(fed.end, [], 4, 0, 1, 1))
    feed.close()


def test_a_read_error_surfaces_at_the_step_that_needs_it_and_a_dropped_one_never(data_dir, monkeypatch):
    loader = Loader(data_dir, SEQ_LEN, seed=3)
    real_step = loader.step
    bad_positions = {8}

    def flaky(position, *args):
        if position in bad_positions and threading.current_thread() is not threading.main_thread():
            raise OSError(f"disk gone at {position}")
        return real_step(position, *args)

    monkeypatch.setattr(loader, "step", flaky)
    feed = Prefetcher(loader, 0, 1, 1, lambda p: 4)
    feed.step(0, [])
    feed.step(4, [])  # schedules position 8 in the background: that read fails
    with pytest.raises(OSError, match="disk gone at 8"):
        feed.step(8, [])
    feed.step(4, [])          # schedules 8 again (fails in the background) ...
    fed, _ = feed.step(0, [])  # ... but a rewind to 0 never needed it: no error
    assert fed.first == 0
    feed.close()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_on_cuda_the_host_batches_are_pinned_and_copy_non_blocking(data_dir):
    loader = Loader(data_dir, SEQ_LEN, seed=3)
    feed = Prefetcher(loader, 0, 1, 2, lambda p: 8, pin_memory=True)
    fed, _ = feed.step(0, [])
    _, batches = feed.step(fed.end, [])  # a hit: read and pinned in the background thread
    assert feed.hits == 1 and all(x.is_pinned() and y.is_pinned() for x, y in batches)
    on_device = [x.to("cuda", non_blocking=True) for x, _ in batches]
    torch.cuda.synchronize()
    want = loader.step(fed.end, [], 8, 0, 1, 2)[1]
    assert all(torch.equal(d.cpu(), w[0]) for d, w in zip(on_device, want))
    feed.close()


def test_a_skip_list_grown_in_place_is_merged_again(data_dir):
    """Skip lists are merged once per change (skips.view_of, known by identity and length): one
    that the loop grows in place must still be read as its new contents, by the loader and by the
    prefetcher (its read ahead under the old list is a miss)."""
    loader = Loader(data_dir, SEQ_LEN, seed=3)
    feed = Prefetcher(loader, 0, 1, 1, lambda p: 8, enabled=True)
    skip_list: list = [[4, 6]]
    fed, _ = feed.step(0, skip_list)
    skip_list += loader.window_entries(fed.end, fed.end + 8, skip_list)  # in place, as a loop might
    got = feed.step(fed.end, skip_list)
    fresh = Loader(data_dir, SEQ_LEN, seed=3).step(fed.end, json.loads(json.dumps(skip_list)), 8, 0, 1, 1)
    assert feed.misses == 2 and same(got, fresh)
    assert not np.isin(loader.chunk_ids(got[0].indices), loader.skipped_chunks(skip_list)).any()
    feed.close()
