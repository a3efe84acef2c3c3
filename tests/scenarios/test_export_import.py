"""Export to a folder transformers loads, and import back with run.init_from=hf:HF_DIR.

Two tiny runs, trained once per module: a byte model (tied, Llama) and a BPE model with QK-norm
and an untied head (Qwen3). transformers as installed does the loading: no custom code."""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from dsslm import export as export_cli
from dsslm.durable import file_sha256
from dsslm.ckpt.format import MANIFEST
from dsslm.config import load
from dsslm.data import prepare
from dsslm.data.tokenizer import ByteTokenizer
from dsslm.hf.folder import HFWeights, read_config
from dsslm.train import main as train_main
from dsslm.train import train
from dsslm.ckpt.trained import open_trained
from helpers import TINY, events, losses_by_step, run_train, tiny_cfg

transformers = pytest.importorskip("transformers")
MULTIBYTE = "naïve café — 日本語 🙂 ß∑ \t\n  <|endoftext|> end"
STEPS = 6


def corpus(folder: Path) -> Path:
    import pydoc_data.topics
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "prose.txt").write_text("\n\n".join(pydoc_data.topics.topics.values())[:30_000] + MULTIBYTE)
    return folder


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("runs")
    src = corpus(root / "src")
    prepare([src], root / "byte", tokenizer="byte", val_fraction=0.1)
    prepare([src], root / "bpe", tokenizer="bpe", vocab_size=400, val_fraction=0.1)
    out = {"byte_data": root / "byte", "bpe_data": root / "bpe"}
    for name, overrides in (("byte", ()), ("bpe", ("model.qk_norm=true", "model.tie_embeddings=false"))):
        run_dir = root / name
        cfg = tiny_cfg(run_dir, f"data.dir={root / name}", f"train.total_steps={STEPS}", "ckpt.every=3",
                       "ckpt.async_save=false", *overrides)
        assert train(cfg) == 0
        out[name] = run_dir
    return out


def export_main(capsys, *argv: str) -> tuple[int, str, str]:
    rc = export_cli.main([*map(str, argv)])
    captured = capsys.readouterr()
    return rc, captured.out, captured.err


def probe(vocab: int) -> torch.Tensor:
    return torch.randint(0, vocab, (2, 32), generator=torch.Generator().manual_seed(5))


@torch.no_grad()
@pytest.mark.parametrize("name, arch", [("byte", "LlamaForCausalLM"), ("bpe", "Qwen3ForCausalLM")])
def test_export_loads_in_transformers_matches_logits_and_generates(runs, tmp_path, capsys, name, arch):
    rc, out, err = export_main(capsys, runs[name], "--out", tmp_path / "hf")
    assert rc == 0, err
    assert "tokenizer ids equal" in out
    model = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf").eval()
    tok = transformers.AutoTokenizer.from_pretrained(tmp_path / "hf")
    assert type(model).__name__ == arch
    trained = open_trained(runs[name])
    x = probe(trained.cfg.model.vocab_size)
    diff = (model(x).logits - trained.model(x)).abs().max()
    assert diff <= 1e-4, diff
    prompt = tok("def f(x):", return_tensors="pt")
    generated = model.generate(**prompt, max_new_tokens=8, do_sample=False)
    assert generated.shape[1] > prompt["input_ids"].shape[1]
    record = json.loads((tmp_path / "hf" / "dsslm_export.json").read_text())
    assert record["step"] == STEPS and record["architecture"] == arch
    assert record["parity"]["max_abs_logit_diff_fp32"] <= 1e-4 and record["parity"]["tokenizer_ids_equal"]
    assert (name == "byte") == model.config.tie_word_embeddings
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]  # no temp folder left


def test_byte_tokenizer_in_hf_gives_dsslm_ids_on_multibyte_text(runs, tmp_path, capsys):
    assert export_main(capsys, runs["byte"], "--out", tmp_path / "hf")[0] == 0
    tok = transformers.AutoTokenizer.from_pretrained(tmp_path / "hf")
    ours = ByteTokenizer()
    assert tok(MULTIBYTE)["input_ids"] == ours.encode(MULTIBYTE) == list(MULTIBYTE.encode())
    assert tok.eos_token_id == ours.eos_id and tok.decode(ours.encode(MULTIBYTE)) == MULTIBYTE


def test_bf16_export_loads_sharded_and_imports_rounded(runs, tmp_path, capsys):
    rc, _, err = export_main(capsys, runs["bpe"], "--out", tmp_path / "hf", "--dtype", "bf16",
                             "--max-shard-size", "40KB")
    assert rc == 0, err
    index = json.loads((tmp_path / "hf" / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 1
    model = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf", dtype="auto")
    assert next(model.parameters()).dtype == torch.bfloat16
    trained = open_trained(runs["bpe"])
    shapes = {n: tuple(p.shape) for n, p in trained.model.named_parameters()}
    imported, _ = HFWeights(tmp_path / "hf", trained.cfg.model, shapes).read()
    for name, param in trained.model.named_parameters():
        assert torch.equal(imported[name], param.detach().bfloat16().float()), name


def test_qk_norm_model_is_refused_where_transformers_lacks_qwen3(runs, tmp_path, capsys, monkeypatch):
    monkeypatch.setattr("dsslm.hf.convert.QWEN3", "Qwen9ForCausalLM")  # what an old transformers offers: nothing
    rc, _, err = export_main(capsys, runs["bpe"], "--out", tmp_path / "hf")
    assert rc == 2 and len(err.strip().splitlines()) == 1 and "Qwen9ForCausalLM" in err
    assert list(tmp_path.iterdir()) == []


def test_a_failed_parity_check_leaves_nothing_that_looks_exported(runs, tmp_path, capsys, monkeypatch):
    # The classic conversion bug: q/k rows left in dsslm's interleaved RoPE order.
    monkeypatch.setattr("dsslm.hf.convert.rope_order", lambda head_dim: torch.arange(head_dim))
    rc, _, err = export_main(capsys, runs["byte"], "--out", tmp_path / "hf")
    assert rc == 2 and len(err.strip().splitlines()) == 1 and "parity check failed" in err
    assert list(tmp_path.iterdir()) == []


def test_out_must_be_new_or_empty(runs, tmp_path, capsys):
    (tmp_path / "empty").mkdir()
    assert export_main(capsys, runs["byte"], "--out", tmp_path / "empty")[0] == 0
    assert (tmp_path / "empty" / "config.json").is_file()
    before = sorted(p.name for p in (tmp_path / "empty").iterdir())
    rc, _, err = export_main(capsys, runs["byte"], "--out", tmp_path / "empty")  # a previous export too
    assert rc == 2 and "not empty" in err and sorted(p.name for p in (tmp_path / "empty").iterdir()) == before


def corrupt(run_dir: Path, tmp_path: Path, how: str) -> Path:
    copy = tmp_path / "run"
    shutil.copytree(run_dir, copy)
    ckpt = copy / "checkpoints" / f"step-{STEPS:08d}"
    if how == "flipped_byte":
        data = bytearray((ckpt / "model.safetensors").read_bytes())
        data[len(data) // 2] ^= 1
        (ckpt / "model.safetensors").write_bytes(bytes(data))
    else:  # a wrong shape in state.json, with a MANIFEST that matches it: the hashes prove nothing
        state = json.loads((ckpt / "state.json").read_text())
        state["config"]["model"]["d_model"] = 64
        (ckpt / "state.json").write_text(json.dumps(state))
        manifest = json.loads((ckpt / MANIFEST).read_text())
        manifest["files"]["state.json"] = {"sha256": file_sha256(ckpt / "state.json"),
                                           "size": (ckpt / "state.json").stat().st_size}
        (ckpt / MANIFEST).write_text(json.dumps(manifest))
    return ckpt


@pytest.mark.parametrize("how", ["flipped_byte", "rehashed_wrong_shape"])
def test_corrupted_checkpoint_exits_2_and_a_run_dir_falls_back(runs, tmp_path, capsys, how):
    ckpt = corrupt(runs["byte"], tmp_path, how)
    rc, _, err = export_main(capsys, ckpt, "--out", tmp_path / "hf")
    assert rc == 2 and len(err.strip().splitlines()) == 1 and ckpt.name in err
    assert not (tmp_path / "hf").exists()
    rc, _, err = export_main(capsys, ckpt.parent.parent, "--out", tmp_path / "hf")
    assert rc == 0 and "passed over" in err  # the run dir's next older checkpoint, named on stderr
    assert json.loads((tmp_path / "hf" / "dsslm_export.json").read_text())["step"] == 3


def test_missing_checkpoint_exits_2(tmp_path, capsys):
    rc, _, err = export_main(capsys, tmp_path / "nope", "--out", tmp_path / "hf")
    assert rc == 2 and len(err.strip().splitlines()) == 1 and "does not exist" in err


# --- import ---------------------------------------------------------------------------------
def exported(runs, name: str, tmp_path: Path, capsys) -> Path:
    assert export_main(capsys, runs[name], "--out", tmp_path / "hf")[0] == 0
    return tmp_path / "hf"


@pytest.mark.slow
@pytest.mark.parametrize("name", ["byte", "bpe"])
def test_round_trip_gives_the_same_weights_to_the_bit_and_the_import_trains(runs, tmp_path, capsys, name):
    hf_dir = exported(runs, name, tmp_path, capsys)
    trained = open_trained(runs[name])
    shapes = {n: tuple(p.shape) for n, p in trained.model.named_parameters()}
    imported, record = HFWeights(hf_dir, trained.cfg.model, shapes).read()
    assert imported.keys() == shapes.keys()
    for n, p in trained.model.named_parameters():
        assert torch.equal(imported[n], p.detach()), n
    run_dir = tmp_path / "imported"
    run_train(run_dir, f"data.dir={runs[name + '_data']}", f"run.init_from=hf:{hf_dir}", "train.total_steps=4",
              "ckpt.every=4", "optim.warmup_steps=1", f"model.qk_norm={name == 'bpe'}")  # TINY pins it: ask the folder's
    assert sorted(losses_by_step(run_dir)) == [1, 2, 3, 4]
    (event,) = events(run_dir, "import")
    assert event["step"] == 0 and event["source"]["files"] == record["files"]
    state = json.loads((run_dir / "checkpoints" / "step-00000004" / "state.json").read_text())
    assert state["train"]["lineage"] == [record]
    adam = load_file(run_dir / "checkpoints" / "step-00000004" / "optim.safetensors")
    assert {float(t) for k, t in adam.items() if k.startswith("step/")} == {4.0}  # a fresh optimizer
    original = json.loads((runs[name] / "checkpoints" / f"step-{STEPS:08d}" / "state.json").read_text())
    # The shape came from config.json; ffn_hidden is now explicit, the width dsslm had derived (8/3 d).
    assert state["config"]["model"] == {**original["config"]["model"], "ffn_hidden": 128}
    # Step 1 trained the exported weights: its loss is theirs on step 1's batch (to the bit, CPU fp32).
    assert losses_by_step(run_dir)[1] == step_one_loss(trained, runs[name + "_data"])


def step_one_loss(trained, data_dir: Path) -> float:
    from dsslm.data import Loader
    from dsslm.loss import token_losses

    cfg = tiny_cfg(Path("unused"), f"data.dir={data_dir}")
    loader = Loader(data_dir, cfg.model.seq_len, cfg.run.seed)
    inputs, targets = loader.read(range(cfg.train.micro_batch_size))  # step 1: the first sequences
    with torch.no_grad():
        ce = token_losses(trained.model(inputs), targets)[0]
    return float(torch.tensor([float(ce.double())], dtype=torch.float64)[0]) / targets.numel()


@pytest.mark.slow
def test_import_on_two_ranks_loads_the_same_weights_everywhere(runs, tmp_path, capsys):
    hf_dir = exported(runs, "byte", tmp_path, capsys)
    common = (f"data.dir={runs['byte_data']}", f"run.init_from=hf:{hf_dir}", "train.total_steps=3",
              "ckpt.every=3", "optim.warmup_steps=1", "train.micro_batch_size=2")
    run_train(tmp_path / "one", *common, "train.grad_accum=2")
    run_train(tmp_path / "two", *common, nproc=2)
    one, two = losses_by_step(tmp_path / "one"), losses_by_step(tmp_path / "two")
    assert one.keys() == two.keys() == {1, 2, 3}
    assert all(abs(one[s] - two[s]) <= 1e-6 for s in one), (one, two)
    assert len(events(tmp_path / "two", "import")) == 1  # rank 0 reports; both ranks loaded


def train_exit(capsys, run_dir: Path, *overrides: str) -> tuple[int, str]:
    rc = train_main([f"run.dir={run_dir}", *TINY, "train.total_steps=2", "optim.warmup_steps=1", *overrides])
    return rc, capsys.readouterr().err


@pytest.mark.parametrize("case", ["pickle_only", "shape", "default_shape", "config_file", "missing", "tokenizer",
                                  "bad_index"])
def test_bad_hf_input_exits_2_with_one_line(runs, tmp_path, capsys, case):
    hf_dir = exported(runs, "byte", tmp_path, capsys)
    data = runs["byte_data"]
    extra: tuple[str, ...] = ()
    if case == "pickle_only":
        (hf_dir / "model.safetensors").rename(hf_dir / "pytorch_model.bin")  # never unpickled: any bytes do
    elif case == "shape":
        extra = ("model.n_layers=3",)
    elif case == "default_shape":  # 4 is model.n_layers' default: the folder's 2 was taken over it, exit 0
        extra = ("model.n_layers=4", "model.n_heads=4")
    elif case == "config_file":  # a key --config sets counts as set too, at its default 1e-6 as well
        (hf_dir / "config.json").write_text(json.dumps({**read_config(hf_dir), "rms_norm_eps": 1e-5}))
        (tmp_path / "c.yaml").write_text("model:\n  norm_eps: 1.0e-6\n")
        extra = ("--config", str(tmp_path / "c.yaml"))
    elif case == "missing":
        hf_dir = tmp_path / "nope"
    elif case == "tokenizer":
        data = runs["bpe_data"]
    else:  # the index is read when there is no model.safetensors (which transformers loads first)
        (hf_dir / "model.safetensors").unlink()
        (hf_dir / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {"x": "../../etc/passwd"}}))
    rc, err = train_exit(capsys, tmp_path / "run", f"data.dir={data}", f"run.init_from=hf:{hf_dir}", *extra)
    assert rc == 2 and len(err.strip().splitlines()) == 1, err
    assert {"pickle_only": "pickle", "shape": "model.n_layers=3", "default_shape": "model.n_layers=4 disagrees",
            "config_file": "model.norm_eps=1e-06 disagrees", "missing": "no such folder",
            "tokenizer": "tokenizer", "bad_index": "weight_map"}[case] in err
    assert not (tmp_path / "run" / "checkpoints").exists()


def test_eval_of_a_folder_whose_weights_miss_a_tensor_exits_2(runs, tmp_path, capsys):
    """transformers fills a tensor its config needs and the files lack with random values: eval
    --tasks scored that model (exit 0, bits/byte 8.06 for a random head). A bad task file is
    refused before the model is loaded, in one line."""
    from safetensors.torch import save_file

    from dsslm import eval as eval_cli
    hf_dir = exported(runs, "byte", tmp_path, capsys)
    task = tmp_path / "t.jsonl"
    task.write_text(json.dumps({"context": "a", "choices": [" b", " c"], "gold": 0}) + "\n")
    for argv, says in (([hf_dir, "--tasks", tmp_path / "none.jsonl"], "no such file"),):
        assert eval_cli.main([*map(str, argv), "--device", "cpu"]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and says in err[0], err
    weights = load_file(hf_dir / "model.safetensors")
    weights["model.norm.weight"][3] = float("nan")
    save_file(weights, hf_dir / "model.safetensors", metadata={"format": "pt"})
    assert eval_cli.main([str(hf_dir), "--tasks", str(task), "--device", "cpu"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "model.norm.weight holds non-finite values" in err[0], err
    del weights["model.layers.1.mlp.down_proj.weight"]
    save_file(weights, hf_dir / "model.safetensors", metadata={"format": "pt"})
    assert eval_cli.main([str(hf_dir), "--tasks", str(task), "--device", "cpu"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "missing keys: model.layers.1.mlp.down_proj.weight" in err[0], err


def test_config_json_reads_what_the_export_wrote(runs, tmp_path, capsys):
    hf_dir = exported(runs, "bpe", tmp_path, capsys)
    config = read_config(hf_dir)
    assert config["architectures"] == ["Qwen3ForCausalLM"] and config["num_key_value_heads"] == 2
    assert config["rope_theta"] == config["rope_parameters"]["rope_theta"] == 10000.0  # 4.x and 5.x readers
    cfg = load(None, [])
    assert config["rms_norm_eps"] == cfg.model.norm_eps and config["tie_word_embeddings"] is False
    tokenizer_config = json.loads((hf_dir / "tokenizer_config.json").read_text())
    # What transformers 4.x needs too (tried with 4.57.1): a class it knows, no token_type_ids.
    assert tokenizer_config["tokenizer_class"] == "PreTrainedTokenizerFast"
    assert tokenizer_config["model_input_names"] == ["input_ids", "attention_mask"]


def test_a_model_key_set_in_code_off_its_default_must_agree_with_the_folder(runs, tmp_path, capsys):
    """A Config built in code has no record of the keys a user set (`Config.explicit` is load()'s):
    a value off its default that disagrees with the folder was silently replaced by the folder's."""
    from dsslm.config import Config
    from dsslm.data.manifest import load_manifest
    from dsslm.hf.convert import HFError
    from dsslm.hf.folder import apply_shape
    hf_dir = exported(runs, "byte", tmp_path, capsys)
    cfg = Config()
    cfg.model.n_layers = 3  # the folder has 2
    with pytest.raises(HFError, match="model.n_layers=3 disagrees"):
        apply_shape(cfg, hf_dir, runs["byte_data"], load_manifest(runs["byte_data"]))
    agreeing = Config()
    apply_shape(agreeing, hf_dir, runs["byte_data"], load_manifest(runs["byte_data"]))
    assert agreeing.model.n_layers == read_config(hf_dir)["num_hidden_layers"]

@torch.no_grad()
@pytest.mark.parametrize("arch", ["LlamaForCausalLM", "Qwen3ForCausalLM"])
def test_import_of_a_folder_transformers_wrote_itself_matches_its_logits(runs, tmp_path, arch):
    """Someone else's model: saved by transformers (sharded, untied, eps 1e-5, rope_theta 5e5)."""
    from dsslm.data import load_manifest
    from dsslm.hf.convert import byte_tokenizer
    from dsslm.hf.folder import apply_shape
    from dsslm.model import build_model

    config_class = transformers.LlamaConfig if arch.startswith("Llama") else transformers.Qwen3Config
    config = config_class(vocab_size=257, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                          num_attention_heads=2, num_key_value_heads=2, head_dim=16, rms_norm_eps=1e-5,
                          rope_parameters={"rope_type": "default", "rope_theta": 5e5}, tie_word_embeddings=False)
    torch.manual_seed(0)
    theirs = getattr(transformers, arch)(config).eval()
    for p in theirs.parameters():
        p.normal_(0, 0.5)  # norm gains too, so a wrong q/k-norm order shows
    theirs.save_pretrained(tmp_path / "hf", max_shard_size="40KB")
    transformers.PreTrainedTokenizerFast(tokenizer_object=byte_tokenizer(), eos_token="<|endoftext|>").save_pretrained(
        tmp_path / "hf")
    assert (tmp_path / "hf" / "model.safetensors.index.json").is_file()
    # Without TINY's explicit qk_norm: tiny.yaml's default (QK-norm on) is not the user's and yields
    # to the folder's architecture either way (a Llama folder under it was refused).
    cfg = load(None, [f"run.dir={tmp_path / 'run'}", *(o for o in TINY if not o.startswith("model.qk_norm")),
                      f"data.dir={runs['byte_data']}", f"run.init_from=hf:{tmp_path / 'hf'}"])
    apply_shape(cfg, tmp_path / "hf", runs["byte_data"], load_manifest(runs["byte_data"]))
    assert (cfg.model.norm_eps, cfg.model.rope_theta, cfg.model.ffn_hidden) == (1e-5, 5e5, 64)
    assert cfg.model.qk_norm == (arch == "Qwen3ForCausalLM") and not cfg.model.tie_embeddings
    ours = build_model(cfg.model).eval()
    shapes = {n: tuple(p.shape) for n, p in ours.named_parameters()}
    ours.load_state_dict(HFWeights(tmp_path / "hf", cfg.model, shapes).read()[0])
    x = probe(257)
    diff = (ours(x) - theirs(x).logits).abs().max()
    assert diff <= 1e-4, diff


def test_a_config_json_claiming_another_shape_than_its_weights_is_refused_before_the_model_is_built(
        runs, tmp_path, capsys, monkeypatch):
    """config.json is someone else's file: its claimed shape must agree with the weight files'
    safetensors headers before a model of that shape is allocated (a typo'd width is terabytes)."""
    from dsslm import job as job_module
    hf_dir = exported(runs, "byte", tmp_path, capsys)
    original = json.loads((hf_dir / "config.json").read_text())
    config = {**original, "hidden_size": 4096, "intermediate_size": 11008,
              "head_dim": 4096 // original["num_attention_heads"]}
    (hf_dir / "config.json").write_text(json.dumps(config))
    built, real = [], job_module.build_model
    monkeypatch.setattr(job_module, "build_model", lambda *a, **k: built.append(1) or real(*a, **k))
    not_shape = [o for o in TINY if not o.startswith("model.")]  # the shape is config.json's
    rc = train_main([f"run.dir={tmp_path / 'run'}", *not_shape, "train.total_steps=2", "optim.warmup_steps=1",
                     f"data.dir={runs['byte_data']}", f"run.init_from=hf:{hf_dir}"])
    err = capsys.readouterr().err
    assert rc == 2 and len(err.strip().splitlines()) == 1, err
    assert "model.embed_tokens.weight is [257, 32] F32, its config.json needs [257, 4096]" in err
    assert built == [] and not (tmp_path / "run" / "checkpoints").exists()
    # A layer count is checked against the headers before a table of its size is built (10^6
    # layers took half a minute and gigabytes to refuse), and JSON nested too deep is one line.
    for text, says in ((json.dumps({**original, "num_hidden_layers": 10**6}),
                        "num_hidden_layers=1000000, the weight files hold 2 layer(s)"),
                       ("[" * 100_000 + "]" * 100_000, "config.json is unreadable")):
        (hf_dir / "config.json").write_text(text)
        rc = train_main([f"run.dir={tmp_path / 'run'}", *not_shape, "train.total_steps=2", "optim.warmup_steps=1",
                         f"data.dir={runs['byte_data']}", f"run.init_from=hf:{hf_dir}"])
        err = capsys.readouterr().err
        assert rc == 2 and len(err.strip().splitlines()) == 1 and says in err, err


@pytest.mark.slow
def test_document_masked_model_exports_with_a_warning_and_matches_on_one_document(runs, tmp_path, capsys):
    run_dir = tmp_path / "masked"
    cfg = tiny_cfg(run_dir, f"data.dir={runs['byte_data']}", "train.total_steps=6", "ckpt.every=6",
                   "ckpt.async_save=false", "model.document_mask=true", "model.document_positions=true")
    assert train(cfg) == 0
    trained = open_trained(run_dir)
    eos = ByteTokenizer().eos_id
    assert trained.cfg.model.eos_id == eos  # taken from the data manifest, kept in the checkpoint
    rc, out, err = export_main(capsys, run_dir, "--out", tmp_path / "hf")
    assert rc == 0, err
    warning = [line for line in err.splitlines() if "warning" in line]
    assert len(warning) == 1 and "model.document_mask" in warning[0] and "one document per sequence" in warning[0]
    record = json.loads((tmp_path / "hf" / "dsslm_export.json").read_text())
    assert "document_mask" in record and record["parity"]["max_abs_logit_diff_fp32"] <= 1e-4
    model = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf").eval()
    one_doc = probe(trained.cfg.model.vocab_size)
    one_doc[one_doc == eos] = 0
    with torch.no_grad():
        assert (model(one_doc).logits - trained.model(one_doc)).abs().max() <= 1e-4  # what it reproduces
        packed = one_doc.clone()
        packed[:, 10] = eos  # two documents a row: transformers attends across the EOS, dsslm does not
        assert (model(packed).logits[:, 11:] - trained.model(packed)[:, 11:]).abs().max() > 1e-3


@torch.no_grad()
def test_the_weight_files_are_the_ones_transformers_loads(tmp_path):
    """transformers 5.x loads config.json's `transformers_weights`, else model.safetensors, else the
    index. dsslm read the index first and ignored `transformers_weights`: a folder holding both a
    model.safetensors and an index was imported (and hashed into the lineage) from the index while
    transformers ran model.safetensors (logits 0.585 apart)."""
    from safetensors.torch import save_file

    from dsslm.config import ModelCfg
    from dsslm.hf.causal_lm import check_hf_weights
    from dsslm.hf.convert import HFError, model_values
    from dsslm.hf.folder import read_weights

    config = transformers.LlamaConfig(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                      num_attention_heads=2, num_key_value_heads=2, head_dim=8)
    hf_dir = tmp_path / "hf"
    models = []
    for seed in range(3):
        torch.manual_seed(seed)
        models.append(transformers.LlamaForCausalLM(config).eval())
    models[0].save_pretrained(hf_dir, max_shard_size="10KB")  # sharded: the index and its shards
    assert (hf_dir / "model.safetensors.index.json").is_file() and not (hf_dir / "model.safetensors").exists()
    for model, name in ((models[1], "model.safetensors"), (models[2], "alt.safetensors")):
        save_file({k: v.contiguous() for k, v in model.state_dict().items()}, hf_dir / name, metadata={"format": "pt"})
    original = json.loads((hf_dir / "config.json").read_text())
    cfg = ModelCfg(**model_values(original))

    def loaded_by_both() -> tuple[str, ...]:
        theirs = transformers.AutoModelForCausalLM.from_pretrained(hf_dir, local_files_only=True).state_dict()
        ours, record = read_weights(hf_dir, cfg)
        check_hf_weights(hf_dir)  # dsslm.eval checks the same files
        assert all(torch.equal(ours[k], theirs[k]) for k in ours)
        return tuple(record["files"])

    assert loaded_by_both() == ("model.safetensors",)  # model.safetensors before the index
    (hf_dir / "config.json").write_text(json.dumps({**original, "transformers_weights": "alt.safetensors"}))
    assert loaded_by_both() == ("alt.safetensors",)
    (hf_dir / "config.json").write_text(json.dumps({**original, "transformers_weights": "model.safetensors.index.json"}))
    assert len(loaded_by_both()) > 1  # the shards
    (hf_dir / "config.json").write_text(json.dumps(original))
    (hf_dir / "model.safetensors").unlink()
    assert len(loaded_by_both()) > 1
    # Someone else's string: a plain name of a safetensors file in the folder, or refused.
    for value, says in (("../hf/alt.safetensors", "must be a plain"), ("pytorch_model.bin", "must be a plain"),
                        (["alt.safetensors"], "must be a plain"), ("gone.safetensors", "gone.safetensors, which is not in")):
        (hf_dir / "config.json").write_text(json.dumps({**original, "transformers_weights": value}))
        with pytest.raises(HFError, match=f"transformers_weights.*{says}"):
            read_weights(hf_dir, cfg)


@torch.no_grad()
def test_an_empty_context_is_scored_after_the_folders_bos_as_lm_eval_does(tmp_path):
    """lm-eval's HFLM scores an empty context after its prefix_token_id: the tokenizer's BOS, else
    EOS. dsslm used EOS, so on a folder whose BOS is not its EOS every such score differed."""
    import math

    from dsslm import eval as eval_cli
    from dsslm.hf.convert import byte_tokenizer

    config = transformers.LlamaConfig(vocab_size=257, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                      num_attention_heads=2, num_key_value_heads=2, head_dim=8,
                                      max_position_embeddings=64)
    torch.manual_seed(0)
    theirs = transformers.LlamaForCausalLM(config).eval()
    theirs.save_pretrained(tmp_path / "hf")
    transformers.PreTrainedTokenizerFast(tokenizer_object=byte_tokenizer(), eos_token="<|endoftext|>",
                                         bos_token="!").save_pretrained(tmp_path / "hf")
    task = tmp_path / "t.jsonl"
    choice = " the cat"
    task.write_text(json.dumps({"context": "", "choices": [choice, " a dog"], "gold": 0}) + "\n")
    result = eval_cli.evaluate_tasks(str(tmp_path / "hf"), [str(task)], 0, None, None, torch.device("cpu"))
    ids = [ord("!"), *choice.encode()]  # BOS "!" is byte 33 of the byte tokenizer; EOS is 256
    logp = torch.log_softmax(theirs(torch.tensor([ids])).logits[0].double(), -1)
    ll = sum(float(logp[i, ids[i + 1]]) for i in range(len(ids) - 1))
    assert result["tasks"]["t"]["bpb"] == pytest.approx(-ll / math.log(2) / len(choice), rel=1e-5)
