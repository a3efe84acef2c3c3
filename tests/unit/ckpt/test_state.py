"""Checkpoint state read back from disk is checked field by field before it is trusted.

Every case rewrites a checkpoint of a real run *and recomputes its MANIFEST*, so the hashes
match: what an attacker (or a buggy tool) with write access to run.dir can do. Each such
checkpoint must be passed over with a `passed_over` event naming what is wrong, and the resume
must continue from the previous one, to the bit."""
from __future__ import annotations

import json
import os
import shutil
import struct
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from dsslm.ckpt import format as ckpt_format
from dsslm.ckpt.accept import upgrade_state
from dsslm.fields import Fields, Float, Int, ListOf, StateError, Window, validate
from dsslm.recovery.faults import DrillAbort
from dsslm.train import main, train
from helpers import TINY, copy_run_back_to, events, losses_by_step, read_jsonl, remanifest, run_train, tiny_cfg

STEPS = ["train.total_steps=12", "ckpt.every=4", "ckpt.keep_last=5"]


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> Path:
    run_dir = tmp_path_factory.mktemp("state") / "run"
    assert train(tiny_cfg(run_dir, *STEPS)) == 0
    return run_dir


def tampered_run(reference: Path, tmp_path: Path, edit) -> Path:
    """A copy of the reference run cut back to step 8 (so it resumes), its newest checkpoint edited."""
    run_dir = tmp_path / "run"
    folder = copy_run_back_to(reference, run_dir, 8)
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    (run_dir / "metrics.jsonl").write_text("\n".join(lines[:8]) + "\n")
    edit(folder)
    remanifest(folder)
    return run_dir


def edit_state(change):
    def edit(folder: Path) -> None:
        state = json.loads((folder / "state.json").read_text())
        state = change(state)
        (folder / "state.json").write_text(json.dumps(state))
    return edit


def edit_tensor(group: str, name: str, make):
    def edit(folder: Path) -> None:
        tensors = load_file(folder / f"{group}.safetensors")
        tensors[name] = make(tensors.get(name))
        save_file(tensors, folder / f"{group}.safetensors")
    return edit


def edit_header(group: str, name: str, **entry):
    """Rewrite one tensor's entry in a safetensors header (offsets overlapping another's, say)."""
    def edit(folder: Path) -> None:
        path = folder / f"{group}.safetensors"
        raw = path.read_bytes()
        n = struct.unpack("<Q", raw[:8])[0]
        header = json.loads(raw[8:8 + n])
        header[name].update(entry)
        blob = json.dumps(header).encode()
        blob += b" " * (-len(blob) % 8)
        path.write_bytes(struct.pack("<Q", len(blob)) + blob + raw[8 + n:])
    return edit


def drop_optim(name: str):
    """Remove every optimizer tensor of one parameter (moments and step count)."""
    def edit(folder: Path) -> None:
        tensors = load_file(folder / "optim.safetensors")
        save_file({k: v for k, v in tensors.items() if not k.endswith("/" + name)}, folder / "optim.safetensors")
    return edit


def symlink_out(path: Path) -> None:
    """Replace `path` by a link to a copy outside the folder: the hashes (read through it) match."""
    outside = path.parent.parent.parent / f"outside-{path.name}"
    shutil.move(path, outside)
    path.symlink_to(outside)


def set_field(path: str, value):
    def change(state):
        node = state
        *parents, leaf = path.split(".")
        for key in parents:
            node = node[key]
        node[leaf] = value
        return state
    return change


CASES = {
    # name: (edit, the field the passed_over reason must name)
    "skip_list not a list": (edit_state(lambda s: {**s, "skip_list": "x", "train": {**s["train"], "skip_list": "x"}}),
                             "state.train.skip_list"),
    "negative step": (edit_state(lambda s: {**s, "step": -5}), "state.step"),
    "step 1e30": (edit_state(lambda s: {**s, "step": 1e30}), "state.step"),
    "top level a list": (edit_state(lambda s: [1, 2, 3]), "state"),
    "unknown top-level field": (edit_state(lambda s: {**s, "surprise": 1}), "state.surprise"),
    "missing part": (edit_state(lambda s: {k: v for k, v in s.items() if k != "monitor"}), "state.monitor"),
    "lr_scale above 1": (edit_state(set_field("train.lr_scale", 4.0)), "state.train.lr_scale"),
    "window backwards": (edit_state(lambda s: {**s, "skip_list": [[9, 3]], "train": {**s["train"], "skip_list": [[9, 3]]}}),
                         "state.train.skip_list[0]"),
    "monitor loss NaN": (edit_state(set_field("monitor.losses", ["nan"])), "state.monitor.losses[0]"),
    "rng of another size": (edit_state(set_field("rng", [])), "state.rng"),
    "copies disagree": (edit_state(lambda s: {**s, "step": 4}), "state.step"),
    # both copies agree, but the folder is step-00000008: chosen as 8, it would restore step 12
    "step not the folder's": (edit_state(lambda s: {**s, "step": 12, "train": {**s["train"], "step": 12}}),
                              "state.step"),
    # the sharded form of the streams in a gathered folder, which has no rank files to read them from
    "rng per rank in a gathered folder": (edit_state(set_field("rng", {"per_rank": 1})), "state.rng"),
    "position negative": (edit_state(set_field("train.next_sequence", -1)), "state.train.next_sequence"),
    "domain tokens negative": (edit_state(set_field("train.domain_tokens", {"code": -3})),
                               "state.train.domain_tokens.code"),
    "wrong shape": (edit_tensor("model", "blocks.0.attn.qkv.weight", lambda t: torch.zeros(t.shape[0] + 1, t.shape[1])),
                    "blocks.0.attn.qkv.weight"),
    "broadcastable shape": (edit_tensor("model", "norm.weight", lambda t: torch.ones(1)), "norm.weight"),
    "wrong dtype": (edit_tensor("model", "tok_emb.weight", lambda t: t.double()), "tok_emb.weight"),
    "unknown tensor": (edit_tensor("model", "extra.weight", lambda t: torch.zeros(2)), "extra.weight"),
    "moment of the wrong shape": (edit_tensor("optim", "exp_avg/norm.weight", lambda t: t[:3]), "norm.weight"),
    # Values no run saves: every applied step was finite, and a second moment is a mean of squares.
    "NaN weight": (edit_tensor("model", "norm.weight", lambda t: t.clone().index_fill_(0, torch.tensor([3]),
                                                                                     float("nan"))),
                   "model norm.weight: 1 non-finite"),
    "inf moment": (edit_tensor("optim", "exp_avg/norm.weight", lambda t: torch.full_like(t, float("inf"))),
                   "optim exp_avg norm.weight"),
    "negative second moment": (edit_tensor("optim", "exp_avg_sq/norm.weight", lambda t: -torch.ones_like(t)),
                               "exp_avg_sq norm.weight: negative"),
    "hostile safetensors header": (edit_header("model", "norm.weight", data_offsets=[0, 8]), "did not load"),
    "file is a symlink": (lambda folder: symlink_out(folder / "state.json"), "state.json is a symbolic link"),
    # Found by review: each crashed the resume (ValueError; exit 1), or resumed off the bitwise path.
    "monitor losses and gnorms differ": (edit_state(lambda s: {**s, "monitor": {**s["monitor"],
                                                                                "gnorms": s["monitor"]["gnorms"][:-1]}}),
                                         "state.monitor.gnorms"),
    "one parameter's optimizer state gone": (drop_optim("norm.weight"), "no optimizer state for 'norm.weight'"),
}


@pytest.mark.slow
@pytest.mark.parametrize("case", sorted(CASES))
def test_malformed_checkpoint_is_passed_over_and_the_previous_one_used(reference, tmp_path, case):
    edit, field = CASES[case]
    run_dir = tampered_run(reference, tmp_path, edit)
    assert train(tiny_cfg(run_dir, *STEPS)) == 0
    passed = [e for e in events(run_dir, "passed_over") if e["checkpoint"].endswith("step-00000008")]
    assert len(passed) == 1 and field in passed[0]["reason"], passed
    assert events(run_dir, "resume")[-1]["step"] == 4
    assert losses_by_step(run_dir) == losses_by_step(reference)  # resumed from 4, to the bit


def test_a_checkpoint_folder_that_is_a_symlink_is_passed_over_and_never_deleted_through(reference, tmp_path):
    """A link in checkpoints/ could point at another run's checkpoint: retention deleting "it"
    would delete that one. It is never followed: passed over, and left alone."""
    other = tmp_path / "other-run-step-00000008"
    run_dir = tampered_run(reference, tmp_path, lambda folder: None)
    folder = run_dir / "checkpoints" / "step-00000008"
    shutil.move(folder, other)
    folder.symlink_to(other, target_is_directory=True)
    before = {p.name: p.read_bytes() for p in other.iterdir()}
    assert train(tiny_cfg(run_dir, *STEPS, "ckpt.keep_last=1", "train.total_steps=16")) == 0
    passed = [e for e in events(run_dir, "passed_over") if e["checkpoint"] == "step-00000008"]
    assert len(passed) == 1 and "symbolic link" in passed[0]["reason"]
    assert events(run_dir, "resume")[-1]["step"] == 4
    # The re-save of step 8 put the link aside for a person to look at; what it points to is intact.
    kept = list((run_dir / "checkpoints").glob("step-00000008.invalid-*"))
    assert len(kept) == 1 and kept[0].is_symlink()
    assert {p.name: p.read_bytes() for p in other.iterdir()} == before


@pytest.mark.slow
def test_a_manifest_that_is_a_fifo_is_passed_over_without_hanging(reference, tmp_path):
    run_dir = tampered_run(reference, tmp_path, lambda folder: None)
    manifest = run_dir / "checkpoints" / "step-00000008" / "MANIFEST"
    manifest.unlink()
    os.mkfifo(manifest)  # reading it would block for ever
    run_train(run_dir, *STEPS, timeout_s=120)
    passed = [e for e in events(run_dir, "passed_over") if e["checkpoint"] == "step-00000008"]
    assert len(passed) == 1 and "MANIFEST is not a regular file" in passed[0]["reason"]
    assert events(run_dir, "resume")[-1]["step"] == 4


def test_an_oversized_state_json_is_passed_over_before_it_is_read(reference, tmp_path, monkeypatch):
    monkeypatch.setattr(ckpt_format, "MAX_STATE_BYTES", 1 << 20)  # real ones here are ~30 KB
    run_dir = tampered_run(reference, tmp_path, edit_state(set_field("config.padding", "x" * (2 << 20))))
    assert train(tiny_cfg(run_dir, *STEPS)) == 0
    passed = [e for e in events(run_dir, "passed_over") if e["checkpoint"].endswith("step-00000008")]
    assert len(passed) == 1 and "state.json is" in passed[0]["reason"] and "more than" in passed[0]["reason"]
    assert events(run_dir, "resume")[-1]["step"] == 4


def test_a_checkpoint_of_another_config_is_refused_not_passed_over(reference, tmp_path, capsys):
    """A well-formed checkpoint of another model is another run's: exit 2, never a fresh start
    that retention would then use to delete the saved checkpoints."""
    run_dir = tmp_path / "run"
    shutil.copytree(reference, run_dir)
    before = sorted(p.name for p in (run_dir / "checkpoints").iterdir())
    rc = main([f"run.dir={run_dir}", *TINY, *STEPS, "train.total_steps=20", "model.d_model=48"])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and len(err) == 1 and "model.d_model" in err[0]
    assert sorted(p.name for p in (run_dir / "checkpoints").iterdir()) == before
    assert not events(run_dir, "passed_over")


def test_a_checkpoint_whose_config_this_dsslm_cannot_read_is_refused_in_one_line(reference, tmp_path, capsys):
    """state.config with a list where a map belongs, hashes recomputed: OmegaConf's merge raised
    TypeError out of the resume (exit 1, a traceback, on every restart). Now exit 2 and one line
    naming the checkpoint, and nothing is passed over or written: an older dsslm's config that
    this one cannot read must not make the run start afresh."""
    run_dir = tampered_run(reference, tmp_path, edit_state(set_field("config.data.mix", [1, 2])))
    before = sorted(p.name for p in (run_dir / "checkpoints").iterdir())
    rc = main([f"run.dir={run_dir}", *TINY, *STEPS])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and len(err) == 1 and "step-00000008" in err[0] and "state.config" in err[0], err
    assert sorted(p.name for p in (run_dir / "checkpoints").iterdir()) == before
    assert not events(run_dir, "passed_over")


def test_a_saved_config_an_older_dsslm_accepted_still_resumes_and_opens_in_the_tools(reference, tmp_path):
    """Rules added to the config later (finite floats, run.val_batches >= 1) are for the config
    typed now, not for a checkpoint's own: optim.clip=inf and run.val_batches=0 trained before
    them, and that run must resume and export. (Refused for a moment in this session's work.)"""
    from dsslm.ckpt.trained import open_trained

    def older(state):
        state["config"]["optim"]["clip"] = float("inf")
        state["config"]["run"]["val_batches"] = 0
        return state
    run_dir = tampered_run(reference, tmp_path, edit_state(older))
    assert open_trained(run_dir).step == 8
    assert train(tiny_cfg(run_dir, *STEPS)) == 0
    assert events(run_dir, "resume")[-1]["step"] == 8 and not events(run_dir, "passed_over")


def test_a_new_mix_is_refused_on_resume_unless_its_drift_is_allowed(reference, tmp_path, capsys):
    run_dir = tmp_path / "run"
    shutil.copytree(reference, run_dir)
    mix = ["data.mix.code=0.5", "data.mix.tests=0.5", "train.total_steps=14"]
    assert main([f"run.dir={run_dir}", *TINY, *STEPS, *mix]) == 2
    assert "data.mix.code" in capsys.readouterr().err
    assert main(["--allow-drift", "data.mix", f"run.dir={run_dir}", *TINY, *STEPS, *mix]) == 0
    assert sorted(events(run_dir, "resume")[-1]["drift"]) == ["data.mix.code", "data.mix.tests"]


def test_broken_run_level_skip_list_is_rebuilt_from_the_checkpoints(reference, tmp_path):
    run_dir = tmp_path / "run"
    shutil.copytree(reference, run_dir)
    windows = [[1000, 1032]]  # ahead of every checkpoint's position
    for folder in (run_dir / "checkpoints").glob("step-*"):
        state = json.loads((folder / "state.json").read_text())
        state["skip_list"] = state["train"]["skip_list"] = windows
        (folder / "state.json").write_text(json.dumps(state))
        remanifest(folder)
    (run_dir / "skip_list.json").write_text('{"schema": 2, "skip_list": [[100, 1')  # torn
    assert train(tiny_cfg(run_dir, *STEPS, "train.total_steps=14")) == 0
    rebuilt = events(run_dir, "recovery_rebuilt")
    assert len(rebuilt) == 1 and rebuilt[0]["skip_list"] == windows and "skip_list.json" in rebuilt[0]["reason"]
    assert json.loads((run_dir / "skip_list.json").read_text())["skip_list"] == windows
    # The broken file is kept beside it for a person (an edit with one bad entry holds good ones).
    aside = run_dir / rebuilt[0]["kept_aside"]
    assert aside.read_text() == '{"schema": 2, "skip_list": [[100, 1' and aside.name.startswith("skip_list.json.invalid-")


def test_schema_1_state_is_upgraded_to_the_step_vocabulary():
    old = {"format": 1, "step": 30, "skip_list": [[5, 13]], "loader": {"next_data_batch": 38}, "scaler": None,
           "run": {"step": 30, "tokens": 900, "skip_list": [[5, 13]], "lr_scale": 0.7, "skipped_steps": 1,
                   "clipped_steps": 2, "lineage": [],
                   "rewinds": [{"step": 5, "window": [5, 13], "to_step": 0, "lr_scale_factor": 1.0}]},
           "monitor": {"format": 1, "losses": [], "gnorms": [], "streak": 0, "spike_start": 5},
           "rng": [], "world_size": 1, "engine": "ddp", "fingerprint": {"global_batch_size": 4}, "config": {}}
    new = upgrade_state(old)
    assert new["schema"] == 2 and "format" not in new and "scaler" not in new and "run" not in new
    assert "loader" not in new and new["train"]["tokens_seen"] == 900 and "tokens" not in new["train"]
    # Data batches of 4 sequences become sequences: batch d was sequences [4d, 4d + 4).
    assert new["train"]["skip_list"] == new["skip_list"] == [[20, 52]] and new["train"]["next_sequence"] == 152
    assert new["train"]["rewinds"][0] == {"step": 6, "window": [20, 52], "to_step": 0, "lr_scale_factor": 1.0}
    assert new["monitor"]["spike_start"] == 6  # index 5 is the step counted 6
    assert upgrade_state(new) is new


def test_schema_checks_name_the_field():
    spec = Fields(step=Int(0, 10), windows=ListOf(Window()), lr=Float(0.0, 1.0))
    validate({"step": 3, "windows": [[1, 2]], "lr": 0.5}, spec, "s")
    for bad, field in (({"step": True, "windows": [], "lr": 0.5}, "s.step"),
                       ({"step": 3, "windows": [[2, 1]], "lr": 0.5}, "s.windows[0]"),
                       ({"step": 3, "windows": [[1, 2.5]], "lr": 0.5}, "s.windows[0][1]"),
                       ({"step": 3, "windows": [], "lr": float("inf")}, "s.lr"),
                       ({"step": 3, "windows": []}, "s.lr"),
                       ({"step": 3, "windows": [], "lr": 0.5, "x": 1}, "s.x")):
        with pytest.raises(StateError, match=r"^" + field.replace("[", r"\[").replace("]", r"\]") + ":"):
            validate(bad, spec, "s")


def test_metrics_of_the_refused_step_and_the_resume_line_up(reference):
    """Guard for the fixture itself: 12 step records, steps 1..12, checkpoints at 0, 4, 8, 12."""
    records = [r for r in read_jsonl(reference / "metrics.jsonl") if "loss" in r]
    assert [r["step"] for r in records] == list(range(1, 13))
    assert sorted(p.name for p in (reference / "checkpoints").glob("step-*")) == \
        ["step-00000000", "step-00000004", "step-00000008", "step-00000012"]  # step 0: a spike in warmup can rewind


def tree(folder: Path) -> dict:
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


def test_a_run_dir_whose_every_checkpoint_is_invalid_is_refused_not_restarted(reference, tmp_path, capsys):
    """Every checkpoint passed over, and the start trained from step 0 in the same run.dir,
    appending a second history to the first's logs. Now exit 5 and one line, every time, until a
    person chooses another run.dir or run.restart_from_scratch=true."""
    run_dir = tmp_path / "run"
    copy_run_back_to(reference, run_dir, 8)
    ckpts = run_dir / "checkpoints"
    (ckpts / "step-00000000" / "model.safetensors").unlink()  # the start checkpoint (monitor.enabled)
    (ckpts / "step-00000004" / "MANIFEST").unlink()  # lost: set aside
    lost = tree(ckpts / "step-00000004")
    state = ckpts / "step-00000008" / "state.json"
    state.write_bytes(state.read_bytes().replace(b'"step"', b'"stop"', 1))  # its hash no longer matches
    with open(run_dir / "metrics.jsonl", "a") as f:
        f.write('{"step": 13, "lo')  # a kill mid-line: a torn record is no evidence, the rest is
    args = [f"run.dir={run_dir}", *TINY, *STEPS]
    assert main(args) == 5
    *said, last = capsys.readouterr().err.strip().splitlines()  # the passed_over lines, then the refusal's
    (aside,) = ckpts.glob("step-00000004.invalid-*")
    assert last.startswith("dsslm: ") and "trained to step 12" in last and aside.name in last
    assert "step-00000008" in last and "another run.dir" in last and "run.restart_from_scratch=true" in last
    assert len(said) == 3 and all("passed over" in line for line in said), said
    before = {name: data for name, data in tree(run_dir).items() if name != "events.jsonl"}
    assert main(args) == 5  # again: the folder set aside is not passed over (or reported) again
    assert {name: data for name, data in tree(run_dir).items() if name != "events.jsonl"} == before
    assert events(run_dir, "start") == events(reference, "start")  # neither start began a run
    passed = [e["checkpoint"] for e in events(run_dir, "passed_over")]
    assert sorted(passed) == ["step-00000000"] * 2 + ["step-00000004"] + ["step-00000008"] * 2  # once per start
    capsys.readouterr()
    assert main([*args, "run.restart_from_scratch=true"]) == 0
    (started_over,) = events(run_dir, "restart_from_scratch")
    assert started_over["recorded_step"] == 12 and aside.name in started_over["not_resumable"]
    assert events(run_dir, "start")[-1]["step"] == 0 and tree(aside) == lost
    assert len(list(ckpts.glob("step-00000008.invalid-*"))) == 1  # its re-save put the damaged one aside


@pytest.mark.parametrize("gone", ["removed", "emptied"])
def test_a_run_dir_whose_checkpoints_are_gone_is_refused_not_restarted(reference, tmp_path, capsys, gone):
    """A scratch purge or a deleted checkpoints/ leaves nothing to pass over or set aside, and the
    start trained from step 0 there, appending a second history to the first's logs."""
    run_dir = tmp_path / "run"
    shutil.copytree(reference, run_dir)
    shutil.rmtree(run_dir / "checkpoints")
    if gone == "emptied":
        (run_dir / "checkpoints").mkdir()
    metrics = (run_dir / "metrics.jsonl").read_bytes()
    args = [f"run.dir={run_dir}", *TINY, *STEPS]
    capsys.readouterr()
    assert main(args) == 5
    last = capsys.readouterr().err.strip().splitlines()[-1]
    assert last.startswith("dsslm: ") and f"trained to step 12 ({run_dir / 'metrics.jsonl'} says so)" in last
    assert f"{run_dir / 'checkpoints'} holds no checkpoint that can be resumed" in last
    assert ("it is missing" if gone == "removed" else "no step-XXXXXXXX folder in it") in last
    assert "another run.dir" in last and "run.restart_from_scratch=true" in last
    assert (run_dir / "metrics.jsonl").read_bytes() == metrics and not list(run_dir.glob("checkpoints/*"))
    assert events(run_dir, "start") == events(reference, "start")  # no run began
    assert main(args) == 5  # again: nothing the refusal wrote changes what the next start reads
    assert main([*args, "run.restart_from_scratch=true"]) == 0
    (started_over,) = events(run_dir, "restart_from_scratch")
    assert started_over["recorded_step"] == 12 and started_over["not_resumable"] == []
    assert events(run_dir, "start")[-1]["step"] == 0
    steps = [r["step"] for r in read_jsonl(run_dir / "metrics.jsonl") if "loss" in r]
    assert steps == [*range(1, 13), *range(1, 13)]  # the second history, asked for


def test_a_run_killed_before_step_1_starts_again_at_step_0(tmp_path):
    """Its logs show only a start at step 0, and no checkpoint was saved: nothing to lose."""
    run_dir = tmp_path / "run"
    steps = ("train.total_steps=4", "optim.warmup_steps=1", "ckpt.every=4", "monitor.enabled=false")
    with pytest.raises(DrillAbort):
        train(tiny_cfg(run_dir, *steps, "faults.crash_at_step=0", "faults.crash_mode=raise"))
    assert [e["step"] for e in events(run_dir, "start")] == [0] and not list(run_dir.glob("checkpoints/step-*"))
    assert train(tiny_cfg(run_dir, *steps)) == 0
    assert [e["step"] for e in events(run_dir, "start")] == [0, 0] and not events(run_dir, "restart_from_scratch")
    assert [r["step"] for r in read_jsonl(run_dir / "metrics.jsonl") if "loss" in r] == [1, 2, 3, 4]


def test_a_fresh_run_dir_holding_a_foreign_step_folder_trains_and_keeps_it(tmp_path):
    """No log shows a run, so this is a first start: the folder is set aside, kept, and trained beside."""
    run_dir = tmp_path / "run"
    foreign = run_dir / "checkpoints" / "step-99999999"
    foreign.mkdir(parents=True)
    (foreign / "model.safetensors").write_bytes(os.urandom(4096))
    (foreign / "state.json").write_text('{"step": 99999999, "skip_li')
    before = tree(foreign)
    assert train(tiny_cfg(run_dir, "train.total_steps=6", "ckpt.every=6")) == 0
    (aside,) = (run_dir / "checkpoints").glob("step-99999999.invalid-*")
    assert tree(aside) == before and events(run_dir, "start")[0]["step"] == 0
    assert [e["set_aside"] for e in events(run_dir, "passed_over")] == [aside.name]


@pytest.mark.parametrize("metrics, events_, expect", [
    ("", "", None),
    ('{"step": 7, "loss": 2.5}\n', "", (7, "metrics.jsonl")),
    ('{"step": 7, "loss": 2.5}\n{"step": 8, "lo', '{"event": "save", "step": 5}\n', (7, "metrics.jsonl")),
    ('{"step": 0, "loss": 2.5}\n', '{"event": "start", "step": 0}\n{"event": "save", "step": 9}\n', (9, "events.jsonl")),
    ('{"step": true, "loss": 1}\n{"step": 3}\n{"step": "9", "loss": 1}\n[1, 2]\n', '{"step": 1e3, "event": "x"}\n', None),
    ("\x00\xff garbage " * 50_000 + '\n{"step": 4, "loss": 1}', "[" * 100_000, (4, "metrics.jsonl")),
])
def test_what_counts_as_a_run_past_step_0(tmp_path, metrics, events_, expect):
    from dsslm.ckpt.resume import recorded_step
    (tmp_path / "metrics.jsonl").write_text(metrics)
    (tmp_path / "events.jsonl").write_text(events_)
    assert recorded_step(tmp_path) == expect


def test_a_log_that_is_not_a_file_is_no_evidence_and_never_read(tmp_path):
    from dsslm.ckpt.resume import recorded_step
    os.mkfifo(tmp_path / "metrics.jsonl")  # a read would block the start
    (tmp_path / "events.jsonl").mkdir()
    assert recorded_step(tmp_path) is None
