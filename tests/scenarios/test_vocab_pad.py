"""Checkpoints written before `model.vocab_pad_to` existed (embedding rows = vocabulary) are refused
cleanly under the padded default and resume exactly with `model.vocab_pad_to=1`."""
import json

import pytest
import torch
from safetensors.torch import load_file

from helpers import events, losses_by_step, remanifest, run_train

pytestmark = pytest.mark.slow

STEPS = ("train.total_steps=12", "ckpt.every=6")


def make_legacy(folder) -> None:
    """Strip the key from the checkpoint's config, as a checkpoint from before the key reads."""
    state = json.loads((folder / "state.json").read_text())
    del state["fingerprint"]["config_items"]["model.vocab_pad_to"]
    del state["config"]["model"]["vocab_pad_to"]
    (folder / "state.json").write_text(json.dumps(state))
    remanifest(folder)


def test_unpadded_checkpoint_is_refused_by_name_then_resumes_with_pad_to_1(tmp_path):
    reference = tmp_path / "reference"
    run_train(reference, *STEPS, "model.vocab_pad_to=1")
    legacy = tmp_path / "legacy"
    run_train(legacy, *STEPS, "model.vocab_pad_to=1", "ckpt.async_save=false", "faults.crash_at_step=8", check=False)
    folder = legacy / "checkpoints" / "step-00000006"
    assert load_file(folder / "model.safetensors")["tok_emb.weight"].shape[0] == 257
    make_legacy(folder)

    refused = run_train(legacy, *STEPS, check=False)  # the default pads to 64: 320 rows
    assert refused.returncode == 2
    # The crashed run left its lock: taking it over is a console warning of its own (observe.console).
    line = [text for text in refused.stderr.strip().splitlines() if "took run.dir over from a dead holder" not in text]
    assert len(line) == 1 and "model.vocab_pad_to=1, now 64" in line[0], refused.stderr
    saved = sorted(p.name for p in (legacy / "checkpoints").iterdir())
    assert saved == ["step-00000000", "step-00000006"]  # the start checkpoint and step 6: nothing written

    run_train(legacy, *STEPS, "model.vocab_pad_to=1")
    assert events(legacy, "resume")[-1]["step"] == 6
    ref, got = losses_by_step(reference), losses_by_step(legacy)
    assert all(got[s] == ref[s] for s in range(7, 13))  # exact continuation
    final = load_file(legacy / "checkpoints" / "step-00000012" / "model.safetensors")
    assert all(torch.equal(t, load_file(reference / "checkpoints" / "step-00000012" / "model.safetensors")[n])
               for n, t in final.items())
