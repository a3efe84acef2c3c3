"""A real full disk (a small tmpfs) under run.dir while training appends to its logs: one error
line, exit 4, no torn line, the lock released; with space again the run resumes exactly."""
from __future__ import annotations

import errno
import json
import os
import subprocess
import time

import pytest

from helpers import ROOT, TINY, events, read_jsonl, run_train, train_cmd

pytestmark = pytest.mark.slow

EXIT_WRITE_FAILED = 4
# WSD: the learning rate of the steps trained before the disk filled does not depend on
# train.total_steps, so the resume (with another length) can audit them.
WSD = ["optim.schedule=wsd", "optim.decay_steps=5"]


@pytest.fixture
def small_disk(tmp_path):
    mount = tmp_path / "disk"
    mount.mkdir()
    made = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=4m", "tmpfs", str(mount)],
                          capture_output=True, text=True)
    if made.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here (needs root): {made.stderr.strip()}")
    yield mount
    subprocess.run(["umount", "-l", str(mount)], check=False)


def fill(disk) -> None:
    with open(disk / "filler", "wb", buffering=0) as f:
        try:
            while True:
                f.write(b"\0" * 4096)
        except OSError as exc:
            assert exc.errno == errno.ENOSPC


def test_enospc_in_the_logs_exits_4_with_one_last_line_and_no_torn_line(small_disk):
    run_dir = small_disk / "run"
    run_train(run_dir, *WSD, "train.total_steps=10", "ckpt.every=10")  # ~0.5 MB checkpoint to resume from
    env = {**os.environ, "OMP_NUM_THREADS": "1", "DS_ACCELERATOR": "cpu"}
    proc = subprocess.Popen(train_cmd() + [f"run.dir={run_dir}", *TINY, *WSD, "train.total_steps=5000",
                                           "ckpt.every=1000"],
                            cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.time() + 120
    while len(read_jsonl(run_dir / "metrics.jsonl")) < 15 and time.time() < deadline:
        assert proc.poll() is None, proc.communicate()
        time.sleep(0.05)
    fill(small_disk)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == EXIT_WRITE_FAILED, err
    # The run's log lines (resume, steps) come first; the failure is said once, in the last line.
    lines = err.strip().splitlines()
    assert "No space left on device" in lines[-1] and ".jsonl" in lines[-1] and lines[-1].startswith("dsslm: "), err
    assert "Traceback" not in err and sum("No space left" in line for line in lines) == 1, err
    for name in ("metrics.jsonl", "events.jsonl"):  # a careless reader: every line must parse
        for line in (run_dir / name).read_text().splitlines():
            json.loads(line)
    assert not (run_dir / "LOCK").exists()
    (small_disk / "filler").unlink()
    run_train(run_dir, *WSD, "train.total_steps=60", "ckpt.every=10")
    audit = events(run_dir, "resume_audit")[-1]
    assert audit["from_step"] == 10 and audit["compared"] >= 4 and audit["verdict"] == "exact", audit
    assert events(run_dir, "end")[-1]["step"] == 60
