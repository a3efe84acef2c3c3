"""slurm/prepare.sbatch on the two-node Slurm harness (tests/scenarios/slurm_cluster.TwoNodeSlurm):
the tokenizer step trains a BPE once, one --part task on each node tokenizes its share of the input
files, the merge writes the domain; the DATA_DIR is the same bytes as one process's prepare."""
from __future__ import annotations

import json
import random
from pathlib import Path

import pytest

from dsslm.data import parts
from dsslm.data.prepare import prepare, quiet_datasets
from helpers import PYTHON, ROOT
from nodes import two_nodes  # noqa: F401 (fixture)
from test_two_nodes import slurm_on_two_nodes  # noqa: F401 (fixture)

pytestmark = [pytest.mark.slurm, pytest.mark.slow]

SBATCH = ROOT / "slurm" / "prepare.sbatch"
JOB_TIMEOUT_S = 300


def write_corpus(folder: Path) -> list[Path]:
    """Two text files of a unit each (parts.UNIT_BYTES) and a small JSONL, the third unit: one node
    makes units 0 and 2, the other unit 1. Few distinct words: the BPE encodes them fast."""
    rng = random.Random(11)
    words = ["alpha", "beta", "gamma", "delta", "naïve", "λx", "def", "return", "(", ")", ":", "\n", "    "]
    folder.mkdir()
    for name in ("a.txt", "b.txt"):
        with open(folder / name, "w") as f:
            while f.tell() < parts.UNIT_BYTES:
                f.write(" ".join(rng.choice(words) for _ in range(2000)) + "\n")
    (folder / "c.jsonl").write_text("".join(json.dumps({"text": " ".join(rng.choice(words) for _ in range(50))}) + "\n"
                                            for _ in range(100)))
    return [folder / "a.txt", folder / "b.txt", folder / "c.jsonl"]


def every_file(folder: Path) -> dict[str, bytes]:
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


def test_prepare_on_two_nodes_writes_the_bytes_one_process_writes(slurm_on_two_nodes, tmp_path):
    from slurm_cluster import FINISHED_STATES
    inputs = write_corpus(tmp_path / "src")
    args = ["--tokenizer", "bpe", "--vocab-size", "300", "--tokenizer-sample", str(1 << 20)]
    out = tmp_path / "data"
    job_id = slurm_on_two_nodes.sbatch(SBATCH, ["--input", *map(str, inputs), "--out", str(out), *args],
                                       ["--nodes=2", f"--output={tmp_path}/%x-%j.out"],
                                       env={"DSSLM_PYTHON": PYTHON, "DSSLM_PREPARE_WORKERS": "1"}, cwd=ROOT)
    log_path = tmp_path / f"dsslm-prepare-{job_id}.out"
    try:
        info = slurm_on_two_nodes.wait_state(job_id, FINISHED_STATES, JOB_TIMEOUT_S)
    except TimeoutError as err:
        raise AssertionError(f"{err}\n{log_path.read_text() if log_path.exists() else ''}") from None
    log = log_path.read_text()
    assert (info["JobState"], info["ExitCode"]) == ("COMPLETED", "0:0"), log
    assert "2 task(s) on 2 node(s)" in log and "step 3/3 (merge) done" in log, log
    assert "prepared part 0/2 of domain 'default'" in log and "2 of 3 units (2 made, 0 reused)" in log, log
    assert "prepared part 1/2 of domain 'default'" in log and "1 of 3 units (1 made, 0 reused)" in log, log

    quiet_datasets()
    reference = tmp_path / "reference"
    prepare(inputs, reference, tokenizer="bpe", vocab_size=300, tokenizer_sample=1 << 20)
    assert every_file(out) == every_file(reference)
    assert sorted(p.name for p in out.iterdir()) == ["default", "manifest.json", "tokenizer.json"]
