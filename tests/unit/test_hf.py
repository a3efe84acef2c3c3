"""The dsslm <-> Hugging Face mapping as pure functions: layouts, RoPE, config.json, the byte tokenizer.

No transformers here: HF's rotate-half RoPE is written out in the test, so the mapping is checked
against the math itself; tests/scenarios/test_export_import.py checks it against transformers."""
from __future__ import annotations

import dataclasses
import json

import pytest
import torch

from dsslm.config import ModelCfg, load
from dsslm.data.tokenizer import ByteTokenizer
from dsslm.hf.convert import (LLAMA, QWEN3, HFError, architecture_of, byte_tokenizer, from_hf, hf_shapes, model_values,
                      rope_order, to_hf)
from dsslm.model import apply_rope, build_model, rope_table

MULTIBYTE = "naïve café — 日本語 🙂 ß∑ <|endoftext|> \x00\x7f end"


def model_cfg(*overrides: str) -> ModelCfg:
    cfg = load(None, ["model.d_model=32", "model.n_heads=4", "model.n_layers=2", "model.seq_len=16",
                      "model.vocab_size=50", "model.qk_norm=false", *overrides]).model  # Llama unless asked
    return cfg


def random_state(cfg: ModelCfg, seed: int = 0) -> dict[str, torch.Tensor]:
    torch.manual_seed(seed)
    model = build_model(cfg)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_()  # norm gains too: a permutation of ones would hide a wrong one
        model.tok_emb.weight[cfg.vocab_size:].zero_()  # padded rows: 0, as dsslm keeps them
        model.lm_head.weight[cfg.vocab_size:].zero_()
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def hf_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """transformers' apply_rotary_pos_emb: the first half of each head against the second."""
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    cos, sin = torch.cat([cos, cos], dim=-1), torch.cat([sin, sin], dim=-1)
    return x * cos + rotated * sin


@pytest.mark.parametrize("overrides", [(), ("model.tie_embeddings=false",), ("model.qk_norm=true",),
                                       ("model.qk_norm=true", "model.tie_embeddings=false")])
def test_round_trip_returns_every_bit(overrides):
    cfg = model_cfg(*overrides)
    sd = random_state(cfg)
    hf = to_hf(sd, cfg)
    assert {n: tuple(t.shape) for n, t in hf.items()} == hf_shapes(cfg)
    back = from_hf(hf, cfg, {n: tuple(t.shape) for n, t in sd.items()})
    assert back.keys() == sd.keys()
    for name in sd:
        assert torch.equal(back[name], sd[name]), name
    assert ("lm_head.weight" in hf) == (not cfg.tie_embeddings)


def test_permuted_rows_give_hf_rope_the_same_scores():
    heads, head_dim, seq = 3, 8, 5
    table = rope_table(seq, head_dim, 10000.0)  # complex [seq, 1, pairs]
    cos, sin = torch.view_as_real(table[:, 0]).unbind(-1)  # [seq, pairs]: HF's tables, one half
    torch.manual_seed(1)
    x = torch.randn(seq, 16)
    wq, wk = torch.randn(heads * head_dim, 16), torch.randn(heads * head_dim, 16)

    def dsslm_rope(t, cos, sin):  # t [heads, seq, head_dim]; dsslm's kernel takes [batch, seq, heads, dim]
        return apply_rope(t.transpose(0, 1)[None], table)[0].transpose(0, 1)

    def scores(w_q, w_k, rope):
        q = (x @ w_q.T).view(seq, heads, head_dim).transpose(0, 1)
        k = (x @ w_k.T).view(seq, heads, head_dim).transpose(0, 1)
        q, k = rope(q, cos, sin), rope(k, cos, sin)
        return q @ k.transpose(-1, -2)

    order = rope_order(head_dim)
    hf_q = wq.view(heads, head_dim, 16)[:, order].reshape_as(wq)
    hf_k = wk.view(heads, head_dim, 16)[:, order].reshape_as(wk)
    dsslm = scores(wq, wk, dsslm_rope)
    assert torch.allclose(scores(hf_q, hf_k, hf_rope), dsslm, atol=1e-5)
    assert not torch.allclose(scores(wq, wk, hf_rope), dsslm, atol=1e-2)  # unpermuted: wrong


def test_export_cuts_padded_vocab_rows_and_import_pads_them_back_with_zeros():
    cfg = model_cfg("model.tie_embeddings=false")  # vocab_pad_to 64: 64 rows for a 50-id vocabulary
    padded = random_state(cfg)
    for n in ("tok_emb.weight", "lm_head.weight"):
        padded[n][50:] = torch.randn(14, 32)  # export must cut these, whatever they hold
    hf = to_hf(padded, cfg)
    assert hf["model.embed_tokens.weight"].shape == (50, 32)
    assert torch.equal(hf["lm_head.weight"], padded["lm_head.weight"][:50])
    shapes = {n: tuple(t.shape) for n, t in padded.items()}
    back = from_hf(hf, cfg, shapes)
    assert back["tok_emb.weight"].shape == (64, 32)
    assert torch.equal(back["tok_emb.weight"][:50], padded["tok_emb.weight"][:50])
    assert not back["tok_emb.weight"][50:].any()


def test_architecture_is_llama_or_qwen3_and_anything_else_is_refused():
    assert architecture_of(model_cfg()) == LLAMA and architecture_of(model_cfg("model.qk_norm=true")) == QWEN3
    assert architecture_of(model_cfg("model.dropout=0.1")) == LLAMA  # inference has no dropout
    # A model option transformers' Llama and Qwen3 do not have (as a future dsslm key would be).
    extended = dataclasses.make_dataclass("ExtendedCfg", [("parallel_blocks", bool, False)], bases=(ModelCfg,))
    assert architecture_of(extended(vocab_size=50)) == LLAMA
    with pytest.raises(HFError, match="model.parallel_blocks=True has no Llama or Qwen3 equivalent"):
        architecture_of(extended(vocab_size=50, parallel_blocks=True))


def llama_config(**fields) -> dict:
    base = {"model_type": "llama", "hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
            "num_key_value_heads": 4, "intermediate_size": 128, "vocab_size": 300, "rms_norm_eps": 1e-5,
            "rope_parameters": {"rope_type": "default", "rope_theta": 5e5}, "tie_word_embeddings": False}
    return {**base, **fields}


def test_config_json_becomes_model_values():
    assert model_values(llama_config()) == {
        "d_model": 64, "n_layers": 2, "n_heads": 4, "ffn_hidden": 128, "vocab_size": 300, "qk_norm": False,
        "tie_embeddings": False, "rope_theta": 5e5, "norm_eps": 1e-5}
    old_style = llama_config(rope_theta=1e4, rope_parameters=None, model_type="qwen3", tie_word_embeddings=True)
    values = model_values(old_style)  # transformers 4.x wrote rope_theta at the top
    assert values["rope_theta"] == 1e4 and values["qk_norm"] and values["tie_embeddings"]


@pytest.mark.parametrize("fields, says", [
    ({"model_type": "gpt2"}, "model_type"), ({"num_key_value_heads": 2}, "grouped-query"),
    ({"attention_bias": True}, "biases"), ({"hidden_act": "gelu"}, "silu"), ({"head_dim": 8}, "head_dim"),
    ({"rope_parameters": {"rope_type": "llama3", "rope_theta": 5e5}}, "rope type"),
    ({"use_sliding_window": True}, "sliding"), ({"hidden_size": "64"}, "hidden_size"),
    ({"num_hidden_layers": 0}, "num_hidden_layers"), ({"vocab_size": True}, "vocab_size"),
    # json reads Infinity: RoPE of an infinite theta is the identity, and trained without a word.
    ({"rope_parameters": {"rope_type": "default", "rope_theta": float("inf")}}, "finite"),
    ({"rms_norm_eps": float("nan")}, "finite"),
])
def test_config_json_that_dsslm_cannot_build_is_refused(fields, says):
    with pytest.raises(HFError, match=says):
        model_values(llama_config(**fields))


def test_rope_scaling_and_rope_parameters_that_disagree_are_refused_and_that_agree_are_read():
    """transformers 5.x applies `rope_scaling or rope_parameters`: a folder with a default
    rope_parameters and a linear rope_scaling was imported with plain RoPE while transformers ran it
    scaled (exit 0, logits 6.8e-4 apart on a 6-step model). Nothing says which the model had."""
    linear = {"rope_type": "linear", "factor": 4.0}
    with pytest.raises(HFError, match="rope_parameters=.* and rope_scaling=.* disagree.*remove rope_scaling"):
        model_values(llama_config(rope_scaling=linear))
    with pytest.raises(HFError, match="disagree"):  # the same type, another theta
        model_values(llama_config(rope_scaling={"rope_type": "default", "rope_theta": 1e4}))
    # Equal once completed as transformers completes them (`type`, a top-level rope_theta): read.
    agreeing = llama_config(rope_theta=5e5, rope_scaling={"type": "default"})
    assert model_values(agreeing)["rope_theta"] == 5e5
    assert model_values(llama_config(rope_scaling=None))["rope_theta"] == 5e5  # unset: rope_parameters
    with pytest.raises(HFError, match="rope type 'linear'"):  # rope_scaling alone is read, and refused
        model_values(llama_config(rope_parameters=None, rope_scaling=linear))
    with pytest.raises(HFError, match="rope_scaling=.* is not an object"):
        model_values(llama_config(rope_scaling="linear"))


def test_byte_tokenizer_definition_gives_dsslm_byte_ids():
    tok, ours = byte_tokenizer(), ByteTokenizer()
    tok.encode_special_tokens = True
    assert tok.encode(MULTIBYTE, add_special_tokens=False).ids == ours.encode(MULTIBYTE)
    assert tok.get_vocab_size() == ours.vocab_size and tok.token_to_id("<|endoftext|>") == ours.eos_id
    assert tok.decode(ours.encode(MULTIBYTE)) == MULTIBYTE


def test_a_folder_with_non_finite_weights_is_refused_before_a_run_starts_from_it(tmp_path):
    """run.init_from=hf: with a NaN in one weight trained to NaN (or escalated) after writing its
    start checkpoint. The weights are read once, for the import: each is checked there."""
    import json

    from safetensors.torch import save_file

    from dsslm.hf.folder import read_weights
    cfg = model_cfg("model.vocab_size=300")
    hf = to_hf(random_state(cfg), cfg)
    hf["model.norm.weight"][3] = float("nan")
    save_file({k: v.contiguous() for k, v in hf.items()}, tmp_path / "model.safetensors")
    (tmp_path / "config.json").write_text(json.dumps(llama_config()))
    with pytest.raises(HFError, match="model.norm.weight in model.safetensors holds 1 non-finite"):
        read_weights(tmp_path, cfg)


def test_eval_checks_a_folders_weights_before_transformers_loads_them(tmp_path):
    """`dsslm.eval --tasks HF_DIR` scored a NaN model as a number (bpb NaN, exit 0) and raised
    safetensors' own error out of a truncated file (exit 1): both are one ToolError now."""
    from safetensors.torch import save_file

    from dsslm.ckpt.trained import ToolError
    from dsslm.hf.causal_lm import check_finite, check_hf_weights
    save_file({"a": torch.ones(4), "b": torch.tensor([1.0, float("inf")])}, tmp_path / "model.safetensors")
    check_hf_weights(tmp_path)  # headers only: the values are checked once loaded, read once
    model = torch.nn.Linear(2, 1)
    with torch.no_grad():
        model.bias.fill_(float("nan"))
    with pytest.raises(ToolError, match="bias holds non-finite values"):
        check_finite(model, tmp_path)
    raw = (tmp_path / "model.safetensors").read_bytes()
    (tmp_path / "model.safetensors").write_bytes(raw[:20])
    with pytest.raises(ToolError, match="not a readable safetensors file"):
        check_hf_weights(tmp_path)
    (tmp_path / "model.safetensors").unlink()
    with pytest.raises(ToolError, match="neither model.safetensors nor"):
        check_hf_weights(tmp_path)
    # The files transformers reads are the index's: one outside the folder was loaded unchecked.
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {"a": "../x.safetensors"}}))
    with pytest.raises(ToolError, match="weight_map must map names to plain"):
        check_hf_weights(tmp_path)


def test_a_model_key_set_to_zero_for_derived_agrees_with_what_it_derives_to():
    """run.init_from=hf: refuses a model.* key the user set unless it asks for the folder's value;
    ffn_hidden=0 (8/3 d_model) and vocab_size=0 (follow) ask for what they derive to."""
    from dsslm.hf.folder import _agrees
    values = {"d_model": 32}
    assert _agrees("ffn_hidden", 0, 128, values) and not _agrees("ffn_hidden", 0, 64, values)
    assert _agrees("vocab_size", 0, 257, values) and _agrees("n_layers", 2, 2, values)
    assert not _agrees("n_layers", 4, 2, values) and not _agrees("vocab_size", 300, 257, values)
