"""How many chunks one plain rewind names as data (skipped in every later epoch): before c66092f
the whole widened window (the spike step's batch widened to monitor.skip_batches batches), now only
what the spike step read, the widening being a window of positions (this epoch only).

    .venv/bin/python bench/bench_skip_widening.py

On a ~30 KB corpus (as tests/scenarios/test_skip_data.py builds it) and the embedded one, one spike
step at step 41, a batch of 16 sequences of 32 tokens. Prints one line per case.
"""
from __future__ import annotations

import os
import sys
import tempfile
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # this checkout's dsslm
from dsslm.config import MonitorCfg  # noqa: E402
from dsslm.data import prepare  # noqa: E402
from dsslm.data.corpus import default_data_dir  # noqa: E402
from dsslm.data.loader import Loader  # noqa: E402
from dsslm.recovery.rewind import plan_rewind  # noqa: E402


def small_corpus(root: Path) -> Path:
    src, total = root / "src", 0
    src.mkdir()
    for path in sorted(Path(os.__file__).parent.glob("*.py")):
        text = path.read_text(errors="replace")
        if 2_000 < len(text) < 8_000:
            (src / path.name).write_text(text)
            total += len(text)
        if total > 30_000:
            break
    prepare([src], root / "data", domain="code", val_fraction=0.02)
    return root / "data"


def main() -> None:
    batch, spike = 16, 41
    with tempfile.TemporaryDirectory() as tmp:
        for name, data_dir in (("small", small_corpus(Path(tmp))), ("embedded", default_data_dir())):
            loader = Loader(data_dir, 32, 1337)
            for skip_batches in (8, 200):
                plan = plan_rewind(spike, spike, lambda s: ((s - 1) * batch, s * batch), [],
                                   MonitorCfg(skip_batches=skip_batches), batch)
                named = {end: len(set(loader.chunk_ids(np.arange(plan.window[0], end)).tolist()))
                         for end in (plan.window[1], plan.fed_end)}
                print(f"{name}: {loader.n_chunks} chunks, batch {batch}, skip_batches={skip_batches}: window "
                      f"{plan.window}; chunks named as data: whole window (before) {named[plan.window[1]]}, "
                      f"spike step only (now) {named[plan.fed_end]}")


if __name__ == "__main__":
    main()
