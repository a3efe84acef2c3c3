"""Writing a Hugging Face folder from a dsslm checkpoint: the export behind `python -m dsslm.export`
(whose docstring says what the folder holds and how the parity check decides)."""
from __future__ import annotations

import copy
import json
import os
import re
import secrets
import shutil
import time
from pathlib import Path

import torch

from dsslm.ckpt.format import inside_checkpoints
from dsslm.durable import file_mode, file_sha256, publish_folder
from dsslm.hf.convert import PROBE_TEXT, architecture_of, byte_tokenizer, export_config, to_hf
from dsslm.ckpt.trained import ToolError, Trained, open_trained, tokenizer_of

EXPORT_FILE = "dsslm_export.json"
FP32_TOLERANCE = 1e-4  # max |logit difference|, fp32 compute on the exported values
PROBE_TOKENS = 128     # positions per probe sequence (or model.seq_len if shorter)
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
_SIZE = re.compile(r"(\d+(?:\.\d+)?)\s*(|B|KB|MB|GB|KiB|MiB|GiB)", re.IGNORECASE)
_UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "kib": 2**10, "mib": 2**20, "gib": 2**30}


def parse_size(text: str) -> int:
    match = _SIZE.fullmatch(text.strip())
    if not match or float(match.group(1)) <= 0:
        raise ToolError(f"--max-shard-size {text!r} is not a size; write e.g. 5GB or 500MB")
    return int(float(match.group(1)) * _UNITS[match.group(2).lower()])


def check_out(out: Path) -> None:
    problem = inside_checkpoints(out)
    if problem is not None:
        raise ToolError(f"--out {out}: {problem}; choose a folder outside the run's checkpoints/")
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise ToolError(f"--out {out} exists and is not empty; remove it or choose another folder (an export "
                        "never replaces a folder)")


def shard(tensors: dict[str, torch.Tensor], max_bytes: int) -> list[dict[str, torch.Tensor]]:
    """Consecutive groups of at most max_bytes (a bigger tensor alone), in the given order."""
    shards: list[dict[str, torch.Tensor]] = [{}]
    size = 0
    for name, t in tensors.items():
        nbytes = t.numel() * t.element_size()
        if shards[-1] and size + nbytes > max_bytes:
            shards.append({})
            size = 0
        shards[-1][name] = t
        size += nbytes
    return shards


def write_weights(folder: Path, tensors: dict[str, torch.Tensor], max_bytes: int) -> None:
    from safetensors.torch import save_file

    shards = shard(tensors, max_bytes)
    if len(shards) == 1:
        save_file(shards[0], folder / "model.safetensors", metadata={"format": "pt"})
        os.chmod(folder / "model.safetensors", file_mode())  # save_file makes 0600: others could not load it
        return
    weight_map = {}
    for i, part in enumerate(shards, 1):
        name = f"model-{i:05d}-of-{len(shards):05d}.safetensors"
        save_file(part, folder / name, metadata={"format": "pt"})
        os.chmod(folder / name, file_mode())
        weight_map.update({k: name for k in part})
    total = sum(t.numel() * t.element_size() for t in tensors.values())
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (folder / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")


def write_tokenizer(folder: Path, tok) -> None:
    """tokenizer.json + tokenizer_config.json. Special strings in text stay text
    (split_special_tokens), and no post-processor adds tokens: that is how dsslm tokenized the data."""
    from tokenizers import Tokenizer
    from transformers import PreTrainedTokenizerFast

    backend = byte_tokenizer() if tok.kind == "byte" else Tokenizer.from_str(tok.backend.to_str())
    spec = json.loads(backend.to_str())
    if spec.get("post_processor") is not None:
        spec["post_processor"] = None  # dsslm encodes with add_special_tokens=False: no BOS the model never saw
        backend = Tokenizer.from_str(json.dumps(spec))
    eos = backend.id_to_token(tok.eos_id)
    # model_input_names: without it transformers 4.x also returns token_type_ids, which Llama's
    # generate() refuses.
    hf_tok = PreTrainedTokenizerFast(tokenizer_object=backend, eos_token=eos, bos_token=eos, pad_token=eos,
                                     split_special_tokens=True, model_max_length=10**9,
                                     model_input_names=["input_ids", "attention_mask"])
    hf_tok.save_pretrained(folder)
    # "PreTrainedTokenizerFast" is what transformers 4.x (and so most serving stacks) know; 5.x
    # reads it as its TokenizersBackend.
    edit_json(folder / "tokenizer_config.json", drop=("backend",), tokenizer_class="PreTrainedTokenizerFast")


def edit_json(path: Path, drop: tuple[str, ...] = (), **fields) -> None:
    data = json.loads(path.read_text())
    data.update(fields)
    for key in drop:
        data.pop(key, None)
    path.write_text(json.dumps(data, indent=2, sort_keys=True) + "\n")


def write_folder(folder: Path, trained: Trained, tok, dtype: torch.dtype, max_bytes: int) -> None:
    from transformers import GenerationConfig

    cfg = trained.cfg.model
    config = export_config(cfg, tok.eos_id, dtype)
    sd = {n: p.detach().cpu() for n, p in trained.model.named_parameters()}
    write_weights(folder, {n: t.to(dtype, copy=True) for n, t in to_hf(sd, cfg).items()}, max_bytes)
    config.to_json_file(folder / "config.json")
    # transformers 4.x reads rope_theta and torch_dtype at the top level; 5.x reads rope_parameters
    # and dtype, and ignores these.
    edit_json(folder / "config.json", rope_theta=cfg.rope_theta, torch_dtype=str(dtype).removeprefix("torch."))
    GenerationConfig(bos_token_id=tok.eos_id, eos_token_id=tok.eos_id, pad_token_id=tok.eos_id).save_pretrained(folder)
    write_tokenizer(folder, tok)


# What transformers reproduces of a model trained with model.document_mask: stated in the export's
# record and printed as a warning line by `python -m dsslm.export`.
DOCUMENT_MASK_NOTE = ("trained with model.document_mask: transformers reproduces its logits on one document per "
                      "sequence (generation, or one document per row), not on packed rows of several EOS-separated "
                      "documents, where it attends across the EOS; there pass a 4-D attention mask and per-document "
                      "position_ids yourself")


def probe_batch(tok, vocab_size: int, seq_len: int, eos_id: int = -1) -> torch.Tensor:
    """Two fixed sequences: uniformly random ids (every row of the embedding is fair game) and
    the probe text's ids repeated. With `eos_id` (a document-masked model), no EOS inside: one
    document per row, the input on which transformers and dsslm compute the same function."""
    length = min(seq_len, PROBE_TOKENS)
    random_ids = torch.randint(0, vocab_size, (length,), generator=torch.Generator().manual_seed(0))
    if eos_id >= 0:
        random_ids[random_ids == eos_id] = (eos_id + 1) % vocab_size
    text = torch.tensor(tok.encode(PROBE_TEXT)).repeat(length // len(tok.encode(PROBE_TEXT)) + 1)[:length]
    return torch.stack([random_ids, text])


@torch.no_grad()
def check_parity(folder: Path, trained: Trained, tok, dtype: torch.dtype) -> dict:
    """Load the written folder with transformers and compare; the figures go into dsslm_export.json."""
    import transformers
    from transformers import AutoModelForCausalLM, AutoTokenizer

    cfg = trained.cfg.model
    probe = probe_batch(tok, cfg.vocab_size, cfg.seq_len, cfg.eos_id if cfg.document_mask else -1)
    model = trained.model.cpu()
    reference = model(probe)[..., :cfg.vocab_size]
    exported = model
    if dtype != torch.float32:  # the same function of the rounded values: what the files hold
        exported = open_rounded(trained, dtype)
    hf32 = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    fp32_diff = float((exported(probe)[..., :cfg.vocab_size] - hf32(probe).logits.float()).abs().max())
    del hf32
    hf16 = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.bfloat16).eval()
    bf16_diff = float((reference - hf16(probe).logits.float()).abs().max())
    del hf16
    with torch.autocast("cpu", dtype=torch.bfloat16):
        own_bf16_diff = float((reference - model(probe)[..., :cfg.vocab_size]).abs().max())
    hf_tok = AutoTokenizer.from_pretrained(folder)
    ids, hf_ids = tok.encode(PROBE_TEXT), hf_tok(PROBE_TEXT)["input_ids"]
    return {"max_abs_logit_diff_fp32": fp32_diff, "tolerance_fp32": FP32_TOLERANCE,
            "max_abs_logit_diff_bf16": bf16_diff, "dsslm_own_bf16_diff": own_bf16_diff,
            "max_abs_logit": float(reference.abs().max()), "probe_shape": list(probe.shape),
            "tokenizer_ids_equal": ids == hf_ids and hf_tok.eos_token_id == tok.eos_id,
            "probe_text_tokens": len(ids), "transformers_version": transformers.__version__}


def open_rounded(trained: Trained, dtype: torch.dtype):
    model = copy.deepcopy(trained.model)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(p.to(dtype).float())
    return model


def open_to_readers(folder: Path) -> None:
    mode = 0o666 & ~_umask()  # safetensors writes 0600; an export is for others to read
    for path in folder.iterdir():
        os.chmod(path, mode)
    os.chmod(folder, 0o777 & ~_umask())  # mkdtemp-like 0700 otherwise


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def export(source: str, out: Path, dtype_name: str = "fp32", check: bool = True, data: str | None = None,
           max_shard_size: str = "5GB") -> dict:
    """The whole export; returns what dsslm_export.json holds. ToolError (exit 2) on bad input or
    a failed check, with nothing left at `out`."""
    started = time.perf_counter()
    max_bytes = parse_size(max_shard_size)
    check_out(out)
    trained = open_trained(source)
    architecture_of(trained.cfg.model)  # refuses before anything is written
    tok = tokenizer_of(trained, data)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.parent / f".{out.name}.tmp-{os.getpid()}-{secrets.token_hex(3)}"
    tmp.mkdir()
    try:
        write_folder(tmp, trained, tok, DTYPES[dtype_name], max_bytes)
        written_s = time.perf_counter() - started
        parity = check_parity(tmp, trained, tok, DTYPES[dtype_name]) if check else None
        if parity is not None and not (parity["max_abs_logit_diff_fp32"] <= FP32_TOLERANCE
                                       and parity["tokenizer_ids_equal"]):
            raise ToolError(f"parity check failed (max |logit diff| fp32 {parity['max_abs_logit_diff_fp32']:.3g}, "
                            f"tolerance {FP32_TOLERANCE:g}; tokenizer ids equal: {parity['tokenizer_ids_equal']}); "
                            f"nothing was written to {out}")
        record = {"format": 1, "checkpoint": str(trained.path.resolve()), "step": trained.step,
                  "architecture": architecture_of(trained.cfg.model), "dtype": dtype_name,
                  "vocab_size": trained.cfg.model.vocab_size, "tokenizer": tok.kind,
                  "tokenizer_sha256": trained.fingerprint["tokenizer_sha256"],
                  "parity": parity if check else "skipped (--no-check)",
                  **({"document_mask": DOCUMENT_MASK_NOTE} if trained.cfg.model.document_mask else {}),
                  "write_s": round(written_s, 3), "total_s": round(time.perf_counter() - started, 3),
                  "files": {p.name: file_sha256(p) for p in sorted(tmp.iterdir())}}
        (tmp / EXPORT_FILE).write_text(json.dumps(record, indent=1) + "\n")
        open_to_readers(tmp)
        publish_folder(tmp, out)  # replaces an empty folder; a non-empty one (a race) fails here
        return record
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def quiet_transformers() -> None:
    """For the CLIs that load with transformers (export, eval): its load reports and progress bars
    would bury their one line."""
    import transformers

    transformers.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()
