"""dsslm.ckpt.store and format: roundtrip, corruption, atomic publish, retention, async writer, crash drills."""
from __future__ import annotations

import errno
import hashlib
import json
import os
import shutil
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest
import safetensors.torch
import torch

from dsslm.ckpt import catalogue, format as ckpt_io, store as checkpoint
from dsslm.ckpt.store import CheckpointError, CheckpointStore, load_checkpoint, invalid_reason

from helpers import ROOT


def make_tensors(seed: int = 0) -> dict:
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(64, 32, generator=g)
    return {"model": {"w": w, "b": torch.randn(32, generator=g).bfloat16(),
                      "h": torch.randn(7, generator=g).half(), "ids": torch.arange(5), "scalar": torch.tensor(2.5)},
            "optim": {"exp_avg.w": torch.randn(64, 32, generator=g), "exp_avg_sq.w": torch.rand(64, 32, generator=g)}}


def state_for(step: int, tag: str = "") -> dict:
    return {"step": step, "skip_list": [[10, 12]], "monitor": {"losses": [2.5, 2.25]}, "tag": tag}


def bits(t: torch.Tensor) -> torch.Tensor:
    """Bit pattern, so NaN payloads and -0.0 compare exactly."""
    return t.reshape(-1).view(torch.uint8)


def assert_same_tensors(saved: dict, loaded: dict) -> None:
    assert saved.keys() == loaded.keys()
    for group in saved:
        assert saved[group].keys() == loaded[group].keys()
        for name, t in saved[group].items():
            got = loaded[group][name]
            assert got.dtype == t.dtype and got.shape == t.shape, name
            assert torch.equal(bits(got), bits(t.contiguous())), name


def file_hashes(folder: Path) -> dict:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(folder.iterdir())}


def ckpt(run: Path, step: int) -> Path:
    return run / "checkpoints" / f"step-{step:08d}"


def recorder():
    events = []
    return events, lambda event, **fields: events.append((event, fields))


def run_script(body: str, run: Path) -> subprocess.CompletedProcess:
    code = textwrap.dedent(f"""
        import os, sys, torch
        from unittest import mock
        from pathlib import Path
        sys.path.insert(0, {str(ROOT)!r})
        from dsslm.ckpt import catalogue, store as checkpoint
        from dsslm.ckpt.store import CheckpointStore
        run = Path({str(run)!r})
        t = {{"model": {{"w": torch.full((256, 64), 1.0)}}, "optim": {{"m": torch.full((256, 64), 2.0)}}}}
    """) + textwrap.dedent(body)
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)


def test_roundtrip_is_bit_equal(tmp_path):
    tensors = make_tensors()
    tensors["model"]["odd"] = torch.tensor([float("nan"), -0.0, float("inf"), 1e-45])
    tensors["model"]["strided"] = torch.randn(8, 6).t()  # non-contiguous source
    state = state_for(7)
    path = CheckpointStore(tmp_path).save(7, tensors, state)
    assert path == ckpt(tmp_path, 7)
    assert sorted(p.name for p in path.iterdir()) == ["MANIFEST", "model.safetensors", "optim.safetensors", "state.json"]
    manifest = json.loads((path / "MANIFEST").read_text())
    assert manifest["format"] == 1 and manifest["step"] == 7
    assert manifest["files"] == {name: {"sha256": h, "size": (path / name).stat().st_size}
                                 for name, h in file_hashes(path).items() if name != "MANIFEST"}
    loaded = load_checkpoint(path)
    assert loaded.step == 7 and loaded.state == state
    assert_same_tensors(tensors, loaded.tensors)
    # The streamed files are ordinary safetensors: the library reads them byte for byte alike.
    with safetensors.safe_open(path / "model.safetensors", "pt") as f:
        assert set(f.keys()) == set(tensors["model"])
    # Largest elements first keeps every tensor aligned in the file, as safetensors lays it out.
    raw = (path / "model.safetensors").read_bytes()
    header_len = int.from_bytes(raw[:8], "little")
    assert (8 + header_len) % 8 == 0
    for name, entry in json.loads(raw[8:8 + header_len]).items():
        assert entry["data_offsets"][0] % tensors["model"][name].element_size() == 0, name
    assert CheckpointStore(tmp_path).load_latest().state == state


def test_tied_tensors_save(tmp_path):
    emb = torch.randn(10, 4)
    tied = {"model": {"wte.weight": emb, "lm_head.weight": emb, "wte_t": emb.t(), "rows": emb[2:5]}}
    with pytest.raises(RuntimeError):  # what the host copies protect against
        safetensors.torch.save_file(tied["model"], tmp_path / "raw.safetensors")
    CheckpointStore(tmp_path).save(1, tied, {"step": 1})
    loaded = load_checkpoint(ckpt(tmp_path, 1)).tensors["model"]
    assert torch.equal(loaded["wte.weight"], emb) and torch.equal(loaded["lm_head.weight"], emb)
    assert torch.equal(loaded["wte_t"], emb.t()) and torch.equal(loaded["rows"], emb[2:5])


def flip_byte(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0x01
    path.write_bytes(bytes(data))


def truncate(path: Path) -> None:
    with open(path, "r+b") as f:
        f.truncate(path.stat().st_size - 8)


@pytest.mark.parametrize("damage, reason", [(flip_byte, "sha256"), (truncate, "bytes")])
def test_damaged_newest_is_passed_over(tmp_path, damage, reason):
    warm_events, on_warm = recorder()
    mgr = CheckpointStore(tmp_path, on_event=on_warm)
    for step in (1, 2, 3):
        mgr.save(step, make_tensors(step), state_for(step))
    damage(ckpt(tmp_path, 3) / "model.safetensors")
    cold_events, on_cold = recorder()
    for reader, events in ((mgr, warm_events), (CheckpointStore(tmp_path, on_event=on_cold), cold_events)):
        latest = reader.load_latest()
        assert latest.step == 2 and latest.state == state_for(2)
        assert_same_tensors(make_tensors(2), latest.tensors)
        assert reader.valid_steps() == [1, 2]
        passed = [f for e, f in events if e == "passed_over"]
        assert len(passed) == 1 and passed[0]["checkpoint"] == "step-00000003"
        assert reason in passed[0]["reason"] and "model.safetensors" in passed[0]["reason"]
    assert ckpt(tmp_path, 3).is_dir()  # never deleted
    with pytest.raises(CheckpointError, match=reason):
        load_checkpoint(ckpt(tmp_path, 3))


def test_loaders_rehash_even_when_the_cache_says_valid(tmp_path):
    mgr = CheckpointStore(tmp_path)
    for step in (1, 2):
        mgr.save(step, make_tensors(step), state_for(step))
    model_file = ckpt(tmp_path, 2) / "model.safetensors"
    before = model_file.stat()
    flip_byte(model_file)  # same size; restore the mtime so the stat-keyed cache cannot notice
    os.utime(model_file, ns=(before.st_atime_ns, before.st_mtime_ns))
    assert mgr.valid_steps() == [1, 2]  # cheap path: cached
    assert mgr.load_latest().step == 1
    assert mgr.latest_before(2).step == 1
    assert mgr.valid_steps() == [1]  # the full hash updated the cache


def test_valid_steps_is_cached_and_load_hashes_only_what_it_returns(tmp_path, monkeypatch):
    hashed = []
    real = ckpt_io.file_sha256
    monkeypatch.setattr(ckpt_io, "file_sha256", lambda p: hashed.append(p.parent.name) or real(p))
    mgr = CheckpointStore(tmp_path, keep_last=5)
    for step in (1, 2, 3):
        mgr.save(step, make_tensors(step), state_for(step))  # retention lists valid steps each time
    assert mgr.valid_steps() == [1, 2, 3]
    assert hashed == []  # published folders were hashed while written
    assert mgr.load_latest().step == 3
    assert set(hashed) == {"step-00000003"} and len(hashed) == 3  # model, optim, state


def test_unfinished_and_foreign_folders_are_ignored_not_deleted(tmp_path):
    events, on_event = recorder()
    mgr = CheckpointStore(tmp_path, keep_last=1, on_event=on_event)
    mgr.save(1, make_tensors(1), state_for(1))
    no_manifest = ckpt(tmp_path, 5)
    shutil.copytree(ckpt(tmp_path, 1), no_manifest)
    (no_manifest / "MANIFEST").unlink()
    tmp = tmp_path / "checkpoints" / ".tmp-step-00000006-999-abcd"
    shutil.copytree(ckpt(tmp_path, 1), tmp)
    odd = tmp_path / "checkpoints" / "step-12"
    odd.mkdir()
    assert mgr.valid_steps() == [1]
    assert mgr.load_latest().step == 1
    mgr.save(2, make_tensors(2), state_for(2))  # retention with keep_last=1 runs
    assert mgr.valid_steps() == [2] and not ckpt(tmp_path, 1).exists()
    assert no_manifest.is_dir() and tmp.is_dir() and odd.is_dir()
    passed = {f["checkpoint"]: f["reason"] for e, f in events if e == "passed_over"}
    assert passed.keys() == {"step-00000005", "step-12"}  # once each, temp folder silent
    assert "MANIFEST" in passed["step-00000005"] and "step-XXXXXXXX" in passed["step-12"]
    assert sum(e == "passed_over" for e, _ in events) == 2


def test_extra_and_missing_files_invalidate(tmp_path):
    path = CheckpointStore(tmp_path).save(1, make_tensors(), state_for(1))
    (path / "notes.txt").write_text("x")
    assert "notes.txt" in invalid_reason(path)
    (path / "notes.txt").unlink()
    assert invalid_reason(path) is None
    copied = shutil.copytree(path, path.with_name("step-00000009"))  # a folder renamed by hand
    assert "MANIFEST says step 1" in invalid_reason(copied)
    manifest = json.loads((path / "MANIFEST").read_text())
    del manifest["files"]["state.json"]
    (path / "state.json").unlink()
    (path / "MANIFEST").write_text(json.dumps(manifest))
    assert "state.json" in invalid_reason(path)  # the contract requires it
    other = CheckpointStore(tmp_path).save(2, make_tensors(), state_for(2))
    (other / "optim.safetensors").unlink()
    assert invalid_reason(other) == "file optim.safetensors is missing"


def test_a_rewind_sets_the_left_trajectorys_checkpoints_aside_and_resumes_from_the_replay(tmp_path):
    events = []
    mgr = CheckpointStore(tmp_path, keep_last=1, on_event=lambda e, **f: events.append((e, f)))
    for step in (2, 4, 6):
        mgr.save(step, make_tensors(step), state_for(step))
    moved = mgr.leave_after(3)  # keep_last=1: retention left 6 alone, and 6 is after the rewind
    assert [n.split("-")[1:3] for n in moved] == [["step", "00000006"]]
    mgr.save(3, make_tensors(3), state_for(3))  # the replay's own checkpoint, older by step
    assert mgr.load_latest().step == 3 and mgr.valid_steps() == [3]
    assert (tmp_path / "checkpoints" / moved[0] / "MANIFEST").exists()  # kept for a person
    assert ("left_trajectory", {"rewound_to": 3, "checkpoints": moved}) in events


def test_latest_before(tmp_path):
    mgr = CheckpointStore(tmp_path, keep_last=10)
    for step in (2, 4, 6):
        mgr.save(step, make_tensors(step), state_for(step))
    assert mgr.latest_before(5).step == 4
    assert mgr.latest_before(4).step == 4
    assert mgr.latest_before(100).step == 6
    assert mgr.latest_before(1) is None
    flip_byte(ckpt(tmp_path, 4) / "optim.safetensors")
    assert mgr.latest_before(5).step == 2
    assert CheckpointStore(tmp_path / "empty").load_latest() is None


def test_retention_keeps_exactly_the_policy(tmp_path):
    events, on_event = recorder()
    mgr = CheckpointStore(tmp_path, keep_last=2, keep_every=5, on_event=on_event)
    mgr.pin([3])
    broken = ckpt(tmp_path, 1).with_name("step-00000000")  # invalid: retention must not touch it
    broken.mkdir(parents=True)
    for step in range(1, 13):
        mgr.save(step, make_tensors(step), state_for(step))
    assert mgr.valid_steps() == [3, 5, 10, 11, 12]
    survivors = sorted(p.name for p in (tmp_path / "checkpoints").iterdir())
    assert survivors == ["step-00000000"] + [f"step-{s:08d}" for s in (3, 5, 10, 11, 12)]
    deleted = [int(f["checkpoint"][5:]) for e, f in events if e == "retention_delete"]
    assert deleted == [1, 2, 4, 6, 7, 8, 9]
    mgr.pin([10])  # replaces the pinned set: 3 is let go
    assert mgr.apply_retention() == [3]
    assert mgr.valid_steps() == [5, 10, 11, 12]
    mgr.pin([])
    assert CheckpointStore(tmp_path, keep_last=1).apply_retention() == [5, 10, 11]


@pytest.mark.parametrize("err", [errno.ENOSPC, errno.EIO])
def test_writer_error_surfaces_in_training_thread(tmp_path, monkeypatch, err):
    mgr = CheckpointStore(tmp_path)
    for step in (1, 2):
        mgr.save(step, make_tensors(step), state_for(step))
    before = {s: file_hashes(ckpt(tmp_path, s)) for s in (1, 2)}
    real = checkpoint._write_file

    def failing(path, chunks):
        if ".tmp-step-00000003" in str(path) and path.name == "optim.safetensors":
            raise OSError(err, os.strerror(err))
        return real(path, chunks)

    monkeypatch.setattr(checkpoint, "_write_file", failing)
    mgr.save_async(3, make_tensors(3), state_for(3))  # returns: the failure is in the writer
    with pytest.raises(CheckpointError) as info:
        for _ in range(500):
            mgr.check()
            time.sleep(0.01)
    assert isinstance(info.value.__cause__, OSError) and info.value.__cause__.errno == err
    assert "step-00000003" in str(info.value)
    mgr.check()  # raised once, not again
    assert mgr.valid_steps() == [1, 2]
    assert {s: file_hashes(ckpt(tmp_path, s)) for s in (1, 2)} == before
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == ["step-00000001", "step-00000002"]
    # A failure also reaches the next save_async, or wait(), when nobody polled check().
    mgr.save_async(3, make_tensors(3), state_for(3))
    with pytest.raises(CheckpointError):
        mgr.save_async(4, make_tensors(4), state_for(4))
    mgr.save_async(3, make_tensors(3), state_for(3))
    with pytest.raises(CheckpointError):
        mgr.wait()
    monkeypatch.setattr(checkpoint, "_write_file", real)
    mgr.save(4, make_tensors(4), state_for(4))
    assert mgr.valid_steps() == [1, 2, 4]


def test_snapshot_is_taken_before_save_async_returns(tmp_path, monkeypatch):
    real = checkpoint._write_file
    writer_threads = set()

    def slow(path, chunks):
        writer_threads.add(threading.current_thread().name)
        time.sleep(0.3)
        return real(path, chunks)

    monkeypatch.setattr(checkpoint, "_write_file", slow)
    events, on_event = recorder()
    on_event_threads = set()
    mgr = CheckpointStore(tmp_path, on_event=lambda e, **f: on_event_threads.add(threading.get_ident()) or on_event(e, **f))
    tensors, state = make_tensors(1), state_for(1)
    expected = {g: {n: t.clone() for n, t in d.items()} for g, d in tensors.items()}
    expected_state = json.loads(json.dumps(state))
    mgr.save_async(1, tensors, state)
    for group in tensors.values():  # what the optimizer does on the next step
        for t in group.values():
            t.add_(1) if t.dtype != torch.bool else t.logical_not_()
    state["skip_list"].append([99, 100])
    state["monitor"]["losses"][0] = -1.0
    mgr.wait()
    loaded = load_checkpoint(ckpt(tmp_path, 1))
    assert_same_tensors(expected, loaded.tensors)
    assert loaded.state == expected_state
    assert writer_threads == {"dsslm-ckpt-writer"}
    assert [e for e, _ in events] == ["save"] and on_event_threads == {threading.get_ident()}


def test_at_most_one_save_in_flight(tmp_path, monkeypatch):
    real = checkpoint._write_file
    active, peak, lock = set(), [0], threading.Lock()

    def tracked(path, chunks):
        with lock:
            active.add(path.parent.name)
            peak[0] = max(peak[0], len(active))
        time.sleep(0.05)
        result = real(path, chunks)
        if path.name == "MANIFEST":
            with lock:
                active.discard(path.parent.name)
        return result

    monkeypatch.setattr(checkpoint, "_write_file", tracked)
    mgr = CheckpointStore(tmp_path, keep_last=10)
    for step in range(1, 5):
        mgr.save_async(step, make_tensors(step), state_for(step))
        assert mgr.valid_steps() == list(range(1, step))  # the previous one is published
    mgr.wait()
    assert peak[0] == 1
    assert mgr.valid_steps() == [1, 2, 3, 4]


@pytest.mark.slow
def test_crash_drill_mid_save_leaves_previous_checkpoints(tmp_path):
    before = run_script("""
        mgr = CheckpointStore(run)
        mgr.die_in_save(3, after_files=1)
        mgr.save(1, t, {"step": 1}); mgr.save(2, t, {"step": 2})
        mgr.save_async(3, t, {"step": 3})
        mgr.wait()
        print("survived")
    """, tmp_path)
    assert before.returncode == 137, before.stderr
    assert "survived" not in before.stdout
    temps = [p for p in (tmp_path / "checkpoints").iterdir() if p.name.startswith(".tmp-step-00000003-")]
    assert len(temps) == 1 and [p.name for p in temps[0].iterdir()] == ["model.safetensors"]
    events, on_event = recorder()
    mgr = CheckpointStore(tmp_path, on_event=on_event)
    assert mgr.valid_steps() == [1, 2]
    assert mgr.load_latest().step == 2
    assert events == [] and temps[0].is_dir()  # the temp folder is neither reported nor removed
    mgr.save(3, {"model": {"w": torch.ones(2)}}, {"step": 3})
    assert mgr.valid_steps() == [1, 2, 3] and temps[0].is_dir()


@pytest.mark.slow
@pytest.mark.parametrize("crash_after, expect_tag", [("aside", "old"), ("new", "new")])
def test_replace_survives_a_crash_between_renames(tmp_path, crash_after, expect_tag):
    result = run_script(f"""
        mgr = CheckpointStore(run)
        mgr.save(4, t, {{"step": 4, "tag": "older"}})
        mgr.save(5, t, {{"step": 5, "tag": "old"}})
        real = catalogue._rename
        def crashing(src, dst):
            real(src, dst)
            crash = dst.name.endswith(".replaced") if {crash_after!r} == "aside" else src.name.startswith(".tmp")
            if crash and "step-00000005" in dst.name:
                os._exit(137)
        t["model"]["w"].fill_(9.0)
        with mock.patch.object(catalogue, "_rename", crashing):
            mgr.save(5, t, {{"step": 5, "tag": "new"}})
    """, tmp_path)
    assert result.returncode == 137, result.stderr
    names = sorted(p.name for p in (tmp_path / "checkpoints").iterdir())
    assert "step-00000005.replaced" in names
    assert ("step-00000005" in names) == (crash_after == "new")
    mgr = CheckpointStore(tmp_path)
    mgr.settle_replaces()  # what a start does (remove_leftovers)
    latest = mgr.load_latest()
    assert latest.step == 5 and latest.state["tag"] == expect_tag
    names = sorted(p.name for p in (tmp_path / "checkpoints").iterdir())
    temps = [".tmp"] if crash_after == "aside" else []  # the new copy never made it in; left alone
    assert [n[:4] if n.startswith(".tmp-step-00000005-") else n for n in names] == temps + ["step-00000004", "step-00000005"]
    assert mgr.save(5, make_tensors(), state_for(5, "again")) == ckpt(tmp_path, 5)
    assert mgr.load_latest().state["tag"] == "again"


def test_replace_keeps_the_step_readable_at_every_moment(tmp_path, monkeypatch):
    mgr = CheckpointStore(tmp_path)
    mgr.save(5, make_tensors(1), state_for(5, "old"))
    seen = []
    real = catalogue._rename

    def observed(src, dst):
        # The writer holds the manager's re-entrant lock here, so these reads see the mid-replace state.
        before = mgr.latest_before(5)
        real(src, dst)
        after = mgr.latest_before(5)
        seen.append((before.path.name, before.state["tag"], after.path.name, after.state["tag"]))

    monkeypatch.setattr(catalogue, "_rename", observed)
    mgr.save(5, make_tensors(2), state_for(5, "new"))
    assert seen == [("step-00000005", "old", "step-00000005.replaced", "old"),
                    ("step-00000005.replaced", "old", "step-00000005", "new"),
                    ("step-00000005", "new", "step-00000005", "new")]  # the aside renamed .deleting-*
    assert [p.name for p in (tmp_path / "checkpoints").iterdir()] == ["step-00000005"]


def test_existing_invalid_folder_is_renamed_aside_not_deleted(tmp_path):
    mgr = CheckpointStore(tmp_path)
    mgr.save(4, make_tensors(1), state_for(4, "old"))
    flip_byte(ckpt(tmp_path, 4) / "state.json")
    mgr.save(4, make_tensors(2), state_for(4, "new"))
    assert mgr.load_latest().state["tag"] == "new"
    invalid = [p for p in (tmp_path / "checkpoints").iterdir() if p.name.startswith("step-00000004.invalid-")]
    assert len(invalid) == 1 and invalid_reason(invalid[0]) is not None


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_snapshot_of_cuda_tensors(tmp_path):
    live = {"model": {"w": torch.randn(1024, 1024, device="cuda"), "b": torch.randn(7, device="cuda").bfloat16()},
            "optim": {"m": torch.rand(1024, 1024, device="cuda")}}
    mgr = CheckpointStore(tmp_path)
    for step in (1, 2):  # the second save reuses the pinned host buffers
        expected = {g: {n: t.cpu() for n, t in d.items()} for g, d in live.items()}
        mgr.save_async(step, live, {"step": step})
        for group in live.values():
            for t in group.values():
                t.add_(1)  # queued on the device right away, as the next optimizer step would be
        mgr.wait()
        assert_same_tensors(expected, load_checkpoint(ckpt(tmp_path, step)).tensors)


def test_bad_inputs_fail_in_the_caller(tmp_path):
    mgr = CheckpointStore(tmp_path)
    with pytest.raises(TypeError):
        mgr.save_async(1, make_tensors(), {"x": object()})
    with pytest.raises(TypeError, match="state"):
        mgr.save_async(1, {"optim": {"step": 3.0}}, {})
    with pytest.raises(ValueError, match="A-Za-z0-9_"):
        mgr.save_async(1, {"../model": {}}, {})
    with pytest.raises(ValueError, match="keep_last"):
        CheckpointStore(tmp_path, keep_last=0)
    mgr.wait()
    assert mgr.valid_steps() == []


def test_a_delete_renames_the_folder_before_it_removes_anything(tmp_path, monkeypatch):
    mgr = CheckpointStore(tmp_path, keep_last=1)
    mgr.save(1, make_tensors(1), state_for(1))
    changes = []
    real_rename, real_unlink = catalogue._rename, Path.unlink
    monkeypatch.setattr(catalogue, "_rename", lambda src, dst: changes.append(("rename", src.name, dst.name))
                        or real_rename(src, dst))
    monkeypatch.setattr(Path, "unlink", lambda self, *a, **k: changes.append(("unlink", self.parent.name, self.name))
                        or real_unlink(self, *a, **k))
    mgr.save(2, make_tensors(2), state_for(2))
    deleting = [c for c in changes if c[1] == "step-00000001" or c[1].startswith("step-00000001.")]
    assert deleting[0][:2] == ("rename", "step-00000001") and deleting[0][2].startswith("step-00000001.deleting-")
    assert {c[1] for c in deleting[1:]} == {deleting[0][2]}  # every file goes from the renamed folder
    assert mgr.valid_steps() == [2] and sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == ["step-00000002"]


def test_a_restarted_store_hashes_only_what_it_loads(tmp_path, monkeypatch):
    """After a restart, listing and retention hash nothing (sizes only); the resume hashes the one
    folder it loads; a same-size flipped byte found by that hash keeps the folder out of the count."""
    writer = CheckpointStore(tmp_path, keep_last=3)
    for step in (1, 2, 3):
        writer.save(step, make_tensors(step), state_for(step))
    flip_byte(ckpt(tmp_path, 3) / "optim.safetensors")
    hashed = []
    real = ckpt_io.file_sha256
    monkeypatch.setattr(ckpt_io, "file_sha256", lambda p: hashed.append(p.parent.name) or real(p))
    events, on_event = recorder()
    restarted = CheckpointStore(tmp_path, keep_last=3, on_event=on_event)
    assert restarted.valid_steps() == [1, 2, 3] and restarted.apply_retention() == [] and hashed == []
    assert restarted.load_latest().step == 2  # 3 was hashed, failed, and was passed over
    assert set(hashed) == {"step-00000003", "step-00000002"}
    assert restarted.valid_steps() == [1, 2]  # the hash failure is remembered: 3 no longer counts
    restarted.save(4, make_tensors(4), state_for(4))
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == \
        ["step-00000001", "step-00000002", "step-00000003", "step-00000004"]  # 3 kept for a person, 1 kept: 3 did not count
    assert [f["checkpoint"] for e, f in events if e == "passed_over"] == ["step-00000003"]


def test_only_ascii_digits_name_a_checkpoint(tmp_path):
    """`\\d` matches any Unicode digit: step-٠٠٠٠٠٠١٢ (Arabic-Indic) was a second folder for step 12,
    tried in listdir order beside step-00000012 and never removed by retention."""
    assert ckpt_io.parse_name("step-00000012") == (12, False)
    assert ckpt_io.parse_name("step-\u0660\u0660\u0660\u0660\u0660\u0660\u0661\u0662") is None
    assert ckpt_io.parse_name("step-\uff10\uff10\uff10\uff10\uff10\uff10\uff11\uff12") is None  # full-width


def test_a_tool_never_writes_inside_or_beside_checkpoint_folders(tmp_path):
    """An export or a report written into a step folder adds a file its MANIFEST does not list:
    the next resume passed the checkpoint over and started from an older one."""
    ckpts = tmp_path / "run" / "checkpoints"
    (ckpts / "step-00000003").mkdir(parents=True)
    assert "inside the checkpoint folder" in ckpt_io.inside_checkpoints(ckpts / "step-00000003" / "hf")
    assert "inside the checkpoint folder" in ckpt_io.inside_checkpoints(ckpts / "step-00000003")
    assert "among the checkpoints" in ckpt_io.inside_checkpoints(ckpts / "hf")
    assert ckpt_io.inside_checkpoints(tmp_path / "run" / "report") is None
    assert ckpt_io.inside_checkpoints(tmp_path / "exports" / "hf") is None
    # Named like one but no checkpoint (no MANIFEST, not in a checkpoints/ folder): one export per step.
    (tmp_path / "exports" / "step-00000003").mkdir(parents=True)
    assert ckpt_io.inside_checkpoints(tmp_path / "exports" / "step-00000003") is None
    assert ckpt_io.inside_checkpoints(tmp_path / "exports" / "step-00000004") is None


def tree_bytes(folder: Path) -> dict:
    return {p.name: p.read_bytes() for p in sorted(folder.iterdir())}


def start(run: Path, **kwargs) -> tuple[CheckpointStore, list]:
    """A store as a trainer's start makes it: the run.dir lock's holder clears and settles."""
    events, on_event = recorder()
    store = CheckpointStore(run, on_event=on_event, **kwargs)
    store.remove_leftovers()
    return store, events


def test_a_start_removes_only_its_own_temp_folders_and_sets_any_other_aside(tmp_path):
    """Every `checkpoints/.tmp-*` was deleted at start, whoever made it: another tool's work in
    progress or a person's copy went with the saves a kill cut short."""
    ckpts = tmp_path / "checkpoints"
    sharded = ckpts / CheckpointStore(tmp_path).make_tmp(5)  # make_tmp's name, as a sharded save makes it
    (sharded / "model.safetensors").write_bytes(b"half written")
    gathered = ckpts / ".tmp-step-00000007-4242-0a1b2c3d"  # _write's: 4 random bytes
    gathered.mkdir()
    (gathered / "model.safetensors").write_bytes(b"half written")
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    (elsewhere / "keep").write_text("not under checkpoints/")
    (ckpts / ".tmp-step-00000009-1-00c0ffee").symlink_to(elsewhere)  # ours by name: unlinked, never followed
    foreign = ckpts / ".tmp-notours"
    foreign.mkdir()
    (foreign / "notes.txt").write_text("a person's notes")
    (ckpts / ".tmp-step-00000007-4242-x").write_text("no dsslm save makes this name")
    (ckpts / ".tmp-link").symlink_to(elsewhere)
    events, on_event = recorder()
    removed = CheckpointStore(tmp_path, on_event=on_event).remove_leftovers()
    assert removed == sorted([sharded.name, gathered.name, ".tmp-step-00000009-1-00c0ffee"])
    assert (elsewhere / "keep").read_text() == "not under checkpoints/"
    (aside,) = ckpts.glob(".tmp-notours.invalid-*")
    assert tree_bytes(aside) == {"notes.txt": b"a person's notes"}
    (near,) = ckpts.glob(".tmp-step-00000007-4242-x.invalid-*")
    (link,) = ckpts.glob(".tmp-link.invalid-*")
    assert near.read_text() == "no dsslm save makes this name" and link.is_symlink()
    assert sorted(p.name for p in ckpts.iterdir()) == sorted([aside.name, near.name, link.name])
    said = {f["checkpoint"]: f for e, f in events if e == "passed_over"}
    assert said.keys() == {".tmp-notours", ".tmp-step-00000007-4242-x", ".tmp-link"}
    assert said[".tmp-notours"]["set_aside"] == aside.name and aside.name in said[".tmp-notours"]["reason"]
    events.clear()
    assert CheckpointStore(tmp_path, on_event=on_event).remove_leftovers() == [] and events == []
    assert sorted(p.name for p in ckpts.iterdir()) == sorted([aside.name, near.name, link.name])  # not again


def test_a_checkpoint_whose_manifest_is_lost_is_set_aside_and_kept(tmp_path):
    """Its tensors are intact: a person can recompute the hashes and use it. It was deleted at the
    next start as if a kill had cut a retention delete short."""
    mgr = CheckpointStore(tmp_path, keep_last=2)
    for step in (1, 2, 3):
        mgr.save(step, make_tensors(step), state_for(step))
    (ckpt(tmp_path, 3) / "MANIFEST").unlink()
    before = tree_bytes(ckpt(tmp_path, 3))
    store, events = start(tmp_path, keep_last=2)
    (aside,) = (tmp_path / "checkpoints").glob("step-00000003.invalid-*")
    assert tree_bytes(aside) == before and not ckpt(tmp_path, 3).exists()
    (passed,) = [f for e, f in events if e == "passed_over"]
    assert passed["checkpoint"] == "step-00000003" and passed["set_aside"] == aside.name
    assert "no MANIFEST" in passed["reason"] and "remove it by hand" in passed["reason"]
    assert store.load_latest().step == 2
    for step in (4, 5, 6):  # retention neither counts the aside nor deletes it
        store.save(step, make_tensors(step), state_for(step))
    assert store.valid_steps() == [5, 6] and tree_bytes(aside) == before
    _, again = start(tmp_path)  # a later start, and its listings, say nothing more of it
    again_store = CheckpointStore(tmp_path)
    assert again_store.valid_steps() == [5, 6] and again_store.load_latest().step == 6
    assert [e for e, _ in events if e == "passed_over"] == ["passed_over"] and again == []


def test_a_foreign_step_folder_is_set_aside_and_kept(tmp_path):
    """checkpoints/step-99999999 that dsslm never wrote (random bytes, a torn state.json) was deleted
    at the next start, for holding only files with a checkpoint's names."""
    CheckpointStore(tmp_path).save(1, make_tensors(1), state_for(1))
    foreign = tmp_path / "checkpoints" / "step-99999999"
    foreign.mkdir()
    (foreign / "model.safetensors").write_bytes(os.urandom(4096))
    (foreign / "state.json").write_text('{"step": 99999999, "skip_li')
    before = tree_bytes(foreign)
    store, events = start(tmp_path)
    (aside,) = (tmp_path / "checkpoints").glob("step-99999999.invalid-*")
    assert tree_bytes(aside) == before
    assert [f["set_aside"] for e, f in events if e == "passed_over"] == [aside.name]
    assert store.load_latest().step == 1 and store.not_resumable() == [aside.name]


def test_an_older_dsslms_half_delete_is_set_aside_and_said_in_one_line(tmp_path):
    """An older dsslm deleted MANIFEST first, then each file: a kill between left this."""
    from dsslm.observe.console import LINES

    mgr = CheckpointStore(tmp_path, keep_last=5)
    for step in (1, 2):
        mgr.save(step, make_tensors(step), state_for(step))
    for name in ("MANIFEST", "model.safetensors"):
        (ckpt(tmp_path, 1) / name).unlink()
    store, events = start(tmp_path)
    (aside,) = (tmp_path / "checkpoints").glob("step-00000001.invalid-*")
    assert sorted(p.name for p in aside.iterdir()) == ["optim.safetensors", "state.json"]
    (passed,) = [f for e, f in events if e == "passed_over"]
    level, line = LINES["passed_over"]
    said = line(passed)
    assert "\n" not in said and "step-00000001" in said and aside.name in said and "by hand" in said
    assert store.load_latest().step == 2
