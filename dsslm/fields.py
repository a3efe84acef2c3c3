"""A small declarative check for JSON state read back from disk: types and ranges of every field.

A checkpoint's `state.json` was written by us, but anyone who can write into `run.dir` can also
recompute its MANIFEST, so its hashes matching proves nothing about its contents. Each stateful
part declares the shape of its `state_dict()` with these specs; `validate(value, spec, "monitor")`
raises `StateError` naming the first field that does not fit (`monitor.losses[3]: ...`), and the
store passes that checkpoint over like one whose hashes do not match.

    spec = Fields(step=Int(0, MAX_STEP), losses=ListOf(Float(), max_len=1000), start=Optional(Int(0)))
"""
from __future__ import annotations

import abc
import math
import re
from typing import Any

MAX_STEP = 10**8 - 1  # step-XXXXXXXX has 8 digits
MAX_COUNT = 2**62     # token and sequence counters: far beyond any run, small enough for int64


class StateError(ValueError):
    """A field of saved state has the wrong type or an impossible value; the message names it."""


class Spec(abc.ABC):
    """One field's expected type and range."""

    @abc.abstractmethod
    def validate(self, value: Any, path: str) -> None:
        """Raise StateError naming `path` unless `value` fits."""


def validate(value: Any, spec: Spec, path: str) -> None:
    spec.validate(value, path)


def _fail(path: str, value: Any, want: str) -> None:
    shown = repr(value)
    shown = shown if len(shown) <= 40 else shown[:37] + "..."
    raise StateError(f"{path}: {shown} is not {want}")


class Int(Spec):
    def __init__(self, lo: int | None = None, hi: int | None = None):
        self.lo, self.hi = lo, hi

    def validate(self, value: Any, path: str) -> None:
        # bool is an int in Python; 1e30 is a float: neither is a count.
        if isinstance(value, bool) or not isinstance(value, int):
            _fail(path, value, "an integer")
        if (self.lo is not None and value < self.lo) or (self.hi is not None and value > self.hi):
            _fail(path, value, f"an integer in [{self.lo}, {self.hi}]")


class Float(Spec):
    """A JSON number (ints accepted); finite unless `finite=False`, where the sinks' "nan"/"inf"
    strings are accepted too."""

    def __init__(self, lo: float | None = None, hi: float | None = None, finite: bool = True):
        self.lo, self.hi, self.finite = lo, hi, finite

    def validate(self, value: Any, path: str) -> None:
        if not self.finite and value in ("nan", "inf", "-inf"):
            return
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            _fail(path, value, "a number")
        if self.finite and not math.isfinite(value):
            _fail(path, value, "a finite number")
        if (self.lo is not None and value < self.lo) or (self.hi is not None and value > self.hi):
            _fail(path, value, f"a number in [{self.lo}, {self.hi}]")


class Str(Spec):
    def __init__(self, max_len: int = 10_000):
        self.max_len = max_len

    def validate(self, value: Any, path: str) -> None:
        if not isinstance(value, str) or len(value) > self.max_len:
            _fail(path, value, f"a string of at most {self.max_len} characters")


class Bool(Spec):
    def validate(self, value: Any, path: str) -> None:
        if not isinstance(value, bool):
            _fail(path, value, "true or false")


class Optional(Spec):
    def __init__(self, inner: Spec):
        self.inner = inner

    def validate(self, value: Any, path: str) -> None:
        if value is not None:
            self.inner.validate(value, path)


class ListOf(Spec):
    def __init__(self, item: Spec, max_len: int = 1_000_000, length: int | None = None):
        self.item, self.max_len, self.length = item, max_len, length

    def validate(self, value: Any, path: str) -> None:
        if not isinstance(value, list):
            _fail(path, value, "a list")
        if self.length is not None and len(value) != self.length:
            _fail(path, value, f"a list of {self.length} items")
        if len(value) > self.max_len:
            _fail(path, value, f"a list of at most {self.max_len} items")
        for i, item in enumerate(value):
            self.item.validate(item, f"{path}[{i}]")


class Window(Spec):
    """A half-open [start, end) range of non-negative integers with start <= end."""

    def validate(self, value: Any, path: str) -> None:
        ListOf(Int(0, MAX_COUNT), length=2).validate(value, path)
        if value[0] > value[1]:
            _fail(path, value, "a window [start, end) with start <= end")


class MapOf(Spec):
    """A JSON object with string keys and values of one spec (a table by parameter or domain name)."""

    def __init__(self, value: Spec, max_len: int = 100_000):
        self.value, self.max_len = value, max_len

    def validate(self, value: Any, path: str) -> None:
        if not isinstance(value, dict) or len(value) > self.max_len:
            _fail(path, value, f"an object of at most {self.max_len} entries")
        for key, item in value.items():
            self.value.validate(item, f"{path}.{key}")


class Fields(Spec):
    """A JSON object with exactly these keys (`optional` ones may be absent; `open` allows more)."""

    def __init__(self, optional: tuple[str, ...] = (), open: bool = False, **fields: Spec):
        self.fields, self.optional, self.open = fields, set(optional), open

    def validate(self, value: Any, path: str) -> None:
        if not isinstance(value, dict):
            _fail(path, value, "an object")
        for name, spec in self.fields.items():
            if name not in value:
                if name in self.optional:
                    continue
                raise StateError(f"{path}.{name}: missing")
            spec.validate(value[name], f"{path}.{name}")
        extra = sorted(set(value) - set(self.fields))
        if extra and not self.open:
            raise StateError(f"{path}.{extra[0]}: not a field of this state (written by another version?)")


class Json(Spec):
    """Anything JSON: for free-form records (lineage, config) that only people read."""

    def validate(self, value: Any, path: str) -> None:
        return


MAX_SHARD_PATH = 1000  # characters


_CONTROL = re.compile(r"[\x00-\x1f\x7f]")


def shard_path_problem(value: Any) -> str | None:
    """What is wrong with `value` as a shard's path (None: nothing): it must be relative,
    "/"-separated, every part a name (no empty part, ".", ".."), with no backslash or control
    character, at most MAX_SHARD_PATH characters. The one rule for manifest.json
    (`data.manifest.check_manifest`) and for skip entries (`ShardPath`): the loader copies the
    manifest's string into the skip entries it writes, so a path that one accepted and the other
    refused would make a run write checkpoints and a skip_list.json its own resume refuses."""
    if not isinstance(value, str) or not value:
        return "it is empty or not a string"
    if len(value) > MAX_SHARD_PATH:
        return f"it is longer than {MAX_SHARD_PATH} characters"
    if _CONTROL.search(value):  # a regex: a start checks 10^5 shard paths
        return "it holds a control character"
    if "\\" in value:
        return "it holds a backslash"
    if value.startswith("/"):
        return "it is absolute"
    if any(p in ("", ".", "..") for p in value.split("/")):
        return "it has an empty, '.' or '..' part"
    return None


class ShardPath(Spec):
    """A shard's path as manifest.json names it (`shard_path_problem`; the loader then requires it
    to be one of its train shards)."""

    def validate(self, value: Any, path: str) -> None:
        problem = shard_path_problem(value)
        if problem is not None:
            _fail(path, value, f"a relative shard path such as web/train-00000.bin ({problem})")


class SkipEntry(Spec):
    """One skip list entry (dsslm.data.skips): a window [start, end) of global sequence indices
    (what earlier versions wrote), or data {"shard": PATH, "tokens": [a, b)}, optionally with the
    step it applies from ("from_step")."""

    data = Fields(optional=("from_step",), shard=ShardPath(), tokens=Window(), from_step=Int(1, MAX_STEP))

    def validate(self, value: Any, path: str) -> None:
        if isinstance(value, list):
            Window().validate(value, path)
        elif isinstance(value, dict):
            SkipEntry.data.validate(value, path)
        else:
            _fail(path, value, 'a window [start, end] or {"shard": PATH, "tokens": [a, b]}')


# The most entries a skip list read back may hold (state.json, skip_list.json, a triage's lists):
# its writer refuses to commit a longer one (recovery.rewind.check_skip_list), else a run would
# write checkpoints and a skip_list.json its own resume refuses.
MAX_SKIP_ENTRIES = 100_000


class SkipList(ListOf):
    """A skip list: at most MAX_SKIP_ENTRIES `SkipEntry`s."""

    def __init__(self):
        super().__init__(SkipEntry(), max_len=MAX_SKIP_ENTRIES)
