"""What the watchdog (dsslm/health/watchdog.py) needs of torch.distributed: a board in the job's
key-value store where each rank posts its beat and reads every rank's, the collectives' timeout,
the flight recorder's record of this rank's collectives, and what a collective's exception means.

The board's store I/O runs in a thread of its own. TCPStore's timeout does not bound every
operation: measured on torch 2.13, an `add` on a SIGSTOPped store server was still waiting after
20 s with a 1 s timeout, and a link that goes down sends no reset either. So the watchdog never
waits on the store: it reads the last complete exchange and its time, and a store that stops
answering is itself the evidence (its host is stopped, dead or cut off).
"""
from __future__ import annotations

import json
import os
import threading
import time
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

# Collectives the flight recorder keeps per rank (torch's own ring buffer; 0 = off). Set before
# the process group is made, unless the user set it (torchtitan turns it on the same way).
FLIGHT_RECORDS = "2000"
VERDICT = "verdict"
# gloo and NCCL say these in a collective's exception; the process group keeps no error codes.
TIMEOUT_MARKS = ("Timed out", "timed out", "Timeout", "timeout")
PEER_MARKS = ("Connection closed by peer", "Connection reset by peer", "Broken pipe", "Connection refused",
              "communicator was aborted", "remote process exited", "Socket Timeout")


def enable_flight_recorder() -> None:
    os.environ.setdefault("TORCH_FR_BUFFER_SIZE", FLIGHT_RECORDS)


def store_address() -> tuple[str, int] | None:
    """(host, port) of the TCPStore behind the default process group, or None (no group, or
    another kind of store)."""
    if not dist.is_initialized():
        return None
    store = dist.distributed_c10d._get_default_store()
    while hasattr(store, "underlying_store"):  # torchrun wraps it in a PrefixStore or two
        store = store.underlying_store
    return (store.host, store.port) if isinstance(store, dist.TCPStore) else None


def set_collective_timeout(seconds: float) -> None:
    """The default group's timeout for the collectives started from now on (gloo and NCCL)."""
    if dist.is_initialized():
        dist.distributed_c10d._set_pg_timeout(timedelta(seconds=seconds))


def flight_record() -> tuple[str | None, str | None]:
    """This rank's flight record as JSON (the collectives it started, each `retired` once done)
    and the collective it shows unfinished, oldest first (`gloo:all_reduce #93`); None where torch
    keeps no record."""
    try:
        record = torch._C._distributed_c10d._dump_fr_trace_json(True, False).decode()
    except (AttributeError, RuntimeError, UnicodeDecodeError):
        return None, None
    try:
        entries = json.loads(record).get("entries") or []
        unfinished = [e for e in entries if isinstance(e, dict) and not e.get("retired", True)]
    except (ValueError, AttributeError):
        return record, None
    first = unfinished[0] if unfinished else None
    return record, f"{first.get('profiling_name')} #{first.get('collective_seq_id')}" if first else None


def collective_failure(exc: BaseException) -> str | None:
    """`timeout` for a collective that ran past the group's timeout, `peer` for one whose peer went
    away (its connection closed or reset), None for anything else."""
    if not isinstance(exc, RuntimeError):
        return None
    text = str(exc)
    if any(mark in text for mark in PEER_MARKS):
        return "peer"
    if isinstance(exc, dist.DistBackendError) or "gloo" in text or "NCCL" in text:
        return "timeout" if any(mark in text for mark in TIMEOUT_MARKS) else None
    return None


class StoreBoard:
    """Beats in the job's TCPStore under `dsslm/watch/<token>/`, exchanged by a daemon thread every
    `beat_s`: our last beat posted, every rank's read back, and the verdict if a rank announced one.
    `view()` is the last complete exchange: (its monotonic time, beats by rank, verdict). The beat
    is `source()` at the exchange (so it is as fresh as the store can show it) plus `n`, the count
    of exchanges: a peer sees this rank beating while `n` moves."""

    def __init__(self, address: tuple[str, int], token: str, rank: int, world_size: int, beat_s: float):
        self.address, self.prefix, self.rank = address, f"dsslm/watch/{token}/", rank
        self.keys = [f"beat/{r}" for r in range(world_size)]
        self.beat_s = beat_s
        self.op_timeout = timedelta(seconds=min(30.0, max(2.0, 4 * beat_s)))
        self.outbox: bytes | None = None
        self.source: Any = None  # () -> dict: this rank's beat, read at each exchange
        self.announcing: str | None = None
        self.last: tuple[float, list[Any], str | None] = (time.monotonic(), [None] * world_size, None)
        self.exchanges = 0
        self._store: Any = None
        self._wake, self._stop = threading.Event(), threading.Event()
        self._thread = threading.Thread(target=self._run, name="dsslm-watch-store", daemon=True)
        self._thread.start()

    def post(self, beat: dict) -> None:
        self.outbox = json.dumps(beat).encode()

    def announce(self, verdict: str) -> None:
        """Every rank learns `verdict` at its next exchange; the first announcement stays."""
        self.announcing = verdict
        self._wake.set()

    def view(self) -> tuple[float, list[Any], str | None]:
        return self.last

    def close(self, beat: dict, wait_s: float) -> None:
        """Post a last beat (`exited`), wait up to `wait_s` for it to go out, stop."""
        self.source = None
        self.post(beat)
        done = self.exchanges
        self._wake.set()
        deadline = time.monotonic() + wait_s
        while self.exchanges == done and self._thread.is_alive() and time.monotonic() < deadline:
            time.sleep(0.01)
        self._stop.set()
        self._wake.set()

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                self._exchange()
            except Exception:  # noqa: BLE001 - any store failure: reconnect next time; the view ages
                self._store = None
            self._wake.wait(self.beat_s)
            self._wake.clear()

    def _exchange(self) -> None:
        if self._store is None:
            client = dist.TCPStore(*self.address, is_master=False, timeout=self.op_timeout, wait_for_workers=False)
            self._store = dist.PrefixStore(self.prefix, client)
        store = self._store
        if self.source is not None and not self._stop.is_set():
            self.post({**self.source(), "n": self.exchanges})
        if self.outbox is not None:
            store.set(self.keys[self.rank], self.outbox)
        if self.announcing is not None:
            store.compare_set(VERDICT, "", self.announcing)  # only the first announcement is kept
        if store.check(self.keys):
            raw = store.multi_get(self.keys)
        else:  # ranks that have not beaten yet: read the others
            raw = [store.get(k) if store.check([k]) else None for k in self.keys]
        verdict = store.get(VERDICT).decode() if store.check([VERDICT]) else None
        self.last = (time.monotonic(), [_decode(v) for v in raw], verdict)
        self.exchanges += 1


def _decode(raw: bytes | None) -> dict | None:
    try:
        beat = json.loads(raw) if raw else None
    except ValueError:
        return None
    return beat if isinstance(beat, dict) else None
