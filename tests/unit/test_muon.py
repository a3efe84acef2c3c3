"""optim.name=muon: the groups, and the update torch.optim.Muon + AdamW make, to the bit."""
import pytest
import torch

from dsslm.config import ConfigError, load
from dsslm.model import build_model
from dsslm.optim import build_optimizer, muon_groups, set_lr


def cfg_with(*overrides):
    cfg = load(None, ["model.vocab_size=64", "model.d_model=32", "model.n_layers=2", "model.n_heads=4",
                      "model.seq_len=16", "optim.name=muon", *overrides])
    return cfg


@pytest.mark.parametrize("tied", [True, False])
def test_muon_takes_the_hidden_matrices_and_adamw_the_rest(tied):
    cfg = cfg_with(f"model.tie_embeddings={str(tied).lower()}")
    model = build_model(cfg.model)
    groups = muon_groups(model, cfg.optim)
    muon, *adamw = groups
    assert muon["muon"] and sorted(muon["names"]) == sorted(
        n for n, p in model.named_parameters() if p.dim() == 2 and n.startswith("blocks."))
    adamw_names = [n for g in adamw for n in g["names"]]
    assert "tok_emb.weight" in adamw_names and ("lm_head.weight" in adamw_names) == (not tied)
    assert all(p.dim() == 1 for g in adamw for n, p in zip(g["names"], g["params"]) if "norm" in n)
    assert muon["lr_ratio"] == cfg.optim.muon_lr / cfg.optim.peak_lr


def test_one_step_is_torch_muon_on_the_matrices_and_torch_adamw_on_the_rest_to_the_bit():
    cfg = cfg_with("optim.impl=single", "optim.muon_ns_dtype=bfloat16")  # torch's NS runs in bf16
    torch.manual_seed(0)
    model = build_model(cfg.model)
    twin = build_model(cfg.model)
    twin.load_state_dict(model.state_dict())
    ours = build_optimizer(model, cfg.optim, torch.device("cpu"))
    groups = muon_groups(twin, cfg.optim)
    theirs_muon = torch.optim.Muon(groups[0]["params"], lr=cfg.optim.muon_lr, weight_decay=cfg.optim.weight_decay,
                                   momentum=cfg.optim.muon_momentum, nesterov=True)
    theirs_adamw = torch.optim.AdamW([{"params": g["params"], "weight_decay": g["weight_decay"]} for g in groups[1:]],
                                     lr=cfg.optim.peak_lr, betas=(cfg.optim.beta1, cfg.optim.beta2),
                                     eps=cfg.optim.eps, foreach=False)
    idx = torch.randint(0, 64, (2, 16))
    for step in range(3):
        for m in (model, twin):
            m(idx).logsumexp(-1).mean().backward()
        lr = cfg.optim.peak_lr * (step + 1) / 3
        set_lr(ours, lr)
        ours.step()
        ours.zero_grad()
        for g in theirs_muon.param_groups:
            g["lr"] = lr * cfg.optim.muon_lr / cfg.optim.peak_lr
        for g in theirs_adamw.param_groups:
            g["lr"] = lr
        theirs_muon.step()
        theirs_adamw.step()
        twin.zero_grad()
    for (name, a), b in zip(model.state_dict().items(), twin.state_dict().values()):
        assert torch.equal(a, b), name
    assert set(ours.orthogonalised.values()) == {3} and len(ours.orthogonalised) == len(groups[0]["params"])


def test_newton_schulz_in_fp32_is_bf16s_orthogonalisation_without_its_rounding():
    """auto is fp32 on CPU (bf16 matmuls there are 14-40x slower): the same map, closer to an
    orthogonal factor: singular values in NS's band [0.5, 1.5] either way, fp32 within bf16's
    rounding of bf16's result."""
    from dsslm.optim import ns_dtype, orthogonalise
    assert ns_dtype("auto", torch.device("cpu")) == torch.float32
    assert ns_dtype("auto", torch.device("cuda", 0)) == torch.bfloat16
    torch.manual_seed(0)
    for shape in ((64, 16), (16, 64), (48, 48)):
        g = torch.randn(shape)
        fp32, bf16 = orthogonalise(g, torch.float32), orthogonalise(g, torch.bfloat16)
        assert fp32.dtype == torch.float32 and bf16.dtype == torch.bfloat16 and fp32.shape == shape
        for out in (fp32, bf16.float()):
            s = torch.linalg.svdvals(out)
            assert 0.5 < s.min() and s.max() < 1.5, (shape, s)
        assert (fp32 - bf16.float()).abs().max() < 0.05, shape  # bf16 keeps 8 bits: ~0.4% of ~1
        assert not torch.equal(fp32, bf16.float())


def test_muon_settings_are_checked():
    with pytest.raises(ConfigError, match="optim.name"):
        cfg_with("optim.name=sgd")
    with pytest.raises(ConfigError, match="optim.muon_lr"):
        cfg_with("optim.muon_lr=0")
    with pytest.raises(ConfigError, match="optim.muon_ns_dtype"):
        cfg_with("optim.muon_ns_dtype=fp16")


def test_shared_work_is_spread_over_the_ranks_across_buckets(monkeypatch):
    """Sharing assigns a step's matrices to ranks by the load of the whole step, not bucket by bucket:
    with one matrix per bucket (a large model's matrices each fill a bucket), every bucket's first
    pick was rank 0, which then orthogonalised everything while the other ranks waited for it."""
    import dsslm.optim as optim
    monkeypatch.setattr(optim, "WHOLE_BUCKET_ELEMENTS", 1)  # every matrix its own bucket
    cfg = cfg_with("optim.muon_ns_dtype=float32")
    torch.manual_seed(0)
    model = build_model(cfg.model)
    idx = torch.randint(0, 64, (2, 16))
    model(idx).logsumexp(-1).mean().backward()
    held = []
    for rank in range(2):
        ours = build_optimizer(model, cfg.optim, torch.device("cpu"))
        # A one-process stand-in for the all-gather: every rank's share sized like this one's.
        ours.share = (rank, 2, lambda send: [send.clone(), send.clone()])
        ours.step()
        held.append(set(ours.orthogonalised))
    matrices = sorted(n for n, p in model.named_parameters() if p.dim() == 2 and n.startswith("blocks."))
    assert sorted(held[0] | held[1]) == matrices and not held[0] & held[1]
    # Largest first to the least-loaded rank: two layers' equal matrices go one to each rank.
    assert len(held[0]) == len(held[1]) == len(matrices) // 2, held
