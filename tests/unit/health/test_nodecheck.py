"""The check before the first step (dsslm/health/nodecheck.py): each node's own checks, the verdict
every rank reaches from the same table (links, clocks, GPUs), the exit code, and what rank 0 records.
The multi-process and two-node drills are tests/scenarios/test_two_nodes.py's and test_nodes.py's."""
from __future__ import annotations

import json
import subprocess

import pytest
import torch

from dsslm.config import NodesCfg, load
from dsslm.exits import EXIT_BAD_INPUT, EXIT_BAD_NODE, EXIT_CRASH_LOOP, EXIT_OK, EXIT_WRITE_FAILED
from dsslm.health import nodecheck
from dsslm.health.nodecheck import (check_data, check_dir, check_gpu, check_memory, exit_code, fs_type, host_bytes,
                                    judge, line_of, record)
from dsslm.health.nodes import read_nodes

CFG = NodesCfg()


def ok_local() -> dict:
    return {"run_dir": {"ok": True}, "data": {"ok": True}, "memory": {"ok": True}}


def ranks(*hosts: str, local=None) -> list[dict]:
    """Each rank's results; the first rank of each host carries its node's checks."""
    out, seen = [], set()
    for r, host in enumerate(hosts):
        entry = {"rank": r, "host": host, "slurm_node": None}
        if host not in seen:
            entry["local"] = (local or {}).get(host, ok_local())
            seen.add(host)
        out.append(entry)
    return out


def links(rates: dict[tuple[int, int], float]) -> dict:
    """{(src, dst): bytes/s} as time_links measures them (1 MiB messages)."""
    return {link: {"latency_s": 1e-4, "bytes": 1 << 20, "seconds": (1 << 20) / rate} for link, rate in rates.items()}


def test_run_dir_probe_and_room(tmp_path):
    good = check_dir(tmp_path, needed=1000)
    assert good["ok"] and good["free_bytes"] > 1000 and good["write_mb_s"] > 0, good
    assert not list(tmp_path.iterdir())  # the probe file is gone
    full = check_dir(tmp_path, needed=1 << 62)
    assert not full["ok"] and "MB free, the next checkpoint needs" in full["why"], full
    missing = check_dir(tmp_path / "nope", needed=1)
    assert not missing["ok"] and "is not there" in missing["why"], missing


def test_a_full_filesystem_fails_the_write_and_the_room(tmp_path):
    mount = tmp_path / "disk"
    mount.mkdir()
    made = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=64k", "tmpfs", str(mount)], capture_output=True)
    if made.returncode != 0:
        pytest.skip("cannot mount a tmpfs here (needs root)")
    try:
        result = check_dir(mount, needed=1 << 20)
        assert not result["ok"] and "No space left" in result["why"], result  # the 256 KiB probe cannot be written
        assert not list(mount.iterdir())  # nor is it left behind
    finally:
        subprocess.run(["umount", "-l", str(mount)], check=False)


def test_the_filesystem_under_run_dir_and_the_data_is_recorded(tmp_path):
    assert fs_type("/proc") == "proc" and fs_type("/proc/self") == "proc"  # the deepest mount over the path
    assert isinstance(fs_type(tmp_path), str)
    assert check_dir(tmp_path, needed=1)["fs"] == fs_type(tmp_path) == check_data(tmp_path, [])["fs"]


def test_data_shards_are_read_at_both_ends(tmp_path):
    (tmp_path / "d").mkdir()
    (tmp_path / "d" / "a.bin").write_bytes(b"\0" * 10_000)
    good = check_data(tmp_path, ["d/a.bin"])
    assert good["ok"] and good["shards"] == 1 and good["writable"], good
    (tmp_path / "d" / "b.bin").mkdir()  # a path the node cannot read as a file
    bad = check_data(tmp_path, ["d/a.bin", "d/b.bin", "d/gone.bin"])
    assert not bad["ok"] and "b.bin" in bad["why"] and "(and 1 more)" in bad["why"], bad


def test_memory_for_the_rewind_points_and_the_snapshot():
    assert check_memory(1)["ok"]
    short = check_memory(1 << 62)
    assert not short["ok"] and "GB of host memory available" in short["why"], short
    cfg = load(None, ["monitor.rewind_points=2"])
    state = 12 * 1000
    assert host_bytes(cfg, 1000, 0, 4) == state // 4 + 2 * state // 4  # sharded snapshot and two points
    cfg = load(None, ["ckpt.format=gathered", "monitor.enabled=false"])
    assert (host_bytes(cfg, 1000, 0, 4), host_bytes(cfg, 1000, 1, 4)) == (state, 0)  # rank 0 gathers


def test_the_known_matmul_on_the_cpu():
    result = check_gpu(torch.device("cpu"), timed_n=64, reps=2)
    assert result["ok"] and result["tflops"] > 0, result


def test_a_wrong_matmul_is_named(monkeypatch):
    real = torch.Tensor.__matmul__

    def flipped(a, b):
        out = real(a, b)
        if out.shape == (nodecheck.EXACT_N, nodecheck.EXACT_N) and out.dtype == torch.float32:
            out[3, 5] += 1
        return out
    monkeypatch.setattr(torch.Tensor, "__matmul__", flipped)
    result = check_gpu(torch.device("cpu"), timed_n=64, reps=1)
    assert not result["ok"] and "1 of 262144 entries" in result["why"], result


def test_a_slow_sender_of_two_nodes_is_named_and_the_receiver_is_not():
    table = judge(ranks("a", "a", "b", "b"), [0.0] * 4, links({(0, 2): 500e6, (2, 0): 1e6}), CFG)
    assert (table["a"]["verdict"], table["b"]["verdict"]) == ("ok", "bad"), table
    assert table["b"]["ranks"] == [2, 3] and "sends 1.00 MB/s" in table["b"]["why"][0], table["b"]
    assert table["a"]["checks"]["network"]["send_mb_s"] == 500.0


def test_from_three_nodes_a_slow_receiver_is_named_not_its_neighbours():
    fast, slow = 500e6, 2e6
    rates = {(0, 1): slow, (2, 1): slow, (1, 0): fast, (1, 2): fast, (0, 2): fast, (2, 0): fast}
    table = judge(ranks("a", "b", "c"), [0.0] * 3, links(rates), CFG)
    assert [h for h, n in table.items() if n["verdict"] == "bad"] == ["b"], table
    assert "receives 2.00 MB/s" in table["b"]["why"][0]


def test_links_alike_and_one_node_name_nobody():
    even = links({(0, 1): 400e6, (1, 0): 300e6})
    assert all(n["verdict"] == "ok" for n in judge(ranks("a", "b"), [0.0, 0.0], even, CFG).values())
    alone = judge(ranks("a", "a"), [0.0, 5.0], {}, CFG)
    assert alone["a"]["verdict"] == "ok" and "clock" not in alone["a"]["checks"], alone


def test_a_clock_far_from_the_median_node():
    table = judge(ranks("a", "b", "c"), [100.0, 100.01, 103.5], {}, CFG)
    assert [h for h, n in table.items() if n["verdict"] == "bad"] == ["c"], table
    assert "+3.5 s from the median node's" in table["c"]["why"][0]


def test_of_two_nodes_only_the_one_without_rank_0_is_named_for_its_clock():
    """The median of two clocks is their midpoint: a 5 s skew (max_clock_skew_s 2) put each node
    2.5 s from it and refused both; a 3 s one passed both. Rank 0's node is the reference."""
    for clocks, skew in (([100.0, 100.01, 105.0, 105.02], "+5.0"), ([100.0, 100.01, 103.0, 103.02], "+3.0"),
                         ([105.0, 105.01, 100.0, 100.02], "-5.0")):  # rank 0's node off: still only b named
        table = judge(ranks("a", "a", "b", "b"), clocks, {}, CFG)
        assert [h for h, n in table.items() if n["verdict"] == "bad"] == ["b"], (clocks, table)
        assert table["b"]["why"] == [f"its clock is {skew} s from rank 0's node's (at most 2 s)"], table["b"]
        assert table["a"]["checks"]["clock"] == {"ok": True, "skew_s": 0.0}
        assert exit_code(table, 1, 3) == EXIT_BAD_NODE
    close = judge(ranks("a", "b"), [100.0, 101.5], {}, CFG)
    assert all(n["verdict"] == "ok" for n in close.values()) and close["b"]["checks"]["clock"]["skew_s"] == 1.5
    # From three nodes the median: rank 0's node is named when it is the one off.
    three = judge(ranks("a", "b", "c"), [103.5, 100.0, 100.01], {}, CFG)
    assert [h for h, n in three.items() if n["verdict"] == "bad"] == ["a"], three
    assert "+3.5 s from the median node's" in three["a"]["why"][0]


def test_a_wrong_or_slow_gpu():
    everyone = ranks("a", "a", "b", "b")
    for r, tflops in zip(everyone, (400, 410, 395, 90)):
        r["gpu"] = {"ok": True, "tflops": tflops}
    table = judge(everyone, [0.0] * 4, {}, CFG)
    assert table["b"]["verdict"] == "bad" and "rank 3's GPU runs a matmul at 90.0" in table["b"]["why"][0], table
    everyone[1]["gpu"] = {"ok": False, "tflops": 400, "why": "cuda:1 computes a known matmul wrong (3 of 9 entries)"}
    assert judge(everyone, [0.0] * 4, {}, CFG)["a"]["why"][0].startswith("rank 1: cuda:1 computes")


def test_exit_codes_a_node_the_shared_storage_and_the_crash_loop():
    bad_dir = {"run_dir": {"ok": False, "why": "full"}, "data": {"ok": True}, "memory": {"ok": True}}
    one = judge(ranks("a", "b", local={"b": bad_dir}), [0.0, 0.0], {}, CFG)
    assert exit_code(one, 1, 3) == EXIT_BAD_NODE and line_of(one["b"]) == \
        "node b (rank 1) failed its check before the first step: full"
    both = judge(ranks("a", "b", local={"a": bad_dir, "b": bad_dir}), [0.0, 0.0], {}, CFG)
    assert exit_code(both, 1, 3) == EXIT_WRITE_FAILED  # a full shared disk: no node's fault
    no_data = {**ok_local(), "data": {"ok": False, "why": "unreadable"}}
    assert exit_code(judge(ranks("a", "b", local={"a": no_data, "b": no_data}), [0, 0], {}, CFG), 1, 3) == EXIT_BAD_INPUT
    assert [n["verdict"] for n in both.values()] == ["shared", "shared"], both  # neither node is bad
    bad_gpu = {**bad_dir, "gpu": {"ok": False, "why": "cuda:0 computes a known matmul wrong"}}
    mixed = judge(ranks("a", "b", local={"a": bad_dir, "b": bad_gpu}), [0.0, 0.0], {}, CFG)
    assert {h: n["verdict"] for h, n in mixed.items()} == {"a": "shared", "b": "bad"}, mixed
    assert exit_code(mixed, 1, 3) == EXIT_WRITE_FAILED  # run.dir first: no requeue cures it
    alone = judge(ranks("a", local={"a": bad_dir}), [0.0], {}, CFG)
    assert exit_code(alone, 2, 3) == EXIT_BAD_NODE  # one node, run.dir's filesystem not known shared: the node
    assert exit_code(alone, 3, 3) == EXIT_CRASH_LOOP and exit_code(alone, 3, 0) == EXIT_BAD_NODE
    assert exit_code(judge(ranks("a", "b"), [0, 0], {}, CFG), 5, 3) == EXIT_OK


def test_a_one_node_job_is_not_refused_as_a_bad_node_for_a_shared_filesystem(tmp_path, capsys):
    """One node has no other to compare with, and a requeue onto another meets the same network
    filesystem: run.dir that cannot be written there is exit 4, the data unreadable there exit 2,
    and the node is not named bad (nothing for the requeue to exclude). On a node-local filesystem
    (a disk, a tmpfs over the path), and for its memory, the node is refused as before (76)."""
    cfg = load(None, [f"run.dir={tmp_path}"])
    unwritable = {"ok": False, "fs": "nfs4", "why": f"run.dir {tmp_path}: cannot write and fsync a file there "
                                                   "(Read-only file system)"}
    table = judge(ranks("a", "a", local={"a": {**ok_local(), "run_dir": unwritable}}), [0.0, 0.0], {}, CFG)
    assert table["a"]["verdict"] == "shared" and exit_code(table, 1, 3) == EXIT_WRITE_FAILED, table
    code, doc = record(cfg, tmp_path, table, 0.1, {})
    assert code == EXIT_WRITE_FAILED and read_nodes(tmp_path)["nodes"]["a"]["verdict"] == "shared"
    err = capsys.readouterr().err
    assert ("(Read-only file system) (on a nfs4 filesystem every node shares): not a node's fault; free space in "
            "run.dir or make it writable") in err and "node a (ranks 0-1) failed" not in err, err
    events = [json.loads(line) for line in (tmp_path / "events.jsonl").read_text().splitlines()]
    assert events[-1]["event"] == "bad_node" and events[-1]["nodes"] == [] and events[-1]["exit_code"] == 4
    unreadable = {"ok": False, "fs": "lustre", "why": "cannot read /data/web/a.bin: Permission denied"}
    data = judge(ranks("a", local={"a": {**ok_local(), "data": unreadable}}), [0.0], {}, CFG)
    assert data["a"]["verdict"] == "shared" and exit_code(data, 1, 3) == EXIT_BAD_INPUT, data
    for local in ({**ok_local(), "run_dir": {**unwritable, "fs": "tmpfs"}},
                  {**ok_local(), "data": {**unreadable, "fs": "ext4"}},
                  {**ok_local(), "memory": {"ok": False, "why": "0.10 GB of host memory available"}}):
        node = judge(ranks("a", local={"a": local}), [0.0], {}, CFG)
        assert node["a"]["verdict"] == "bad" and exit_code(node, 1, 3) == EXIT_BAD_NODE, node


def test_rank_0_records_the_table_the_lines_and_the_events(tmp_path, capsys, monkeypatch):
    status = tmp_path / "status"
    monkeypatch.setenv("DSSLM_STATUS_FILE", str(status))
    cfg = load(None, [f"run.dir={tmp_path}"])
    bad_dir = {"run_dir": {"ok": False, "why": "run.dir /x: 0.1 MB free, the next checkpoint needs 0.6 MB"},
               "data": {"ok": True}, "memory": {"ok": True}}
    table = judge(ranks("a", "b", local={"b": bad_dir}), [0.0, 0.0], links({(0, 1): 1e8, (1, 0): 1e8}), CFG)
    code, doc = record(cfg, tmp_path, table, 0.42, {})
    assert code == EXIT_BAD_NODE and doc["refused_in_a_row"] == 1
    written = read_nodes(tmp_path)
    assert written["nodes"]["b"]["verdict"] == "bad" and written["seconds"] == 0.42, written
    err = capsys.readouterr().err
    assert "dsslm: node b (rank 1) failed its check before the first step: run.dir /x: 0.1 MB free" in err, err
    events = [json.loads(line) for line in (tmp_path / "events.jsonl").read_text().splitlines()]
    assert [e["event"] for e in events] == ["node_check", "bad_node"] and events[1]["nodes"] == ["b"], events
    assert status.read_text() == f"bad_node {EXIT_BAD_NODE}\n"
    code, doc = record(cfg, tmp_path, table, 0.4, {})  # the next start, refused again
    assert doc["refused_in_a_row"] == 2
    before = {p.name: p.read_bytes() for p in tmp_path.iterdir()}
    code, doc = record(cfg, tmp_path, judge(ranks("a", "b"), [0, 0], {}, CFG), 0.4, {})
    assert code == EXIT_OK and doc["refused_in_a_row"] == 0 and "nodes checked in 0.40 s: a, b ok" in capsys.readouterr().out
    # A start that passes writes nothing yet (a refusal after the check leaves run.dir as it was):
    # the straggler report publishes it after the first step.
    assert {p.name: p.read_bytes() for p in tmp_path.iterdir()} == before


def test_a_passed_check_is_published_once_the_first_step_is_done(tmp_path):
    from test_stragglers import FakeEngine, FakeSinks
    from dsslm.config import StragglersCfg
    from dsslm.health.stragglers import Stragglers
    from dsslm.health.watchdog import Progress
    cfg = load(None, [f"run.dir={tmp_path}"])
    _, doc = record(cfg, tmp_path, judge(ranks("a"), [0.0], {}, CFG), 0.05, {})
    sinks = FakeSinks()
    report = Stragglers(StragglersCfg(), FakeEngine(), Progress(), sinks, tmp_path, doc)
    assert read_nodes(tmp_path) is None
    report.after_step(1)
    report.after_step(2)
    assert read_nodes(tmp_path)["nodes"]["a"]["verdict"] == "ok"
    assert [(e["event"], e["verdict"], e["nodes"]) for e in sinks.events] == [("node_check", "ok", {"a": "ok"})]


def test_a_check_that_raises_fails_with_its_error_instead_of_leaving_the_others_waiting():
    def check_gpu(device):
        raise RuntimeError("CUDA error: an illegal memory access was encountered")
    result = nodecheck.guarded(check_gpu, "cuda:0")
    assert not result["ok"] and result["why"] == ("check_gpu raised RuntimeError: CUDA error: an illegal memory "
                                                  "access was encountered"), result
