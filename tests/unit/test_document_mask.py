"""model.document_mask / model.document_positions: attention within the documents of a packed
sequence, so its loss is the per-document runs' token-weighted sum."""
import warnings

import pytest
import torch
import torch.nn.functional as F

from dsslm.config import ConfigError, load
from dsslm.model import (_SplitRopeFn, apply_rope, build_model, document_ids, document_mask, document_positions)

EOS, LENGTHS = 63, (5, 7, 4)  # three documents, each closed by its EOS, packed into seq_len 16


def cfg_with(*overrides):
    return load(None, ["model.vocab_size=64", "model.d_model=32", "model.n_layers=2", "model.n_heads=4",
                       "model.seq_len=16", f"model.eos_id={EOS}", *overrides]).model


def packed_documents(seed: int = 0) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.cat([torch.randint(0, EOS, (n - 1,), generator=gen), torch.tensor([EOS])]) for n in LENGTHS]


def test_document_ids_and_positions_restart_after_each_eos():
    idx = torch.cat(packed_documents())[None]
    assert document_ids(idx, EOS).tolist() == [[0] * 5 + [1] * 7 + [2] * 4]
    assert document_positions(document_ids(idx, EOS)).tolist() == [[*range(5), *range(7), *range(4)]]
    mask = document_mask(document_ids(idx, EOS))[0, 0]
    assert mask[6, 5] and mask[6, 6] and not mask[6, 4] and not mask[6, 7] and not mask[15, 11]


@pytest.mark.parametrize("positions", [False, True])
@pytest.mark.parametrize("qk_norm", [False, True])  # _SplitRopeFn's path, and apply_rope's
def test_packed_loss_equals_the_documents_run_alone(positions, qk_norm):
    torch.manual_seed(0)
    overrides = ["model.document_mask=true", f"model.document_positions={str(positions).lower()}",
                 f"model.qk_norm={str(qk_norm).lower()}"]
    model = build_model(cfg_with(*overrides)).eval()
    docs = packed_documents()
    packed = torch.cat(docs)[None]
    logits = model(packed)[0]
    # Targets inside a document: a document's closing EOS predicts the next document, which no
    # run of the document alone sees, so those positions (and the sequence's last) are left out.
    packed_sum, solo_sum, count, start = 0.0, 0.0, 0, 0
    for doc in docs:
        n = len(doc)
        alone = model(doc[None])[0]
        # fp32: without document_positions RoPE's angles differ by the document's offset, equal only
        # in exact arithmetic (attention depends on the positions' difference); with it, only the
        # kernels' summation order differs.
        torch.testing.assert_close(logits[start:start + n], alone, rtol=0, atol=2e-6 if positions else 2e-5)
        packed_sum += F.cross_entropy(logits[start:start + n - 1], doc[1:], reduction="sum")
        solo_sum += F.cross_entropy(alone[:-1], doc[1:], reduction="sum")
        count, start = count + n - 1, start + n
    assert (packed_sum / count).item() == pytest.approx((solo_sum / count).item(), rel=1e-6, abs=0)
    # And the mask is what makes it so: the unmasked model's later documents see the earlier ones.
    plain = build_model(cfg_with(f"model.qk_norm={str(qk_norm).lower()}"))
    plain.load_state_dict(model.state_dict())
    assert not torch.allclose(plain(packed)[0, 5:12], model(docs[1][None])[0], atol=1e-3)


def test_per_token_rope_table_forward_and_backward_match_apply_rope():
    torch.manual_seed(0)
    model = build_model(cfg_with("model.document_mask=true", "model.document_positions=true"))
    idx = torch.stack([torch.cat(packed_documents(s)) for s in range(2)])
    table = model.rope[document_positions(document_ids(idx, EOS))]  # [batch, seq, 1, pairs]
    qkv = torch.randn(2, 16, 96, requires_grad=True)
    out = _SplitRopeFn.apply(qkv, table, 4)
    ref_qkv = qkv.detach().clone().requires_grad_(True)
    q, k, v = ref_qkv.view(2, 16, 3, 4, 8).unbind(2)
    ref = (apply_rope(q, table).transpose(1, 2), apply_rope(k, table).transpose(1, 2), v.transpose(1, 2))
    for a, b in zip(out, ref):
        assert torch.equal(a, b)
    weights = [torch.randn_like(t) for t in out]
    sum((a * w).sum() for a, w in zip(out, weights)).backward()
    sum((b * w).sum() for b, w in zip(ref, weights)).backward()
    torch.testing.assert_close(qkv.grad, ref_qkv.grad, rtol=0, atol=1e-6)


def test_flex_block_mask_gives_the_dense_masks_attention():
    """The CUDA path's mask (FlexAttention forward runs on a CPU too; its CPU backward does not)."""
    torch.manual_seed(0)
    model = build_model(cfg_with("model.document_mask=true")).eval()
    idx = torch.stack([torch.cat(packed_documents(s)) for s in range(2)])
    doc = document_ids(idx, EOS)
    x = model.tok_emb(idx)
    attn = model.blocks[0].attn
    with torch.no_grad(), warnings.catch_warnings():  # unfused outside torch.compile, and says so
        warnings.simplefilter("ignore")
        flex = attn(x, model.rope[:16], document_mask(doc, flex=True))
    dense = attn(x, model.rope[:16], document_mask(doc))
    torch.testing.assert_close(flex, dense, rtol=0, atol=1e-5)


def test_document_positions_without_the_mask_is_refused():
    with pytest.raises(ConfigError, match="model.document_positions=true needs model.document_mask=true"):
        cfg_with("model.document_positions=true")


def test_attention_score_probe_reads_a_document_masked_forward():
    from dsslm.observe.diagnostics import attention_score_probe
    model = build_model(cfg_with("model.document_mask=true", "model.document_positions=true"))
    with torch.no_grad(), attention_score_probe(model) as probes:
        model(torch.cat(packed_documents())[None])
    assert len(probes) == 2 and all(torch.isfinite(torch.tensor(p.max_score)) for p in probes)


def test_flex_attention_only_where_it_is_compiled_and_without_dropout():
    """On CUDA the document mask takes FlexAttention only under train.compile (eager flex
    materialises every score) and without attention dropout (flex has none); otherwise SDPA's
    dense mask. The choice follows the blocks' compilation however the engine applied it."""
    from dsslm.config import load as load_cfg
    from dsslm.engine.blocks import prepare_model
    model = build_model(cfg_with("model.document_mask=true"))
    assert not model.attention_compiled() and not model.flex_attention()
    prepare_model(model, load_cfg(None, ["train.compile=true"]).train)  # per block (FSDP2, ZeRO-3)
    assert model.attention_compiled() and model.flex_attention()
    dropping = build_model(cfg_with("model.document_mask=true", "model.dropout=0.1"))
    prepare_model(dropping, load_cfg(None, ["train.compile=true"]).train)
    assert not dropping.train().flex_attention() and dropping.eval().flex_attention()
