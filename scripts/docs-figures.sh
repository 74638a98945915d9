#!/usr/bin/env bash
# Generates the figure sections of docs/benchmarks.md (between
# `<!-- figure:NAME -->` and `<!-- /figure:NAME -->`) from docs/figures/NAME.json.
# Figures are never typed: benchmark programs write docs/figures/*.json
# themselves; figures the test command measures land in target/figures/ and
# are copied over first.
#
#   bash scripts/docs-figures.sh          copy target/figures/, regenerate
#   bash scripts/docs-figures.sh --check  fail if docs/benchmarks.md differs
#                                         from what docs/figures/ generates,
#                                         or a section has no figure file
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
cd "$root"
mode=${1:-write}
if [ "$mode" != "--check" ]; then
  mkdir -p docs/figures
  shopt -s nullglob
  for json in target/figures/*.json; do
    cp "$json" docs/figures/
  done
fi
python3 - "$mode" <<'PY'
import json, pathlib, re, sys
check = sys.argv[1] == "--check"
doc = pathlib.Path("docs/benchmarks.md")
text = doc.read_text()
figures = {p.stem: json.loads(p.read_text()) for p in sorted(pathlib.Path("docs/figures").glob("*.json"))}

def cell(c):
    return str(c).replace("|", "\\|")

def render(name, f):
    settings = ", ".join(f"{k}={json.dumps(v, ensure_ascii=False)}" for k, v in f.get("settings", {}).items())
    env = f.get("environment", {})
    where = ", ".join(f"{k} {env[k]}" for k in ("commit", "date", "machine") if k in env)
    header = "| " + " | ".join(f["columns"]) + " |\n|" + "---|" * len(f["columns"])
    rows = "\n".join("| " + " | ".join(cell(c) for c in row) + " |" for row in f["rows"])
    return (
        f"<!-- figure:{name} -->\n"
        f"{f['what']}. Settings: {settings}. Measured: {where or 'unknown'} "
        f"(`docs/figures/{name}.json`, written by the program that measured it).\n\n"
        f"{header}\n{rows}\n\n**{f['summary']}**\n"
        f"<!-- /figure:{name} -->"
    )

missing = []
def replace(m):
    name = m.group(1)
    if name not in figures:
        missing.append(name)
        return m.group(0)
    return render(name, figures[name])

generated = re.sub(r"<!-- figure:([a-z0-9-]+) -->.*?<!-- /figure:\1 -->", replace, text, flags=re.S)
if missing:
    sys.exit(f"docs/benchmarks.md has sections without a figure file: {', '.join(missing)}")
unused = sorted(set(figures) - set(re.findall(r"<!-- figure:([a-z0-9-]+) -->", text)))
if unused:
    sys.exit(f"figure files without a section in docs/benchmarks.md: {', '.join(unused)}")
if check:
    if generated != text:
        sys.exit("docs/benchmarks.md is stale: run bash scripts/docs-figures.sh")
    print("docs/benchmarks.md matches docs/figures/", file=sys.stderr)
else:
    doc.write_text(generated)
    print("docs/benchmarks.md figures regenerated from docs/figures/", file=sys.stderr)
PY
