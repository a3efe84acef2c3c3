"""What only a CUDA device can check: fused AdamW chosen and resuming to the bit, TF32 on, bf16
compiled training under each engine, the padded head. Skipped without a GPU (none in CI)."""
import pytest
import torch

from helpers import events, losses_by_step, read_jsonl, run_train

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]

GPU_ENV = {"DS_ACCELERATOR": "cuda"}
CUDA = ("train.device=cuda", "train.precision=bf16", "train.total_steps=20", "ckpt.every=10")


def test_auto_is_fused_adamw_and_tf32_on_cuda(tmp_path):
    from dsslm.config import load
    from dsslm.engine import build_engine
    from dsslm.model import build_model
    cfg = load(None, ["train.device=cuda", "model.vocab_size=257"])
    engine = build_engine(cfg, build_model(cfg.model))
    assert engine.optim_impl == "fused" and engine.optimizer.defaults["fused"]
    assert torch.get_float32_matmul_precision() == "high"
    engine.close()


@pytest.mark.parametrize("recipe", [(), ("optim.name=muon", "model.document_mask=true", "model.document_positions=true")],
                         ids=["adamw", "muon-document-mask"])
def test_bf16_compiled_run_resumes_to_the_bit_on_cuda(tmp_path, recipe):
    """Fused AdamW (optim.impl=auto on CUDA); with Muon and FlexAttention's document mask too.

    The job killed at step 15 recorded steps 11-15 after its checkpoint at 10; the resumed job
    trains them again. Step 11 is a forward pass from the restored state and must give the loss
    recorded to the bit: that is the resume. Later steps may differ in the last bits: compiled
    backward kernels add with atomics (the tied embedding's gradient is an index_put with
    accumulate), so two processes' updates are not bitwise equal even without a resume. They are
    held to 1e-3, which a resume that lost a piece of state (a moment, the step count, the data
    position) does not meet; the resume audit must not call it a mismatch."""
    import math

    killed = tmp_path / "killed"
    # A synchronous save: the kill at 15 must find step 10's checkpoint written.
    run = (*CUDA, "train.compile=true", "ckpt.async_save=false", *recipe)
    run_train(killed, *run, "faults.crash_at_step=15", check=False, env=GPU_ENV)
    first_job = read_jsonl(killed / "metrics.jsonl")
    recorded = {r["step"]: r["loss"] for r in first_job if "loss" in r}
    assert max(recorded) == 15
    run_train(killed, *run, env=GPU_ENV)
    assert events(killed, "resume")[0]["step"] == 10
    again = {r["step"]: r["loss"] for r in read_jsonl(killed / "metrics.jsonl")[len(first_job):] if "loss" in r}
    assert again[11] == recorded[11]
    assert all(math.isclose(again[s], recorded[s], rel_tol=1e-3) for s in range(12, 16))
    (audit,) = events(killed, "resume_audit")
    assert audit["verdict"] in ("exact", "within_tolerance"), audit


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")
@pytest.mark.parametrize("engine", [("engine.kind=ddp",), ("engine.kind=fsdp",),
                                    ("engine.kind=zero", "engine.zero_stage=1"),
                                    ("engine.kind=zero", "engine.zero_stage=3")])
def test_compiled_bf16_engines_train_on_two_gpus(tmp_path, engine):
    run_train(tmp_path, *CUDA, "train.compile=true", "train.activation_checkpointing=full", *engine, nproc=2,
              env=GPU_ENV)
    losses = losses_by_step(tmp_path)
    assert losses[20] < losses[1]
    assert any("mfu" in r for r in read_jsonl(tmp_path / "metrics.jsonl"))


@pytest.mark.parametrize("kind,gpus", [("ddp", 1), ("fsdp", 1), ("ddp", 2), ("fsdp", 2)],
                         ids=["ddp-1", "fsdp-1", "ddp-2", "fsdp-2"])
def test_a_rewind_point_restores_the_state_it_took_on_cuda(kind, gpus):
    """The rewind point taken from each rank's own part of the state, on CUDA (device-to-host
    copies, and on 2 GPUs a DDP replica's tensors summed over NCCL as int bit patterns): the
    restored state is the point's to the bit. The steps after it are compared within 1e-3
    (CUDA kernels need not repeat bitwise), which a restore of the wrong state would not meet."""
    import math

    from helpers import run_distributed
    from test_engines import rewind_point_worker
    if torch.cuda.device_count() < gpus:
        pytest.skip("needs 2 GPUs")
    for result in run_distributed(rewind_point_worker, gpus, (kind, 1, ("train.device=cuda",))):
        assert result["restored"]
        assert all(math.isclose(a[0], b[0], rel_tol=1e-3) for a, b in zip(result["again"], result["first"]))
        assert result["largest_sent"] <= 1
