"""What the check before the first step (health/nodecheck.py) needs of torch.distributed: the
links between nodes timed one at a time, and every rank's wall clock read at one moment.

A ring all-reduce takes as long on every rank as its slowest link, so it cannot say which node is
slow. Here each node's first rank (its leader) sends to the next node's leader and to the previous
one's, each directed link timed alone: a round holds links that share no node, so neither the
data nor the TCP acknowledgements of another transfer queue in front of it (a throttled node's
queue delays the acks of what it receives while it sends). A 4-byte message gives the latency, then
16 KiB, then each message as large as the link's last rate says fits in `budget_s`, up to 16 MiB, and
that size sent 5 times, the fastest counting (a busy machine only ever slows a message down): a
link at a tenth of its peers' speed costs a second, not minutes.
"""
from __future__ import annotations

import time
from typing import Any

import torch
import torch.distributed as dist

LATENCY_BYTES = 4
FIRST_BYTES, MOST_BYTES = 16 << 10, 16 << 20
BUDGET_S = 0.2  # a message on a link is sized to take about this long, by its last one's rate
# Messages at a link's final size; the fastest counts. Measured: on a 2-core VM at load 5-10, one
# 16 MiB message on a healthy veth took 190 ms (87 MB/s against 849 MB/s the other way) while its
# process waited for a core; a throttled link is slow every time.
REPEATS = 5


def links_of(leaders: list[int]) -> list[tuple[int, int]]:
    """Each leader to the next and to the previous one in a ring, each directed link once."""
    n = len(leaders)
    links: list[tuple[int, int]] = []
    for i, src in enumerate(leaders):
        for dst in (leaders[(i + 1) % n], leaders[(i - 1) % n]):
            if dst != src and (src, dst) not in links:
                links.append((src, dst))
    return links


def rounds_of(links: list[tuple[int, int]]) -> list[list[tuple[int, int]]]:
    """`links` in rounds where no rank is in two links (greedy, in order: the same on every rank)."""
    rounds: list[list[tuple[int, int]]] = []
    for link in links:
        for batch in rounds:
            if not {r for pair in batch for r in pair} & set(link):
                batch.append(link)
                break
        else:
            rounds.append([link])
    return rounds


def time_links(device: torch.device, leaders: list[int], first: int = FIRST_BYTES, most: int = MOST_BYTES,
               budget_s: float = BUDGET_S, repeats: int = REPEATS) -> dict[tuple[int, int], dict[str, float]]:
    """{(src, dst): {"latency_s", "bytes", "seconds"}} for every link between consecutive leaders,
    the same table on every rank (every rank of the group calls this; only leaders send).
    `seconds` is the receiver's fastest time for the largest message sent on that link. Each link's
    next message is as large as its last rate says fits in `budget_s` (at most `most` bytes); at
    `most` bytes, or once a message took half the budget, that size is sent `repeats` times in all."""
    if not dist.is_initialized() or len(leaders) < 2:
        return {}
    me = dist.get_rank()
    links = links_of(leaders)
    table: dict[tuple[int, int], dict[str, float]] = {link: {} for link in links}
    size = dict.fromkeys(links, LATENCY_BYTES)
    samples: dict[tuple[int, int], int] = {}  # messages sent at a link's final size
    buffer = torch.zeros(most, dtype=torch.uint8, device=device) if me in leaders else None
    while size:
        for batch in rounds_of([link for link in links if link in size]):
            mine = next((link for link in batch if me in link), None)
            dist.barrier()  # every rank: the round starts together
            took = _transfer(buffer, mine, size[mine], me, device) if mine is not None else None
            everyone: list[Any] = [None] * dist.get_world_size()
            dist.all_gather_object(everyone, took)
            for link in batch:
                sent, seconds = size[link], max(everyone[link[1]], 1e-9)
                if sent == LATENCY_BYTES:
                    table[link]["latency_s"] = seconds
                    size[link] = first
                    continue
                if link in samples:  # a repeat: a busy machine only ever makes a message slower
                    table[link]["seconds"] = min(table[link]["seconds"], seconds)
                    samples[link] += 1
                    if samples[link] >= repeats:
                        del size[link]
                    continue
                table[link].update(bytes=sent, seconds=seconds)
                if sent >= most or seconds >= budget_s / 2:
                    samples[link] = 1  # its final size: sent again, the fastest counts
                    if repeats <= 1:
                        del size[link]
                else:
                    size[link] = min(most, max(2 * sent, int(sent / seconds * budget_s)))
    return table


def _transfer(buffer: torch.Tensor, link: tuple[int, int], size: int, me: int, device: torch.device) -> float | None:
    """One message on `link`: the receiver's seconds from the round's barrier to its arrival."""
    src, dst = link
    started = time.perf_counter()
    if me == src:
        dist.send(buffer[:size], dst)
        return None
    dist.recv(buffer[:size], src)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter() - started


def wall_clocks() -> list[float]:
    """Every rank's `time.time()` read as it leaves one barrier (they leave within about a message's
    latency of each other): the clocks' offsets, within that latency."""
    if not dist.is_initialized():
        return [time.time()]
    dist.barrier()
    now = time.time()
    everyone: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, now)
    return everyone
