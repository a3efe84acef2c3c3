"""Export and import time at configs/125m.yaml (random weights), and the parity figures.

    python bench/bench_hf.py [--dir /tmp] [--repeats 2] [--vocab 32768]

Trains configs/125m.yaml for one step (model.seq_len=128, one sequence: the weights stay about
random, their shapes are the real ones, with a model.vocab_size of --vocab over byte data) and then
prints, as medians of --repeats: the export's time (fp32 and bf16, write and parity check, as
dsslm_export.json records them), the import's (HFWeights.read: headers, SHA-256 of the files,
tensors, layout back to dsslm), the parity figures and the transformers version. Machines are
shared and noisy: read the figures next to `uptime`'s load average, which is printed too.
"""
from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from dsslm.config import CONFIG_DIR, load  # noqa: E402
from dsslm.data import prepare  # noqa: E402
from dsslm.hf.write import export  # noqa: E402
from dsslm.hf.folder import HFWeights  # noqa: E402
from dsslm.train import train  # noqa: E402
from dsslm.ckpt.trained import open_trained  # noqa: E402


def make_run(root: Path, vocab: int) -> Path:
    (root / "text.txt").write_text(Path(argparse.__file__).read_text())
    prepare([root / "text.txt"], root / "data", tokenizer="byte", val_fraction=0.05)
    cfg = load(CONFIG_DIR / "125m.yaml", [f"run.dir={root / 'run'}", f"data.dir={root / 'data'}",
                                          f"model.vocab_size={vocab}", "model.seq_len=128",
                                          "train.micro_batch_size=1", "train.grad_accum=1", "train.total_steps=1",
                                          "optim.warmup_steps=0", "ckpt.every=1", "train.precision=fp32",
                                          "train.device=cpu", "run.val_every=0", "run.tensorboard=false",
                                          "observe.every=0"])
    assert train(cfg) == 0
    return root / "run"


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--dir", default=tempfile.gettempdir())
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--vocab", type=int, default=32768)
    args = parser.parse_args()
    import transformers
    transformers.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()
    root = Path(tempfile.mkdtemp(prefix="bench-hf-", dir=args.dir))
    try:
        run_dir = make_run(root, args.vocab)
        trained = open_trained(run_dir)
        n_params = sum(p.numel() for p in trained.model.parameters())
        shapes = {n: tuple(p.shape) for n, p in trained.model.named_parameters()}
        print(f"125m.yaml, vocab {args.vocab}: {n_params / 1e6:.1f}M parameters; transformers {transformers.__version__}")
        for dtype in ("fp32", "bf16"):
            records, reads = [], []
            for i in range(args.repeats):
                out = root / f"hf-{dtype}-{i}"
                records.append(export(str(run_dir), out, dtype))
                started = time.perf_counter()
                HFWeights(out, trained.cfg.model, shapes).read()
                reads.append(time.perf_counter() - started)
                shutil.rmtree(out)
            parity = records[-1]["parity"]
            print(f"{dtype}: export {statistics.median(r['total_s'] for r in records):.1f} s "
                  f"(write {statistics.median(r['write_s'] for r in records):.1f} s, the rest the parity check); "
                  f"import read {statistics.median(reads):.2f} s")
            print(f"  parity: max |logit diff| fp32 compute {parity['max_abs_logit_diff_fp32']:.3g}, "
                  f"HF bf16 vs dsslm fp32 {parity['max_abs_logit_diff_bf16']:.3g} "
                  f"(dsslm's own bf16 autocast vs fp32 {parity['dsslm_own_bf16_diff']:.3g}; max |logit| "
                  f"{parity['max_abs_logit']:.3g}), tokenizer ids equal: {parity['tokenizer_ids_equal']}")
        print(f"load average {os.getloadavg()[0]:.2f} {os.getloadavg()[1]:.2f} {os.getloadavg()[2]:.2f}")
    finally:
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
