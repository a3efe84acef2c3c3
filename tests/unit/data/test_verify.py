"""Shard verification: hashed once, cached by (path, size, mtime_ns, ctime_ns), the cache read
without trust; a changed shard is caught, data.verify=full ignores the cache; work split by bytes."""
from __future__ import annotations

import json
import os

import numpy as np
import pytest

from dsslm.data import DataError, load_manifest, prepare
from dsslm.data import verify
from dsslm.data.verify import (CACHE_FILE, cache_path, check_digests, hash_shards, plan_hashing, read_cache,
                               share_of, update_cache)


@pytest.fixture
def data_dir(tmp_path):
    rng = np.random.default_rng(2)
    (tmp_path / "t.txt").write_text("".join(" ".join(map(str, rng.integers(0, 10**6, 8))) + "\n" for _ in range(500)))
    prepare([tmp_path / "t.txt"], tmp_path / "d", val_fraction=0.05, shard_tokens=6_000)
    return tmp_path / "d"


def start(data_dir, full=False, cache=None) -> dict:
    """One single-rank start's verification, as train.verify_data does it; returns what it hashed."""
    manifest = load_manifest(data_dir, verify=False)
    cache = cache or data_dir / CACHE_FILE
    plan = plan_hashing(data_dir, manifest, cache, full)
    found = hash_shards(data_dir, share_of(plan["hash"], 0, 1), lambda n: None)
    if found:
        update_cache(cache, manifest, found)
    check_digests(data_dir, manifest, found)
    return found


def shards(data_dir) -> list[str]:
    return [e["path"] for d in load_manifest(data_dir, verify=False)["domains"].values() for e in d["train"] + d["val"]]


def flip_byte_keeping_size_and_mtime(path) -> None:
    before = path.stat()
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0x01
    path.write_bytes(bytes(data))
    os.utime(path, ns=(before.st_atime_ns, before.st_mtime_ns))


def test_a_second_start_hashes_nothing_and_a_touched_shard_is_the_only_one_rehashed(data_dir, monkeypatch):
    hashed = []
    real = verify._hash_one
    monkeypatch.setattr(verify, "_hash_one", lambda path, *rest: hashed.append(path.name) or real(path, *rest))
    names = shards(data_dir)
    assert len(names) >= 5
    assert sorted(start(data_dir)) == sorted(names) and len(hashed) == len(names)
    hashed.clear()
    assert start(data_dir) == {} and hashed == []
    os.utime(data_dir / names[2])  # new mtime, same bytes
    assert list(start(data_dir)) == [names[2]] and hashed == [names[2].split("/")[-1]]
    assert start(data_dir, full=True).keys() == set(names)  # full ignores the cache


def test_a_changed_shard_with_a_new_mtime_is_caught_by_the_cached_verification(data_dir):
    start(data_dir)
    shard = data_dir / shards(data_dir)[1]
    data = bytearray(shard.read_bytes())
    data[10] ^= 0xFF
    shard.write_bytes(bytes(data))
    with pytest.raises(DataError, match=f"shard {shard} does not match its sha256"):
        start(data_dir)
    with pytest.raises(DataError, match="does not match"):  # the mismatch was not cached as a pass
        start(data_dir)


def test_a_flipped_byte_that_kept_size_and_mtime_is_caught_and_full_ignores_a_forged_cache(data_dir):
    start(data_dir)
    shard = data_dir / shards(data_dir)[0]
    flip_byte_keeping_size_and_mtime(shard)
    with pytest.raises(DataError, match="does not match"):  # the ctime moved: a miss even with mtime kept
        start(data_dir)
    # Someone rewrites the cache to vouch for the edited file's current times: only full catches it.
    cache = read_cache(data_dir / CACHE_FILE)
    st = shard.stat()
    name = shards(data_dir)[0]
    cache[name] = {"stat": [st.st_size, st.st_mtime_ns, st.st_ctime_ns],
                   "sha256": load_manifest(data_dir, verify=False)["domains"]["default"]["train"][0]["sha256"],
                   "max_token": 0, "dtype": "uint16"}
    (data_dir / CACHE_FILE).write_text(json.dumps({"format": 1, "shards": cache}))
    assert start(data_dir) == {}  # true trusts a cache entry whose times match: that is its contract
    with pytest.raises(DataError, match=f"shard {shard} does not match"):
        start(data_dir, full=True)


@pytest.mark.parametrize("garbage", [
    "not json", json.dumps([1, 2]), json.dumps({"format": 2, "shards": {}}),
    json.dumps({"format": 1, "shards": {"default/train-00000.bin": {"stat": [1, 2], "sha256": "0" * 64}}}),
    json.dumps({"format": 1, "shards": {"default/train-00000.bin": {"stat": [1, 2, True], "sha256": "0" * 64}}}),
    json.dumps({"format": 1, "shards": {"default/train-00000.bin": {"stat": [1, 2, 3], "sha256": "xyz"}}}),
])
def test_a_malformed_cache_is_a_miss_and_is_rewritten(data_dir, garbage):
    (data_dir / CACHE_FILE).write_text(garbage)
    assert len(start(data_dir)) == len(shards(data_dir))
    assert sorted(read_cache(data_dir / CACHE_FILE)) == sorted(shards(data_dir))


def test_an_entry_for_another_size_or_time_is_a_miss(data_dir):
    start(data_dir)
    name = shards(data_dir)[3]
    cache = read_cache(data_dir / CACHE_FILE)
    for i in range(3):
        entry = json.loads(json.dumps(cache))
        entry[name]["stat"][i] += 1
        (data_dir / CACHE_FILE).write_text(json.dumps({"format": 1, "shards": entry}))
        assert list(start(data_dir)) == [name]


def test_a_read_only_data_dir_keeps_its_cache_in_the_run_folder(data_dir, tmp_path, monkeypatch):
    monkeypatch.setattr(verify.os, "access", lambda path, mode: False)
    cache = cache_path(data_dir, tmp_path / "run")
    assert cache == tmp_path / "run" / CACHE_FILE
    assert len(start(data_dir, cache=cache)) == len(shards(data_dir)) and start(data_dir, cache=cache) == {}
    assert not (data_dir / CACHE_FILE).exists()


def test_a_shard_that_changes_while_it_is_hashed_is_refused(data_dir):
    path = data_dir / shards(data_dir)[0]
    with pytest.raises(DataError, match="changed while it was being hashed"):
        hash_shards(data_dir, [shards(data_dir)[0]], lambda n: os.utime(path, ns=(1, 1)))


def test_the_shares_partition_the_work_and_balance_the_bytes():
    todo = [[f"s{i}", size] for i, size in enumerate([900, 100, 500, 500, 300, 300, 200, 100, 50])]
    for world_size in (1, 2, 3, 8, 16):
        parts = [share_of(todo, r, world_size) for r in range(world_size)]
        assert sorted(p for part in parts for p in part) == sorted(t[0] for t in todo)
        loads = [sum(dict(todo)[p] for p in part) for part in parts]
        assert max(loads) - min(loads) <= 900  # never worse than the largest shard
    assert [sum(dict(todo)[p] for p in share_of(todo, r, 2)) for r in range(2)] == [1500, 1450]


# --- a manifest from elsewhere is checked before it is trusted ---------------------------------------
def _edit_manifest(data_dir, change) -> None:
    path = data_dir / "manifest.json"
    manifest = json.loads(path.read_text())
    change(manifest)
    path.write_text(json.dumps(manifest))


def _first_shard(manifest) -> dict:
    return next(iter(manifest["domains"].values()))["train"][0]


def _second_split(manifest) -> list:
    return next(iter(manifest["domains"].values()))["val"]


@pytest.mark.parametrize("change, field", [
    (lambda m: _first_shard(m).update(path="../../etc/passwd"), "path"),
    (lambda m: _first_shard(m).update(path="/etc/passwd"), "path"),
    (lambda m: _first_shard(m).update(tokens=-5), "tokens"),
    (lambda m: _first_shard(m).update(sha256=7), "sha256"),
    (lambda m: m.update(dtype="object"), "dtype"),
    (lambda m: m.update(dtype="uint16") or m["tokenizer"].update(vocab_size=70_000), "dtype"),
    (lambda m: m["tokenizer"].update(vocab_size="257"), "tokenizer.vocab_size"),
    (lambda m: m["tokenizer"].update(eos_id=300), "tokenizer.eos_id"),
    (lambda m: m.update(domains=[]), "domains"),
    (lambda m: next(iter(m["domains"].values())).update(train={}), "domains."),
    (lambda m: m.pop("tokenizer"), "tokenizer"),
    # A NUL or a lone surrogate in a path: a bad path, not a ValueError or UnicodeEncodeError out of resolve().
    (lambda m: _first_shard(m).update(path="code/x\u0000y"), "path"),
    (lambda m: _first_shard(m).update(path="code/\ud800"), "path"),
    # One file under two entries (to upweight it, or in two domains): a skip entry names a shard by
    # its path, so one listing of it would still be fed. (Before: accepted.)
    (lambda m: _second_split(m).append(dict(_first_shard(m))), "path"),
    (lambda m: _second_split(m).append(dict(_first_shard(m), path="./" + _first_shard(m)["path"])), "path"),
])
def test_a_malformed_manifest_is_one_data_error_naming_the_field(data_dir, change, field):
    _edit_manifest(data_dir, change)
    with pytest.raises(DataError, match=rf"manifest.json: \S*{field}.*rebuild"):
        load_manifest(data_dir, verify=False)


def test_a_shard_link_leading_out_of_data_dir_is_refused(data_dir, tmp_path):
    manifest = load_manifest(data_dir, verify=False)
    shard = data_dir / _first_shard(manifest)["path"]
    outside = tmp_path / "outside.bin"
    os.replace(shard, outside)
    shard.symlink_to(outside)
    with pytest.raises(DataError, match="a path inside DATA_DIR"):
        load_manifest(data_dir, verify=False)


def test_a_token_beyond_the_vocabulary_is_caught_when_hashed_and_cached_as_a_miss(data_dir):
    manifest = load_manifest(data_dir, verify=False)
    entry = _first_shard(manifest)
    shard = data_dir / entry["path"]
    tokens = np.fromfile(shard, dtype=manifest["dtype"])
    tokens[len(tokens) // 2] = 300  # the byte tokenizer has 257 ids
    tokens.tofile(shard)
    import hashlib
    _edit_manifest(data_dir, lambda m: _first_shard(m).update(sha256=hashlib.sha256(shard.read_bytes()).hexdigest()))
    with pytest.raises(DataError, match=r"holds token id 300, beyond the tokenizer's vocabulary \(vocab_size 257\)"):
        start(data_dir)
    with pytest.raises(DataError, match="holds token id 300"):  # the cache never vouches for it
        start(data_dir)


def test_the_cache_records_each_shards_largest_token(data_dir):
    found = start(data_dir)
    assert all(0 <= v["max_token"] < 257 for v in found.values())
    assert start(data_dir) == {}  # the second start hashes nothing


def test_a_manifest_whose_eos_id_is_not_its_tokenizers_is_refused(data_dir):
    """The document mask and a skip entry's document bounds split on the manifest's eos_id: one that
    is not the tokenizer's (here a newline) is refused, for the byte tokenizer too. (Before: a
    byte manifest's tokenizer was never checked, and eos_id by no kind.)"""
    _edit_manifest(data_dir, lambda m: m["tokenizer"].update(eos_id=10))
    load_manifest(data_dir, verify=False)  # the fields alone are well formed
    with pytest.raises(DataError, match="sha256, vocab_size or eos_id"):
        load_manifest(data_dir, verify=True)


def test_a_manifest_nested_beyond_what_json_parses_is_one_data_error(data_dir):
    (data_dir / "manifest.json").write_text("[" * 100_000 + "]" * 100_000)
    with pytest.raises(DataError, match="unreadable"):
        load_manifest(data_dir, verify=False)


def test_a_shard_name_the_file_system_refuses_is_a_missing_shard(data_dir):
    # In the domain's own folder: the name itself is refused (ENAMETOOLONG), not its folder's absence.
    folder = load_manifest(data_dir, verify=False)["domains"]
    folder = next(iter(folder.values()))["train"][0]["path"].split("/")[0]
    _edit_manifest(data_dir, lambda m: _first_shard(m).update(path=f"{folder}/{'x' * 300}"))
    with pytest.raises(DataError, match="is missing"):
        load_manifest(data_dir, verify=False)


@pytest.mark.parametrize("respell", [
    lambda p: "./" + p, lambda p: p.replace("/", "//"), lambda p: p + "/", lambda p: "./" * 500 + p,
    lambda p: p.replace("/", "\\"), lambda p: p + "\x01",
])
def test_a_shard_path_a_skip_entry_would_refuse_is_refused_in_the_manifest(data_dir, respell):
    """The loader copies the manifest's path into the skip entries it writes, and ShardPath checks
    those on resume: a spelling the manifest took but ShardPath refused made every checkpoint after
    a rewind unreadable, and the skip list was rebuilt without the entry. (Before: './x', 'a//x', a
    trailing '/' and a path over 1000 characters resolved inside DATA_DIR and were accepted.)"""
    from dsslm.fields import SkipEntry, StateError, validate
    path = _first_shard(load_manifest(data_dir, verify=False))["path"]
    spelled = respell(path)
    with pytest.raises(StateError):
        validate({"shard": spelled, "tokens": [0, 2]}, SkipEntry(), "skip_list[0]")
    _edit_manifest(data_dir, lambda m: _first_shard(m).update(path=spelled))
    with pytest.raises(DataError, match=r"manifest.json: \S+\.train\[0\]\.path is .*expected a relative shard path"
                                        r".*rebuild") as refused:
        load_manifest(data_dir, verify=False)
    assert "\n" not in str(refused.value)
    if "\x01" not in spelled:  # what to write instead, where dropping './' and doubled '/' makes it one
        assert f"write it as {path!r}" in str(refused.value)


def test_an_absolute_shard_path_gets_no_respelling(data_dir):
    """Dropping the root of '/srv/data/web/x.bin' names 'srv/data/web/x.bin' under DATA_DIR: another
    file. (Before: suggested as the fix.)"""
    _edit_manifest(data_dir, lambda m: _first_shard(m).update(path="/srv/data/web/train-00000.bin"))
    with pytest.raises(DataError) as refused:
        load_manifest(data_dir, verify=False)
    assert "write it as" not in str(refused.value) and "srv/data" in str(refused.value)


def test_an_empty_train_shard_is_refused_in_the_manifest(data_dir):
    """prepare never writes one; the loader maps the train shard after one whose last document has
    no EOS (the document goes on there), and an empty file cannot be mapped. (Before: accepted,
    then a traceback from np.memmap when a skip entry named that document.) An empty val shard
    stays accepted (a small split)."""
    import hashlib
    manifest = load_manifest(data_dir, verify=False)
    folder = _first_shard(manifest)["path"].split("/")[0]
    (data_dir / folder / "train-99999.bin").write_bytes(b"")
    empty = {"path": f"{folder}/train-99999.bin", "tokens": 0, "sha256": hashlib.sha256(b"").hexdigest()}
    _edit_manifest(data_dir, lambda m: next(iter(m["domains"].values()))["train"].append(empty))
    with pytest.raises(DataError, match=r"manifest.json: \S+\.train\[\d+\]\.tokens is '0', expected at least 1 "
                                        r"in a train shard; drop the entry or rebuild"):
        load_manifest(data_dir, verify=False)


def test_a_manifest_of_another_dtype_over_the_same_files_is_a_cache_miss(data_dir):
    """The cache's max_token is the largest id read in the dtype of the manifest that hashed the
    shard; the same bytes read as uint32 hold other ids. (Before: a manifest with the same sha256s
    and dtype uint32 was accepted from the cache, and ids far beyond the vocabulary were fed.)"""
    import hashlib
    manifest = load_manifest(data_dir, verify=False)
    for entry in (e for d in manifest["domains"].values() for e in d["train"] + d["val"]):
        tokens = np.fromfile(data_dir / entry["path"], dtype=np.uint16)  # an even count, for uint32
        tokens[: len(tokens) - len(tokens) % 2].tofile(data_dir / entry["path"])
    def even(m):
        for e in (e for d in m["domains"].values() for e in d["train"] + d["val"]):
            e.update(tokens=e["tokens"] - e["tokens"] % 2,
                     sha256=hashlib.sha256((data_dir / e["path"]).read_bytes()).hexdigest())
    _edit_manifest(data_dir, even)
    start(data_dir)
    assert start(data_dir) == {}  # cached
    def as_uint32(m):
        m["dtype"] = "uint32"
        for e in (e for d in m["domains"].values() for e in d["train"] + d["val"]):
            e["tokens"] //= 2
    _edit_manifest(data_dir, as_uint32)
    manifest = load_manifest(data_dir, verify=False)
    cache = data_dir / CACHE_FILE
    plan = plan_hashing(data_dir, manifest, cache, full=False)
    assert plan["cached"] == 0 and len(plan["hash"]) == len(shards(data_dir))
    found = hash_shards(data_dir, [p for p, _ in plan["hash"]], lambda n: None, manifest["dtype"])
    with pytest.raises(DataError, match=r"holds token id \d+, beyond the tokenizer's vocabulary"):
        check_digests(data_dir, manifest, found)


def test_a_cache_entry_from_before_the_dtype_was_recorded_is_a_miss(data_dir):
    start(data_dir)
    name = shards(data_dir)[0]
    raw = json.loads((data_dir / CACHE_FILE).read_text())
    del raw["shards"][name]["dtype"]
    (data_dir / CACHE_FILE).write_text(json.dumps(raw))
    assert list(start(data_dir)) == [name]
