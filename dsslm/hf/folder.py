"""Reading a Hugging Face model folder for `run.init_from=hf:HF_DIR`: its config.json, its
safetensors weights (never a pickle) and its tokenizer, checked against the run's data.

Everything in the folder is someone else's file, so it is validated before it is trusted:
config.json's fields (`hf.model_values`), the weight files' names (plain names inside the
folder, chosen as transformers chooses them: `weight_files`), and every tensor's name, shape and
dtype, read from the safetensors headers before any data is loaded. The weight files' SHA-256 go into the run's lineage.

    apply_shape(cfg, hf_dir, data_dir, manifest)   # in setup, before the model is built: model.* from config.json
    HFWeights(hf_dir, cfg.model, engine.param_shapes).read()   # the weights, as dsslm names them
"""
from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import torch

from dsslm.config import HF_PREFIX, Config, ModelCfg, ffn_hidden_of, validate
from dsslm.data.tokenizer import load_tokenizer
from dsslm.durable import file_sha256
from dsslm.hf.convert import EXPORTED_KEYS, PROBE_TEXT, HFError, architecture_of, from_hf, hf_shapes, model_values

CONFIG_FILE = "config.json"
WEIGHTS_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
TOKENIZER_FILE = "tokenizer.json"
PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".ckpt", ".pkl", ".pickle")
_SAFE_NAME = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.-]*\.safetensors")
_SAFE_INDEX = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.-]*\.safetensors\.index\.json")
# Buffers older exports saved; they are computed from the config, never learned.
_DERIVED = re.compile(r"model\.layers\.\d+\.self_attn\.rotary_emb\.inv_freq")
_LAYER = re.compile(r"model\.layers\.(\d{1,9})\.")
_DTYPES = {"F32": torch.float32, "BF16": torch.bfloat16, "F16": torch.float16}


def hf_dir_of(init_from: str) -> Path | None:
    return Path(init_from[len(HF_PREFIX):]) if init_from.startswith(HF_PREFIX) else None


def read_config(hf_dir: Path) -> dict:
    if not hf_dir.is_dir():
        raise HFError("no such folder; name a Hugging Face model folder")
    try:
        config = json.loads((hf_dir / CONFIG_FILE).read_text())
    except FileNotFoundError:
        raise HFError(f"no {CONFIG_FILE} there; name a Hugging Face model folder") from None
    except (OSError, ValueError, RecursionError) as exc:  # RecursionError: JSON nested past the parser's depth
        raise HFError(f"{hf_dir / CONFIG_FILE} is unreadable ({exc})") from None
    if not isinstance(config, dict):
        raise HFError(f"{hf_dir / CONFIG_FILE} is not a JSON object")
    return config


def apply_shape(cfg: Config, hf_dir: Path, data_dir: Path, manifest: dict) -> None:
    """Set model.* from the folder's config.json. A key the user set (in --config or an override,
    `cfg.explicit`) must agree, even at its default value: a disagreement names the key instead of
    training some other shape. The data must use the model's tokenizer."""
    try:
        values = model_values(read_config(hf_dir))
        data_tok = load_tokenizer(data_dir, manifest)
    except ValueError as exc:  # HFError, or a DATA_DIR whose tokenizer does not match its manifest
        raise HFError(f"run.init_from=hf:{hf_dir}: {exc}") from None
    defaults = ModelCfg()
    loaded = "explicit" in vars(cfg)  # by load(): the default file's values (tiny.yaml's QK-norm) are not the user's
    for key, value in values.items():
        now = getattr(cfg.model, key)
        # Set by the user (explicit: even at its default value), or, in a Config built in code (no
        # `explicit`), off its default: it must ask for the folder's value.
        user_set = f"model.{key}" in cfg.explicit or (not loaded and now != getattr(defaults, key))
        if user_set and not _agrees(key, now, value, values):
            raise HFError(f"model.{key}={now!r} disagrees with {hf_dir / CONFIG_FILE} ({EXPORTED_KEYS[key]}="
                          f"{value!r}); drop model.{key} from the config and overrides, or set model.{key}={value!r}")
        setattr(cfg.model, key, value)
    if data_tok.vocab_size > cfg.model.vocab_size:
        raise HFError(f"the data's tokenizer has {data_tok.vocab_size} ids but {hf_dir}'s embedding has "
                      f"{cfg.model.vocab_size} rows; prepare the data with --tokenizer {hf_dir}")
    check_tokenizer(hf_dir, data_tok)
    validate(cfg)
    # Before the model is built: a config.json claiming a shape its weight files do not have must
    # not make the run allocate that shape first (a typo'd hidden_size of 10^6 is terabytes).
    try:
        check_headers(hf_dir, cfg.model)
    except HFError as exc:
        raise HFError(f"run.init_from=hf:{hf_dir}: {exc}") from None


def _agrees(key: str, now: Any, value: Any, values: dict) -> bool:
    """Whether model.{key}=now, as set, asks for the folder's value: 0 for ffn_hidden and
    vocab_size means "derived" (from d_model, from the data), and what it derives to here counts."""
    if key == "ffn_hidden" and now == 0:
        return ffn_hidden_of(values["d_model"], 0) == value
    return now == value or (key == "vocab_size" and now == 0)


def check_tokenizer(hf_dir: Path, data_tok) -> None:
    """The model's tokenizer.json must give the data's ids: a model trained on other ids learns
    nothing from its weights but noise."""
    from tokenizers import Tokenizer

    path = hf_dir / TOKENIZER_FILE
    if not path.is_file():
        raise HFError(f"{hf_dir} has no {TOKENIZER_FILE}, so its tokenizer cannot be checked against the data's; "
                      "add the model's tokenizer.json")
    try:
        tok = Tokenizer.from_file(str(path))
    except Exception as exc:  # the Rust parser's errors are plain Exceptions
        raise HFError(f"{path} is not a tokenizer.json `tokenizers` can read ({exc})") from None
    tok.encode_special_tokens = True  # as dsslm reads data: special strings in text are text
    if tok.encode(PROBE_TEXT, add_special_tokens=False).ids != list(data_tok.encode(PROBE_TEXT)):
        raise HFError(f"{path} gives other ids than the data's tokenizer on a probe text; prepare the data with "
                      f"`python -m dsslm.data prepare --tokenizer {hf_dir}`")


def weight_files(hf_dir: Path) -> tuple[list[str], dict[str, str]]:
    """The safetensors files transformers loads from the folder, and the index's name -> file map
    ({} for one unsharded file). Chosen as transformers 5.x chooses them (modeling_utils'
    _get_resolved_checkpoint_files): config.json's `transformers_weights`, else model.safetensors,
    else the index. A folder can hold more than one of these (a model.safetensors left beside a
    later sharded save): any other order imports, checks and hashes into the lineage weights other
    than those transformers runs."""
    explicit = _transformers_weights(hf_dir)
    if explicit is not None:
        name = explicit
    elif (hf_dir / WEIGHTS_FILE).is_file():
        name = WEIGHTS_FILE
    elif (hf_dir / INDEX_FILE).is_file():
        name = INDEX_FILE
    else:
        pickles = sorted(p.name for p in hf_dir.iterdir() if p.suffix in PICKLE_SUFFIXES)
        if pickles:
            raise HFError(f"{hf_dir} holds only pickle weights ({pickles[0]}); dsslm never unpickles: save the model "
                          "with safetensors (save_pretrained(dir, safe_serialization=True)) and import that")
        raise HFError(f"{hf_dir} has neither {WEIGHTS_FILE} nor {INDEX_FILE}")
    return _read_index(hf_dir, hf_dir / name) if _SAFE_INDEX.fullmatch(name) else ([name], {})


def _transformers_weights(hf_dir: Path) -> str | None:
    """config.json's `transformers_weights`: the file transformers loads before any other. Someone
    else's string, so like the index's file names it must be a plain name of a file in the folder
    (transformers only keeps it from escaping the folder; a pickle it would also take is refused)."""
    if not (hf_dir / CONFIG_FILE).is_file():
        return None
    value = read_config(hf_dir).get("transformers_weights")
    if value is None:
        return None
    if not isinstance(value, str) or not (_SAFE_NAME.fullmatch(value) or _SAFE_INDEX.fullmatch(value)):
        raise HFError(f"{hf_dir / CONFIG_FILE}: transformers_weights={value!r} must be a plain *.safetensors or "
                      f"*.safetensors.index.json file name in {hf_dir}; fix it or remove the key")
    if not (hf_dir / value).is_file():
        raise HFError(f"{hf_dir / CONFIG_FILE}: transformers_weights names {value}, which is not in {hf_dir}; "
                      "fix it or remove the key")
    return value


def _read_index(hf_dir: Path, index: Path) -> tuple[list[str], dict[str, str]]:
    try:
        weight_map = json.loads(index.read_text())["weight_map"]
    except (OSError, ValueError, KeyError, TypeError, RecursionError) as exc:
        raise HFError(f"{index} is unreadable or has no weight_map ({exc})") from None
    if not isinstance(weight_map, dict) or not all(
            isinstance(k, str) and isinstance(v, str) and _SAFE_NAME.fullmatch(v) for k, v in weight_map.items()):
        raise HFError(f"{index}: weight_map must map names to plain *.safetensors file names in {hf_dir}")
    files = sorted(set(weight_map.values()))
    missing = [f for f in files if not (hf_dir / f).is_file()]
    if missing:
        raise HFError(f"{index} names {missing[0]}, which is not in {hf_dir}")
    return files, weight_map


def read_weights(hf_dir: Path, cfg: ModelCfg) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """Every tensor a `cfg` model needs, by HF name, after checking each header; and the lineage
    record (the folder, its architecture and the weight files' SHA-256)."""
    from safetensors import safe_open

    files, want, found = check_headers(hf_dir, cfg)
    tensors: dict[str, torch.Tensor] = {}
    for name in files:
        keys = [k for k in sorted(want) if found[k][0] == name]
        if cfg.tie_embeddings and found.get("lm_head.weight", ("",))[0] == name:
            keys.append("lm_head.weight")
        with safe_open(hf_dir / name, framework="pt") as f:
            for k in keys:
                tensors[k] = f.get_tensor(k)
                bad = int((~torch.isfinite(tensors[k])).sum())
                if bad:  # a run from these would train to NaN (or escalate) having written checkpoints
                    raise HFError(f"{hf_dir}: {k} in {name} holds {bad} non-finite value(s); a folder to train "
                                  "from must hold finite weights")
    head = tensors.pop("lm_head.weight", None) if cfg.tie_embeddings else None
    if head is not None and not torch.equal(head, tensors["model.embed_tokens.weight"]):
        raise HFError(f"{hf_dir}: tie_word_embeddings is true but lm_head.weight differs from the embedding")
    record = {"run_dir": "", "step": 0, "checkpoint": f"{HF_PREFIX}{hf_dir.resolve()}", "source": "huggingface",
              "architecture": architecture_of(cfg), "files": {n: file_sha256(hf_dir / n) for n in files}}
    return tensors, record


def check_headers(hf_dir: Path, cfg: ModelCfg) -> tuple[list[str], dict, dict]:
    """The weight files' safetensors headers (names, shapes, dtypes: nothing else is read) against
    the shapes `cfg` (the folder's config.json) claims: HFError naming the first disagreement.
    Returns the files, the wanted shapes by HF name, and what each header holds."""
    from safetensors import safe_open

    files, weight_map = weight_files(hf_dir)
    found: dict[str, tuple[str, tuple, str]] = {}
    for name in files:
        try:
            with safe_open(hf_dir / name, framework="pt") as f:
                for key in f.keys():
                    view = f.get_slice(key)
                    if key in found:
                        raise HFError(f"{hf_dir}: tensor {key} is in both {found[key][0]} and {name}")
                    found[key] = (name, tuple(view.get_shape()), view.get_dtype())
        except HFError:
            raise
        except Exception as exc:  # safetensors' header errors
            raise HFError(f"{hf_dir / name} is not a readable safetensors file ({exc})") from None
    # The layer count from the headers first: the table of wanted shapes grows with config.json's
    # claim, and a claim of 10^8 layers would fill the memory before any comparison said no.
    layers = {int(m.group(1)) for key in found if (m := _LAYER.match(key))}
    if cfg.n_layers != len(layers) or (layers and max(layers) != len(layers) - 1):
        raise HFError(f"{hf_dir}: config.json says num_hidden_layers={cfg.n_layers}, the weight files hold "
                      f"{len(layers)} layer(s); the weights do not fit its config.json")
    want = hf_shapes(cfg)
    _check_found(hf_dir, found, want, weight_map, cfg)
    return files, want, found


def _check_found(hf_dir: Path, found: dict, want: dict, weight_map: dict, cfg: ModelCfg) -> None:
    extra = sorted(k for k in set(found) - set(want) if not _DERIVED.fullmatch(k)
                   and not (k == "lm_head.weight" and cfg.tie_embeddings))
    missing = sorted(set(want) - set(found))
    if missing or extra:
        what = f"no tensor {missing[0]}" if missing else f"tensor {extra[0]}, which a {architecture_of(cfg)} has not"
        raise HFError(f"{hf_dir}: {what}; the weights do not fit its config.json")
    for key, (name, shape, dtype) in found.items():
        if key in weight_map and weight_map[key] != name:
            raise HFError(f"{hf_dir}: {key} is in {name}, the index says {weight_map[key]}")
        if key in want and (shape != want[key] or dtype not in _DTYPES):
            raise HFError(f"{hf_dir / name}: {key} is {list(shape)} {dtype}, its config.json needs "
                          f"{list(want[key])} in F32, BF16 or F16")


class HFWeights:
    """The weights of `run.init_from=hf:HF_DIR`, as dsslm names them, for Checkpointer.start_from."""

    def __init__(self, hf_dir: Path, cfg: ModelCfg, shapes: dict[str, tuple]):
        self.hf_dir, self.cfg, self.shapes = hf_dir, cfg, shapes

    def read(self, expect: dict | None = None) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
        """`expect`: the record rank 0 read; another rank must read the same files."""
        hf, record = read_weights(self.hf_dir, self.cfg)
        if expect is not None and record["files"] != expect["files"]:
            raise HFError(f"{self.hf_dir}: its weight files changed while the job started; start it again")
        return from_hf(hf, self.cfg, self.shapes), record
