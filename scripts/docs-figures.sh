#!/usr/bin/env bash
# Copies the figures the test command measured (target/figures/*.json) to
# docs/figures/ and regenerates their sections of docs/benchmarks.md, between
# `<!-- figure:NAME -->` and `<!-- /figure:NAME -->`. Figures are never typed.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
cd "$root"
mkdir -p docs/figures
shopt -s nullglob
for json in target/figures/*.json; do
  cp "$json" docs/figures/
done
python3 - <<'PY'
import json, pathlib, re
doc = pathlib.Path("docs/benchmarks.md")
text = doc.read_text()
for path in sorted(pathlib.Path("docs/figures").glob("*.json")):
    name = path.stem
    f = json.loads(path.read_text())
    settings = ", ".join(f"{k}={json.dumps(v)}" for k, v in f.get("settings", {}).items())
    header = "| " + " | ".join(f["columns"]) + " |\n|" + "---:|" * len(f["columns"])
    rows = "\n".join("| " + " | ".join(str(c) for c in row) + " |" for row in f["rows"])
    body = (
        f"{f['what']}. Settings: {settings} (from `docs/figures/{name}.json`, written by the program that measured it).\n\n"
        f"{header}\n{rows}\n\n**{f['summary']}**\n"
    )
    block = f"<!-- figure:{name} -->\n{body}<!-- /figure:{name} -->"
    pattern = re.compile(rf"<!-- figure:{name} -->.*?<!-- /figure:{name} -->", re.S)
    text = pattern.sub(lambda _: block, text) if pattern.search(text) else text
doc.write_text(text)
PY
echo "docs/benchmarks.md figures regenerated from docs/figures/" >&2
