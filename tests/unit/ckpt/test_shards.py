"""dsslm.ckpt.shards: the sharded format's index, its reader, the hostile indexes and folders it
refuses, the split of hashing among ranks; the store's sharded write, and a kill at every point of
a delete; Adam's step placed where torch's kernels expect it after a restore."""
from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest
import torch

from dsslm.ckpt import shards
from dsslm.ckpt.format import CheckpointError, invalid_reason, parse_name, read_manifest
from dsslm.ckpt.store import CheckpointStore
from dsslm.engine.ranks import Exchange
from dsslm.engine.state import Shard, adam_step_tensor, load_adam_state, OptimState, rows_of

from helpers import remanifest

SHAPES = {"model/w": (5, 3), "model/b": (7,), "optim/exp_avg/w": (5, 3)}


def full_tensors(seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {key: torch.randn(*shape, generator=g) for key, shape in SHAPES.items()}


def rank_shards(tensors: dict, rank: int, world: int) -> list[Shard]:
    """What a replica engine hands over: rank's rows of every tensor, as DDP does."""
    out = []
    for key, t in tensors.items():
        start, end = rows_of(tuple(t.shape), rank, world)
        if end > start:
            out.append(Shard(key, tuple(t.shape), start, end, t.reshape(-1)[start:end]))
    return out


def save_sharded(run_dir: Path, step: int, world: int, seed: int = 0) -> Path:
    """A sharded save by `world` ranks, each with its own store, through one exchange (in turn:
    rank 0 last, as its writer waits for every rank's post)."""
    tensors = full_tensors(seed)
    stores = [CheckpointStore(run_dir) for _ in range(world)]
    tmp = stores[0].make_tmp(step)
    exchange = Exchange(None, world)
    for rank in list(range(1, world)) + [0]:
        state = {"step": step, "world_size": world} if rank == 0 else None
        stores[rank].save_shard_async(step, tmp, rank, world, rank_shards(tensors, rank, world),
                                      {"rng": {"rank": rank}}, exchange, state)
        stores[rank].wait()
    return run_dir / "checkpoints" / f"step-{step:08d}"


def open_checked(folder: Path):
    """What a loader does, in one process: hash and scan every file, then check the index."""
    files = read_manifest(folder)["files"]
    result = shards.verify_share(folder, files, sorted(files))
    if result["bad"]:
        raise CheckpointError(result["bad"])
    ckpt = shards.open_folder(folder, files)
    shards.check_headers(ckpt.reader.index, result["headers"])
    return ckpt


@pytest.mark.parametrize("world", [1, 2, 3])
def test_sharded_save_reads_back_every_span_bit_exact(tmp_path, world):
    folder = save_sharded(tmp_path, 4, world)
    assert invalid_reason(folder) is None
    ckpt = open_checked(folder)
    tensors = full_tensors()
    for key, t in tensors.items():
        assert torch.equal(ckpt.reader.read(key), t.reshape(-1))
        n = t.numel()
        for start, end in [(0, 1), (2, n - 1), (n - 1, n), (1, 4)]:  # spans across pieces and rows
            assert torch.equal(ckpt.reader.read(key, start, end), t.reshape(-1)[start:end])
    names = set(read_manifest(folder)["files"])
    assert {shards.shard_file(r, world) for r in range(world)} <= names
    assert json.loads((folder / shards.rank_file(world - 1, world)).read_text()) == {"rng": {"rank": world - 1}}


def test_reader_reads_only_the_bytes_asked_for(tmp_path):
    folder = save_sharded(tmp_path, 4, 2)
    reader = open_checked(folder).reader
    reader.read("model/w", 0, 6)  # rank 0's rows of a 2-rank split: rows 0-1 of 5x3
    assert reader.bytes_read == 6 * 4


def test_gathered_folder_reads_through_the_same_reader(tmp_path):
    store = CheckpointStore(tmp_path)
    t = full_tensors()
    store.save(2, {"model": {"w": t["model/w"], "b": t["model/b"]}, "optim": {"exp_avg/w": t["optim/exp_avg/w"]}},
               {"step": 2})
    ckpt = open_checked(tmp_path / "checkpoints" / "step-00000002")
    assert sorted(ckpt.reader.keys()) == sorted(SHAPES)
    assert torch.equal(ckpt.reader.read("model/w", 4, 11), t["model/w"].reshape(-1)[4:11])


def edit_index(folder: Path, change) -> None:
    index = json.loads((folder / shards.INDEX_FILE).read_text())
    change(index)
    (folder / shards.INDEX_FILE).write_text(json.dumps(index))
    remanifest(folder)  # the attacker rewrites the MANIFEST too: only the checks can refuse it


def piece(index, key, i):
    return index["tensors"][key]["pieces"][i]


HOSTILE = {
    "rows outside the tensor": (lambda ix: piece(ix, "model/b", -1).__setitem__(3, 99), "outside the tensor"),
    "overlapping rows": (lambda ix: piece(ix, "model/w", 1).__setitem__(2, piece(ix, "model/w", 1)[2] - 3),
                         "overlap"),
    "missing rows": (lambda ix: ix["tensors"]["model/w"]["pieces"].pop(), "cover"),
    "another world size": (lambda ix: ix.__setitem__("world_size", 3), "3 ranks"),
    # "" is the save id of a gathered folder's in-memory index, whose header checks are skipped:
    # on disk it would let a piece name another tensor's bytes
    "no save id": (lambda ix: (ix.__setitem__("save", ""), piece(ix, "model/b", 0).__setitem__(1, "model/w")),
                   "save"),
    "a piece in a file the folder lacks": (lambda ix: piece(ix, "model/b", 0).__setitem__(0, "shard-00007-of-00002.safetensors"),
                                           "malformed"),
}


@pytest.mark.parametrize("case", sorted(HOSTILE))
def test_hostile_index_is_refused(tmp_path, case):
    folder = save_sharded(tmp_path, 4, 2)
    change, why = HOSTILE[case]
    edit_index(folder, change)
    with pytest.raises(CheckpointError, match=why):
        open_checked(folder)


def test_a_shard_from_another_world_size_is_refused(tmp_path):
    """rank 1's file of a 3-rank save presented as rank 1 of a 2-rank one (MANIFEST rewritten)."""
    two, three = save_sharded(tmp_path / "a", 4, 2), save_sharded(tmp_path / "b", 4, 3)
    (two / shards.shard_file(1, 2)).write_bytes((three / shards.shard_file(1, 3)).read_bytes())
    remanifest(two)
    with pytest.raises(CheckpointError, match="another save"):
        open_checked(two)


def test_a_shard_swapped_between_two_checkpoints_is_refused(tmp_path):
    """Same world size, same layout, other values: the hash is right only for the other folder."""
    a, b = save_sharded(tmp_path / "a", 4, 2, seed=0), save_sharded(tmp_path / "b", 4, 2, seed=1)
    (a / shards.shard_file(1, 2)).write_bytes((b / shards.shard_file(1, 2)).read_bytes())
    assert "does not match its sha256" in invalid_reason(a)
    remanifest(a)  # and with the MANIFEST rewritten to match: the save token in the file differs
    with pytest.raises(CheckpointError, match="another save"):
        open_checked(a)


def test_a_manifest_listing_a_file_twice_is_refused(tmp_path):
    folder = save_sharded(tmp_path, 4, 2)
    text = (folder / "MANIFEST").read_text()
    files = json.loads(text)["files"]
    name = shards.shard_file(0, 2)
    entry = json.dumps(files[name])
    doubled = text.replace('"files": {', f'"files": {{"{name}": {entry}, ', 1)
    assert doubled != text
    (folder / "MANIFEST").write_text(doubled)
    assert "appears twice" in invalid_reason(folder)


def test_non_finite_piece_is_found_while_hashing(tmp_path):
    folder = save_sharded(tmp_path, 4, 2)
    from safetensors.torch import load_file, save_file
    path = folder / shards.shard_file(1, 2)
    from safetensors import safe_open
    with safe_open(path, "pt") as f:
        meta = f.metadata()
    tensors = load_file(path)
    key = next(k for k in tensors if k.startswith("model/w@"))
    tensors[key][0] = float("nan")
    save_file(tensors, path, metadata=meta)
    remanifest(folder)
    with pytest.raises(CheckpointError, match="model w: 1 non-finite"):
        open_checked(folder)


def test_split_files_gives_each_rank_about_its_share():
    files = {f"f{i}": {"size": size} for i, size in enumerate([100, 90, 50, 40, 10, 5, 5])}
    shares = shards.split_files(files, 3)
    assert sorted(n for share in shares for n in share) == sorted(files)
    loads = [sum(files[n]["size"] for n in share) for share in shares]
    assert max(loads) <= 100 and min(loads) >= 90


def test_a_failed_rank_fails_the_save_for_rank_0_and_leaves_nothing(tmp_path, monkeypatch):
    from dsslm.ckpt import store as store_mod
    stores = [CheckpointStore(tmp_path), CheckpointStore(tmp_path)]
    tmp = stores[0].make_tmp(4)
    exchange = Exchange(None, 2)
    real = store_mod._write_file

    def broken(path, chunks):
        if "shard-00001" in path.name:
            raise OSError(28, "No space left on device")
        return real(path, chunks)

    monkeypatch.setattr(store_mod, "_write_file", broken)
    tensors = full_tensors()
    stores[1].save_shard_async(4, tmp, 1, 2, rank_shards(tensors, 1, 2), {}, exchange, None)
    stores[1].wait()  # rank 1 does not raise: its failure is rank 0's to raise, for every rank
    stores[0].save_shard_async(4, tmp, 0, 2, rank_shards(tensors, 0, 2), {}, exchange, {"step": 4, "world_size": 2})
    with pytest.raises(CheckpointError, match="rank 1 could not write its shard"):
        stores[0].wait()
    assert not list((tmp_path / "checkpoints").iterdir())


def killed_in_child(fn) -> int:
    """`fn()` in a forked child (no torch work there: files only); its exit code. A real kill:
    os._exit, no cleanup, no flush."""
    pid = os.fork()
    if pid == 0:
        try:
            fn()
        except BaseException:  # noqa: BLE001 - a child must never return into pytest
            os._exit(1)
        os._exit(0)
    return os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1])


def folder_bytes(folder: Path) -> dict:
    return {p.name: p.read_bytes() for p in sorted(folder.iterdir())}


@pytest.mark.parametrize("fmt", ["gathered", "sharded"])
def test_a_kill_at_every_point_of_a_retention_delete_leaves_no_folder_without_manifest(tmp_path, fmt):
    """A delete removed MANIFEST first, so a kill in it left a `step-XXXXXXXX` without one, and the
    next start deleted every such folder, whatever it was. Now it renames first: at every point a
    kill leaves the whole checkpoint or a `.deleting-*` folder, and the next start finishes that
    one alone and resumes from the newest checkpoint, its bytes as saved."""
    def save(run: Path, step: int) -> None:
        if fmt == "sharded":
            save_sharded(run, step, 2, seed=step)
        else:
            CheckpointStore(run).save(step, {"model": full_tensors(step)}, {"step": step})

    template = tmp_path / "template"
    for step in (4, 8):
        save(template, step)
    newest = folder_bytes(template / "checkpoints" / "step-00000008")
    changes = 2 + len(list((template / "checkpoints" / "step-00000004").iterdir()))  # rename, files, folder
    for after in range(changes + 1):  # 0: killed before the rename; `changes`: after the folder went
        run = tmp_path / f"killed-{after}"
        shutil.copytree(template, run)
        store = CheckpointStore(run, keep_last=1)
        store.die_in_delete(4, after)
        code = killed_in_child(store.apply_retention)
        assert code == 137, after
        names = sorted(p.name for p in (run / "checkpoints").iterdir())
        assert all(invalid_reason(run / "checkpoints" / n) is None for n in names if parse_name(n)), names
        events = []
        restarted = CheckpointStore(run, keep_last=1, on_event=lambda event, **f: events.append((event, f)))  # noqa: B023
        restarted.remove_leftovers()
        assert [p.name for p in (run / "checkpoints").iterdir()] == (["step-00000008"] if 0 < after else
                                                                     ["step-00000004", "step-00000008"]), after
        finished = [f["folders"] for e, f in events if e == "deletes_finished"]
        assert finished == ([] if after in (0, changes) else [[n for n in names if ".deleting-" in n]]), after
        assert not [e for e, _ in events if e == "passed_over"]
        assert restarted.load_latest().step == 8 and folder_bytes(run / "checkpoints" / "step-00000008") == newest


def test_a_kill_in_a_replaces_delete_of_the_old_copy_is_finished_at_the_next_start(tmp_path):
    folder = save_sharded(tmp_path, 8, 2)
    shutil.copytree(folder, folder.with_name("step-00000008.replaced"))  # a replace, killed before its delete
    store = CheckpointStore(tmp_path)
    store.die_in_delete(8, 2)  # the rename, one file
    assert killed_in_child(store.settle_replaces) == 137
    (deleting,) = [p.name for p in (tmp_path / "checkpoints").iterdir() if p.name != "step-00000008"]
    assert deleting.startswith("step-00000008.replaced.deleting-")
    events = []
    CheckpointStore(tmp_path, on_event=lambda event, **f: events.append((event, f))).remove_leftovers()
    assert [p.name for p in (tmp_path / "checkpoints").iterdir()] == ["step-00000008"]
    assert events == [("deletes_finished", {"folders": [deleting], "reason": "deletes a kill cut short"})]


def test_rows_of_split_every_row_once():
    for rows in (1, 2, 5, 7):
        for world in (1, 2, 3, 4):
            spans = [rows_of((rows, 3), r, world) for r in range(world)]
            covered = [i for a, b in spans for i in range(a, b)]
            assert covered == list(range(rows * 3))


@pytest.mark.parametrize("kernel", [{"fused": True}, {"foreach": True}, {"foreach": False}, {"capturable": True}])
def test_adam_step_is_restored_where_torch_would_put_it(kernel):
    """torch's AdamW makes `step` on the parameter's device for fused and capturable groups (the
    CUDA kernels read it as a device pointer), a CPU float32 scalar otherwise; a restore must do
    the same. A meta-device parameter stands in for a CUDA one: the placement logic, not the kernel."""
    param = torch.nn.Parameter(torch.empty(4, 3, device="meta"))
    group = {"params": [param], **kernel}
    step = adam_step_tensor(7, param, group)
    on_device = kernel.get("fused") or kernel.get("capturable")
    assert step.dtype == torch.float32 and step.shape == ()
    assert step.device == (param.device if on_device else torch.device("cpu"))


@pytest.mark.parametrize("impl", ["fused", "foreach", "single"])
def test_restored_adam_state_matches_what_torch_makes(impl):
    """Every tensor load_adam_state puts back has the device, dtype and shape of the one torch's
    own first step made (CPU here; the same function runs on CUDA)."""
    kernel = {"fused": {"fused": True}, "foreach": {"foreach": True}, "single": {"foreach": False}}[impl]
    param = torch.nn.Parameter(torch.randn(4, 3))
    opt = torch.optim.AdamW([param], lr=0.1, **kernel)
    param.grad = torch.randn(4, 3)
    opt.step()
    made = opt.state[param]
    saved = OptimState(step={"w": float(made["step"])}, exp_avg={"w": made["exp_avg"].clone()},
                       exp_avg_sq={"w": made["exp_avg_sq"].clone()})
    opt2 = torch.optim.AdamW([param], lr=0.1, **kernel)
    load_adam_state(opt2, {"w": param}, saved)
    for key, value in made.items():
        got = opt2.state[param][key]
        assert (got.device, got.dtype, got.shape) == (value.device, value.dtype, value.shape), key
    param.grad = torch.randn(4, 3)
    opt2.step()  # the kernel accepts it
