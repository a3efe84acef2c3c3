"""A Hugging Face folder's causal LM run by transformers, for `dsslm.eval --tasks HF_DIR`: the
safetensors files checked before transformers reads them (never a pickle), the loaded weights
checked finite and fitting their config, the tokenizer checked against the embedding table."""
from __future__ import annotations

from pathlib import Path

import torch

from dsslm.ckpt.format import parse_name
from dsslm.ckpt.trained import ToolError


def is_hf_folder(path: Path) -> bool:
    return (path / "config.json").is_file() and parse_name(path.name) is None and not (path / "checkpoints").is_dir()


def check_hf_weights(folder: Path) -> None:
    """The folder's safetensors files readable, before transformers loads them: the files are the
    ones transformers will read (`weight_files`: chosen in its order, plain names inside the
    folder), not a glob, since an index naming sub/ or ../ files would have them loaded unchecked. Only headers are read here;
    the values are checked once loaded (`check_finite`), so the weights are read once."""
    from safetensors import safe_open

    from dsslm.hf.folder import weight_files
    try:
        names, _ = weight_files(folder)
    except ValueError as exc:  # HFError: an index naming files elsewhere, or pickles only
        raise ToolError(str(exc)) from None
    for path in (folder / name for name in names):
        try:
            with safe_open(path, framework="pt") as f:
                f.keys()
        except Exception as exc:  # noqa: BLE001 - safetensors' own errors: a truncated or foreign file
            raise ToolError(f"{path}: not a readable safetensors file ({' '.join(str(exc).split())[:200]})") from None


def check_finite(model: torch.nn.Module, folder: Path) -> None:
    """Every float tensor of a loaded model finite: a NaN weight would score as a number."""
    for name, t in model.state_dict().items():
        if t.is_floating_point() and not bool(torch.isfinite(t).all()):
            raise ToolError(f"{folder}: {name} holds non-finite values; the weights are damaged")


def open_hf(folder: Path, device: torch.device):
    """A Hugging Face folder's causal LM (safetensors only: never a pickle), its tokenizer as dsslm
    reads tokenizer.json, its context length, and the id an empty context is scored after."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from dsslm.data.tokenizer import BPETokenizer, eos_token_of

    from dsslm.hf.write import quiet_transformers
    quiet_transformers()  # its load report and progress bar would bury our one line
    tok_file = folder / "tokenizer.json"
    if not tok_file.is_file():
        raise ToolError(f"{folder} has no tokenizer.json; export with python -m dsslm.export, or add one")
    check_hf_weights(folder)
    try:
        model, loading = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32, use_safetensors=True,
                                                              local_files_only=True, output_loading_info=True)
        from tokenizers import Tokenizer
        tok = BPETokenizer.from_file(tok_file, "file", eos_token_of(tok_file, Tokenizer.from_file(str(tok_file))))
        # lm-eval's HFLM scores an empty context after its prefix_token_id: the tokenizer's BOS
        # as transformers reads it (tokenizer_config.json and the rest), else EOS. A foreign folder's
        # BOS can differ from its EOS, and so would every empty-context score.
        bos = AutoTokenizer.from_pretrained(folder, local_files_only=True).bos_token_id
    except Exception as exc:  # noqa: BLE001 - transformers' config checks raise their own types too
        raise ToolError(f"{folder}: transformers cannot load it ({' '.join(str(exc).split())[:300]})") from None
    # transformers fills a tensor its config needs and the files lack with random values (and a
    # log line): scores of such a model are noise that looks like a result.
    for what in ("missing_keys", "mismatched_keys"):
        keys = sorted(str(k) for k in loading.get(what) or ())
        if keys:
            raise ToolError(f"{folder}: the weights do not fit its config.json ({what.replace('_', ' ')}: "
                            f"{', '.join(keys[:3])}{' ...' if len(keys) > 3 else ''})")
    check_finite(model, folder)
    seq_len = getattr(model.config, "max_position_embeddings", None)
    if not isinstance(seq_len, int) or seq_len < 1:
        raise ToolError(f"{folder}/config.json has no max_position_embeddings; dsslm.eval needs the context length")
    rows = model.get_input_embeddings().num_embeddings
    if tok.vocab_size > rows:  # an id past the embedding table: an IndexError at the first batch
        raise ToolError(f"{folder}: tokenizer.json has {tok.vocab_size} ids but the model embeds {rows}; "
                        "the folder's tokenizer is not its model's")
    prefix_id = tok.eos_id if bos is None else bos
    if not 0 <= prefix_id < rows:  # a bos_token the vocabulary lacks, which transformers adds past it
        raise ToolError(f"{folder}: the tokenizer's BOS is id {prefix_id}, past the model's {rows} embeddings; "
                        "fix bos_token in tokenizer_config.json")
    model = model.to(device).eval()
    return (lambda ids: model(ids).logits), tok, seq_len, prefix_id
