"""The documentation still matches the code: README.md and docs/*.md.

Two checks, each a function returning problems as "file:line: what" strings:

- links: every relative link (and image) leads to a file that exists, and a `#anchor` to a
  heading of the target Markdown file, by GitHub's slug rules;
- commands: every command in a fenced shell block (and every inline code span that is one) that
  runs `python -m dsslm.<cli>` (with any interpreter prefix, or through torchrun / accelerate
  launch / sbatch slurm/train.sbatch) names a CLI that exists, uses only flags its argparse parser
  has, and for dsslm.train / dsslm.drill names a --config file that exists and overrides that
  `dsslm.config.load` accepts. A command must name the venv's interpreter (`.venv/bin/python`,
  `.venv/bin/torchrun`, ...) unless its block activated the venv first: copied as written into a
  fresh clone after `bash scripts/setup.sh`, it has to run.

Placeholders (DATA_DIR, RUN_DIR, HF_DIR, N, F, `key=value`) are accepted; `[...]` and `...` mark
optional parts. Nothing here trains or reads data: the CLIs' parsers are taken from their `main`
as it calls argparse, before it does anything else.
"""
from __future__ import annotations

import argparse
import importlib
import importlib.util
import inspect
import re
import shlex
import sys
from functools import lru_cache
from pathlib import Path
from unittest import mock

import pytest

ROOT = Path(__file__).resolve().parents[2]
SHELL_INFOS = {"", "sh", "bash", "shell", "console", "zsh"}
PYTHON = re.compile(r"^(?:.*/)?python(?:3(?:\.\d+)?)?$")
LAUNCHERS = ("torchrun", "accelerate")
TORCHRUNS = ("dsslm.torchrun", "dsslm.engine.agent")  # torchrun with dsslm's exit codes
ENV_ASSIGNMENT = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*=")
# A metavariable: DATA_DIR, RUN_DIR, HF_DIR, N, F, FILE.yaml, OTHER_RUN/checkpoints/step-00008000.
PLACEHOLDER = re.compile(r"^(?:[^/]*/)*?[A-Z][A-Z0-9_]*(?:[./].*)?$")
PLACEHOLDER_OVERRIDES = {"key=value", "dotted.key=value", "KEY=VALUE"}
ACTIVATE = re.compile(r"^(?:source|\.)\s+\S*\.venv/bin/activate\b")


def doc_files(root: Path = ROOT) -> list[Path]:
    return [root / "README.md", *sorted((root / "docs").glob("*.md"))]


# --- Markdown ----------------------------------------------------------------------------------

FENCE = re.compile(r"^ {0,3}(`{3,}|~{3,})\s*([^`\s]*)")


def blocks(text: str):
    """Yield (kind, line number, line, info) for every line: kind "prose" outside fenced blocks,
    "code" inside them (info: the block's info string), "fence" for an opening or closing fence."""
    fence = None
    info = ""
    for number, line in enumerate(text.splitlines(), 1):
        match = FENCE.match(line)
        if fence is None and match:
            fence, info = match.group(1), match.group(2).lower()
            yield "fence", number, line, info
            continue
        if fence is not None:
            if line.strip().startswith(fence[0] * len(fence)) and not line.strip().strip(fence[0]):
                fence = None
                yield "fence", number, line, info
                continue
            yield "code", number, line, info
        else:
            yield "prose", number, line, None


def strip_code_spans(line: str) -> str:
    return re.sub(r"(`+)(.+?)\1", "", line)


def code_spans(line: str) -> list[str]:
    return [m.group(2).strip() for m in re.finditer(r"(`+)(.+?)\1", line)]


def slug(heading: str) -> str:
    """GitHub's anchor for a heading (github-slugger): the rendered text, lowercased, everything
    but letters, digits, `_`, `-` and spaces removed, each space a `-`."""
    text = re.sub(r"!?\[([^\]]*)\]\([^)]*\)", r"\1", heading)   # links and images: their text
    text = re.sub(r"<[^>]+>", "", text)                          # inline HTML
    text = text.replace("`", "")
    text = re.sub(r"(\*{1,3})(\S.*?\S|\S)\1", r"\2", text)       # *emphasis*, **strong**
    text = text.strip().lower()
    text = re.sub(r"[^\w\- ]", "", text)
    return text.replace(" ", "-")


def anchors(path: Path) -> set[str]:
    """Every anchor GitHub gives the headings of a Markdown file (duplicates get -1, -2, ...),
    plus explicit <a name=...> / id=... anchors."""
    seen: dict[str, int] = {}
    found: set[str] = set()
    lines = path.read_text(encoding="utf-8").splitlines()
    previous = None
    for kind, _number, line, *_ in blocks("\n".join(lines)):
        heading = None
        if kind == "prose":
            match = re.match(r"^ {0,3}#{1,6}(?:\s+(.*?))?\s*$", line)
            if match:
                heading = re.sub(r"\s+#+\s*$", "", match.group(1) or "")
            elif previous is not None and previous.strip() and re.match(r"^ {0,3}(=+|-+)\s*$", line) \
                    and not re.match(r"^ {0,3}([-*+]|\d+\.)\s", previous):
                heading = previous.strip()
            for explicit in re.findall(r"""<a\s+(?:name|id)=["']([^"']+)["']""", line):
                found.add(explicit)
        previous = line if kind == "prose" else None
        if heading is not None:
            base = slug(heading)
            count = seen.get(base, 0)
            seen[base] = count + 1
            found.add(base if count == 0 else f"{base}-{count}")
    return found


LINK = re.compile(r"!?\[(?:[^\[\]]|\[[^\]]*\])*\]\(\s*<?([^)\s>]*)>?(?:\s+[\"'(][^)]*)?\)")
REFERENCE = re.compile(r"^ {0,3}\[[^\]]+\]:\s*<?(\S+?)>?(?:\s+.*)?$")


def links(text: str):
    """(line number, target) of every inline link, image and reference definition in prose."""
    for kind, number, line, *_ in blocks(text):
        if kind != "prose":
            continue
        plain = strip_code_spans(line)
        for match in LINK.finditer(plain):
            yield number, match.group(1)
        match = REFERENCE.match(plain)
        if match:
            yield number, match.group(1)


def check_links(files: list[Path], root: Path = ROOT) -> list[str]:
    problems = []
    for path in files:
        for number, target in links(path.read_text(encoding="utf-8")):
            where = f"{path.relative_to(root) if path.is_relative_to(root) else path}:{number}"
            if not target or re.match(r"^[a-zA-Z][a-zA-Z0-9+.-]*:", target) or target.startswith("//"):
                continue  # http:, https:, mailto:, ...: not checked here
            file_part, _, anchor = target.partition("#")
            dest = (path.parent / file_part).resolve() if file_part else path
            if not dest.exists():
                problems.append(f"{where}: link to {target!r}: {file_part} does not exist")
                continue
            if anchor and dest.suffix.lower() == ".md" and dest.is_file() and anchor not in anchors(dest):
                problems.append(f"{where}: link to {target!r}: no heading in {dest.name} has the anchor #{anchor}")
    return problems


# --- Commands ----------------------------------------------------------------------------------

def logical_lines(text: str):
    """(line number, command) for each line of a fenced shell block, continuation lines joined;
    (line number, None) marks the start of each block."""
    pending, start, current_info = "", 0, None
    for kind, number, line, info in blocks(text):
        if kind != "code" or info not in SHELL_INFOS:
            if pending:
                yield start, pending
                pending = ""
            current_info = None
            continue
        if current_info is None:
            current_info = info
            yield number, None  # a new block
        stripped = line.strip()
        if stripped.startswith("$ "):
            stripped = stripped[2:]
        if not pending:
            start = number
        if stripped.endswith("\\"):
            pending += stripped[:-1] + " "
            continue
        pending += stripped
        yield start, pending
        pending = ""
    if pending:
        yield start, pending


def split_words(command: str) -> list[list[str]]:
    """The simple commands of a shell line (split at &&, ||, ;, |), each as words; comments dropped."""
    lexer = shlex.shlex(command, posix=True, punctuation_chars=";&|")
    lexer.whitespace_split = True
    lexer.commenters = "#"
    try:
        words = list(lexer)
    except ValueError:
        return [command.split()]
    commands, current = [], []
    for word in words:
        if word and set(word) <= set(";&|"):
            commands.append(current)
            current = []
        else:
            current.append(word)
    commands.append(current)
    return [c for c in commands if c]


LIST_OVERRIDE = re.compile(r"^[A-Za-z_][\w.]*=\[[^\[\]]*\]$")


def optional_marks_removed(words: list[str]) -> list[str]:
    out = []
    for word in words:
        if not LIST_OVERRIDE.match(word):  # key=[a,b] is an override's list, not an optional part
            word = word.strip("[]")
        if not word or word in ("...", "…") or word.endswith("..."):
            continue
        out.append(word)
    return out


class _Captured(BaseException):
    def __init__(self, parser: argparse.ArgumentParser):
        super().__init__()
        self.parser = parser


@lru_cache(maxsize=None)
def cli_parser(cli: str) -> argparse.ArgumentParser | str:
    """The argparse parser `dsslm.<cli>`'s main builds, or why there is none. main is called with
    no arguments and stopped the moment it asks argparse to parse them."""
    name = f"dsslm.{cli}"
    try:
        spec = importlib.util.find_spec(name)
    except (ImportError, ValueError):
        spec = None
    if spec is None:
        return f"{name} is not a module"
    if spec.submodule_search_locations is not None:  # a package: python -m runs its __main__
        name += ".__main__"
        if importlib.util.find_spec(name) is None:
            return f"dsslm.{cli} is a package without a __main__"
    module = importlib.import_module(name)
    main = getattr(module, "main", None)
    if not callable(main):
        return f"{name} has no main()"
    source = inspect.getsource(module)
    if not re.search(r"parse_(?:known_)?args|ArgumentParser", source):
        return f"{name}: main() does not visibly use argparse; cannot check its flags"

    def capture(self, *args, **kwargs):
        raise _Captured(self)

    with mock.patch.object(argparse.ArgumentParser, "parse_known_args", capture), \
            mock.patch.object(sys, "argv", [f"python -m dsslm.{cli}"]):
        try:
            main([]) if inspect.signature(main).parameters else main()
        except _Captured as got:
            return got.parser
    return f"{name}: main() returned without parsing arguments; cannot check its flags"


def takes(action: argparse.Action) -> str | int:
    if action.nargs is None:
        return 1
    return action.nargs


def walk_arguments(parser: argparse.ArgumentParser, words: list[str]):
    """(flags problems, {flag: values}, positionals) of `words` against `parser`, choosing a
    subcommand's parser by its name."""
    problems, values, positionals = [], {}, []
    i = 0
    while i < len(words):
        word = words[i]
        i += 1
        if word.startswith("-") and word != "-" and not re.match(r"^-\d", word):
            flag, eq, inline = word.partition("=")
            action = parser._option_string_actions.get(flag)
            if action is None:
                known = sorted(s for s in parser._option_string_actions if s.startswith("--"))
                problems.append(f"unknown flag {flag} for {parser.prog} (it has {', '.join(known)})")
                continue
            n = takes(action)
            got = [inline] if eq else []
            if not eq and n not in (0, "?"):
                count = n if isinstance(n, int) else None
                while i < len(words) and (count is None or len(got) < count) \
                        and not (words[i].startswith("-") and len(words[i]) > 1):
                    got.append(words[i])
                    i += 1
            elif not eq and n == "?" and i < len(words) and not words[i].startswith("-"):
                got.append(words[i])
                i += 1
            values.setdefault(action.dest, []).extend(got)
            continue
        subparsers = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
        if subparsers and not positionals:
            chooser = subparsers[0]
            if word not in chooser.choices:
                problems.append(f"{parser.prog}: no subcommand {word!r} (it has {', '.join(chooser.choices)})")
                return problems, values, positionals
            more, sub_values, sub_positionals = walk_arguments(chooser.choices[word], words[i:])
            values.update(sub_values)
            return problems + more, values, [word, *sub_positionals]
        positionals.append(word)
    return problems, values, positionals


def dsslm_invocation(words: list[str]) -> tuple[str, list[str]] | None:
    """(cli, its arguments) if `words` run a dsslm module, else None."""
    for i, word in enumerate(words[:-1]):
        # dsslm's torchrun takes torchrun's arguments: the module it launches is the invocation
        if word == "-m" and words[i + 1].startswith("dsslm") and words[i + 1] not in TORCHRUNS:
            return words[i + 1].partition(".")[2], words[i + 2:]
    if words and words[0] == "sbatch":
        for i, word in enumerate(words):
            if word.endswith("train.sbatch"):
                return "train", words[i + 1:]
    return None


def check_config(config: str | None, overrides: list[str], root: Path) -> list[str]:
    from dsslm.config import ConfigError, load

    overrides = [o for o in overrides if o not in PLACEHOLDER_OVERRIDES]
    path = None
    if config is not None and not PLACEHOLDER.match(config):
        path = root / config
        if not path.is_file():
            return [f"--config {config}: no such file"]
    try:
        load(path, overrides)
    except ConfigError as err:
        return [f"config.load rejects {' '.join(overrides)!r}: {err}"]
    return []


def check_command(words: list[str], activated: bool, root: Path = ROOT) -> list[str]:
    """Problems with one simple command, already split into words."""
    while words and ENV_ASSIGNMENT.match(words[0]):
        env = words.pop(0)
        if env.startswith(("DSSLM_VENV=", "DSSLM_PYTHON=")):
            activated = True
    if not words:
        return []
    program, problems = words[0], []
    runs_python = PYTHON.match(program) or program.rsplit("/", 1)[-1] in LAUNCHERS
    if runs_python and "/" not in program and not activated:
        problems.append(f"{program!r} is not the venv's: write .venv/bin/{program} "
                        f"(or run `source .venv/bin/activate` first, in the same block)")
    if program == "sbatch" and not activated and dsslm_invocation(words):
        problems.append("sbatch runs the python on PATH: prefix DSSLM_VENV=$PWD/.venv "
                        "(or `source .venv/bin/activate` first in the block)")
    if program == "bash" and len(words) > 1 and words[1].endswith(".sh") and not (root / words[1]).is_file():
        problems.append(f"{words[1]} does not exist")
    if PYTHON.match(program) and len(words) > 1 and words[1].endswith(".py") and not (root / words[1]).is_file():
        problems.append(f"{words[1]} does not exist")
    for flag in ("--config_file",):
        if flag in words[:-1]:
            value = words[words.index(flag) + 1]
            if not (root / value).is_file():
                problems.append(f"{flag} {value}: no such file")
    invocation = dsslm_invocation(words)
    if invocation is None:
        return problems
    cli, arguments = invocation
    arguments = optional_marks_removed(arguments)
    parser = cli_parser(cli)
    if isinstance(parser, str):
        return problems + [parser]
    flag_problems, values, positionals = walk_arguments(parser, arguments)
    problems += flag_problems
    if not any(isinstance(a, argparse._SubParsersAction) for a in parser._actions):
        declared = [a for a in parser._actions if not a.option_strings]
        for action, value in zip(declared, positionals):
            if action.choices and value not in action.choices and not PLACEHOLDER.match(value):
                problems.append(f"{value!r} is not a {action.dest} of {parser.prog} "
                                f"(one of {', '.join(map(str, action.choices))})")
    if cli in ("train", "drill") and not flag_problems:
        configs = values.get("config") or [None]
        overrides = [p for p in positionals if "=" in p]
        problems += check_config(configs[-1], overrides, root)
    return problems


INLINE_COMMAND = re.compile(r"^(?:[A-Za-z_][A-Za-z0-9_]*=\S*\s+)*(?:\S*python\S*|\S*torchrun|\S*accelerate launch)"
                            r"\s.*-m\s+(?:dsslm|pytest)")


def check_commands(files: list[Path], root: Path = ROOT) -> list[str]:
    problems = []
    for path in files:
        text = path.read_text(encoding="utf-8")
        name = path.relative_to(root) if path.is_relative_to(root) else path
        activated = False
        for number, command in logical_lines(text):
            if command is None:
                activated = False
                continue
            if ACTIVATE.match(command):
                activated = True
            for words in split_words(command):
                problems += [f"{name}:{number}: {command!r}: {p}" for p in check_command(words, activated, root)]
        for kind, number, line, *_ in blocks(text):
            if kind != "prose":
                continue
            for span in code_spans(line):
                if INLINE_COMMAND.match(span):
                    for words in split_words(span):
                        problems += [f"{name}:{number}: `{span}`: {p}" for p in check_command(words, False, root)]
    return problems


TEST_REF = re.compile(r"^(?:tests/)?((?:scenarios|unit)/[\w/]+\.py)?::(\w+)$")


def check_test_references(files: list[Path], root: Path = ROOT) -> list[str]:
    """Every `file.py::test_name` (or `::test_name`, of the file named last on its line) a page
    names: the test a promise rests on must exist."""
    problems = []
    for path in files:
        for number, line in enumerate(path.read_text().splitlines(), 1):
            current = None
            for span in code_spans(line):
                m = TEST_REF.match(span)
                if not m:
                    continue
                current = m.group(1) or current
                target = root / "tests" / current if current else None
                if target is None or not target.is_file():
                    problems.append(f"{path.name}:{number}: `{span}`: no test file {current}")
                elif not re.search(rf"^\s*(?:async )?def {m.group(2)}\(", target.read_text(), re.M):
                    problems.append(f"{path.name}:{number}: `{span}`: no test {m.group(2)} in tests/{current}")
    return problems


# --- Tests -------------------------------------------------------------------------------------

def test_every_relative_link_in_the_docs_leads_somewhere():
    assert check_links(doc_files()) == []


def test_every_documented_command_parses():
    assert check_commands(doc_files()) == []


def test_every_test_a_page_names_exists(tmp_path):
    """docs/reliability.md names the test behind each promise; two of them had been renamed."""
    assert check_test_references(doc_files()) == []
    (tmp_path / "page.md").write_text("`scenarios/test_resume.py::test_sigkill_mid_run_resumes_to_the_bit`, "
                                      "`::test_no_such_test`\n`unit/test_nope.py::test_x`\n")
    assert [p.split(": ", 2)[-1] for p in check_test_references([tmp_path / "page.md"])] == [
        "no test test_no_such_test in tests/scenarios/test_resume.py", "no test file unit/test_nope.py"]


TESTS_PATH = re.compile(r"(?<![\w/.])tests/[\w/]+\.py")


def test_every_tests_path_named_exists():
    """A `tests/....py` path named in a page, slurm/README.md, a script or a docstring is a file:
    slurm/README.md and the Slurm tests' docstrings named test_slurm.py and slurm_cluster.py under
    tests/ after their move to tests/scenarios/."""
    files = [*doc_files(), ROOT / "slurm" / "README.md", *sorted((ROOT / ".ci").iterdir()),
             *sorted((ROOT / "scripts").glob("*")), *sorted(ROOT.glob("tests/**/*.py")),
             *sorted(ROOT.glob("dsslm/**/*.py"))]
    missing = [f"{path.relative_to(ROOT)}:{number}: {name}" for path in files if path.is_file()
               for number, line in enumerate(path.read_text(errors="replace").splitlines(), 1)
               for name in TESTS_PATH.findall(line) if not (ROOT / name).is_file()]
    assert missing == []


def test_the_docs_are_there():
    names = {p.name for p in doc_files()}
    assert {"README.md", "design.md"} <= names


def test_slugs_follow_github():
    assert slug("Reliability: what is promised, and the test behind each promise") == \
        "reliability-what-is-promised-and-the-test-behind-each-promise"
    assert slug("Hugging Face, sampling and evaluation") == "hugging-face-sampling-and-evaluation"
    assert slug("`run.dir` and `ckpt.keep_last`") == "rundir-and-ckptkeep_last"
    assert slug("Exit codes (0, 2, 3, 4)") == "exit-codes-0-2-3-4"
    assert slug("**Bold** and [a link](x.md)") == "bold-and-a-link"


def test_the_checker_catches_what_it_should(tmp_path):
    """Negative control: a dead link, a dead anchor, a bad key, a bad flag, a missing CLI, a
    missing config and a bare interpreter are each caught; the good lines pass."""
    (tmp_path / "other.md").write_text("# Other page\n\n## A section\n\n## A section\n")
    page = tmp_path / "page.md"
    page.write_text(
        "# Page\n\n"
        "[good](other.md#a-section) [good too](other.md#a-section-1) [self](#page) [web](https://x.org/)\n"
        "[dead file](missing.md) [dead anchor](other.md#no-such-section) `[in code](missing.md)`\n\n"
        "```\n"
        ".venv/bin/python -m dsslm.train --config configs/tiny.yaml train.total_steps=500\n"
        ".venv/bin/python -m dsslm.train --config configs/tiny.yaml train.no_such_key=5\n"
        ".venv/bin/python -m dsslm.sample RUN_DIR --prompt \"x\" --no-such-flag 3\n"
        ".venv/bin/python -m dsslm.no_such_cli --help\n"
        ".venv/bin/python -m dsslm.drill rezume --nproc 2\n"
        ".venv/bin/python -m dsslm.data prepare --input a.txt --out DATA_DIR --domian web\n"
        ".venv/bin/torchrun --nproc_per_node 2 -m dsslm.train --config configs/nope.yaml\n"
        "python -m dsslm.report RUN_DIR\n"
        "```\n\n"
        "```\n"
        "source .venv/bin/activate\n"
        "python -m dsslm.drill resume [--config F] [--nproc N] [key=value ...]\n"
        "```\n\n"
        "Inline: `.venv/bin/python -m dsslm.export RUN_DIR --out HF_DIR --dtyp bf16`.\n")
    link_problems = check_links([page], root=tmp_path)
    assert len(link_problems) == 2, link_problems
    assert "missing.md does not exist" in link_problems[0]
    assert "#no-such-section" in link_problems[1]

    command_problems = check_commands([page], root=ROOT)
    expected = ["unknown config key 'train.no_such_key'", "unknown flag --no-such-flag",
                "dsslm.no_such_cli is not a module", "'rezume' is not a drill", "unknown flag --domian",
                "configs/nope.yaml: no such file",
                "'python' is not the venv's", "unknown flag --dtyp"]
    assert len(command_problems) == len(expected), "\n".join(command_problems)
    for problem, wanted in zip(command_problems, expected):
        assert wanted in problem, (wanted, problem)


@pytest.mark.parametrize("cli", ["train", "drill", "report", "export", "sample", "eval", "data"])
def test_every_cli_parser_is_found(cli):
    assert isinstance(cli_parser(cli), argparse.ArgumentParser), cli_parser(cli)


def test_what_the_readmes_commands_write_is_left_out_of_git():
    """README's quick start writes data/books and hf/books into the checkout; git status listed them."""
    import shutil
    import subprocess
    if shutil.which("git") is None or not (ROOT / ".git").exists():
        pytest.skip("not a git checkout")
    readme = (ROOT / "README.md").read_text()
    written = set(re.findall(r"--out (\S+)", readme)) | set(re.findall(r"run\.dir=(\S+)", readme)) | {"runs/tiny"}
    assert {"data/books", "hf/books"} <= written
    paths = [f"{folder}/file" for folder in sorted(written)] + ["dsslm/data/__init__.py", "dsslm/hf/__init__.py"]
    proc = subprocess.run(["git", "check-ignore", "--no-index", *paths], cwd=ROOT, capture_output=True, text=True)
    assert set(proc.stdout.split()) == set(paths[:-2]), proc.stdout  # and the package's own data/ and hf/ are kept
