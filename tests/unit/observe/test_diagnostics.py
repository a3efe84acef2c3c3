"""Each diagnostic against a hand computation on a tiny model, and a 2-domain run's metrics."""
from __future__ import annotations

import importlib.machinery
import math
import sys
import types
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F

from dsslm.ckpt.store import CheckpointStore
from dsslm.config import ConfigError, ObserveCfg, load
from dsslm.data import prepare
from dsslm.observe.diagnostics import (Diagnostics, attention_score_probe, flops_per_token, model_flops_utilization,
                               peak_flops_of, update_stats)
from dsslm.engine import build_engine
from dsslm.data.loader import Loader
from dsslm.observe.sinks import Sinks
from dsslm.model import build_model
from dsslm.train import train
from helpers import TINY, read_jsonl, run_train, tiny_cfg

STEPS, EVERY, VAL_EVERY, CLIP = 12, 4, 6, 1.5


def corpus(out: Path) -> Path:
    """Two domains: English prose (pydoc's topic help) and Python source (textwrap.py)."""
    import pydoc_data.topics
    import textwrap
    src = out.parent / "src"
    src.mkdir(exist_ok=True)
    (src / "prose.txt").write_text("\n\n".join(pydoc_data.topics.topics.values())[:24_000])
    (src / "code.txt").write_text(Path(textwrap.__file__).read_text()[:24_000])
    prepare([src / "prose.txt"], out, domain="prose", tokenizer="byte", val_fraction=0.1)
    prepare([src / "code.txt"], out, domain="code", val_fraction=0.1)
    return out


def run_cfg(run_dir: Path, data_dir: Path, *overrides: str):
    return tiny_cfg(run_dir, f"data.dir={data_dir}", f"train.total_steps={STEPS}", f"ckpt.every={STEPS}",
                    "ckpt.async_save=false", *overrides)


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory) -> Path:
    return corpus(tmp_path_factory.mktemp("corpus") / "data")


@pytest.fixture(scope="module")
def observed_run(tmp_path_factory, data_dir) -> Path:
    run_dir = tmp_path_factory.mktemp("observed")
    cfg = run_cfg(run_dir, data_dir, f"observe.every={EVERY}", f"run.val_every={VAL_EVERY}",
                  "run.val_batches=2", f"optim.clip={CLIP}")
    assert train(cfg) == 0
    return run_dir


def step_records(run_dir: Path) -> list[dict]:
    return [r for r in read_jsonl(run_dir / "metrics.jsonl") if "loss" in r]


def tiny_job(data_dir: Path, *overrides: str) -> SimpleNamespace:
    """What Diagnostics reads from a Job: a one-process DDP engine, the loader, silent sinks."""
    cfg = load(None, [*TINY, f"data.dir={data_dir}", f"observe.every={EVERY}", *overrides])
    cfg.model.vocab_size = 257
    torch.manual_seed(0)
    engine = build_engine(cfg, build_model(cfg.model))
    loader = Loader(data_dir, cfg.model.seq_len, cfg.run.seed)
    sinks = SimpleNamespace(emit=lambda event, **fields: None)
    return SimpleNamespace(cfg=cfg, engine=engine, loader=loader, sinks=sinks)


# --- MFU -----------------------------------------------------------------------------------------
def test_peak_table_and_mfu_by_hand(data_dir, monkeypatch):
    assert peak_flops_of("NVIDIA H100 80GB HBM3") == 989e12
    assert peak_flops_of("NVIDIA H200") == 989e12
    assert peak_flops_of("NVIDIA H100 PCIe") == 756e12
    assert peak_flops_of("NVIDIA A100-SXM4-80GB") == 312e12
    assert peak_flops_of("NVIDIA A10G") is None  # not the A10's figure: the A10G is a different part
    assert peak_flops_of("Tesla V100-SXM2-32GB") is None  # no bf16 tensor cores
    # 6 * 1000 + 12 * 2 layers * 32 d_model * 16 positions
    assert flops_per_token(1000, 2, 32, 16) == 6000 + 12288
    assert model_flops_utilization(18288, 1e6, 989e12, 2) == pytest.approx(18288e6 / 1978e12)

    monkeypatch.setattr("dsslm.observe.diagnostics.peak_flops", lambda device: 1e12)
    job = tiny_job(data_dir, "observe.every=0")
    record = {"step": 1, "loss": 5.0, "gnorm": 1.0, "tokens_per_s": 2000.0, "verdict": "ok"}
    n, m = job.engine.n_params, job.cfg.model
    expected = (6 * n + 12 * m.n_layers * m.d_model * m.seq_len) * 2000.0 / 1e12
    observed = Diagnostics(job.cfg, job.engine, job.sinks, job.loader).observe(record, None)
    assert observed["mfu"] == pytest.approx(expected, rel=1e-12)


# --- norms and the update ratio --------------------------------------------------------------------
HAND_GROUPS = {  # the model's parameter names, grouped by hand (2 layers, untied head)
    "embeddings": ["tok_emb.weight"],
    "attention": [f"blocks.{i}.attn.{w}.weight" for i in range(2) for w in ("qkv", "proj")],
    "mlp": [f"blocks.{i}.mlp.{w}.weight" for i in range(2) for w in ("gate_up", "down")],
    "norms": [f"blocks.{i}.{w}.weight" for i in range(2) for w in ("attn_norm", "mlp_norm")] + ["norm.weight"],
    "head": ["lm_head.weight"],
}


def test_param_norm_per_group_by_hand(data_dir):
    job = tiny_job(data_dir, "model.tie_embeddings=false")
    sd, _ = job.engine.full_state()
    assert sorted(n for names in HAND_GROUPS.values() for n in names) == sorted(sd)
    got = update_stats(sd, sd)
    # Every norm gain starts at 1: the group's norm is sqrt(its element count) = sqrt(5 * 32).
    assert got["param_norm"]["norms"] == pytest.approx(math.sqrt(5 * 32), rel=1e-12)
    for group, names in HAND_GROUPS.items():
        hand = math.sqrt(sum(float((sd[n].double() ** 2).sum()) for n in names))
        assert got["param_norm"][group] == pytest.approx(hand, rel=1e-9), group
        assert got["update_norm"][group] == 0.0
    tied, _ = tiny_job(data_dir).engine.full_state()
    assert "head" not in update_stats(tied, tied)["param_norm"]  # a tied head is the embedding


def test_update_ratio_matches_a_hand_adamw_step(data_dir):
    job = tiny_job(data_dir, "model.tie_embeddings=false", "optim.weight_decay=0.1")
    engine, opt = job.engine, job.cfg.optim
    diag = Diagnostics(job.cfg, job.engine, job.sinks, job.loader)
    before = diag.snapshot(EVERY - 1)  # the step that makes step EVERY is measured
    assert diag.snapshot(EVERY) is None
    torch.manual_seed(1)
    grads = {n: torch.randn_like(p) for n, p in engine.module.named_parameters()}
    for name, p in engine.module.named_parameters():
        p.grad = grads[name].clone()
    lr = 0.01
    engine.step(lr)
    record = diag.observe({"step": EVERY, "loss": 5.0, "gnorm": 1.0, "tokens_per_s": 1.0, "verdict": "ok"}, before)

    # AdamW's first step, by hand: m_hat = g, v_hat = g^2, so theta' = theta (1 - lr wd) - lr g / (|g| + eps).
    # Matrices decay; norm gains and the embedding do not (optim.decay_embeddings=false).
    decays = {n: n != "tok_emb.weight" and before[n].dim() >= 2 for n in before}
    after = {n: before[n] * (1 - lr * opt.weight_decay * decays[n])
             - lr * grads[n] / (grads[n].abs() + opt.eps)
             for n in before}
    live = dict(engine.module.named_parameters())
    for name in before:
        torch.testing.assert_close(live[name].detach(), after[name], rtol=0, atol=1e-6)
    for group, names in HAND_GROUPS.items():
        param = math.sqrt(sum(float((before[n].double() ** 2).sum()) for n in names))
        update = math.sqrt(sum(float(((after[n] - before[n]).double() ** 2).sum()) for n in names))
        assert record["param_norm"][group] == pytest.approx(param, rel=1e-9), group
        assert record["update_norm"][group] == pytest.approx(update, rel=1e-4), group
        assert record["update_ratio"][group] == pytest.approx(update / param, rel=1e-4), group
    # ~lr per element with |g| >> eps, so the update norm is close to lr * sqrt(numel)
    assert record["update_norm"]["norms"] == pytest.approx(lr * math.sqrt(5 * 32), rel=1e-3)


# --- attention and output logits -------------------------------------------------------------------
def explicit_max_scores(model, idx: torch.Tensor) -> tuple[list[float], list[float]]:
    """Per layer: the max of q.k/sqrt(d) over causal positions, and over all positions, computed
    with RoPE as complex rotations and RMSNorm written out."""
    cfg = model.cfg
    heads, dim = cfg.n_heads, cfg.d_model // cfg.n_heads
    seq = idx.shape[1]
    freqs = cfg.rope_theta ** (-torch.arange(0, dim, 2, dtype=torch.float64) / dim)
    rot = torch.polar(torch.ones(seq, dim // 2, dtype=torch.float64), torch.arange(seq)[:, None] * freqs)

    def rope(x):  # pairs (x[2j], x[2j+1]) as x[2j] + i x[2j+1], times e^{i pos freq_j}
        z = torch.view_as_complex(x.double().reshape(*x.shape[:-1], dim // 2, 2).contiguous()) * rot
        return torch.view_as_real(z).flatten(-2)

    def rms(x, w, eps=1e-6):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w

    causal, full = [], []
    x = model.tok_emb(idx)
    rope_table = model.rope[:seq]
    mask = torch.ones(seq, seq, dtype=torch.bool).tril()
    for block in model.blocks:
        h = rms(x, block.attn_norm.weight)
        qkv = h @ block.attn.qkv.weight.T
        q, k = (t.reshape(idx.shape[0], seq, heads, dim).transpose(1, 2) for t in qkv.split(cfg.d_model, -1)[:2])
        if cfg.qk_norm:
            q, k = rms(q, block.attn.q_norm.weight), rms(k, block.attn.k_norm.weight)
        scores = rope(q) @ rope(k).transpose(-1, -2) / math.sqrt(dim)
        causal.append(float(scores.masked_fill(~mask, -math.inf).max()))
        full.append(float(scores.max()))
        x = block(x, rope_table)
    return causal, full


@pytest.mark.parametrize("qk_norm", [False, True])
def test_max_attention_logit_matches_explicit_attention(qk_norm):
    cfg = load(None, [*TINY, f"model.qk_norm={qk_norm}", "model.init_std=0.3"])
    cfg.model.vocab_size = 257
    torch.manual_seed(0)
    model = build_model(cfg.model)
    if qk_norm:  # gains away from 1, so a missed q_norm/k_norm would show
        for block in model.blocks:
            torch.nn.init.uniform_(block.attn.q_norm.weight, 0.5, 2.0)
            torch.nn.init.uniform_(block.attn.k_norm.weight, 0.5, 2.0)
    idx = torch.randint(0, 257, (3, 32), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        causal, full = explicit_max_scores(model, idx)
        with attention_score_probe(model) as probes:
            model(idx)
    assert [p.max_score for p in probes] == pytest.approx(causal, rel=1e-5, abs=1e-6)
    assert causal != pytest.approx(full, rel=1e-3)  # the causal mask matters on this input
    assert not any(h for m in model.modules() for h in (m._forward_hooks, m._forward_pre_hooks))


def test_probe_logits_in_eval_mode_then_back(data_dir):
    job = tiny_job(data_dir, "model.dropout=0.5")
    diag = Diagnostics(job.cfg, job.engine, job.sinks, job.loader)
    model = job.engine.module
    with torch.no_grad():
        model.norm.weight.neg_()  # negates every logit: the largest magnitude is now a negative one
    assert diag.probe.shape == (2, 32)  # observe.probe_sequences, the first val sequences
    scores, max_logit = diag.probe_logits()
    assert model.training
    with torch.no_grad():
        model.eval()
        logits = model(diag.probe)
        model.train()
    assert max_logit == pytest.approx(float(logits.abs().max()), rel=1e-6)
    assert max_logit != pytest.approx(float(logits.max()), rel=1e-3)
    assert len(scores) == 2 and all(math.isfinite(s) for s in scores)


# --- a 2-domain run ----------------------------------------------------------------------------------
def test_measured_steps_carry_the_diagnostics(observed_run):
    records = step_records(observed_run)
    assert [r["step"] for r in records] == list(range(1, STEPS + 1))
    fields = {"param_norm", "update_norm", "update_ratio", "max_attn_logit", "max_logit", "peak_mem_bytes"}
    for r in records:
        assert "mfu" not in r  # CPU: no known peak
        if r["step"] % EVERY:
            assert not fields & set(r)
            continue
        assert fields <= set(r)
        assert set(r["update_ratio"]) == {"embeddings", "attention", "mlp", "norms"}
        for group, ratio in r["update_ratio"].items():
            assert ratio == pytest.approx(r["update_norm"][group] / r["param_norm"][group], rel=1e-12)
            assert 0 < ratio < 1
        assert r["max_attn_logit"] == max(r["max_attn_logit_by_layer"].values())
        assert r["max_logit"] > 0 and r["peak_mem_bytes"] > 2**20


def test_clip_fraction_by_hand(observed_run):
    records = step_records(observed_run)
    clipped = [r["gnorm"] > CLIP for r in records]
    assert 0 < sum(clipped) < len(records), "pick CLIP inside this run's grad norms"
    for i, r in enumerate(records):
        assert r["clip_frac"] == pytest.approx(sum(clipped[: i + 1]) / r["step"], abs=1e-12)


def test_val_loss_per_domain_equals_hand_evaluation(observed_run, data_dir):
    vals = [r for r in read_jsonl(observed_run / "metrics.jsonl") if "val_loss" in r]
    assert [r["step"] for r in vals] == list(range(VAL_EVERY, STEPS + 1, VAL_EVERY))
    final = vals[-1]["val_loss"]
    assert set(final) == {"code", "prose"}
    cfg = run_cfg(observed_run, data_dir)
    cfg.model.vocab_size = 257
    model = build_model(cfg.model)
    ckpt = CheckpointStore(observed_run).load_latest()
    assert ckpt.step == STEPS
    missing, unexpected = model.load_state_dict(ckpt.tensors["model"], strict=False)
    assert missing == ["lm_head.weight"] and not unexpected  # tied: stored once, as tok_emb.weight
    loader = Loader(data_dir, cfg.model.seq_len, cfg.run.seed)
    model.eval()
    for domain in ("code", "prose"):
        ce, tokens = 0.0, 0
        with torch.no_grad():
            for inputs, targets in loader.val_batches(domain, 2, cfg.train.micro_batch_size):
                logits = model(inputs).double()
                ce += float(F.cross_entropy(logits.flatten(0, 1), targets.flatten(), reduction="sum"))
                tokens += targets.numel()
        assert tokens == 2 * 4 * 32
        assert final[domain] == pytest.approx(ce / tokens, abs=1e-6), domain
    assert abs(final["code"] - final["prose"]) > 1e-3  # two domains really evaluated apart


def test_diagnostics_do_not_change_training(observed_run, data_dir, tmp_path):
    cfg = run_cfg(tmp_path, data_dir, "observe.every=0", f"run.val_every={VAL_EVERY}", "run.val_batches=2",
                  f"optim.clip={CLIP}")
    assert train(cfg) == 0
    plain = [(r["loss"], r["gnorm"]) for r in step_records(tmp_path)]
    assert plain == [(r["loss"], r["gnorm"]) for r in step_records(observed_run)]


# --- sinks and config --------------------------------------------------------------------------------
def test_wandb_sink_logs_steps_and_val(tmp_path, monkeypatch):
    logged, inits = [], []
    run = SimpleNamespace(log=logged.append, define_metric=lambda *a, **k: None, finish=lambda: None)
    fake = types.ModuleType("wandb")
    fake.__spec__ = importlib.machinery.ModuleSpec("wandb", None)
    fake.init = lambda **kwargs: inits.append(kwargs) or run
    monkeypatch.setitem(sys.modules, "wandb", fake)
    observe = ObserveCfg(wandb=True, wandb_project="p", wandb_mode="offline")
    sinks = Sinks(tmp_path, True, 10, False, observe=observe, config={"a": 1})
    sinks.log_step({"step": 1, "loss": 2.0, "tokens_per_s": 5.0, "step_time_s": 0.1, "verdict": "ok",
                    "update_ratio": {"mlp": 0.01}})
    sinks.log_val({"step": 1, "val_loss": {"code": 3.0}})
    sinks.close()
    assert inits[0]["project"] == "p" and inits[0]["mode"] == "offline" and inits[0]["config"] == {"a": 1}
    assert logged == [{"step": 1, "loss": 2.0, "tokens_per_s": 5.0, "step_time_s": 0.1, "update_ratio/mlp": 0.01},
                      {"step": 1, "val_loss/code": 3.0}]
    assert [r["step"] for r in read_jsonl(tmp_path / "metrics.jsonl")] == [1, 1]


def test_wandb_missing_is_a_config_error_on_every_rank(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "wandb", None)  # what find_spec reports for an absent package
    with pytest.raises(ConfigError, match="pip install"):
        Sinks(tmp_path, False, 10, False, observe=ObserveCfg(wandb=True))


def test_observe_config_is_checked():
    with pytest.raises(ConfigError, match="observe.every"):
        load(None, ["observe.every=-1"])
    with pytest.raises(ConfigError, match="observe.wandb_mode"):
        load(None, ["observe.wandb_mode=cloud"])


# --- two ranks ---------------------------------------------------------------------------------------
@pytest.mark.slow
def test_sharded_two_ranks_measure_what_one_process_does(tmp_path, data_dir):
    """FSDP on 2 gloo ranks: full_state is a collective whose tensors only rank 0 gets; the
    measurements must match a one-process run of the same global batch, written once."""
    common = (f"data.dir={data_dir}", "train.total_steps=6", "ckpt.every=6", "observe.every=3")
    # A rank left out of a collective would hang: the timeout turns that into a failure.
    run_train(tmp_path / "one", *common, "engine.kind=ddp", "train.micro_batch_size=8", timeout_s=120)
    run_train(tmp_path / "fsdp", *common, "engine.kind=fsdp", "train.micro_batch_size=2", "train.grad_accum=2",
              nproc=2, timeout_s=120)
    one, fsdp = step_records(tmp_path / "one"), step_records(tmp_path / "fsdp")
    assert [r["step"] for r in fsdp] == list(range(1, 7))  # one writer
    for a, b in zip(one[2::3], fsdp[2::3]):
        for field in ("param_norm", "update_norm", "update_ratio"):
            assert b[field] == pytest.approx(a[field], rel=1e-4), field
        assert b["max_attn_logit_by_layer"] == pytest.approx(a["max_attn_logit_by_layer"], rel=1e-4)
        assert b["max_logit"] == pytest.approx(a["max_logit"], rel=1e-4)
