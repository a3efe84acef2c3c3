import pytest
import torch

from dsslm.config import load
from dsslm.engine.ddp import DDPEngine
from dsslm.loss import IGNORE_INDEX, accumulate, token_losses
from dsslm.model import build_model


def test_z_loss_against_hand_computation():
    logits = torch.tensor([[[1.0, 2.0, 3.0], [0.0, 0.0, 0.0]]])
    targets = torch.tensor([[2, IGNORE_INDEX]])
    ce, z = token_losses(logits, targets)
    lse = torch.log(torch.exp(torch.tensor([1.0, 2.0, 3.0])).sum())
    assert torch.allclose(ce, lse - 3.0)
    assert torch.allclose(z, lse ** 2)  # the ignored position counts in neither


def make_engine(seed=0):
    cfg = load(None, ["model.vocab_size=40", "model.d_model=32", "model.n_layers=2", "model.n_heads=2",
                      "model.seq_len=16", "train.z_loss=1e-4"])
    torch.manual_seed(seed)
    return DDPEngine(cfg, build_model(cfg.model)), cfg


def grads(engine):
    return {n: p.grad.clone() for n, p in engine.params.items()}


def test_token_weighted_accumulation_equals_one_big_batch():
    gen = torch.Generator().manual_seed(1)
    inputs = torch.randint(0, 40, (8, 16), generator=gen)
    targets = torch.randint(0, 40, (8, 16), generator=gen)
    # Padding: micro-batches end up with very different numbers of real targets.
    targets[0:2, 3:] = IGNORE_INDEX
    targets[2:4, 12:] = IGNORE_INDEX
    targets[6, :] = IGNORE_INDEX
    one, cfg = make_engine()
    real = int((targets != IGNORE_INDEX).sum())
    whole = accumulate(one, [(inputs, targets)], "fp32", cfg.train.z_loss, clip=1e9, tokens_global=real)
    many, _ = make_engine()
    split = [(inputs[i:i + 2], targets[i:i + 2]) for i in range(0, 8, 2)]
    parts = accumulate(many, split, "fp32", cfg.train.z_loss, clip=1e9, tokens_global=real)
    assert whole.batch_tokens == parts.batch_tokens == int((targets != IGNORE_INDEX).sum())
    assert abs(whole.loss - parts.loss) < 1e-6
    for name, g in grads(one).items():
        assert torch.allclose(g, grads(many)[name], atol=1e-6, rtol=1e-6), name
    # A mean of per-micro-batch means would weight short micro-batches more: it differs.
    with torch.no_grad():
        mean_of_means = sum(float(token_losses(one.forward(x), y)[0]) / int((y != IGNORE_INDEX).sum())
                            for x, y in split) / 4
    assert abs(mean_of_means - whole.loss) > 1e-3


def test_clip_returns_pre_clip_norm_and_clips():
    engine, cfg = make_engine()
    gen = torch.Generator().manual_seed(2)
    batch = (torch.randint(0, 40, (4, 16), generator=gen), torch.randint(0, 40, (4, 16), generator=gen))
    result = accumulate(engine, [batch], "fp32", 0.0, clip=1e-3, tokens_global=4 * 16)
    post = torch.sqrt(sum((p.grad ** 2).sum() for p in engine.params.values()))
    assert result.gnorm > 1e-3 and abs(float(post) - 1e-3) < 1e-6


def test_one_host_read_per_step_whatever_the_micro_batches(monkeypatch):
    """Every host read of a tensor (.item(), .tolist(), float(), int(), bool()) is a GPU sync; a
    step makes exactly one, for its loss, norm, stop flag and token count together."""
    engine, cfg = make_engine()
    gen = torch.Generator().manual_seed(4)
    batches = [(torch.randint(0, 40, (2, 16), generator=gen), torch.randint(0, 40, (2, 16), generator=gen))
               for _ in range(4)]
    reads = []
    for name in ("item", "tolist", "__float__", "__int__", "__bool__", "__index__"):
        original = getattr(torch.Tensor, name)
        monkeypatch.setattr(torch.Tensor, name, lambda self, *a, _f=original, _n=name: reads.append(_n) or _f(self, *a))
    result = accumulate(engine, batches, "fp32", cfg.train.z_loss, clip=1.0, tokens_global=4 * 2 * 16)
    monkeypatch.undo()
    assert reads == ["tolist"], reads
    assert result.batch_tokens == 128 and result.gnorm > 0 and result.loss > 0


def test_a_wrong_token_count_fails_the_step_before_the_update():
    engine, cfg = make_engine()
    inputs = torch.randint(0, 40, (2, 16))
    targets = inputs.clone()
    targets[0, :4] = IGNORE_INDEX  # 28 real targets, not the 32 a full batch would have
    before = {n: p.detach().clone() for n, p in engine.params.items()}
    with pytest.raises(RuntimeError, match="tokens_global=32 .* hold 28"):
        accumulate(engine, [(inputs, targets)], "fp32", cfg.train.z_loss, clip=1.0, tokens_global=32)
    assert all(torch.equal(before[n], p) for n, p in engine.params.items())
    with pytest.raises(ValueError, match="tokens_global=0"):
        accumulate(engine, [(inputs, targets)], "fp32", cfg.train.z_loss, clip=1.0, tokens_global=0)
