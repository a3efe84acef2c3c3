"""Ranked classification: each example is a context and its choices; each choice's continuation
is scored by the model's summed log-likelihood given the context, and the example counts as correct
when the gold choice scores highest: raw (`acc`), per character of the choice (`acc_norm`,
lm-eval-harness's name and rule; OLMES' `acc_per_char`) and per token of the continuation
(`acc_per_token`). `bpb` is the bits per byte of the gold continuations (their summed nats in bits
over their UTF-8 bytes: the same ratio of sums as `val_bpb`), which moves long before a small
model's accuracy leaves chance.

Tokenization, truncation and tie-breaking follow lm-eval-harness's `loglikelihood` (HFLM), so an
exported model scores the same examples the same way there (tests/scenarios/test_evals.py):
trailing whitespace of the context moves to the continuation, the pair is encoded whole and split
at the context's token count, an empty context is the EOS token, the input keeps the last
`seq_len` tokens, and argmax takes the first of equal scores. A continuation longer than
`seq_len` tokens is scored in consecutive windows (where lm-eval would fail). Under
`model.document_mask` an empty context's EOS is hidden from its continuation, which an export
run by transformers attends to (docs/evals.md).

The batches depend only on the examples and the token budget, never on the world size: each
rank scores every world_size-th batch (padded with dummy forwards so every rank runs the same
number, which sharded engines need), the log-likelihoods are gathered, and every rank computes
the same result, to the bit on a CPU whatever the world size.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Callable

import numpy as np
import torch

from dsslm.evals.tasks import Task, TaskError
from dsslm.precision import autocast

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
