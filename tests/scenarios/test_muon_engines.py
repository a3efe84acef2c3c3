"""optim.name=muon on every engine: each block of each hidden matrix (q, k, v; gate, up; the
others whole) orthogonalised once per step, by one rank, so no engine falls back to SGD or AdamW;
on ZeRO and FSDP each matrix assembled on that rank alone, every rank receiving back only its
part; the same curve on DDP, FSDP2 and ZeRO 1/2/3 at 1 and 2 ranks, and the same bits whether the
work is shared or not; the state in the checkpoint layout; a resume to the bit on the same engine,
and a run saved before per-block Muon resuming with one line that says its updates differ."""
from __future__ import annotations

import functools
import math

import pytest
import torch

from helpers import run_distributed
from test_engines import build, make_cfg, plain, run_steps, tensors

pytestmark = pytest.mark.slow
# Three blocks: at 2 ranks ZeRO-1/2's partition boundary then falls inside a matrix, so a matrix
# is made whole from both ranks' fragments (ZeRO-3 splits every matrix anyway).
MUON = ("optim.name=muon", "optim.muon_lr=0.02", "model.n_layers=3")
ENGINES = {"ddp": ("ddp", 1), "fsdp": ("fsdp", 1), "zero1": ("zero", 1), "zero2": ("zero", 2), "zero3": ("zero", 3),
           # bf16 turns ZeRO-1 into DeepSpeed's BF16_Optimizer, a third partition layout
           "ddp_bf16": ("ddp", 1, "train.precision=bf16"), "zero1_bf16": ("zero", 1, "train.precision=bf16"),
           # every rank orthogonalising every matrix itself (optim.muon_distribute=false)
           **{f"{k}_alone": (e, s, "optim.muon_distribute=false") for k, e, s in
              (("ddp", "ddp", 1), ("fsdp", "fsdp", 1), ("zero1", "zero", 1), ("zero3", "zero", 3))}}
SPLIT, TOTAL = 4, 6


class Pieces:
    """A StateReader over the ranks' local_state() pieces, joined: what a sharded checkpoint reads."""

    def __init__(self, pieces: list):
        self.whole: dict = {}
        for key, shape, start, end, values in pieces:
            flat = self.whole.setdefault(key, (shape, torch.zeros(math.prod(shape), dtype=torch.from_numpy(values).dtype)))[1]
            flat[start:end] = torch.from_numpy(values)

    def keys(self):
        return list(self.whole)

    def shape(self, key):
        return tuple(self.whole[key][0])

    def read(self, key, start=0, end=None):
        return self.whole[key][1][start:end].clone()


def muon_worker(rank: int, world_size: int, kind: str, state=None, pieces=None) -> dict:
    """Steps [0, TOTAL) (full state and this rank's local_state pieces kept at SPLIT), or, given a
    full state or all ranks' pieces, the steps after SPLIT from it."""
    from dsslm.engine.state import OptimState
    import torch.distributed as dist
    torch.set_num_threads(1)
    cfg = make_cfg(*ENGINES[kind][:2], *MUON, *ENGINES[kind][2:])
    engine = build(cfg)
    out = {"wire": [0, 0]}  # elements Muon's all-to-alls sent to and received from other ranks
    all_to_all = dist.all_to_all_single
    if world_size > 1:
        def counted(output, input, output_split_sizes, input_split_sizes, *args, **kwargs):
            out["wire"][0] += input.numel() - input_split_sizes[rank]
            out["wire"][1] += output.numel() - output_split_sizes[rank]
            return all_to_all(output, input, output_split_sizes, input_split_sizes, *args, **kwargs)
        dist.all_to_all_single = counted
    if state is None and pieces is None:
        out["curve"] = run_steps(engine, cfg, range(SPLIT), grad_accum=2)
        out["split"] = plain(engine.full_state())
        out["pieces"] = [(s.key, s.shape, s.start, s.end, plain(s.tensor.contiguous())) for s in engine.local_state()]
    else:
        if pieces is not None:
            engine.load_local_state(Pieces(pieces))
        else:
            model_sd, optim = tensors(state)
            engine.load_full_state(model_sd, OptimState(**optim))
        out["curve"] = []
    out["curve"] += run_steps(engine, cfg, range(SPLIT, TOTAL), grad_accum=2)
    muon = getattr(engine.optimizer, "optimizer", engine.optimizer)  # ZeRO wraps ours
    out["counts"] = dict(muon.orthogonalised)
    out["peak"], out["owned"] = muon.buffer_peak, sum(
        math.prod(e.shape) for plan in muon._plans.values() for b in plan for e in b if e.owner == rank)
    out["final"] = plain(engine.full_state())
    engine.close()
    dist.all_to_all_single = all_to_all  # the next run in this process counts its own
    return out


def several(rank: int, world_size: int, jobs: tuple) -> list:
    """Each (worker, *args) of `jobs` in turn in these processes, in one process group that no
    engine owns (as the resume drill runs a second job): a spawn and its imports (DeepSpeed's
    start among them) cost more than a tiny run, and this file makes 23 runs."""
    import torch.distributed as dist
    if world_size > 1:
        dist.init_process_group("gloo")
    try:
        return [worker(rank, world_size, *args) for worker, *args in jobs]
    finally:
        if world_size > 1:
            dist.destroy_process_group()


def run_all(world_size: int, jobs: list[tuple]) -> list[list]:
    """Each job's results by rank, all jobs run in one spawn of `world_size` ranks."""
    by_rank = run_distributed(several, world_size, (tuple(jobs),), timeout_s=600)
    return [[by_rank[r][i] for r in range(world_size)] for i in range(len(jobs))]


# Every straight run a test compares ("adamw": the same model under AdamW), made together per
# world size on first use.
STRAIGHT = {1: ("ddp", "fsdp", "zero3", "ddp_bf16", "adamw"),
            2: ("ddp", "fsdp", "zero1", "zero2", "zero3", "zero1_bf16", "ddp_alone", "fsdp_alone", "zero1_alone",
                "zero3_alone")}


@functools.lru_cache(maxsize=None)
def straight_runs(world_size: int) -> dict[str, list]:
    kinds = STRAIGHT[world_size]
    return dict(zip(kinds, run_all(world_size, [(adamw_worker,) if k == "adamw" else (muon_worker, k) for k in kinds])))


def straight(kind: str, world_size: int) -> list:
    return straight_runs(world_size)[kind]


def hidden_matrices() -> dict[str, int]:
    """Every hidden matrix by name, with its number of elements."""
    from dsslm.model import build_model
    cfg = make_cfg("ddp", 1, *MUON)
    return {n: p.numel() for n, p in build_model(cfg.model).named_parameters() if p.dim() == 2 and n.startswith("blocks.")}


def hidden_blocks() -> list[str]:
    """What Muon orthogonalises: qkv's q, k and v and gate_up's gate and up each on its own."""
    stacks = {"qkv.weight": ("q", "k", "v"), "gate_up.weight": ("gate", "up")}
    return sorted(f"{n}[{b}]" if b else n for n in hidden_matrices()
                  for b in stacks.get(".".join(n.split(".")[-2:]), ("",)))


@pytest.mark.parametrize("kind,world", [("ddp", 1), ("ddp", 2), ("fsdp", 1), ("fsdp", 2), ("zero1", 2),
                                        ("zero2", 2), ("zero3", 1), ("zero3", 2), ("zero1_bf16", 2)])
def test_each_block_is_orthogonalised_once_per_step_by_one_rank(kind, world):
    runs = straight(kind, world)
    held = [set(r["counts"]) for r in runs]
    assert all(set(r["counts"].values()) == {TOTAL} for r in runs), [r["counts"] for r in runs]
    # each block by exactly one rank, both ranks take some, and a matrix's blocks stay together
    assert sorted(n for h in held for n in h) == hidden_blocks() and all(held), held
    assert all(len({r for r, h in enumerate(held) for b in h if b.startswith(n + "[") or b == n}) == 1
               for n in hidden_matrices())
    if world > 1 and not kind.startswith("ddp"):
        # Each matrix assembled on its owner only, and each rank sent back only its part. FSDP and
        # ZeRO-3 hold half of every matrix: half of the elements cross per step each way, where
        # the all-reduce that made every matrix whole on every rank moved all of them, twice.
        # ZeRO-1/2's partitions hold most matrices whole, so only the one cut by the boundary moves.
        elements = sum(hidden_matrices().values())
        for r in runs:
            sent, received = (n / TOTAL for n in r["wire"])
            if kind in ("fsdp", "zero3"):
                assert sent == received == elements / 2, (r["wire"], elements)
            else:
                assert 0 < sent < elements / 4 and 0 < received < elements / 4, (r["wire"], elements)
            # Muon's buffers at their largest: at most the bucket (here every matrix) plus what the rank owns
            assert 0 < r["peak"] <= 4 * (elements + r["owned"]), (r["peak"], elements, r["owned"])
    optim = runs[0]["final"][1]  # rank 0 gets the full state (sharded engines gather to it)
    assert sorted(optim["momentum"]) == sorted(hidden_matrices())  # Muon's state, by name, at full shape
    assert not set(optim["momentum"]) & set(optim["exp_avg"]) and set(optim["step"].values()) == {float(TOTAL)}
    reference = straight("ddp_bf16" if kind.endswith("bf16") else "ddp", 1)[0]["curve"]
    assert all(r["curve"] == runs[0]["curve"] for r in runs)  # every rank reports the same numbers
    # Another engine or world size sums the gradient in another order, and Newton-Schulz's five
    # steps of cubic products amplify that ulp (more so in bf16, the bf16 runs' and a GPU's dtype):
    # 1e-4 relative on the loss over 6 steps.
    for step, ((loss, _), (ref, _)) in enumerate(zip(runs[0]["curve"], reference)):
        assert math.isclose(loss, ref, rel_tol=1e-4), (kind, world, step, loss, ref)
    # And it is Muon, not AdamW: the AdamW run's curve differs well beyond that.
    if (kind, world) == ("ddp", 1):
        adamw = straight("adamw", 1)[0]
        assert abs(adamw[-1][0] - reference[-1][0]) > 1e-3


def adamw_worker(rank: int, world_size: int) -> list:
    torch.set_num_threads(1)
    cfg = make_cfg("ddp", 1, MUON[-1])  # the same model, AdamW
    engine = build(cfg)
    curve = run_steps(engine, cfg, range(TOTAL), grad_accum=2)
    engine.close()
    return curve


@pytest.mark.parametrize("kind", ["ddp", "fsdp", "zero1", "zero3"])
def test_sharing_the_orthogonalisations_changes_no_bit(kind):
    """One rank runs NS on each matrix and hands each rank its part (DDP: all of it): the bits
    every rank would have computed alone (and, alone, every rank orthogonalises every matrix)."""
    shared, alone = straight(kind, 2), straight(f"{kind}_alone", 2)
    assert all(r["counts"] == {name: TOTAL for name in hidden_blocks()} for r in alone)
    assert shared[0]["curve"] == alone[0]["curve"]
    (model_a, optim_a), (model_b, optim_b) = shared[0]["final"], alone[0]["final"]  # rank 0: the full state
    assert model_a and all((model_a[n] == model_b[n]).all() for n in model_a)
    assert sorted(optim_a["momentum"]) == sorted(hidden_matrices())
    assert all((optim_a["momentum"][n] == optim_b["momentum"][n]).all() for n in optim_a["momentum"])


RESUMES = [("ddp", "full"), ("fsdp", "pieces"), ("zero1", "full"), ("zero1", "pieces"), ("zero3", "pieces")]
ACROSS = [("fsdp", "ddp"), ("zero3", "fsdp"), ("ddp", "zero2")]


@functools.lru_cache(maxsize=None)
def resumed_runs() -> dict[tuple, list[dict]]:
    """Every resume the tests below check, from the straight runs' states at SPLIT, in one spawn
    (a process that ran none of the runs it resumes: nothing of a first run is in memory)."""
    jobs = {}
    for kind, through in RESUMES:
        first = straight(kind, 2)
        given = (first[0]["split"], None) if through == "full" else (None, [p for r in first for p in r["pieces"]])
        jobs[(kind, through)] = (muon_worker, kind, *given)
    for saved, resumed in ACROSS:
        jobs[(saved, resumed)] = (muon_worker, resumed, straight(saved, 2)[0]["split"])
    return dict(zip(jobs, run_all(2, list(jobs.values()))))


@pytest.mark.parametrize("kind,through", RESUMES)
def test_resume_continues_to_the_bit_on_the_same_engine(kind, through):
    """Through the full (gathered) state, and through each rank's own pieces (a sharded checkpoint)."""
    first = straight(kind, 2)
    resumed = resumed_runs()[(kind, through)]
    assert resumed[0]["curve"] == first[0]["curve"][SPLIT:]
    (model_a, optim_a), (model_b, optim_b) = first[0]["final"], resumed[0]["final"]
    for name in model_a:
        assert (model_a[name] == model_b[name]).all(), name
    for kind_ in ("momentum", "exp_avg", "exp_avg_sq"):
        for name in optim_a[kind_]:
            assert (optim_a[kind_][name] == optim_b[kind_][name]).all(), (kind_, name)
    assert optim_a["step"] == optim_b["step"]


@pytest.mark.parametrize("saved,resumed", ACROSS)
def test_muon_state_resumes_across_engines_within_the_engines_tolerance(saved, resumed):
    after = resumed_runs()[(saved, resumed)]
    for (loss, _), (ref, _) in zip(after[0]["curve"], straight(saved, 2)[0]["curve"][SPLIT:]):
        assert math.isclose(loss, ref, rel_tol=1e-4)


@pytest.mark.parametrize("engine", [("engine.kind=ddp",), ("engine.kind=zero", "engine.zero_stage=3"),
                                    ("engine.kind=ddp", "ckpt.format=sharded")], ids=["ddp", "zero3", "ddp-sharded"])
def test_a_muon_run_killed_and_resumed_through_its_checkpoint_ends_on_the_same_bits(tmp_path, capsys, engine):
    """Resumed from step 4, not from step 0: a restart from scratch on CPU gives the same bits too,
    so the losses alone cannot tell. (A sharded Muon checkpoint was passed over: its index check
    wanted AdamW's moments for every stepped parameter, and every resume started again at 0.)"""
    from dsslm.train import main
    from helpers import TINY, events, losses_by_step, run_train
    common = [*TINY, *MUON, *engine, "train.total_steps=8", "ckpt.every=4", "ckpt.async_save=false"]
    assert main([f"run.dir={tmp_path / 'straight'}", *common]) == 0
    crashed = run_train(tmp_path / "crashed", *common[len(TINY):], "faults.crash_at_step=6", check=False)
    assert crashed.returncode != 0
    capsys.readouterr()
    assert main([f"run.dir={tmp_path / 'crashed'}", *common]) == 0
    assert "saved before issue 41" not in capsys.readouterr().out
    assert [e["step"] for e in events(tmp_path / "crashed", "resume")] == [4]
    assert not events(tmp_path / "crashed", "passed_over")
    assert losses_by_step(tmp_path / "crashed") == losses_by_step(tmp_path / "straight")
    if "ckpt.format=sharded" in engine:
        return
    from safetensors.torch import load_file
    optim = load_file(tmp_path / "crashed" / "checkpoints" / "step-00000008" / "optim.safetensors")
    assert any(k.startswith("momentum/blocks.") for k in optim) and not any(k.startswith("momentum/tok_emb") for k in optim)


def test_a_run_saved_before_per_block_muon_resumes_and_says_in_one_line_that_its_updates_differ(tmp_path, capsys):
    """Its checkpoint holds one momentum buffer per matrix either way, so it loads; the job that
    wrote the steps after the checkpoint ran the fused update (its config, in its `start` event,
    has no optim.muon_split), so the audit compares nothing and raises no alert."""
    import json
    from dsslm.train import main
    from helpers import TINY, events, run_train
    common = [*MUON, "train.total_steps=8", "ckpt.every=4", "ckpt.async_save=false"]
    run_dir = tmp_path / "old"
    assert run_train(run_dir, *common, "faults.crash_at_step=6", check=False).returncode != 0
    log = run_dir / "events.jsonl"
    lines = [json.loads(line) for line in log.read_text().splitlines()]
    for event in lines:  # what dsslm wrote before issue 41: no such keys
        if event.get("event") == "start":
            del event["config"]["optim"]["muon_split"], event["config"]["optim"]["muon_weight_decay"]
    log.write_text("".join(json.dumps(e) + "\n" for e in lines))
    capsys.readouterr()
    assert main([f"run.dir={run_dir}", *TINY, *common]) == 0
    said = [line for line in capsys.readouterr().out.splitlines() if "saved before issue 41" in line]
    assert len(said) == 1 and "from step 5 its updates differ" in said[0], said
    audit = events(run_dir, "resume_audit")
    assert [a["verdict"] for a in audit] == ["nothing_to_compare"] and "optim.muon_split" in audit[0]["reason"]
    assert not events(run_dir, "alert") and [e["step"] for e in events(run_dir, "resume")] == [4]


@pytest.mark.parametrize("saved, now", [("muon", "adamw"), ("adamw", "muon")])
def test_a_switch_of_optimizer_passed_as_drift_is_refused_with_exit_2_and_one_line(tmp_path, capsys, saved, now):
    """--allow-drift optim.name accepts the config's difference, but no optimizer can read the
    other's state: one line naming both, exit 2, nothing saved (it was a KeyError traceback)."""
    from dsslm.train import main
    from helpers import TINY
    common = [f"run.dir={tmp_path}", *TINY, "optim.muon_lr=0.02", "optim.warmup_steps=2", "ckpt.every=4"]
    assert main([*common, f"optim.name={saved}", "train.total_steps=4"]) == 0
    capsys.readouterr()
    assert main(["--allow-drift", "optim.name", *common, f"optim.name={now}", "train.total_steps=6"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert "Traceback" not in "\n".join(err)
    assert f"holds {saved}'s optimizer state" in err[-1] and f"optim.name={now}" in err[-1], err
    # Nothing passed over (renamed .invalid) or resumed from the start checkpoint instead.
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == ["step-00000000", "step-00000004"]
