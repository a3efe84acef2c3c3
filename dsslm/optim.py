"""AdamW with decay / no-decay groups, Muon for the hidden matrices (`optim.name=muon`), and the
learning rate as a pure function of the step."""
from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn

from dsslm.config import Config, ModelCfg, OptimCfg
from dsslm.config import mup
from dsslm.muon import MuonAdamW, ns_dtype


ROLES = ("embedding", "hidden", "head", "scalars")


def role_of(name: str, param: torch.Tensor, embeddings: set[int]) -> str:
    """A parameter's role: the token embedding (the head too, when tied: one tensor), an untied
    output head, a hidden matrix (attention, MLP), or a vector (norm gains, biases)."""
    if id(param) in embeddings:
        return "embedding"
    if param.dim() < 2:
        return "scalars"
    return "head" if name.split(".")[0] == "lm_head" else "hidden"


def role_rates(cfg: OptimCfg) -> dict[str, float]:
    """Each role's multiplier of the scheduled learning rate (optim.lr_embedding, ...)."""
    return {"embedding": cfg.lr_embedding, "hidden": cfg.lr_hidden, "head": cfg.lr_head, "scalars": cfg.lr_scalars}


def mup_mults(model: nn.Module, cfg: OptimCfg) -> dict[str, float] | None:
    """Each role's muP multiplier of its rate for `model` (dsslm.config.mup.lr_mults), or None under
    the standard parametrisation (then nothing below multiplies anything). Muon's hidden matrices
    take no width factor: Muon's update is already shaped for width (see dsslm.config.mup)."""
    model_cfg = next((m.cfg for m in model.modules() if isinstance(getattr(m, "cfg", None), ModelCfg)), None)
    if model_cfg is None or not mup.enabled(model_cfg):
        return None
    return mup.lr_mults(model_cfg, muon=cfg.name == "muon")


def scaled(rate: float, decay: float, mult: float) -> tuple[float, float]:
    """A rate and its decoupled decay under a muP multiplier: the rate x mult, the decay / mult, so
    the fraction of a weight decayed per step (rate x decay, torch's AdamW and Muon) stays the base's."""
    return (rate, decay) if mult == 1.0 else (rate * mult, decay / mult)


def param_groups(model: nn.Module, cfg: OptimCfg) -> list[dict]:
    """One group per (weight decay, rate multiplier) the roles ask for, decayed groups first: at the
    default multipliers (all 1) the two groups dsslm always had, in the same order, so every
    existing run resumes to the bit. Matrices decay; norm gains, biases and (unless configured)
    embeddings do not: decaying a norm gain pulls it towards 0, which fights the normalisation it
    exists for; the embedding is a lookup table whose rows see few updates, so decay mostly erases
    rare tokens. Each group names its `roles`; a multiplier other than 1 is its `lr_ratio`."""
    embeddings = {id(m.weight) for m in model.modules() if isinstance(m, nn.Embedding)}
    rates, mults = role_rates(cfg), mup_mults(model, cfg)
    groups: dict[tuple[float, float], dict] = {}
    for name, param in model.named_parameters():
        if not param.requires_grad:
            continue
        role = role_of(name, param, embeddings)
        key = (cfg.weight_decay if decays(role, cfg) else 0.0, rates[role])
        if mults is not None:  # muP (model.mup_base_width): the role's rate times its muP multiplier
            rate, decay = scaled(rates[role], key[0], mults[role])
            key = (decay, rate)
        group = groups.setdefault(key, {"params": [], "weight_decay": key[0], "names": [], "roles": []})
        group["params"].append(param)
        group["names"].append(name)
        if role not in group["roles"]:
            group["roles"].append(role)
    ordered = sorted(groups.items(), key=lambda item: item[0][0] == 0.0)  # stable: decayed first, then the rest
    out = []
    for (_, ratio), group in ordered:
        if ratio != 1.0:
            group["lr_ratio"] = ratio
        out.append(group)
    assert_partition(model, [g["params"] for g in out])
    return out


def role_table(model: nn.Module, cfg: OptimCfg) -> dict[str, dict]:
    """{role: {"params": elements, "lr_mult", "weight_decay", "optimizer"}}: what the `start` event
    records of each role (a Muon run's hidden matrices are Muon's, at optim.muon_lr times lr_mult).
    Under muP each role also has its `mup_mult`: its rate is lr_mult x mup_mult times the scheduled
    one, and weight_decay is the one it runs with (divided by mup_mult)."""
    embeddings = {id(m.weight) for m in model.modules() if isinstance(m, nn.Embedding)}
    rates, mults, table = role_rates(cfg), mup_mults(model, cfg), {}
    for name, param in model.named_parameters():
        if param.requires_grad:
            role = role_of(name, param, embeddings)
            muon = cfg.name == "muon" and role == "hidden"
            entry = table.get(role)
            if entry is None:
                decay = muon_weight_decay(cfg) if muon else cfg.weight_decay if decays(role, cfg) else 0.0
                entry = table[role] = {"params": 0, "lr_mult": rates[role], "optimizer": "muon" if muon else "adamw",
                                       "weight_decay": decay}
                if mults is not None:
                    entry["mup_mult"], entry["weight_decay"] = mults[role], scaled(1.0, decay, mults[role])[1]
            entry["params"] += param.numel()
    return table


def decays(role: str, cfg: OptimCfg) -> bool:
    return role in ("hidden", "head") or (role == "embedding" and cfg.decay_embeddings)


def assert_partition(model: nn.Module, groups: list[list[torch.Tensor]]) -> None:
    """Every trainable parameter in exactly one group: a missed one would silently never train."""
    seen: dict[int, int] = {}
    for group in groups:
        for param in group:
            seen[id(param)] = seen.get(id(param), 0) + 1
    wanted = {id(p): n for n, p in model.named_parameters() if p.requires_grad}
    missing = [n for i, n in wanted.items() if i not in seen]
    doubled = [wanted.get(i, "?") for i, count in seen.items() if count > 1]
    extra = [i for i in seen if i not in wanted]
    if missing or doubled or extra:
        raise AssertionError(f"parameter groups are not a partition: missing={missing} "
                             f"in_two_groups={doubled} unknown={len(extra)}")


def adamw_impl(impl: str, device: torch.device) -> str:
    """The AdamW kernel `optim.impl` means on `device`. `auto` is fused on CUDA and on CPU: one
    pass over each tensor instead of one per op. Measured on a 2-core CPU at d 128 (0.83M
    parameters): fused 0.92 ms a step, single-tensor 2.6 ms, foreach 2.9 ms (torch's CPU foreach
    ops loop over tensors in C++ but still make a pass per op). Elsewhere (MPS, XPU), foreach."""
    if impl != "auto":
        return impl
    return "fused" if device.type in ("cuda", "cpu") else "foreach"


def build_adamw(model: nn.Module, cfg: OptimCfg, device: torch.device) -> torch.optim.AdamW:
    """AdamW over the two groups. Every kernel is elementwise per tensor, so its result does not
    depend on how tensors are grouped or flattened (DDP, ZeRO's flat partitions, FSDP's shards):
    a resume with the same kernel continues to the bit; another kernel, within rounding."""
    groups = [{k: v for k, v in g.items() if k not in ("names", "roles")} for g in param_groups(model, cfg)]
    impl = adamw_impl(cfg.impl, device)
    kernel = {"single": {"foreach": False}, "foreach": {"foreach": True}, "fused": {"fused": True}}[impl]
    return torch.optim.AdamW(groups, lr=cfg.peak_lr, betas=(cfg.beta1, cfg.beta2), eps=cfg.eps,
                             weight_decay=cfg.weight_decay, **kernel)


def lr_at(step: int, config: Config) -> float:
    """The planned learning rate of optimizer step `step` (0-based), before lr_scale.

    Pure: the same (step, config) gives the same value in any order of calls, so a resumed run
    follows the plan with no warmup restart.
    """
    cfg, total_steps = config.optim, config.train.total_steps
    if cfg.warmup_steps > 0 and step < cfg.warmup_steps:
        return cfg.peak_lr * (step + 1) / cfg.warmup_steps
    if cfg.schedule == "cosine":
        span = max(1, total_steps - cfg.warmup_steps)
        progress = min(1.0, (step - cfg.warmup_steps) / span)
        return cfg.min_lr + (cfg.peak_lr - cfg.min_lr) * 0.5 * (1.0 + math.cos(math.pi * progress))
    decay_start = total_steps - cfg.decay_steps
    if step < decay_start:
        return cfg.peak_lr
    progress = min(1.0, (step - decay_start + 1) / cfg.decay_steps)
    fraction = 1.0 - progress if cfg.decay_shape == "linear" else 1.0 - math.sqrt(progress)
    return cfg.min_lr + (cfg.peak_lr - cfg.min_lr) * fraction


def decay_start_step(config: Config) -> int | None:
    """First step of the WSD decay phase (the checkpoint before it is kept for cooldown branches)."""
    cfg = config.optim
    return config.train.total_steps - cfg.decay_steps if cfg.schedule == "wsd" else None


def set_lr(optimizer: torch.optim.Optimizer, lr: float) -> None:
    """The planned rate to every group; Muon's group runs at optim.muon_lr / optim.peak_lr of it."""
    for group in optimizer.param_groups:
        group["lr"] = lr * group.get("lr_ratio", 1.0)


# --- Muon ----------------------------------------------------------------------------------------
def muon_groups(model: nn.Module, cfg: OptimCfg) -> list[dict]:
    """Three groups: Muon for the hidden 2-D matrices (attention and MLP projections); AdamW for
    the embedding, an untied head (decayed like today's matrices), norm gains and biases. The
    embedding is a lookup, not a linear map of its input, and the head's rows are scored one by
    one: Muon's orthogonalised update fits neither (Keller Jordan; Moonlight; torch's docs)."""
    adamw = param_groups(model, cfg)
    outer = {id(m.weight) for m in model.modules() if isinstance(m, nn.Embedding)}
    outer |= {id(p) for n, p in model.named_parameters() if n.split(".")[0] in ("lm_head", "tok_emb")}
    hidden, hidden_names = [], []
    for group in adamw:
        keep = [(p, n) for p, n in zip(group["params"], group["names"]) if p.dim() != 2 or id(p) in outer]
        hidden += [p for p in group["params"] if p.dim() == 2 and id(p) not in outer]
        hidden_names += [n for p, n in zip(group["params"], group["names"]) if p.dim() == 2 and id(p) not in outer]
        group["params"], group["names"] = [p for p, _ in keep], [n for _, n in keep]
    assert_partition(model, [hidden] + [g["params"] for g in adamw])
    bad = [n for p, n in zip(hidden, hidden_names) if p.dim() != 2 or id(p) in outer]
    assert not bad and hidden, f"Muon's group must be the hidden 2-D matrices only: {bad or 'none found'}"
    stacked = {id(m.weight): tuple(m.stacked) for m in model.modules() if getattr(m, "stacked", None)}
    blocks = [stacked.get(id(p), ()) if cfg.muon_split else () for p in hidden]
    # muP: the depth factor only (mup_mults' hidden for Muon); the width's is in Muon's own update.
    ratio, decay = scaled(cfg.muon_lr / cfg.peak_lr * cfg.lr_hidden, muon_weight_decay(cfg),
                          (mup_mults(model, cfg) or {"hidden": 1.0})["hidden"])
    muon = {"params": hidden, "names": hidden_names, "blocks": blocks, "muon": True,
            "weight_decay": decay, "momentum": cfg.muon_momentum, "lr_ratio": ratio}
    return [muon] + [{k: v for k, v in g.items() if k != "roles"} for g in adamw if g["params"]]


def muon_weight_decay(cfg: OptimCfg) -> float:
    """Muon's decay coefficient: optim.muon_weight_decay, or (null, the default) the one that takes
    as much off the hidden matrices per step as AdamW takes off its matrices at the same point of
    the schedule. Both decays are decoupled and multiplied by their group's rate (torch's AdamW and
    Muon: p <- p (1 - lr wd)), and Muon's rate is muon_lr / peak_lr times AdamW's, so
    optim.weight_decay alone would decay the matrices that much faster (20x at the defaults)."""
    if cfg.muon_weight_decay is not None:
        return cfg.muon_weight_decay
    return cfg.weight_decay * cfg.peak_lr / cfg.muon_lr


def older_muon(recorded: Any) -> bool:
    """Whether a recorded config (a `start` event's, as a dict) ran Muon as dsslm did before it
    orthogonalised each projection on its own and decayed at AdamW's rate per step (issue 41):
    such a config has no optim.muon_split."""
    optim = recorded.get("optim") if isinstance(recorded, dict) else None
    return isinstance(optim, dict) and optim.get("name") == "muon" and "muon_split" not in optim


def older_muon_note(cfg: OptimCfg, step: int) -> str:
    """The one line a resume of such a run prints: what its updates now do differently."""
    wd = cfg.weight_decay
    return (f"dsslm: this Muon run was saved before issue 41 (qkv and gate_up orthogonalised whole, decay "
            f"optim.weight_decay={wd:g} x Muon's rate): from step {step + 1} its updates differ (each projection "
            f"on its own, decay {muon_weight_decay(cfg):.4g} x Muon's rate, AdamW's per step: "
            f"docs/configuration.md#muon); optim.muon_split=false optim.muon_weight_decay={wd:g} --allow-drift "
            f"optim.muon_split --allow-drift optim.muon_weight_decay keeps the old ones")


def build_optimizer(model: nn.Module, cfg: OptimCfg, device: torch.device) -> torch.optim.AdamW:
    """optim.name: AdamW over its two groups, or MuonAdamW (Muon's group and AdamW's). A sharded
    engine then registers its layout and collectives with MuonAdamW (engine.base.connect_muon)."""
    if cfg.name != "muon":
        return build_adamw(model, cfg, device)
    impl = adamw_impl(cfg.impl, device)
    kernel = {"single": {"foreach": False}, "foreach": {"foreach": True}, "fused": {"fused": True}}[impl]
    return MuonAdamW(muon_groups(model, cfg), ns=ns_dtype(cfg.muon_ns_dtype, device), lr=cfg.peak_lr,
                     betas=(cfg.beta1, cfg.beta2), eps=cfg.eps, weight_decay=cfg.weight_decay, **kernel)
