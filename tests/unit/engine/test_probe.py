"""The node check's links and clocks (dsslm/engine/probe.py): which links, in which rounds, and the
table every rank gets from 2 gloo ranks."""
from __future__ import annotations

import pytest
import torch

from dsslm.engine.probe import links_of, rounds_of, time_links, wall_clocks
from helpers import run_distributed


def test_each_leader_to_its_ring_neighbours_in_rounds_that_share_no_node():
    assert links_of([0, 4]) == [(0, 4), (4, 0)]
    assert rounds_of(links_of([0, 4])) == [[(0, 4)], [(4, 0)]]  # one direction at a time
    links = links_of(list(range(0, 64, 8)))
    assert len(links) == 16 and len(set(links)) == 16
    rounds = rounds_of(links)
    assert sum(len(r) for r in rounds) == 16 and len(rounds) <= 4, rounds
    for batch in rounds:
        ranks = [r for link in batch for r in link]
        assert len(ranks) == len(set(ranks)), batch
    assert links_of([3]) == [] and len(links_of([0, 1, 2])) == 6


def _probe(rank: int, world: int) -> tuple[dict, list[float]]:
    import torch.distributed as dist
    dist.init_process_group("gloo")
    try:
        table = time_links(torch.device("cpu"), [0, 1], most=1 << 20)
        return table, wall_clocks()
    finally:
        dist.destroy_process_group()


@pytest.mark.slow  # two spawned processes
def test_two_ranks_get_the_same_table():
    (table0, clocks0), (table1, clocks1) = run_distributed(_probe, 2)
    assert table0 == table1 and sorted(table0) == [(0, 1), (1, 0)], table0
    for link in table0.values():
        assert link["latency_s"] > 0 and link["bytes"] >= 16 << 10 and link["seconds"] > 0, link
    assert clocks0 == clocks1 and abs(clocks0[0] - clocks0[1]) < 1.0
