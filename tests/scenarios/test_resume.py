"""Checkpoints that resume exactly: kill anywhere, resume, and every later step is equal to the bit."""
import json
import shutil

import pytest
import torch
from safetensors.torch import load_file

from dsslm.ckpt import resume as persist
from dsslm.ckpt.format import invalid_reason
from dsslm.ckpt.shards import TensorReader
from dsslm.recovery.faults import DrillAbort
from dsslm.train import train
from helpers import TINY, events, hook_env, losses_by_step, read_jsonl, run_train, tiny_cfg

pytestmark = pytest.mark.slow

STEPS = ["train.total_steps=30", "ckpt.every=10", "ckpt.keep_last=5"]


def lrs_by_step(run_dir):
    return {r["step"]: r["lr"] for r in read_jsonl(run_dir / "metrics.jsonl") if "lr" in r}


def final_tensors(run_dir, step=30):
    folder = run_dir / "checkpoints" / f"step-{step:08d}"
    return load_file(folder / "model.safetensors"), load_file(folder / "optim.safetensors")


def assert_same_run(a, b, from_step=1):
    la, lb = losses_by_step(a), losses_by_step(b)
    assert set(la) == set(lb) and la, (sorted(la), sorted(lb))
    diff = {s: (la[s], lb[s]) for s in la if s >= from_step and la[s] != lb[s]}
    assert not diff, f"losses differ at steps {sorted(diff)[:5]}: {list(diff.values())[:3]}"
    assert lrs_by_step(a) == lrs_by_step(b)
    for left, right in zip(final_tensors(a), final_tensors(b)):
        assert left.keys() == right.keys()
        assert all(torch.equal(left[k], right[k]) for k in left)


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("ref") / "run"
    run_train(run_dir, *STEPS)
    return run_dir


@pytest.mark.slow
def test_sigkill_mid_run_resumes_to_the_bit(reference, tmp_path):
    run_dir = tmp_path / "run"
    # The save at 10 synchronous: an asynchronous one still writing at 17 on a loaded machine (it
    # did in a 2-worker pytest run) is killed with the process, and the resume starts at 0. Saves
    # killed mid-write are test_crash_inside_save's.
    killed = run_train(run_dir, *STEPS, "faults.crash_at_step=17", "ckpt.async_save=false", check=False)
    assert killed.returncode == -9  # a real SIGKILL: nothing ran after it
    run_train(run_dir, *STEPS)
    assert events(run_dir, "resume")[0]["step"] == 10
    assert_same_run(reference, run_dir)


@pytest.mark.slow
def test_crash_inside_save_resumes_from_the_previous_checkpoint(reference, tmp_path):
    run_dir = tmp_path / "run"
    crashed = run_train(run_dir, *STEPS, "faults.crash_in_save=20", check=False)
    assert crashed.returncode == 137
    leftovers = list((run_dir / "checkpoints").glob(".tmp-*"))
    assert leftovers, "the drill should leave a half-written temp folder behind"
    run_train(run_dir, *STEPS)
    assert events(run_dir, "resume")[0]["step"] == 10
    assert_same_run(reference, run_dir)


def inprocess(run_dir, *extra):
    return tiny_cfg(run_dir, *STEPS, *extra)


def test_corrupt_newest_checkpoint_falls_back_manifestless_set_aside_and_tmp_removed(reference, tmp_path):
    run_dir = tmp_path / "run"
    shutil.copytree(reference, run_dir)
    ckpts = run_dir / "checkpoints"
    newest = ckpts / "step-00000030" / "model.safetensors"
    data = bytearray(newest.read_bytes())
    data[len(data) // 2] ^= 0x01  # one flipped bit
    newest.write_bytes(bytes(data))
    truncated = ckpts / "step-00000020" / "optim.safetensors"
    truncated.write_bytes(truncated.read_bytes()[:-100])
    (ckpts / "step-00000025").mkdir()  # no MANIFEST: not provably dsslm's (a delete renames first)
    (ckpts / "step-00000025" / "state.json").write_text("{}")
    (ckpts / "step-00000026").mkdir()  # no MANIFEST, and a person's file
    (ckpts / "step-00000026" / "notes.txt").write_text("a person's notes")
    (ckpts / ".tmp-step-00000028-1-0a1b2c3d").mkdir()
    metrics_before = len(read_jsonl(run_dir / "metrics.jsonl"))
    assert train(inprocess(run_dir)) == 0
    assert events(run_dir, "resume")[-1]["step"] == 10
    passed = {e["checkpoint"] for e in events(run_dir, "passed_over")}
    assert {"step-00000030", "step-00000020", "step-00000025", "step-00000026"} <= {p.split("/")[-1] for p in passed}
    # Invalid folders are never deleted: without MANIFEST, set aside for a person, as they were.
    (aside25,) = ckpts.glob("step-00000025.invalid-*")
    (aside26,) = ckpts.glob("step-00000026.invalid-*")
    assert (aside25 / "state.json").read_text() == "{}" and (aside26 / "notes.txt").read_text() == "a person's notes"
    assert not events(run_dir, "deletes_finished")
    # ...but a save's temp folder is, by the trainer holding run.dir's lock: no save of it is running.
    assert not (ckpts / ".tmp-step-00000028-1-0a1b2c3d").exists()
    assert events(run_dir, "leftovers_removed")[-1]["folders"] == [".tmp-step-00000028-1-0a1b2c3d"]
    redone = read_jsonl(run_dir / "metrics.jsonl")[metrics_before:]
    ref = losses_by_step(reference)
    assert [r["step"] for r in redone if "loss" in r] == list(range(11, 31))
    assert all(r["loss"] == ref[r["step"]] for r in redone if "loss" in r)


KILL_IN_DELETE = """
    from dsslm.ckpt import store
    real = store.CheckpointStore.__init__
    def armed(self, *args, **kwargs):
        real(self, *args, **kwargs)
        self.die_in_delete(0, 2)  # retention's delete of the start checkpoint: after its rename and one file
    store.CheckpointStore.__init__ = armed
"""


def test_a_kill_inside_a_retention_delete_resumes_to_the_bit(reference, tmp_path):
    run_dir = tmp_path / "run"
    # Saves in line: under load an async writer finished step 10's save late, and retention reached step
    # 0 only at the last save, leaving nothing to resume.
    killed = run_train(run_dir, *STEPS, "ckpt.keep_last=1", "ckpt.async_save=false", check=False,
                       env=hook_env(tmp_path / "hook", KILL_IN_DELETE))
    assert killed.returncode == 137, killed.stderr[-2000:]
    names = sorted(p.name for p in (run_dir / "checkpoints").iterdir())
    (deleting,) = [n for n in names if n.startswith("step-00000000.deleting-")]
    kept = [n for n in names if n != deleting]
    assert kept and all(invalid_reason(run_dir / "checkpoints" / n) is None for n in kept), names
    run_train(run_dir, *STEPS)
    assert events(run_dir, "resume")[0]["step"] == int(kept[-1][5:]) < 30
    assert events(run_dir, "deletes_finished")[0]["folders"] == [deleting] and not events(run_dir, "passed_over")
    assert_same_run(reference, run_dir)


def test_resume_refuses_other_data_or_tokenizer(reference, tmp_path, capsys):
    from dsslm.data.__main__ import main as prepare
    from dsslm.train import main
    other = tmp_path / "other"
    (tmp_path / "t.txt").write_text("some other text entirely " * 400)
    assert prepare(["prepare", "--input", str(tmp_path / "t.txt"), "--out", str(other)]) == 0
    run_dir = tmp_path / "run"
    shutil.copytree(reference, run_dir)
    before = sorted(p.name for p in (run_dir / "checkpoints").iterdir())
    rc = main([f"run.dir={run_dir}", *TINY, *STEPS, "train.total_steps=40", f"data.dir={other}"])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and len(err) == 1 and "data" in err[0] and "--allow-drift" in err[0]
    assert sorted(p.name for p in (run_dir / "checkpoints").iterdir()) == before
    bpe = tmp_path / "bpe"
    assert prepare(["prepare", "--input", str(tmp_path / "t.txt"), "--out", str(bpe),
                    "--tokenizer", "bpe", "--vocab-size", "300"]) == 0
    rc = main([f"run.dir={run_dir}", *TINY, *STEPS, "train.total_steps=40", f"data.dir={bpe}"])
    assert rc == 2 and "tokenizer" in capsys.readouterr().err


def test_changed_hyperparameter_refused_unless_allowed(reference, tmp_path, capsys):
    from dsslm.train import main
    run_dir = tmp_path / "run"
    shutil.copytree(reference, run_dir)
    args = [f"run.dir={run_dir}", *TINY, *STEPS, "train.total_steps=32", "optim.peak_lr=5e-3"]
    assert main(args) == 2
    assert "optim.peak_lr" in capsys.readouterr().err
    assert main(["--allow-drift", "optim.peak_lr", *args]) == 0
    assert events(run_dir, "resume")[-1]["drift"] == {"optim.peak_lr": [0.002, 0.005]}


def test_a_key_that_adds_a_part_is_refused_by_its_name_and_allowed_starts_it_afresh(reference, tmp_path, capsys):
    """optim.clip_mode=zclip adds the clipper's state to the checkpoint's parts. A checkpoint made
    without it was passed over as malformed ("state.clip: missing"), each of them, and
    --allow-drift could not help."""
    from dsslm.train import main
    run_dir = tmp_path / "run"
    shutil.copytree(reference, run_dir)
    args = [f"run.dir={run_dir}", *TINY, *STEPS, "optim.clip_mode=zclip", "optim.zclip_warmup_steps=2"]
    assert main([*args, "train.total_steps=34"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "made with optim.clip_mode='fixed', now 'zclip'" in err[0], err
    assert not events(run_dir, "passed_over") and (run_dir / "checkpoints" / "step-00000030" / "MANIFEST").is_file()
    allow = ["--allow-drift", "optim.clip_mode", "--allow-drift", "optim.zclip_warmup_steps"]
    assert main([*allow, *args, "train.total_steps=34"]) == 0
    assert [e["step"] for e in events(run_dir, "resume")] == [30]
    state = json.loads((run_dir / "checkpoints" / "step-00000034" / "state.json").read_text())
    assert state["clip"]["mean"] is not None  # ZClip's statistics, begun at the resume
    # ...and back: the part the checkpoint holds and this run does not is left.
    assert main([*allow, *args[:-2], "train.total_steps=36"]) == 0
    assert [e["step"] for e in events(run_dir, "resume")] == [30, 34]
    assert "clip" not in json.loads((run_dir / "checkpoints" / "step-00000036" / "state.json").read_text())


def test_dropout_and_double_resume_equal_to_the_bit(tmp_path):
    ref = tmp_path / "ref"
    assert train(inprocess(ref, "model.dropout=0.1")) == 0
    run_dir = tmp_path / "run"
    for kill_at in (12, 23):  # killed, resumed, killed again, resumed again
        with pytest.raises(DrillAbort):
            train(inprocess(run_dir, "model.dropout=0.1", f"faults.crash_at_step={kill_at}",
                            "faults.crash_mode=raise"))
    assert train(inprocess(run_dir, "model.dropout=0.1")) == 0
    assert [e["step"] for e in events(run_dir, "resume")] == [10, 20]
    assert_same_run(ref, run_dir)


@pytest.mark.parametrize("forget", ["rng", "adam_step", "loader", "moments"])
def test_negative_controls_a_forgotten_piece_of_state_is_seen(tmp_path, monkeypatch, forget):
    """The equality test must be able to fail: leave one piece of state unrestored."""
    ref = tmp_path / "ref"
    assert train(inprocess(ref, "model.dropout=0.1")) == 0
    run_dir = tmp_path / "run"
    with pytest.raises(DrillAbort):
        train(inprocess(run_dir, "model.dropout=0.1", "faults.crash_at_step=17", "faults.crash_mode=raise"))
    real_read, real_restore = TensorReader.read, persist.Checkpointer.restore
    if forget == "rng":
        monkeypatch.setattr(persist, "set_rng_state", lambda state: None)
    elif forget == "adam_step":
        def first_step(self, key, start=0, end=None):
            got = real_read(self, key, start, end)
            return torch.ones_like(got) if key.startswith("optim/step/") else got
        monkeypatch.setattr(TensorReader, "read", first_step)
    elif forget == "moments":
        def zero_moments(self, key, start=0, end=None):
            got = real_read(self, key, start, end)
            return torch.zeros_like(got) if key.startswith("optim/exp_avg/") else got
        monkeypatch.setattr(TensorReader, "read", zero_moments)
    elif forget == "loader":
        def restore_without_position(self, ckpt):
            real_restore(self, ckpt)
            self.train.next_sequence = 0  # the loader "restarts": other batches from here on
        monkeypatch.setattr(persist.Checkpointer, "restore", restore_without_position)
    assert train(inprocess(run_dir, "model.dropout=0.1")) == 0
    ref_losses, got = losses_by_step(ref), losses_by_step(run_dir)
    assert any(ref_losses[s] != got[s] for s in range(11, 31))


def test_async_save_snapshot_is_taken_at_the_step(tmp_path):
    """The weights in step-10 are those after step 10, although step 11 ran while it was written."""
    run_dir = tmp_path / "run"
    assert train(inprocess(run_dir, "ckpt.every=10", "train.total_steps=11")) == 0
    sync_dir = tmp_path / "sync"
    assert train(inprocess(sync_dir, "ckpt.every=10", "train.total_steps=11", "ckpt.async_save=false")) == 0
    a = load_file(run_dir / "checkpoints" / "step-00000010" / "model.safetensors")
    b = load_file(sync_dir / "checkpoints" / "step-00000010" / "model.safetensors")
    assert all(torch.equal(a[k], b[k]) for k in a)


def test_state_json_carries_what_resume_needs(reference):
    state = json.loads((reference / "checkpoints" / "step-00000030" / "state.json").read_text())
    for key in ("schema", "step", "skip_list", "train", "rng", "monitor", "fingerprint", "config"):
        assert key in state
    assert "scaler" not in state  # fp32: only fp16 runs have a loss scaler to save
    assert state["schema"] == 2 and state["step"] == 30 and state["train"]["lr_scale"] == 1.0
    assert state["train"]["next_sequence"] == 30 * 4  # 30 steps of 4 sequences
    assert {"python", "numpy", "torch"} <= set(state["rng"][0])
    manifest = json.loads((reference / "checkpoints" / "step-00000030" / "MANIFEST").read_text())
    assert set(manifest["files"]) == {"model.safetensors", "optim.safetensors", "state.json"}
