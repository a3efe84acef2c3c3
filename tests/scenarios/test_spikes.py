"""Loss-spike recovery end to end on real text (the stdlib corpus), fp32."""
import json
import shutil

import numpy as np
import pytest
import torch
from safetensors.torch import load_file

from dsslm.data.corpus import default_data_dir
from dsslm.data.loader import Loader
from dsslm.data.skips import windows_of
from dsslm.train import main, train
from helpers import TINY, events, read_jsonl, run_train, tiny_cfg

pytestmark = pytest.mark.slow

# d_model 64 at lr 3e-3 has settled near loss 3 by step 60, where uniformly random tokens
# (loss ~7) are a clear spike; checkpoints every 5 steps give rewind targets.
SPIKE = ["monitor.triage=false", "model.d_model=64", "optim.peak_lr=3e-3", "train.total_steps=100", "ckpt.every=5",
         "ckpt.keep_last=4", "monitor.min_history=15", "monitor.window=30",
         "monitor.rewind_margin_steps=2", "optim.warmup_steps=5"]


def cfg(run_dir, *extra):
    return tiny_cfg(run_dir, *SPIKE, *extra)


B = 4  # TINY's train.micro_batch_size on one rank: the global batch in sequences


@pytest.mark.slow
def test_clean_run_has_no_skips_or_rewinds(tmp_path):
    assert train(cfg(tmp_path, "train.total_steps=400", "ckpt.every=100")) == 0
    verdicts = [r["verdict"] for r in read_jsonl(tmp_path / "metrics.jsonl") if "verdict" in r]
    assert len(verdicts) == 400 and set(verdicts) == {"ok"}
    assert not events(tmp_path, "skip") and not events(tmp_path, "rewind")


def test_single_poisoned_batch_is_skipped_and_changes_nothing(tmp_path):
    # hard_loss_z high so the isolated outlier takes the skip path, not an immediate rewind.
    assert train(cfg(tmp_path, "faults.poison_batches=[[70,71]]", "monitor.hard_loss_z=1e9",
                     "ckpt.every=1", "ckpt.keep_last=100", "train.total_steps=72")) == 0
    skips = events(tmp_path, "skip")
    assert [(e["step"], e["data_position"]) for e in skips] == [(71, 70 * B)]
    before = tmp_path / "checkpoints" / "step-00000070"
    after = tmp_path / "checkpoints" / "step-00000071"
    for name in ("model.safetensors", "optim.safetensors"):  # weights, both moments, Adam's step
        a, b = load_file(before / name), load_file(after / name)
        assert all(torch.equal(a[k], b[k]) for k in a), name
    records = {r["step"]: r for r in read_jsonl(tmp_path / "metrics.jsonl") if "loss" in r}
    assert records[72]["data_position"] == 71 * B  # the poisoned batch is not replayed; the stream advanced
    assert records[72]["lr"] != records[71]["lr"]


def chunks_fed(records, skip_list) -> set[int]:
    """The chunks (ids name text) the ok steps among `records` read, from position and skip list."""
    lo = Loader(default_data_dir(), 32, 1337)
    fed = set()
    for r in records:
        if r.get("verdict") == "ok":
            batch, _ = lo.step(r["data_position"], skip_list, B, 0, 1, 1)
            fed |= set(lo.chunk_ids(batch.indices).tolist())
    return fed


def test_poisoned_window_rewinds_once_and_its_data_is_never_fed_again(tmp_path):
    # keep_last=30: the resume below needs a checkpoint from before the spike. With 4 kept it found
    # none, and started over at step 0 over the first run's logs (now refused, exit 5).
    assert train(cfg(tmp_path, "faults.poison_batches=[[70,74]]", "ckpt.keep_last=30")) == 0
    rewinds = events(tmp_path, "rewind")
    assert len(rewinds) == 1
    start, end = rewinds[0]["window"]  # in global sequences
    assert start <= 70 * B and end >= 74 * B and rewinds[0]["to_step"] <= 68  # skip_batches=8 covers the rest
    # The skip list names the data the spike steps read, not their positions: the chunks
    # themselves, which a position window would let back in with the next epoch's shuffle. The
    # widening past them (random chunks of the shuffled corpus) is skipped by position only.
    state_skip = json.loads((tmp_path / "checkpoints" / "step-00000100" / "state.json").read_text())["skip_list"]
    lo = Loader(default_data_dir(), 32, 1337)
    (fed_end, window_end), = windows_of(state_skip)
    assert start < fed_end < 74 * B and window_end == end
    window_chunks = set(lo.chunk_ids(np.arange(start, fed_end)).tolist())
    assert set(lo.skipped_chunks(state_skip).tolist()) == window_chunks
    assert rewinds[0]["skip"] == state_skip  # as a triage's rewind events name it
    records = read_jsonl(tmp_path / "metrics.jsonl")
    kept = {r["step"]: r for r in records if "data_position" in r}.values()  # a replayed step's last record
    assert not chunks_fed(kept, state_skip) & window_chunks  # no update of the poisoned data was kept
    # clip_frac is of the steps the weights came from, not of the ones the rewind left behind.
    clipped = sum(r["gnorm"] > 1.0 for r in kept if r["verdict"] != "rewind")
    assert 0 < clipped < 100 and records[-1]["step"] == 100 and records[-1]["clip_frac"] == clipped / 100
    # A resume from a checkpoint older than the spike must still never read the window's data.
    run_dir_copy = tmp_path.parent / f"{tmp_path.name}-resumed"
    shutil.copytree(tmp_path, run_dir_copy)
    for folder in (run_dir_copy / "checkpoints").glob("step-*"):
        if int(folder.name[5:]) > 65:
            shutil.rmtree(folder)
    assert train(cfg(run_dir_copy, "train.total_steps=110")) == 0
    newly = read_jsonl(run_dir_copy / "metrics.jsonl")[len(records):]
    assert newly and not chunks_fed(newly, state_skip) & window_chunks


def test_same_region_again_lowers_lr_scale(tmp_path):
    assert train(cfg(tmp_path, "faults.poison_batches=[[70,74],[74,90]]")) == 0
    changes = events(tmp_path, "lr_scale")
    assert len(events(tmp_path, "rewind")) == 2 and len(changes) == 1
    assert changes[0]["new"] == pytest.approx(0.7)
    assert read_jsonl(tmp_path / "metrics.jsonl")[-1]["lr_scale"] == pytest.approx(0.7)


def test_endless_poison_escalates_with_exit_3(tmp_path, capsys):
    rc = main([f"run.dir={tmp_path}", *TINY, *SPIKE, "faults.poison_batches=[[70,100000]]",
               "monitor.max_rewinds=2"])
    assert rc == 3 and "escalated" in capsys.readouterr().err
    assert len(events(tmp_path, "rewind")) == 2 and len(events(tmp_path, "escalation")) == 1


def test_nan_loss_rewinds_and_recovers(tmp_path):
    assert train(cfg(tmp_path, "faults.nan_steps=[75]")) == 0
    rewinds = events(tmp_path, "rewind")
    assert len(rewinds) == 1 and rewinds[0]["step"] == 75
    # One step vocabulary: the drill, the rewind event and the refused step's record all say 75.
    refused = [r for r in read_jsonl(tmp_path / "metrics.jsonl") if r.get("verdict") == "rewind"]
    assert [r["step"] for r in refused] == [75] and refused[0]["loss"] == "nan"
    final = [r for r in read_jsonl(tmp_path / "metrics.jsonl") if "loss" in r][-1]
    assert final["step"] == 100 and final["loss"] < 4.0


@pytest.mark.slow
def test_two_ranks_only_rank1_poisoned_act_together(tmp_path):
    # 8 sequences a rank: with 2, a clean step's loss spread so widely that half a batch of noise
    # was an outlier on some steps of the four and not on others (no streak, no rewind).
    proc = run_train(tmp_path, *SPIKE, "train.micro_batch_size=8", "faults.poison_batches=[[70,74]]",
                     "faults.poison_rank=1", nproc=2, timeout_s=400)
    assert proc.returncode == 0
    assert len(events(tmp_path, "rewind")) == 1
    assert events(tmp_path, "end")[0]["step"] == 100


def test_monitor_state_survives_resume_and_forgetting_it_is_seen(tmp_path, monkeypatch):
    """Kill at 67, resume from 65, poison at 70: the restored monitor skips it exactly as the
    uninterrupted run did; a monitor that forgot its history (min_history not reached) lets the
    poisoned update through, so the equality check can fail."""
    from dsslm.recovery import monitor as monitor_module
    from dsslm.recovery.faults import DrillAbort
    from helpers import losses_by_step
    poison = ["faults.poison_batches=[[70,71]]", "monitor.hard_loss_z=1e9", "train.total_steps=76"]
    ref = tmp_path / "ref"
    assert train(cfg(ref, *poison)) == 0
    assert [e["step"] for e in events(ref, "skip")] == [71]
    results = {}
    for name in ("restored", "forgotten"):
        run_dir = tmp_path / name
        with pytest.raises(DrillAbort):
            train(cfg(run_dir, *poison, "faults.crash_at_step=67", "faults.crash_mode=raise"))
        if name == "forgotten":
            monkeypatch.setattr(monitor_module.SpikeMonitor, "load_state_dict", lambda self, state: None)
        assert train(cfg(run_dir, *poison)) == 0
        results[name] = losses_by_step(run_dir)
    assert results["restored"] == losses_by_step(ref)
    assert results["forgotten"][72] != losses_by_step(ref)[72]
