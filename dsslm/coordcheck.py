"""`python -m dsslm.coordcheck [--widths 64,128,256,512,1024] [--steps N] [--mup-base-width N] [--out DIR]`

The coordinate check of muP (Tensor Programs V, section 5 and the `mup` package's coord_check):
train the same model a few steps at several widths (d_model; the head count, depth and everything
else fixed) and record each layer's activation scale, mean |x| over a fixed batch, at every step.
Under muP (model.mup_base_width > 0) every curve is flat in width: the slope of log scale against
log width stays near 0 after the first steps. Under the standard parametrisation
(--mup-base-width 0) the learned part of the activations grows with width (the logits fastest),
which is why a learning rate tuned narrow overshoots wide. Prints a table (the last step), writes
coord.json (every step) and, with matplotlib installed, coord.png.

The text is the Python standard library's own source as bytes (what dsslm's embedded corpus is
made of, read here directly: nothing is downloaded or prepared). Bad input: one line, exit 2.
"""
from __future__ import annotations

import argparse
import json
import math
import sys
import sysconfig
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from dsslm.config import ConfigError, load
from dsslm.model import build_model
from dsslm.optim import build_optimizer, set_lr

DEFAULT_WIDTHS = (64, 128, 256, 512, 1024)
TEXT_BYTES = 1 << 20  # sampled windows of the first ~1 MB of the stdlib's top-level modules


def stdlib_bytes(limit: int = TEXT_BYTES) -> torch.Tensor:
    """The first `limit` bytes of the stdlib's top-level .py files in sorted order, as token ids."""
    stdlib, chunks, size = Path(sysconfig.get_paths()["stdlib"]), [], 0
    for path in sorted(stdlib.glob("*.py")):
        data = path.read_bytes()
        chunks.append(data)
        size += len(data)
        if size >= limit:
            break
    return torch.frombuffer(bytearray(b"".join(chunks)[:limit]), dtype=torch.uint8).long()


def batches(text: torch.Tensor, steps: int, batch: int, seq_len: int, seed: int) -> list[torch.Tensor]:
    """`steps` batches of [batch, seq_len + 1] windows: the same ones at every width."""
    gen = torch.Generator().manual_seed(seed)
    starts = torch.randint(0, text.numel() - seq_len - 1, (steps, batch), generator=gen)
    return [torch.stack([text[s:s + seq_len + 1] for s in row.tolist()]) for row in starts]


def layer_modules(model) -> dict[str, torch.nn.Module]:
    """What is measured, in the order of the forward: the embedding, each block's attention and MLP
    branch (before any depth multiplier) and the residual stream after it, the final norm."""
    out = {"embedding": model.tok_emb}
    for i, block in enumerate(model.blocks):
        out.update({f"block{i}.attn": block.attn, f"block{i}.mlp": block.mlp, f"block{i}.resid": block})
    out["final_norm"] = model.norm
    return out


def train_width(width: int, args: argparse.Namespace, data: list[torch.Tensor]) -> dict[str, list[float]]:
    """{layer: mean |x| at each step's forward (step 0: the initial weights)} for one width."""
    overrides = [f"model.d_model={width}", f"model.n_heads={args.heads}", f"model.n_layers={args.layers}",
                 f"model.seq_len={args.seq_len}", "model.vocab_size=256", f"model.mup_base_width={args.mup_base_width}",
                 f"model.mup_base_depth={args.mup_base_depth}", f"optim.name={args.optimizer}",
                 f"optim.peak_lr={args.lr}", "optim.min_lr=0", "optim.warmup_steps=0", "train.device=cpu",
                 # The check's model, not tiny.yaml's recipe: GPT-2's init and no QK-norm, so the figures
                 # in docs/mup.md stay comparable across changes of the default (QK-norm would hide the
                 # scores' growth that muP's 1/d_head attention exists to prevent).
                 f"model.init_std={args.init_std}", f"model.qk_norm={args.qk_norm}"]
    cfg = load(None, overrides)
    torch.manual_seed(args.seed)
    model = build_model(cfg.model)
    optimizer = build_optimizer(model, cfg.optim, torch.device("cpu"))
    set_lr(optimizer, args.lr)  # constant: the check is about the rate's effect at each width, not a schedule
    scales: dict[str, list[float]] = {name: [] for name in [*layer_modules(model), "logits"]}

    def record(name):
        return lambda module, inputs, output: scales[name].append(float(output.detach().abs().float().mean()))
    handles = [m.register_forward_hook(record(n)) for n, m in layer_modules(model).items()]
    try:
        for batch in data:
            logits = model(batch[:, :-1])
            scales["logits"].append(float(logits.detach().abs().mean()))
            loss = F.cross_entropy(logits.flatten(0, 1), batch[:, 1:].flatten())
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), args.clip)
            optimizer.step()
    finally:
        for handle in handles:
            handle.remove()
    return scales


def slope(widths: list[int], values: list[float]) -> float:
    """The least-squares slope of log(value) against log(width): 0 is flat, 1 grows like width."""
    xs, ys = [math.log(w) for w in widths], [math.log(max(v, 1e-30)) for v in values]
    mx, my = sum(xs) / len(xs), sum(ys) / len(ys)
    return sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sum((x - mx) ** 2 for x in xs)


def coord_check(args: argparse.Namespace) -> dict:
    """Every width trained on the same batches from the same seed; the record coord.json holds."""
    data = batches(stdlib_bytes(), args.steps, args.batch, args.seq_len, args.seed)
    per_width, times = {}, {}
    for width in args.widths:
        started = time.perf_counter()
        per_width[width] = train_width(width, args, data)
        times[width] = round(time.perf_counter() - started, 2)
    layers = list(per_width[args.widths[0]])
    scales = {layer: {str(w): per_width[w][layer] for w in args.widths} for layer in layers}
    last = {layer: [per_width[w][layer][-1] for w in args.widths] for layer in layers}
    return {"parametrisation": f"muP, base width {args.mup_base_width}" if args.mup_base_width else "standard",
            "widths": args.widths, "steps": args.steps, "lr": args.lr, "optimizer": args.optimizer,
            "layers_per_model": args.layers, "heads": args.heads, "seq_len": args.seq_len, "batch": args.batch,
            "mup_base_width": args.mup_base_width, "mup_base_depth": args.mup_base_depth, "seed": args.seed,
            "scales": scales, "slope_last_step": {layer: slope(args.widths, v) for layer, v in last.items()},
            "ratio_last_step": {layer: v[-1] / v[0] for layer, v in last.items()}, "seconds_per_width": times}


def table(record: dict) -> str:
    """The last step's mean |x| per layer and width, with the log-log slope and widest / narrowest."""
    widths = record["widths"]
    head = f"{'layer':<14}" + "".join(f"{w:>10}" for w in widths) + f"{'slope':>8}{'ratio':>10}"
    rows = [f"{record['parametrisation']}, step {record['steps'] - 1} (after {record['steps'] - 1} updates), "
            f"lr {record['lr']:g}, {record['optimizer']}: mean |x|", head]
    for layer, per in record["scales"].items():
        rows.append(f"{layer:<14}" + "".join(f"{per[str(w)][-1]:>10.4g}" for w in widths)
                    + f"{record['slope_last_step'][layer]:>8.2f}{record['ratio_last_step'][layer]:>10.3g}")
    return "\n".join(rows)


def plot(record: dict, path: Path) -> bool:
    """coord.png: one panel per step shown (the first, a middle one, the last), mean |x| against
    width on log axes, a line per layer. False where matplotlib is not installed."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    steps = sorted({0, record["steps"] // 2, record["steps"] - 1})
    fig, axes = plt.subplots(1, len(steps), figsize=(4.5 * len(steps), 4), sharey=True, squeeze=False)
    for ax, step in zip(axes[0], steps):
        for layer, per in record["scales"].items():
            ax.plot(record["widths"], [per[str(w)][step] for w in record["widths"]], marker="o", label=layer)
        ax.set(xscale="log", yscale="log", xlabel="width (d_model)", title=f"step {step}")
        ax.set_xticks(record["widths"], [str(w) for w in record["widths"]])
    axes[0][0].set_ylabel("mean |x|")
    axes[0][-1].legend(fontsize=6, loc="best")
    fig.suptitle(f"coordinate check: {record['parametrisation']}, lr {record['lr']:g}")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return True


def _widths(text: str) -> list[int]:
    try:
        widths = [int(w) for w in text.split(",") if w.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a comma-separated list of widths, e.g. 64,128,256") from None
    if len(widths) < 2 or any(w < 1 for w in widths) or widths != sorted(set(widths)):
        raise argparse.ArgumentTypeError(f"{text!r}: give at least two increasing widths >= 1, e.g. 64,128,256")
    return widths


class OneLineParser(argparse.ArgumentParser):
    def error(self, message):  # one line on stderr and exit 2, as every dsslm CLI (ckpt.trained's)
        self.exit(2, f"{self.prog}: error: {message}; see --help\n")


def parse(argv: list[str] | None) -> argparse.Namespace:
    parser = OneLineParser(prog="python -m dsslm.coordcheck", description=__doc__.split("\n\n")[1])
    parser.add_argument("--widths", type=_widths, default=list(DEFAULT_WIDTHS), help="d_model values (64,...,1024)")
    parser.add_argument("--steps", type=int, default=5, help="forwards recorded; updates between them (5)")
    parser.add_argument("--mup-base-width", type=int, default=64, help="model.mup_base_width (0: standard; 64)")
    parser.add_argument("--mup-base-depth", type=int, default=0, help="model.mup_base_depth (0: off)")
    parser.add_argument("--lr", type=float, default=1e-2, help="AdamW's constant rate (1e-2)")
    parser.add_argument("--optimizer", choices=("adamw", "muon"), default="adamw")
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--heads", type=int, default=4, help="fixed across widths: head_dim grows with width")
    parser.add_argument("--seq-len", type=int, default=64)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--clip", type=float, default=1.0, help="global grad-norm bound (optim.clip's default)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--init-std", type=float, default=0.02, help="model.init_std (GPT-2's 0.02)")
    parser.add_argument("--qk-norm", action="store_true", help="model.qk_norm=true (off: the scores show muP's 1/d_head)")
    parser.add_argument("--out", default="coordcheck", metavar="DIR", help="where coord.json and coord.png go")
    args = parser.parse_args(argv)
    bad = [f"--{k.replace('_', '-')}={getattr(args, k)} must be >= {low}" for k, low in
           (("steps", 2), ("mup_base_width", 0), ("mup_base_depth", 0), ("layers", 1), ("heads", 1),
            ("seq_len", 2), ("batch", 1)) if getattr(args, k) < low]
    bad += [f"--widths: {w} is not a multiple of 2 x --heads={args.heads} (each head's dimension must be even "
            "for RoPE)" for w in args.widths if w % (2 * args.heads)][:1]
    bad += [f"--{k}={getattr(args, k)} must be a finite number > 0" for k in ("lr", "clip")
            if not (0 < getattr(args, k) < math.inf)]
    if bad:
        parser.error("; ".join(bad))
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    out = Path(args.out)
    try:
        out.mkdir(parents=True, exist_ok=True)
        record = coord_check(args)
        (out / "coord.json").write_text(json.dumps(record, indent=1) + "\n")
        drawn = plot(record, out / "coord.png")
    except (ConfigError, OSError) as exc:
        print(f"dsslm.coordcheck: error: {' '.join(str(exc).split())}", file=sys.stderr)
        return 2
    print(table(record))
    print(f"wrote {out / 'coord.json'}" + (f" and {out / 'coord.png'}" if drawn else
                                             " (no coord.png: matplotlib is not installed)"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
