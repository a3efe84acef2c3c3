"""README.md's map of the package ("## The package") is the one map of dsslm/: every module and
folder in it exists, and every one that exists is in it. A folder's line stands for its
`__init__.py`."""
from __future__ import annotations

import re
from pathlib import Path

from helpers import ROOT

PACKAGE = ROOT / "dsslm"
# " 1 train.py   what it is" or "   fields.py   ..." (a file), "  data/   what it holds" (a folder)
ENTRY = re.compile(r"^(?P<indent> +)(?:\d+ +)?(?P<name>[\w.]+/?)(?: {2,}|$)")


def map_block(readme: str) -> list[str]:
    """The lines of the fenced block that follows the heading "## The package"."""
    section = readme.split("\n## The package\n", 1)[1].split("\n## ", 1)[0]
    block = re.search(r"^```[^\n]*\n(.*?)^```", section, re.S | re.M)
    assert block, 'README.md: no fenced block under "## The package"'
    return block.group(1).splitlines()


def mapped_paths(lines: list[str]) -> set[str]:
    """The paths the map names, relative to the repository: a file belongs to the folder line
    above it (top-level files come before the first folder)."""
    assert lines and lines[0].strip() == "dsslm/", f"the map starts with dsslm/, not {lines[:1]}"
    paths, folder = {"dsslm/__init__.py"}, "dsslm"
    for line in lines[1:]:
        match = ENTRY.match(line)
        assert match, f"README.md map line is neither a file nor a folder: {line!r}"
        name = match["name"]
        if name.endswith("/"):
            folder = f"dsslm/{name.rstrip('/')}"
            paths.add(f"{folder}/__init__.py")
        else:
            paths.add(f"{folder}/{name}")
    return paths


def package_paths(root: Path = PACKAGE) -> set[str]:
    return {p.relative_to(root.parent).as_posix() for p in root.rglob("*.py") if "__pycache__" not in p.parts}


def test_the_readme_map_names_every_module_and_nothing_else():
    mapped, actual = mapped_paths(map_block((ROOT / "README.md").read_text())), package_paths()
    assert not sorted(actual - mapped), f"modules missing from README.md's map: {sorted(actual - mapped)}"
    assert not sorted(mapped - actual), f"README.md's map names what does not exist: {sorted(mapped - actual)}"


def test_the_parser_places_files_under_their_folder():
    """The check can fail: a file under the wrong folder, or a folder left out, is seen."""
    lines = ["dsslm/", " 1 train.py          the loop", "   model.py          the model",
             "  data/            deterministic data", "   loader.py         reads", " 4 stream.py         positions"]
    assert mapped_paths(lines) == {"dsslm/__init__.py", "dsslm/train.py", "dsslm/model.py", "dsslm/data/__init__.py",
                                   "dsslm/data/loader.py", "dsslm/data/stream.py"}
