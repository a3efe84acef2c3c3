"""Hugging Face Llama / Qwen3 <-> dsslm: parameter names and layouts, config.json both ways, and
the byte tokenizer as a `tokenizers` definition. Reading a Hugging Face folder is `hf_folder.py`.

dsslm -> HF, per block N (`model.layers.N.` on the right):

    tok_emb.weight               model.embed_tokens.weight      rows cut to the true vocabulary
    blocks.N.attn_norm.weight    input_layernorm.weight
    blocks.N.attn.qkv.weight     self_attn.{q,k,v}_proj.weight  rows q | k | v; q and k permuted
    blocks.N.attn.q_norm.weight  self_attn.q_norm.weight        Qwen3; permuted like the rows
    blocks.N.attn.proj.weight    self_attn.o_proj.weight
    blocks.N.mlp_norm.weight     post_attention_layernorm.weight
    blocks.N.mlp.gate_up.weight  mlp.{gate,up}_proj.weight      rows gate | up
    blocks.N.mlp.down.weight     mlp.down_proj.weight
    norm.weight                  model.norm.weight
    lm_head.weight               lm_head.weight                 untied only: a tied head stays tied

RoPE: dsslm rotates each head's pairs (2i, 2i+1) by frequency i; HF's rotate_half pairs (i,
i + head_dim/2) with the same frequency. Reordering each head's q and k rows so that row 2i lands
at i and row 2i+1 at i + head_dim/2 hands HF the same rotation of the same numbers, and since q
and k move alike every q.k is unchanged (transformers' convert_llama_weights_to_hf does this to
Meta's interleaved layout, which is dsslm's). A reorder is exact: a round trip returns every bit.

muP (model.mup_base_width / mup_base_depth, dsslm.config.mup) has multipliers Llama and Qwen3 have
no place for; the export folds each into the weight it follows, which is exact up to one rounding
of each product (the parity check holds it to its tolerance), and import refuses such folders'
reverse (run.init_from=hf: under muP, see config.validate):
- the logits' 1/m into lm_head, which is then written untied (tie_word_embeddings false) where the
  model ties it: a tied matrix cannot carry a factor its input embedding does not have;
- the attention scale's ratio to HF's 1/sqrt(head_dim), sqrt(base / d_model), into q_proj's rows,
  or with QK-norm into q_norm's gain (the norm would remove a factor on q_proj); a scalar on q
  commutes with RoPE;
- depth-muP's branch multiplier into o_proj and down_proj.
"""
from __future__ import annotations

import dataclasses
import math
from typing import Any

import torch

from dsslm.config import ConfigError, ModelCfg, ffn_hidden_of
from dsslm.config import mup

LLAMA, QWEN3 = "LlamaForCausalLM", "Qwen3ForCausalLM"
MODEL_TYPES = {"llama": LLAMA, "qwen3": QWEN3}
# Text both tokenizers must give the same ids for: multi-byte UTF-8, whitespace runs, code, digits,
# and the EOS string written as text (which dsslm never reads as the token).
PROBE_TEXT = ("Héllo wörld — naïve café, 日本語のテキスト, emoji 🙂🚀, ß ∑ ∫ ≠\n"
              "def f(x):\n\treturn x ** 2  # 12345 67.89\n\n   spaces   and\r\nCRLF <|endoftext|> done.")
# How each dsslm model key reaches Hugging Face; a key missing here has no Llama/Qwen3 equivalent,
# so a model that sets it away from its default is refused rather than exported wrong.
EXPORTED_KEYS = {
    "d_model": "hidden_size", "n_layers": "num_hidden_layers", "n_heads": "num_attention_heads",
    "seq_len": "max_position_embeddings", "vocab_size": "vocab_size", "ffn_hidden": "intermediate_size",
    "qk_norm": "the architecture (Qwen3)", "tie_embeddings": "tie_word_embeddings", "rope_theta": "rope_theta",
    "norm_eps": "rms_norm_eps",
    "dropout": "nothing: inference has no dropout", "init_std": "nothing: weights are given",
    "vocab_pad_to": "nothing: the padded rows are cut off",
    # The same weights and function on one document per sequence; packed rows need the caller's
    # 4-D mask and position_ids (the export warns: hf.write.DOCUMENT_MASK_NOTE).
    "document_mask": "nothing on one document a row (export warns)", "document_positions": "position_ids",
    "eos_id": "eos_token_id",
    "mup_base_width": "folded into lm_head (untied) and q_proj / q_norm", "mup_base_depth": "folded into o_proj, down_proj",
}


class HFError(ConfigError):
    """A model or folder that does not fit Llama / Qwen3 as dsslm builds them; says why."""


def rope_order(head_dim: int) -> torch.Tensor:
    """HF row j of a head holds dsslm row rope_order[j]: the even rows, then the odd ones."""
    return torch.cat([torch.arange(0, head_dim, 2), torch.arange(1, head_dim, 2)])


def _reorder_heads(w: torch.Tensor, n_heads: int, order: torch.Tensor) -> torch.Tensor:
    return w.reshape(n_heads, order.numel(), *w.shape[1:])[:, order].reshape(w.shape)


def tied_in_hf(cfg: ModelCfg) -> bool:
    """Whether the export ties lm_head to the embedding: where dsslm does and no muP output
    multiplier has to be folded into the head."""
    return cfg.tie_embeddings and mup.output_mult(cfg) is None


def _folds(cfg: ModelCfg) -> tuple[float | None, float | None, float | None]:
    """(the logits' multiplier, q's factor to HF's 1/sqrt(head_dim), the branch multiplier), None where 1."""
    scale = mup.attention_scale(cfg)
    q_factor = None if scale is None else math.sqrt(cfg.mup_base_width / cfg.d_model)  # = scale x sqrt(head_dim)
    return mup.output_mult(cfg), q_factor, mup.branch_mult(cfg)


def _times(t: torch.Tensor, factor: float | None) -> torch.Tensor:
    return t if factor is None else t * factor


def architecture_of(cfg: ModelCfg) -> str:
    """Llama, or Qwen3 for per-head RMSNorm on q and k before RoPE; HFError if neither fits."""
    defaults = type(cfg)()
    for f in dataclasses.fields(cfg):
        if f.name not in EXPORTED_KEYS and getattr(cfg, f.name) != getattr(defaults, f.name):
            raise HFError(f"model.{f.name}={getattr(cfg, f.name)!r} has no Llama or Qwen3 equivalent in "
                          "transformers; such a model cannot be exported")
    return QWEN3 if cfg.qk_norm else LLAMA


def to_hf(sd: dict[str, torch.Tensor], cfg: ModelCfg) -> dict[str, torch.Tensor]:
    """dsslm's parameters (by name) as HF Llama/Qwen3 tensors, contiguous, in their own dtype."""
    heads, head_dim = cfg.n_heads, cfg.d_model // cfg.n_heads
    order, vocab = rope_order(head_dim), cfg.vocab_size
    logits, q_factor, branch = _folds(cfg)  # muP's multipliers (all None under SP: nothing is multiplied)
    out = {"model.embed_tokens.weight": sd["tok_emb.weight"][:vocab], "model.norm.weight": sd["norm.weight"]}
    if not tied_in_hf(cfg):
        out["lm_head.weight"] = _times(sd["tok_emb.weight" if cfg.tie_embeddings else "lm_head.weight"][:vocab], logits)
    for n in range(cfg.n_layers):
        src, dst = f"blocks.{n}.", f"model.layers.{n}."
        q, k, v = sd[src + "attn.qkv.weight"].chunk(3, dim=0)
        gate, up = sd[src + "mlp.gate_up.weight"].chunk(2, dim=0)
        out.update({
            dst + "input_layernorm.weight": sd[src + "attn_norm.weight"],
            dst + "self_attn.q_proj.weight": _reorder_heads(_times(q, None if cfg.qk_norm else q_factor), heads, order),
            dst + "self_attn.k_proj.weight": _reorder_heads(k, heads, order),
            dst + "self_attn.v_proj.weight": v,
            dst + "self_attn.o_proj.weight": _times(sd[src + "attn.proj.weight"], branch),
            dst + "post_attention_layernorm.weight": sd[src + "mlp_norm.weight"],
            dst + "mlp.gate_proj.weight": gate, dst + "mlp.up_proj.weight": up,
            dst + "mlp.down_proj.weight": _times(sd[src + "mlp.down.weight"], branch),
        })
        if cfg.qk_norm:  # the norm would undo a factor on q_proj: it goes on the gain
            out[dst + "self_attn.q_norm.weight"] = _times(sd[src + "attn.q_norm.weight"], q_factor)[order]
            out[dst + "self_attn.k_norm.weight"] = sd[src + "attn.k_norm.weight"][order]
    return {name: t.contiguous() for name, t in out.items()}


def hf_shapes(cfg: ModelCfg) -> dict[str, tuple[int, ...]]:
    """The HF tensors a model of `cfg` has, by name, at the true vocabulary."""
    d, head_dim, vocab = cfg.d_model, cfg.d_model // cfg.n_heads, cfg.vocab_size
    hidden = ffn_hidden_of(cfg.d_model, cfg.ffn_hidden)  # as model.SwiGLU builds it
    shapes = {"model.embed_tokens.weight": (vocab, d), "model.norm.weight": (d,)}
    if not tied_in_hf(cfg):
        shapes["lm_head.weight"] = (vocab, d)
    for n in range(cfg.n_layers):
        p = f"model.layers.{n}."
        shapes.update({p + "input_layernorm.weight": (d,), p + "post_attention_layernorm.weight": (d,),
                       **{p + f"self_attn.{x}_proj.weight": (d, d) for x in "qkvo"},
                       p + "mlp.gate_proj.weight": (hidden, d), p + "mlp.up_proj.weight": (hidden, d),
                       p + "mlp.down_proj.weight": (d, hidden)})
        if cfg.qk_norm:
            shapes.update({p + "self_attn.q_norm.weight": (head_dim,), p + "self_attn.k_norm.weight": (head_dim,)})
    return shapes


def from_hf(hf: dict[str, torch.Tensor], cfg: ModelCfg, shapes: dict[str, tuple]) -> dict[str, torch.Tensor]:
    """The inverse of `to_hf`, in fp32, with the embedding and head padded with zero rows up to
    `shapes` (dsslm's parameter shapes) when dsslm pads its vocabulary."""
    heads, head_dim = cfg.n_heads, cfg.d_model // cfg.n_heads
    back = torch.argsort(rope_order(head_dim))
    sd = {"tok_emb.weight": hf["model.embed_tokens.weight"], "norm.weight": hf["model.norm.weight"]}
    if not cfg.tie_embeddings:
        sd["lm_head.weight"] = hf["lm_head.weight"]
    for n in range(cfg.n_layers):
        src, dst = f"model.layers.{n}.", f"blocks.{n}."
        q, k = (_reorder_heads(hf[src + f"self_attn.{x}_proj.weight"], heads, back) for x in "qk")
        sd.update({
            dst + "attn_norm.weight": hf[src + "input_layernorm.weight"],
            dst + "attn.qkv.weight": torch.cat([q, k, hf[src + "self_attn.v_proj.weight"]]),
            dst + "attn.proj.weight": hf[src + "self_attn.o_proj.weight"],
            dst + "mlp_norm.weight": hf[src + "post_attention_layernorm.weight"],
            dst + "mlp.gate_up.weight": torch.cat([hf[src + "mlp.gate_proj.weight"], hf[src + "mlp.up_proj.weight"]]),
            dst + "mlp.down.weight": hf[src + "mlp.down_proj.weight"],
        })
        if cfg.qk_norm:
            sd[dst + "attn.q_norm.weight"] = hf[src + "self_attn.q_norm.weight"][back]
            sd[dst + "attn.k_norm.weight"] = hf[src + "self_attn.k_norm.weight"][back]
    for name in ("tok_emb.weight", "lm_head.weight"):
        if name in sd and name in shapes and sd[name].shape[0] < shapes[name][0]:
            pad = sd[name].new_zeros(shapes[name][0] - sd[name].shape[0], sd[name].shape[1])
            sd[name] = torch.cat([sd[name], pad])  # rows no token id reaches (dsslm's vocab padding)
    return {name: t.float().contiguous() for name, t in sd.items()}


def export_config(cfg: ModelCfg, eos_id: int, dtype: torch.dtype):
    """The transformers config object of the architecture `cfg` maps to."""
    import transformers

    arch = architecture_of(cfg)
    if not hasattr(transformers, arch):
        raise HFError(f"model.qk_norm=true exports as {arch}, which transformers {transformers.__version__} "
                      "lacks; upgrade transformers (Qwen3 arrived in 4.51)")
    fields = dict(vocab_size=cfg.vocab_size, hidden_size=cfg.d_model,
                  intermediate_size=ffn_hidden_of(cfg.d_model, cfg.ffn_hidden), num_hidden_layers=cfg.n_layers,
                  num_attention_heads=cfg.n_heads, num_key_value_heads=cfg.n_heads,
                  head_dim=cfg.d_model // cfg.n_heads, hidden_act="silu", max_position_embeddings=cfg.seq_len,
                  rms_norm_eps=cfg.norm_eps, tie_word_embeddings=tied_in_hf(cfg), attention_bias=False,
                  attention_dropout=0.0, rope_parameters={"rope_type": "default", "rope_theta": cfg.rope_theta},
                  bos_token_id=eos_id, eos_token_id=eos_id, use_cache=True)
    if arch == LLAMA:
        config = transformers.LlamaConfig(mlp_bias=False, pretraining_tp=1, **fields)
    else:
        config = transformers.Qwen3Config(use_sliding_window=False, sliding_window=None,
                                          max_window_layers=cfg.n_layers, **fields)
    config.architectures = [arch]
    config.dtype = dtype
    return config


def _get(hf: dict, key: str, kind: type, default: Any = None) -> Any:
    value = hf.get(key, default)
    if kind is float and isinstance(value, int) and not isinstance(value, bool):
        value = float(value)
    if not isinstance(value, kind) or (kind is not bool and isinstance(value, bool)):
        raise HFError(f"config.json: {key}={value!r} is not a {kind.__name__}")
    if kind in (int, float) and not (0 < value < float("inf")):  # json reads Infinity and NaN too
        raise HFError(f"config.json: {key}={value!r} must be a finite number > 0")
    return value


def model_values(hf: dict) -> dict[str, Any]:
    """dsslm model.* values for a Llama/Qwen3 config.json; HFError naming what does not fit."""
    model_type = hf.get("model_type")
    if model_type not in MODEL_TYPES:
        raise HFError(f"config.json: model_type={model_type!r} is not one dsslm imports (llama, qwen3)")
    d, heads = _get(hf, "hidden_size", int), _get(hf, "num_attention_heads", int)
    if d < 1 or heads < 1 or d % heads:
        raise HFError(f"config.json: hidden_size={d} is not a positive multiple of num_attention_heads={heads}")
    refusals = [
        (_get(hf, "num_key_value_heads", int, heads) != heads,
         "num_key_value_heads: grouped-query attention; dsslm's attention has as many k/v heads as q heads"),
        (_get(hf, "head_dim", int, d // heads) != d // heads, "head_dim: not hidden_size / num_attention_heads"),
        (hf.get("hidden_act", "silu") != "silu", "hidden_act: dsslm's MLP is SwiGLU (silu)"),
        (bool(hf.get("attention_bias")) or bool(hf.get("mlp_bias")), "attention_bias/mlp_bias: dsslm has no biases"),
        (bool(hf.get("use_sliding_window")), "use_sliding_window: dsslm attends to the whole sequence"),
    ]
    rope = rope_of(hf)
    refusals.append((rope.get("rope_type", rope.get("type", "default")) != "default",
                     f"rope type {rope.get('rope_type', rope.get('type'))!r}: dsslm has plain RoPE only"))
    for bad, why in refusals:
        if bad:
            raise HFError(f"config.json: {why}")
    theta = _get(rope, "rope_theta", float) if "rope_theta" in rope else _get(hf, "rope_theta", float, 10000.0)
    return {"d_model": d, "n_layers": _get(hf, "num_hidden_layers", int), "n_heads": heads,
            "ffn_hidden": _get(hf, "intermediate_size", int), "vocab_size": _get(hf, "vocab_size", int),
            "qk_norm": model_type == "qwen3", "tie_embeddings": _get(hf, "tie_word_embeddings", bool, False),
            "rope_theta": theta, "norm_eps": _get(hf, "rms_norm_eps", float, 1e-6)}


def _rope_settings(rope: dict, hf: dict) -> dict:
    """A RoPE object as transformers completes it: `type` is the older name of `rope_type`, and
    rope_theta comes from the top level when the object lacks it."""
    rope = dict(rope)
    if "type" in rope:
        rope.setdefault("rope_type", rope.pop("type"))
    rope.setdefault("rope_type", "default")
    rope.setdefault("rope_theta", hf.get("rope_theta", 10000.0))
    return rope


def rope_of(hf: dict) -> dict:
    """The RoPE object transformers applies. It reads `rope_scaling or rope_parameters` (transformers
    5.x, modeling_rope_utils): rope_scaling wins whenever it is set, an empty one counts as unset.
    When both are set and say different things, dsslm would import one RoPE while transformers runs
    the folder with the other (a linear-scaled model imported as plain RoPE trains on other logits,
    without a word), and nothing says which the model was trained with: refused."""
    found = {}
    for key in ("rope_parameters", "rope_scaling"):
        value = hf.get(key)
        if not value:  # None, or empty: transformers' `or` passes it over
            continue
        if not isinstance(value, dict):
            raise HFError(f"config.json: {key}={value!r} is not an object")
        found[key] = value
    if len(found) == 2 and _rope_settings(found["rope_parameters"], hf) != _rope_settings(found["rope_scaling"], hf):
        raise HFError(f"config.json: rope_parameters={found['rope_parameters']!r} and rope_scaling="
                      f"{found['rope_scaling']!r} disagree, and transformers applies rope_scaling; remove rope_scaling "
                      "if rope_parameters is the model's RoPE, else remove rope_parameters")
    return found.get("rope_scaling") or found.get("rope_parameters") or {}


def byte_tokenizer():
    """dsslm's byte tokenizer as a `tokenizers` definition: id b is byte b, 256 is EOS.

    A BPE with no merges over ByteLevel's 256 byte characters, the regex split off (it only groups
    bytes into words, which without merges changes nothing): every byte becomes its own id."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

    from dsslm.data.tokenizer import EOS_TOKEN, byte_level_chars

    vocab = {char: b for b, char in enumerate(byte_level_chars())}
    vocab[EOS_TOKEN] = 256
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([AddedToken(EOS_TOKEN, special=True, normalized=False)])
    return tok
