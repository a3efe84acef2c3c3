"""Sharded checkpoints under the real loop (2 gloo ranks in subprocesses): each rank writes its own
shard; a resume at the same world size and engine is bit-exact; a checkpoint moves between world
sizes and engines (2 ranks FSDP -> 1 process DDP, 1 process gathered -> 2 ranks FSDP) within
fp32 rounding (the runs of a test share one global batch: observed ~5e-8 relative,
asserted 1e-5, the engines' stated tolerance in test_engines_train.py).

ZeRO-2 is one test (DeepSpeed's start costs minutes on the shared 2-core box): 2 ranks resume to
the bit, and its checkpoint moves to 3 FSDP ranks and one process, and back from 3 FSDP ranks."""
from __future__ import annotations

import json

import pytest

from helpers import copy_run_back_to, events, losses_by_step, run_train

pytestmark = pytest.mark.slow

COMMON = ("train.total_steps=8", "ckpt.every=4", "ckpt.keep_last=10", "optim.warmup_steps=5")
FSDP2 = ("engine.kind=fsdp", "train.micro_batch_size=2", "train.grad_accum=2")
DDP1 = ("engine.kind=ddp", "train.micro_batch_size=4", "train.grad_accum=2")


def assert_close(got: dict, ref: dict, steps: range, rel: float = 1e-5) -> None:
    worst = max(abs(got[s] - ref[s]) / ref[s] for s in steps)
    assert worst <= rel, f"worst relative loss difference {worst:.2e} > {rel}"


@pytest.fixture(scope="module")
def fsdp_run(tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("sharded") / "fsdp"
    run_train(run_dir, *COMMON, *FSDP2, nproc=2)
    return run_dir


def test_each_rank_writes_its_own_shard_and_state_json_stays_small(fsdp_run):
    folder = fsdp_run / "checkpoints" / "step-00000008"
    names = set(json.loads((folder / "MANIFEST").read_text())["files"])
    assert names == {"index.json", "state.json", "shard-00000-of-00002.safetensors", "shard-00001-of-00002.safetensors",
                     "rank-00000-of-00002.json", "rank-00001-of-00002.json"}
    state = json.loads((folder / "state.json").read_text())
    assert state["rng"] == {"per_rank": 2} and state["world_size"] == 2
    index = json.loads((folder / "index.json").read_text())
    pieces = index["tensors"]["model/tok_emb.weight"]["pieces"]
    assert [p[0] for p in pieces] == ["shard-00000-of-00002.safetensors", "shard-00001-of-00002.safetensors"]
    assert all(e["format"] == "sharded" for e in events(fsdp_run, "save"))


def test_same_world_size_and_engine_resumes_to_the_bit(fsdp_run, tmp_path):
    run_dir = tmp_path / "resumed"
    copy_run_back_to(fsdp_run, run_dir, 4)
    run_train(run_dir, *COMMON, *FSDP2, nproc=2)
    assert events(run_dir, "resume")[-1]["step"] == 4
    assert losses_by_step(run_dir) == losses_by_step(fsdp_run)


def test_two_rank_fsdp_checkpoint_continues_on_one_process_ddp(fsdp_run, tmp_path):
    run_dir = tmp_path / "one"
    run_train(run_dir, *COMMON, *DDP1, f"run.init_from={fsdp_run / 'checkpoints' / 'step-00000004'}")
    assert events(run_dir, "branch")[-1]["step"] == 4
    assert_close(losses_by_step(run_dir), losses_by_step(fsdp_run), range(5, 9))


def test_one_process_gathered_checkpoint_continues_on_two_rank_fsdp(tmp_path):
    ref = tmp_path / "ref"
    run_train(ref, *COMMON, *DDP1)
    folder = ref / "checkpoints" / "step-00000004"
    assert (folder / "model.safetensors").exists()  # one process: gathered by default
    run_dir = tmp_path / "two"
    run_train(run_dir, *COMMON, *FSDP2, f"run.init_from={folder}", nproc=2)
    assert_close(losses_by_step(run_dir), losses_by_step(ref), range(5, 9))
    assert (run_dir / "checkpoints" / "step-00000008" / "index.json").exists()


def test_tools_read_a_sharded_checkpoint_tensor_by_tensor(fsdp_run):
    """export / sample / eval open a sharded folder: the model holds what the shard files hold
    (assembled here independently, from the files' pieces by name)."""
    import torch
    from safetensors.torch import load_file

    from dsslm.ckpt.trained import open_trained

    folder = fsdp_run / "checkpoints" / "step-00000008"
    pieces = {**load_file(folder / "shard-00000-of-00002.safetensors"),
              **load_file(folder / "shard-00001-of-00002.safetensors")}
    trained = open_trained(folder)
    assert trained.step == 8
    for name, param in trained.model.named_parameters():
        parts = sorted((int(k.split("@")[1]), t) for k, t in pieces.items() if k.split("@")[0] == f"model/{name}")
        assert torch.equal(param.detach().reshape(-1), torch.cat([t for _, t in parts])), name


def test_tools_refuse_a_folder_with_a_shard_of_another_save(fsdp_run, tmp_path):
    """Step 4's folder with step 8's rank-1 shard in it, MANIFEST recomputed: a resume refuses it
    (the shard's metadata names another save), and so do the tools now. (Before: export wrote
    step 8's rows under step 4's name.)"""
    import shutil

    from dsslm.ckpt.trained import ToolError, open_trained
    from helpers import remanifest
    folder = tmp_path / "step-00000004"
    shutil.copytree(fsdp_run / "checkpoints" / "step-00000004", folder)
    shutil.copy(fsdp_run / "checkpoints" / "step-00000008" / "shard-00001-of-00002.safetensors", folder)
    remanifest(folder)
    with pytest.raises(ToolError, match="written by another save"):
        open_trained(folder)


def _start(rank: int, world_size: int, run_dir: str) -> tuple[int, str]:
    """One rank of `python -m dsslm.train` on the FSDP run: its exit code and its last stderr line."""
    import contextlib
    import io

    from dsslm.train import main
    from helpers import TINY
    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        rc = main([f"run.dir={run_dir}", *TINY, *COMMON, *FSDP2])
    return rc, (err.getvalue().strip().splitlines() or [""])[-1]


def test_a_two_rank_run_whose_every_checkpoint_is_invalid_is_refused_on_every_rank(fsdp_run, tmp_path):
    """Each checkpoint's index.json made hostile, MANIFEST recomputed: each was passed over cleanly,
    and the start trained from step 0 in the same run.dir. Now every rank exits 5, nothing trained."""
    import shutil

    from helpers import remanifest, run_distributed
    run_dir = tmp_path / "run"
    shutil.copytree(fsdp_run, run_dir)
    folders = sorted((run_dir / "checkpoints").glob("step-*"))
    for folder in folders:
        index = json.loads((folder / "index.json").read_text())
        index["tensors"]["model/tok_emb.weight"]["pieces"][0][3] += 1  # a piece past its tensor's end
        (folder / "index.json").write_text(json.dumps(index))
        remanifest(folder)
    metrics = (run_dir / "metrics.jsonl").read_bytes()
    results = run_distributed(_start, world_size=2, args=(str(run_dir),), timeout_s=300)
    assert [rc for rc, _ in results] == [5, 5], results
    line = results[0][1]
    assert "trained to step 8" in line and all(f.name in line for f in folders[-3:]), line
    assert "trained to step" not in results[1][1]  # rank 0 alone says it
    assert (run_dir / "metrics.jsonl").read_bytes() == metrics and len(events(run_dir, "start")) == 1
    assert sorted((run_dir / "checkpoints").glob("step-*")) == folders  # each kept where it was
    assert {e["checkpoint"] for e in events(run_dir, "passed_over")} == {f.name for f in folders}


# One global batch of 12 sequences on 2, 3 and 1 ranks (grad_accum follows: 2, 2, 3).
ZERO2 = ("engine.kind=zero", "engine.zero_stage=2", "train.micro_batch_size=3", "train.global_batch_size=12")
FSDP3 = ("engine.kind=fsdp", "train.micro_batch_size=2", "train.global_batch_size=12")
FSDP1 = ("engine.kind=fsdp", "train.micro_batch_size=4", "train.global_batch_size=12")


def test_zero2_shards_resume_to_the_bit_and_move_to_three_fsdp_ranks_and_back(tmp_path):
    """ZeRO's flat partitions cut through rows: its pieces are element spans, read back by
    fragment at the same world size (bit-exact), by uneven rows on 3 FSDP ranks (32 rows do not
    split in 3) and on one process; a 3-rank FSDP checkpoint continues on 2 ZeRO-2 ranks."""
    ref = tmp_path / "zero2"
    run_train(ref, *COMMON, *ZERO2, nproc=2, timeout_s=1500)  # DeepSpeed's start alone took ~10 min here
    resumed = tmp_path / "resumed"
    copy_run_back_to(ref, resumed, 4)
    run_train(resumed, *COMMON, *ZERO2, nproc=2, timeout_s=1500)
    assert events(resumed, "resume")[-1]["step"] == 4
    assert losses_by_step(resumed) == losses_by_step(ref)
    one = tmp_path / "fsdp1"
    run_train(one, *COMMON, *FSDP1, f"run.init_from={ref / 'checkpoints' / 'step-00000004'}")
    assert_close(losses_by_step(one), losses_by_step(ref), range(5, 9))
    three = tmp_path / "fsdp3"
    run_train(three, *COMMON, *FSDP3, "ckpt.every=2", f"run.init_from={ref / 'checkpoints' / 'step-00000004'}",
              nproc=3, timeout_s=1500)
    assert_close(losses_by_step(three), losses_by_step(ref), range(5, 9))
    assert json.loads((three / "checkpoints" / "step-00000006" / "state.json").read_text())["world_size"] == 3
    back = tmp_path / "back"
    run_train(back, *COMMON, *ZERO2, f"run.init_from={three / 'checkpoints' / 'step-00000006'}", nproc=2,
              timeout_s=1500)
    assert_close(losses_by_step(back), losses_by_step(ref), range(7, 9))
