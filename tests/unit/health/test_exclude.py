"""Bad nodes kept out of a requeue (dsslm/health/exclude.py): which nodes run.dir's records call
bad, the job's ExcNodeList after the requeue (expiry, sinfo, enough nodes, the user's own
exclusions), and the Slurm commands it runs (stand-ins here; the real cluster is
tests/scenarios/test_two_nodes.py's)."""
from __future__ import annotations

import json
from pathlib import Path

from dsslm.config import load
from dsslm.health.exclude import EXCLUDED, Candidate, candidates, exclude, main, plan, usable
from dsslm.health.nodes import write_nodes

NOW = 1_800_000_000.0
HOUR = 3600.0


def nodes_doc(bad: dict[str, str], stragglers: list[dict] = (), when: float = NOW - 60) -> dict:
    return {"schema": 1, "time": when, "nodes": {
        host: {"host": host, "slurm_node": None, "ranks": [i], "verdict": "bad" if host in bad else "ok",
               "why": [bad[host]] if host in bad else [], "checks": {}} for i, host in enumerate(["n1", *bad])},
        "stragglers": list(stragglers)}


def hang(run_dir: Path, name: str, host: str, when: float, cause: str = "stopped_beating", **more) -> None:
    """A hang record as the watchdog writes it; without `blamed` in `more`, an older one's format."""
    folder = run_dir / "hangs" / name
    folder.mkdir(parents=True)
    (folder / "hang.json").write_text(json.dumps({
        "schema": 1, "cause": cause, "step": 12, "phase": "data", "in_a_row": 1, "exit_code": 75,
        "time": when, "first": [{"rank": 1, "host": host}], "waiting": [{"rank": 0, "host": "n1"}], **more}))


def test_a_refused_node_a_node_blamed_twice_and_a_persistent_straggler(tmp_path):
    cfg = load(None, [f"run.dir={tmp_path}"])
    straggler = {"rank": 3, "host": "n4.cluster", "slurm_node": None, "phase": "data", "factor": 3.2, "step": 150,
                 "reports": 3, "time": NOW - 30}
    write_nodes(tmp_path, nodes_doc({"n2.cluster": "run.dir /r: 0.1 MB free"}, [straggler]))
    hang(tmp_path, "20260101-000000-a", "n3", NOW - 2 * HOUR)
    hang(tmp_path, "20260101-010000-b", "n3", NOW - HOUR)
    hang(tmp_path, "20260101-020000-c", "n5", NOW - HOUR)  # named once: not yet
    hang(tmp_path, "20250101-000000-d", "n6", NOW - 30 * HOUR)
    hang(tmp_path, "20250101-010000-e", "n6", NOW - 29 * HOUR)  # twice, but long ago (exclude_hours=24)
    found = {c.name: c for c in candidates(tmp_path, cfg, NOW)}
    assert sorted(found) == ["n2", "n3", "n4"], found
    assert found["n2"].why == "failed its check before the first step: run.dir /r: 0.1 MB free"
    assert found["n3"].why.startswith("named by 2 hang records") and found["n3"].since == NOW - HOUR
    assert found["n4"].why == "a straggler in data (3.2x the other ranks' median) from step 150"
    off = load(None, [f"run.dir={tmp_path}", "observe.stragglers.exclude=false", "observe.nodes.hang_blames=0"])
    assert [c.name for c in candidates(tmp_path, off, NOW)] == ["n2"]
    assert candidates(tmp_path, cfg, NOW + 25 * HOUR) == []  # all past exclude_hours


def test_hang_blame_counts_only_the_ranks_a_record_proves_stopped(tmp_path):
    """A lockstep `stuck` record's first rank merely reported a few microseconds before the others;
    `store_silent` and `collective_timeout` prove no rank either: however many such records name a
    host, it is not blamed. Beats that stopped prove it, in the old format (no `blamed`) and the new."""
    cfg = load(None, [f"run.dir={tmp_path}"])  # hang_blames=2
    proven_not = [{"rank": 1, "host": "n3", "pid": 7, "proven": False}]
    for i, when in enumerate((NOW - 2 * HOUR, NOW - HOUR)):
        hang(tmp_path, f"a{i}-stuck-old", "n3", when, cause="stuck")                     # no `blamed`: lockstep
        hang(tmp_path, f"b{i}-stuck-new", "n3", when, cause="stuck", first=proven_not, blamed=[])
        hang(tmp_path, f"c{i}-store-old", "n4", when, cause="store_silent")
        hang(tmp_path, f"d{i}-store-new", "n4", when, cause="store_silent", blamed=[])
        hang(tmp_path, f"e{i}-timeout", "n4", when, cause="collective_timeout")
        hang(tmp_path, f"f{i}-beats-old", "n5.cluster", when)                            # stopped_beating, old
        hang(tmp_path, f"g{i}-stuck-past", "n6", when, cause="stuck", first=[{"rank": 1, "host": "n6", "pid": 7,
             "proven": True}], blamed=[{"rank": 1, "host": "n6.cluster", "pid": 7}])    # the others went past it
    hang(tmp_path, "h-peer-lost", "n7", NOW - HOUR, cause="peer_lost")
    hang(tmp_path, "i-peer-lost", "n7", NOW - HOUR, cause="peer_lost")
    found = {c.name: c for c in candidates(tmp_path, cfg, NOW)}
    assert sorted(found) == ["n5", "n6", "n7"], found
    assert found["n6"].why.startswith("named by 2 hang records") and found["n6"].since == NOW - HOUR
    assert found["n7"].why.startswith("named by 2 hang records"), found["n7"]


def test_a_malformed_hang_entry_is_left_out_and_never_stops_the_requeue(tmp_path):
    """Anyone who can write into run.dir can write a hang record: an entry that does not fit is
    left out (n8 and n9 have one good entry each, not the two it takes), and nothing raises."""
    cfg = load(None, [f"run.dir={tmp_path}"])
    junk = [None, "n8", {"host": "n8"}, {"rank": "1", "host": "n8", "pid": 7}, {"rank": 1, "host": 8, "pid": 7},
            {"rank": 1, "host": "n8", "pid": -1}, {"rank": True, "host": "n8", "pid": 7}]
    hang(tmp_path, "j-junk", "n8", NOW - HOUR, cause="stuck", blamed=junk)
    hang(tmp_path, "k-junk", "n8", NOW - HOUR, cause="stuck", blamed={"host": "n8"})
    hang(tmp_path, "l-good", "n8", NOW - HOUR, blamed=[{"rank": 1, "host": "n8", "pid": 7}])
    hang(tmp_path, "m-junk", "n9", NOW - HOUR, first=[None, {"host": 9}, "n9", {"host": "n9"}])
    hang(tmp_path, "n-junk", "n9", NOW - HOUR, first={"host": "n9"})
    hang(tmp_path, "o-junk", "n9", float("inf"))  # a time past any expiry
    assert candidates(tmp_path, cfg, NOW) == []


def test_the_plan_keeps_enough_nodes_the_users_exclusions_and_lifts_the_expired():
    listed = {"n1": "idle", "n2": "comp", "n3": "alloc", "n4": "down*", "gone": "idle"}
    found = [Candidate("n2", "full run.dir", NOW - 60), Candidate("n3", "slow link", NOW - 50),
             Candidate("n9", "clock", NOW - 40)]
    kept = {"n7": {"since": NOW - 30 * HOUR, "until": NOW - 6 * HOUR, "why": "old"}}
    result = plan(found, kept, listed, needed=3, current=["user1", "n7"], now=NOW, expiry_s=24 * HOUR)
    assert result.exclude == ["user1", "n2"], result  # n3 too would leave 2 usable nodes (n1, gone) for 3
    assert any(line.startswith("n7 may run this job again") for line in result.lines), result.lines
    assert "excluding n2 from this job's requeues until" in result.lines[1] and "full run.dir" in result.lines[1]
    too_few = "not excluding n3 (slow link): only 2 usable node(s) of the partition would remain for this 3-node job"
    assert any(too_few in line for line in result.lines), result.lines
    assert any("not excluding n9 (clock): sinfo does not list it" in line for line in result.lines)
    assert set(result.kept) == {"n2"} and result.kept["n2"]["until"] == NOW - 60 + 24 * HOUR
    roomy = plan(found[:2], {}, {**listed, "n5": "idle", "n6": "mix"}, needed=2, current=[], now=NOW,
                 expiry_s=24 * HOUR)
    assert roomy.exclude == ["n2", "n3"], roomy  # n1, n5, n6 remain for a 2-node job
    assert usable("mix") and usable("comp") and not usable("drain") and not usable("idle*")


def test_it_runs_the_slurm_commands_and_remembers_the_expiry(tmp_path):
    cfg = load(None, [f"run.dir={tmp_path}"])
    write_nodes(tmp_path, nodes_doc({"n2": "its link sends 0.12 MB/s, the median node's 300.0 MB/s"}))
    calls = []

    def run(argv):
        calls.append(argv)
        if argv[:3] == ["scontrol", "-o", "show"]:
            return "JobId=7 JobName=dsslm Partition=debug NumNodes=1 ExcNodeList=(null) NodeList=n2\n"
        if argv[0] == "sinfo":
            return "n1 idle\nn2 comp\n"
        return ""
    lines = exclude(tmp_path, cfg, "7", run, now=NOW)
    assert ["scontrol", "update", "job=7", "ExcNodeList=n2"] in calls and "sinfo" == calls[1][0], calls
    assert calls[1] == ["sinfo", "-h", "-N", "-p", "debug", "-o", "%N %t"]
    assert len(lines) == 1 and lines[0].startswith("excluding n2 from this job's requeues until "), lines
    assert lines[0].endswith(": failed its check before the first step: its link sends 0.12 MB/s, the median "
                             "node's 300.0 MB/s"), lines
    assert json.loads((tmp_path / EXCLUDED).read_text())["nodes"]["n2"]["until"] == NOW - 60 + 24 * HOUR
    calls.clear()
    write_nodes(tmp_path, nodes_doc({}))  # the next start passed; a day later the exclusion ends
    later = exclude(tmp_path, cfg, "7", lambda argv: calls.append(argv) or (
        "Partition=debug NumNodes=1 ExcNodeList=n2" if argv[1] == "-o" else "n1 idle\nn2 idle\n"), now=NOW + 25 * HOUR)
    assert ["scontrol", "update", "job=7", "ExcNodeList="] in calls and later[0].startswith("n2 may run this job again")
    assert json.loads((tmp_path / EXCLUDED).read_text())["nodes"] == {}


def test_a_kept_exclusion_of_a_node_sinfo_no_longer_lists_is_dropped(tmp_path):
    """old1 left the partition (retired, renamed): its exclusion, not yet expired, leaves the
    ExcNodeList written back and excluded_nodes.json, with one line; n2's stays; the user's own
    exclusion (user1, which sinfo does not list either) stays."""
    cfg = load(None, [f"run.dir={tmp_path}"])
    kept = {"old1": {"since": NOW - HOUR, "until": NOW + 23 * HOUR, "why": "slow link"},
            "n2": {"since": NOW - HOUR, "until": NOW + 23 * HOUR, "why": "full run.dir"}}
    (tmp_path / EXCLUDED).write_text(json.dumps({"nodes": kept}))
    calls = []

    def run(argv):
        calls.append(argv)
        if argv[:3] == ["scontrol", "-o", "show"]:
            return "JobId=7 Partition=debug NumNodes=1 ExcNodeList=user1,old1,n2\n"
        if argv[0] == "sinfo":
            return "n1 idle\nn2 idle\nn3 alloc\n"
        return ""
    lines = exclude(tmp_path, cfg, "7", run, now=NOW)
    assert ["scontrol", "update", "job=7", "ExcNodeList=user1,n2"] in calls, calls
    assert lines == ["dropping the exclusion of old1 (slow link): sinfo no longer lists it in this job's partition"]
    assert json.loads((tmp_path / EXCLUDED).read_text())["nodes"] == {"n2": kept["n2"]}
    # A listing with no node in it proves nothing (a wrong partition, sinfo's hiccup): all stay.
    empty = plan([], kept, {}, needed=1, current=["user1", "old1", "n2"], now=NOW, expiry_s=24 * HOUR)
    assert (empty.exclude, empty.kept, empty.lines) == (["user1", "old1", "n2"], kept, []), empty


def test_a_completing_jobs_count_of_nodes_is_not_its_size(tmp_path):
    """Right after the requeue the job completes, and scontrol's NumNodes counts only the nodes still
    completing (measured: 1 of a 2-node job): the allocation's count (--nodes) decides."""
    cfg = load(None, [f"run.dir={tmp_path}"])
    write_nodes(tmp_path, nodes_doc({"n2": "slow link"}))
    calls = []

    def run(argv):
        calls.append(argv)
        return "Partition=debug NumNodes=1 ExcNodeList=(null)" if argv[1] == "-o" else "n1 comp\nn2 idle\n"
    lines = exclude(tmp_path, cfg, "7", run, now=NOW, nodes=2)
    assert lines == ["not excluding n2 (failed its check before the first step: slow link): only 1 usable node(s) "
                     "of the partition would remain for this 2-node job"], lines
    assert not [c for c in calls if c[1] == "update"]


def test_nothing_on_record_runs_no_slurm_command(tmp_path):
    assert exclude(tmp_path, load(None, [f"run.dir={tmp_path}"]), "7", lambda argv: 1 / 0, now=NOW) == []


def test_a_failure_is_one_line_and_exit_0(tmp_path, capsys):
    write_nodes(tmp_path, nodes_doc({"n2": "bad"}))
    assert main(["--job", "7", "--nodes", "2", "--", f"run.dir={tmp_path}", "observe.nodes.exclude_hours=1e9"]) == 0
    assert main(["--job", "7", "--", "no.such.key=1"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert len(out) == 2 and all(line.startswith("could not exclude bad nodes: ") for line in out), out
