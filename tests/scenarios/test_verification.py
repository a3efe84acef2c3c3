"""Startup verification at scale, end to end: the shards are hashed once, split over the ranks;
a restart hashes nothing; a changed shard exits 2; long work waits outside the collectives."""
from __future__ import annotations

import time

import numpy as np
import pytest

from dsslm.data import prepare
from dsslm.train import main
from helpers import TINY, events, run_distributed, run_train

pytestmark = pytest.mark.slow


@pytest.fixture
def data_dir(tmp_path):
    rng = np.random.default_rng(4)
    words = ["lorem", "ipsum", "dolor", "sit", "amet", "consectetur"]
    (tmp_path / "t.txt").write_text(" ".join(rng.choice(words, 12_000)))
    prepare([tmp_path / "t.txt"], tmp_path / "d", val_fraction=0.05, shard_tokens=8_000)
    return tmp_path / "d"


def verified(run_dir) -> list[dict]:
    return events(run_dir, "data_verified")


@pytest.mark.slow
def test_two_ranks_split_the_hashing_and_a_restart_hashes_nothing(tmp_path, data_dir):
    steps = [f"data.dir={data_dir}", "train.total_steps=2", "ckpt.every=2", "train.micro_batch_size=2",
             "optim.warmup_steps=1"]
    run_train(tmp_path / "run", *steps, nproc=2)
    first = verified(tmp_path / "run")[0]
    n_shards = first["hashed_shards"]
    assert n_shards >= 8 and first["cached_shards"] == 0
    assert sum(first["hashed_per_rank"]) == n_shards and min(first["hashed_per_rank"]) > 0
    run_train(tmp_path / "run", *steps, "train.total_steps=3", "ckpt.every=3", nproc=2)
    again = verified(tmp_path / "run")[1]
    assert (again["hashed_shards"], again["cached_shards"], again["hashed_per_rank"]) == (0, n_shards, [0, 0])


def test_a_changed_shard_exits_2_in_one_line_and_full_rehashes_everything(tmp_path, data_dir, capsys):
    base = [f"run.dir={tmp_path / 'run'}", *TINY, f"data.dir={data_dir}", "train.total_steps=2", "ckpt.every=2",
            "optim.warmup_steps=1"]
    assert main(base) == 0
    assert main([*base, "data.verify=full"]) == 0
    assert verified(tmp_path / "run")[1]["hashed_shards"] == verified(tmp_path / "run")[0]["hashed_shards"]
    shard = data_dir / "default" / "train-00001.bin"
    data = bytearray(shard.read_bytes())
    data[100] ^= 0x01
    shard.write_bytes(bytes(data))
    capsys.readouterr()
    before = events(tmp_path / "run")
    assert main([*base, "train.total_steps=4"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and f"shard {shard} does not match its sha256" in err[0]
    assert events(tmp_path / "run") == before  # the refused start wrote nothing


def long_work(rank: int, world_size: int) -> list[str]:
    """gather_long on a real 2-rank DDP engine, three cases in turn; what happened in each."""
    from dsslm.config import load
    from dsslm.engine import build_engine
    from dsslm.model import build_model
    cfg = load(None, ["model.d_model=16", "model.n_layers=1", "model.n_heads=2", "train.device=cpu"])
    cfg.model.vocab_size = 32
    engine = build_engine(cfg, build_model(cfg.model))

    def work(case, progress):
        if case == "slow but steady" and rank == 1:
            for _ in range(12):  # 3 s of work, twice the stall timeout, progressing all along
                time.sleep(0.25)
                progress(1)
        if case == "raises" and rank == 1:
            raise ValueError("rank 1's shard is bad")
        if case == "stuck" and rank == 1:
            time.sleep(5)  # no progress: as if a read hung
        return f"rank {rank} done"

    results = []
    for case in ("slow but steady", "raises", "stuck"):
        try:
            results.append(" / ".join(engine.gather_long(lambda p: work(case, p), "test work", stall_timeout_s=1.5)))  # noqa: B023
        except (RuntimeError, ValueError) as exc:
            results.append(f"{type(exc).__name__}: {exc}")
    # A second job in the same process group (as the resume drill runs them) must not see the
    # first one's counters: it waits for its own work.
    again = build_engine(cfg, build_model(cfg.model))
    results.append(" / ".join(again.gather_long(lambda p: time.sleep(0.5) or f"again {rank}", "test work")))
    again.close()
    engine.close()
    return results


def test_long_work_waits_outside_collectives_fails_on_a_stall_and_raises_everywhere_on_2_ranks():
    for steady, raised, stuck, again in run_distributed(long_work, 2):
        assert again == "again 0 / again 1"
        assert steady == "rank 0 done / rank 1 done"  # longer than the stall timeout, but progressing
        assert raised == "ValueError: rank 1's shard is bad"  # rank 1's error, on both ranks
        assert stuck.startswith("RuntimeError: test work: no rank made progress for 2 s (1 of 2 ranks done)"), stuck


def _two_nodes(rank: int, world_size: int, run_dir: str, copies: str) -> int:
    """Rank r on machine node{r}, reading its node's own copy of DATA_DIR (copies/node{r})."""
    import socket
    socket.gethostname = lambda: f"node{rank}"
    return main([f"run.dir={run_dir}", *TINY, f"data.dir={copies}/node{rank}", "train.total_steps=2",
                 "ckpt.every=2", "optim.warmup_steps=1", "train.micro_batch_size=2"])


@pytest.mark.slow
def test_each_node_verifies_its_own_copy_of_the_data(tmp_path, data_dir, capsys):
    """Node 1's copy has a flipped byte (same size) while rank 0's copy is verified and cached: the
    node that reads it must notice, and every rank exits 2 together."""
    import shutil
    copies = tmp_path / "copies"
    for node in ("node0", "node1"):
        shutil.copytree(data_dir, copies / node)
    assert main([f"run.dir={tmp_path / 'warm'}", *TINY, f"data.dir={copies / 'node0'}", "train.total_steps=2",
                 "optim.warmup_steps=1"]) == 0  # node 0's copy: verified, its cache warm
    shard = copies / "node1" / "default" / "train-00001.bin"
    data = bytearray(shard.read_bytes())
    data[100] ^= 0x01
    shard.write_bytes(bytes(data))
    codes = run_distributed(_two_nodes, world_size=2, args=(str(tmp_path / "run"), str(copies)), timeout_s=240)
    assert codes == [2, 2]
    assert not (tmp_path / "run" / "checkpoints").exists()
    # A good copy on both nodes trains, each node hashing only its own uncached shards.
    shutil.rmtree(copies / "node1")
    shutil.copytree(data_dir, copies / "node1")
    assert run_distributed(_two_nodes, world_size=2, args=(str(tmp_path / "run2"), str(copies)),
                           timeout_s=240) == [0, 0]
    (event,) = verified(tmp_path / "run2")
    assert event["nodes"] == 2 and event["hashed_per_rank"][0] == 0 and event["hashed_per_rank"][1] > 0
