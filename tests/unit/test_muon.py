"""optim.name=muon: the groups, the update torch.optim.Muon makes on each projection as its own
parameter, AdamW's decay per step, and the work shared over ranks."""
from pathlib import Path

import pytest
import torch

from dsslm.config import ConfigError, load
from dsslm.model import build_model
from dsslm.muon import Ranks, block_names, ns_dtype, orthogonalise, orthogonalise_blocks
from dsslm.optim import build_optimizer, muon_groups, set_lr
from helpers import LLAMA_GPT2_INIT


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
    blocks = dict(zip(muon["names"], muon["blocks"]))
    assert blocks["blocks.0.attn.qkv.weight"] == ("q", "k", "v") and blocks["blocks.1.mlp.gate_up.weight"] == ("gate", "up")
    assert blocks["blocks.0.attn.proj.weight"] == () and blocks["blocks.0.mlp.down.weight"] == ()
    fused = muon_groups(build_model(cfg.model), cfg_with("optim.muon_split=false").optim)[0]
    assert set(fused["blocks"]) == {()}


def test_each_projection_steps_as_torch_muon_on_its_own_parameter():
    """The reference no Muon-against-itself comparison can fake: torch.optim.Muon on Q, K, V,
    gate and up as separate parameters (and on the unstacked matrices), at the documented rate
    (muon_lr / peak_lr of the plan), decay (weight_decay x peak_lr / muon_lr), Nesterov momentum
    and torch's shape scaling of each block; torch AdamW on the rest.
    Both fed the same gradients for 3 steps. NS in bf16, torch's dtype; to 1e-6."""
    cfg = cfg_with("optim.impl=single", "optim.muon_ns_dtype=bfloat16")
    o = cfg.optim
    torch.manual_seed(0)
    model = build_model(cfg.model)
    ours = build_optimizer(model, cfg.optim, torch.device("cpu"))
    muon, *rest = muon_groups(model, cfg.optim)
    pieces = {}  # reference name -> (parameter name, rows) of its block
    for name, p, labels in zip(muon["names"], muon["params"], muon["blocks"]):
        rows = p.shape[0] // max(1, len(labels))
        for i, label in enumerate(block_names(name, labels)):
            pieces[label] = (name, slice(i * rows, (i + 1) * rows))
    params = dict(model.named_parameters())
    ref = {label: params[name][rows].detach().clone().requires_grad_() for label, (name, rows) in pieces.items()}
    ref_rest = {n: params[n].detach().clone().requires_grad_() for g in rest for n in g["names"]}
    assert len(ref) == 2 * 7  # per layer: q, k, v, proj, gate, up, down
    theirs_muon = torch.optim.Muon(list(ref.values()), lr=cfg.optim.muon_lr, weight_decay=o.weight_decay * o.peak_lr / o.muon_lr,
                                   momentum=cfg.optim.muon_momentum, nesterov=True)
    theirs_adamw = torch.optim.AdamW([{"params": [ref_rest[n] for n in g["names"]], "weight_decay": g["weight_decay"]}
                                      for g in rest], lr=cfg.optim.peak_lr, betas=(cfg.optim.beta1, cfg.optim.beta2),
                                     eps=cfg.optim.eps, foreach=False)
    idx = torch.randint(0, 64, (2, 16))
    for step in range(3):
        model.zero_grad()
        model(idx).logsumexp(-1).mean().backward()
        for label, (name, rows) in pieces.items():
            ref[label].grad = params[name].grad[rows].clone()
        for n, t in ref_rest.items():
            t.grad = params[n].grad.clone()
        lr = cfg.optim.peak_lr * (step + 1) / 3
        set_lr(ours, lr)
        ours.step()
        for g in theirs_muon.param_groups:
            g["lr"] = lr * cfg.optim.muon_lr / cfg.optim.peak_lr
        for g in theirs_adamw.param_groups:
            g["lr"] = lr
        theirs_muon.step()
        theirs_adamw.step()
    for label, (name, rows) in pieces.items():
        assert (params[name][rows] - ref[label]).abs().max() <= 1e-6, label
    for n, t in ref_rest.items():
        assert torch.equal(params[n], t), n
    assert set(ours.orthogonalised.values()) == {3} and sorted(ours.orthogonalised) == sorted(ref)


def test_muon_decays_the_hidden_matrices_as_much_per_step_as_adamw_decays_its_own():
    """With no gradient, a step is the decay alone: Muon's matrices and AdamW's untied head must
    shrink by the same factor (optim.weight_decay multiplied by muon_lr would shrink them 20x
    more); optim.muon_weight_decay, when set, is Muon's coefficient as torch's Muon takes it."""
    for overrides, wd in (((), None), (("optim.muon_weight_decay=0.5",), 0.5)):
        cfg = cfg_with("model.tie_embeddings=false", *overrides)
        factor = None if wd is None else 1 - 1e-3 * cfg.optim.muon_lr / cfg.optim.peak_lr * wd
        model = build_model(cfg.model)
        ours = build_optimizer(model, cfg.optim, torch.device("cpu"))
        before = {n: p.detach().clone() for n, p in model.named_parameters()}
        for p in model.parameters():
            p.grad = torch.zeros_like(p)
        set_lr(ours, 1e-3)
        ours.step()
        head = model.lm_head.weight / before["lm_head.weight"]
        qkv = model.blocks[0].attn.qkv.weight / before["blocks.0.attn.qkv.weight"]
        want = head.mean() if factor is None else torch.tensor(factor)
        assert torch.allclose(qkv, want.expand_as(qkv), rtol=0, atol=1e-6), (qkv.mean(), want)
        assert abs(head.mean() - (1 - 1e-3 * cfg.optim.weight_decay)) < 1e-6


def test_after_one_step_q_k_and_v_move_alike():
    """After one Muon step from initialisation on real text, Q's, K's and V's updates have
    spectral norms within 2x of each other's. Orthogonalising qkv whole (optim.muon_split=false,
    before issue 41) lets V's larger gradient take the spectrum: Q and K move far less."""
    text = torch.tensor(list(Path(__file__).read_bytes()[:4096]), dtype=torch.long)
    ratios = {}
    for split in ("true", "false"):
        cfg = load(None, ["model.vocab_size=256", "model.d_model=64", "model.n_layers=2", "model.n_heads=4",
                          "model.seq_len=64", *LLAMA_GPT2_INIT,  # as measured
                          "optim.name=muon", "optim.muon_ns_dtype=float32",
                          "optim.muon_weight_decay=0", f"optim.muon_split={split}"])
        torch.manual_seed(0)
        model = build_model(cfg.model)
        ours = build_optimizer(model, cfg.optim, torch.device("cpu"))
        before = model.blocks[0].attn.qkv.weight.detach().clone()
        idx = text[:8 * 65].view(8, 65)
        logits = model(idx[:, :-1])
        torch.nn.functional.cross_entropy(logits.flatten(0, 1), idx[:, 1:].flatten()).backward()
        set_lr(ours, cfg.optim.peak_lr)
        ours.step()
        moved = (model.blocks[0].attn.qkv.weight.detach() - before).chunk(3)
        norms = [float(torch.linalg.matrix_norm(m, ord=2)) for m in moved]
        ratios[split] = max(norms) / min(norms)
    assert ratios["true"] < 2, ratios
    assert ratios["false"] > 2, ratios  # the test tells the two apart


def test_newton_schulz_in_fp32_is_bf16s_orthogonalisation_without_its_rounding():
    """auto is fp32 on CPU (bf16 matmuls there are 14-40x slower): the same map, closer to an
    orthogonal factor: singular values in NS's band [0.5, 1.5] either way, fp32 within bf16's
    rounding of bf16's result."""
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


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_the_batched_newton_schulz_is_each_block_alone(dtype):
    """One batched NS over a stack's blocks gives each block the bits NS gives it alone (this CPU's
    kernels), tall blocks (gate and up) and square ones (q, k, v)."""
    torch.manual_seed(0)
    for blocks, rows, cols in ((3, 32, 32), (2, 86, 32)):
        full = torch.randn(blocks * rows, cols)
        together = orthogonalise_blocks(full, blocks, dtype)
        alone = torch.cat([orthogonalise(b, dtype) for b in full.chunk(blocks)])
        assert together.shape == full.shape and torch.equal(together, alone)


def test_muon_settings_are_checked():
    with pytest.raises(ConfigError, match="optim.name"):
        cfg_with("optim.name=sgd")
    with pytest.raises(ConfigError, match="optim.muon_lr"):
        cfg_with("optim.muon_lr=0")
    with pytest.raises(ConfigError, match="optim.muon_ns_dtype"):
        cfg_with("optim.muon_ns_dtype=fp16")
    with pytest.raises(ConfigError, match="optim.muon_weight_decay"):
        cfg_with("optim.muon_weight_decay=-0.1")


def test_shared_work_is_spread_over_the_ranks_across_buckets(monkeypatch):
    """Sharing assigns a step's matrices to ranks by the load of the whole step, not bucket by bucket:
    with one matrix per bucket (a large model's matrices each fill a bucket), every bucket's first
    pick was rank 0, which then orthogonalised everything while the other ranks waited for it."""
    import dsslm.muon as muon
    monkeypatch.setattr(muon, "WHOLE_BUCKET_ELEMENTS", 1)  # every matrix its own bucket
    cfg = cfg_with("optim.muon_ns_dtype=float32")
    torch.manual_seed(0)
    model = build_model(cfg.model)
    idx = torch.randint(0, 64, (2, 16))
    model(idx).logsumexp(-1).mean().backward()
    held = []
    for rank in range(2):
        ours = build_optimizer(model, cfg.optim, torch.device("cpu"))
        # A one-process stand-in for the all-gather: every rank's share sized like this one's.
        ours.ranks = Ranks(rank, 2, lambda send: [send.clone(), send.clone()], None)
        ours.step()
        held.append({n.split("[")[0] for n in ours.orthogonalised})
    matrices = sorted(n for n, p in model.named_parameters() if p.dim() == 2 and n.startswith("blocks."))
    assert sorted(held[0] | held[1]) == matrices and not held[0] & held[1]
    # Largest first to the least-loaded rank: two layers' equal matrices go one to each rank.
    assert len(held[0]) == len(held[1]) == len(matrices) // 2, held
