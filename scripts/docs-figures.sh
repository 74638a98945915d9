#!/usr/bin/env bash
# Generates the figure sections of docs/benchmarks.md (between
# `<!-- figure:NAME -->` and `<!-- /figure:NAME -->`) from docs/figures/NAME.json.
# Figures are never typed: benchmark programs write docs/figures/*.json
# themselves; figures the test command measures land in target/figures/ and
# are copied over first (with the web console's screenshots).
#
#   bash scripts/docs-figures.sh          copy target/figures/, regenerate
#   bash scripts/docs-figures.sh --check  fail if docs/benchmarks.md differs
#                                         from what docs/figures/ generates,
#                                         a section has no figure file, or a
#                                         figure was measured on an
#                                         uncommitted tree
#
# A figure measured on an uncommitted tree (`-dirty`) is refused (not
# copied, and --check fails) unless STREAMFLEET_FIGURES_DIRTY=1. A figure
# whose code changed after it was measured is marked stale on the page, with
# the number of commits that changed that code since (SOURCES below): a
# reader sees which figures are not the code at HEAD.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
cd "$root"
mode=${1:-write}
if [ "$mode" != "--check" ]; then
  mkdir -p docs/figures
  shopt -s nullglob
  for json in target/figures/*.json; do
    if grep -q '"commit": "[0-9a-f]*-dirty"' "$json" && [ "${STREAMFLEET_FIGURES_DIRTY:-}" != 1 ]; then
      echo "not copied: $json was measured on an uncommitted tree (commit, then measure; or STREAMFLEET_FIGURES_DIRTY=1)" >&2
      exit 1
    fi
    cp "$json" docs/figures/
  done
  # The web console's screenshots (tests/e2e/tests/console.rs), shown in docs/console.md.
  for png in target/figures/console-*.png; do
    cp "$png" docs/figures/
  done
fi
python3 - "$mode" <<'PY'
import json, os, pathlib, re, subprocess, sys
check = sys.argv[1] == "--check"
allow_dirty = os.environ.get("STREAMFLEET_FIGURES_DIRTY") == "1"

# The code each figure measures (git pathspecs): its source, not its tests
# (a test changed is no code measured changed). The test command's own
# timings measure everything but the docs.
def bench(name):
    """A benchmark program's own code: its binary and what every one shares."""
    return [f"tests/bench/src/bin/bench-{name}.rs", "tests/bench/src/lib.rs", "tests/bench/Cargo.toml", "tests/testbed/src"]
CODE = ["worker/src", "streams/src", "operator/src", "crd/src", "contract", "process", "charts", "tools/images"]
SOURCES = {
    "worker": ["worker/src", "streams/src", "tests/bench/watermill"] + bench("worker"),
    "concurrency": ["worker/src", "streams/src"] + bench("concurrency"),
    "shards": ["worker/src", "streams/src"] + bench("shards"),
    "retry": ["worker/src", "streams/src"] + bench("retry"),
    "sweep": ["streams/src"] + bench("sweep"),
    "health": ["streams/src"] + bench("health"),
    "fleet": ["operator/src", "streams/src", "crd/src", "charts"] + bench("fleet"),
    "drill": CODE + ["tests/e2e", "tests/testbed/src"],
    "drill-noguard": CODE + ["tests/e2e", "tests/testbed/src"],
    "drill-100000": CODE + ["tests/e2e", "tests/testbed/src"],
    "reclaim": CODE + ["tests/e2e", "tests/testbed/src"],
    "poll-cost": CODE + ["tests/e2e", "tests/testbed/src"],
    "retries": CODE + ["tests/e2e", "tests/testbed/src"],
    "delay-objective": CODE + ["tests/e2e", "tests/testbed/src"],
}
# Prose is not what the test command's timings measure: docs/, every
# Markdown file and this page generator are left out (the README's commands
# are run by the doc_commands test, whose own changes count).
EVERYTHING = [".", ":(exclude)docs", ":(exclude)*.md", ":(exclude)scripts/docs-figures.sh"]

def changes_since(name, commit):
    """Commits that changed the figure's code after `commit`; None when the
    history cannot say (a shallow clone)."""
    if not re.fullmatch(r"[0-9a-f]{7,40}", commit):
        return None
    out = subprocess.run(["git", "rev-list", "--count", f"{commit}..HEAD", "--", *SOURCES.get(name, EVERYTHING)],
                         capture_output=True, text=True)
    return int(out.stdout.strip()) if out.returncode == 0 else None
doc = pathlib.Path("docs/benchmarks.md")
text = doc.read_text()
figures = {p.stem: json.loads(p.read_text()) for p in sorted(pathlib.Path("docs/figures").glob("*.json"))}

def cell(c):
    return str(c).replace("|", "\\|")

def plot(name, f):
    """An SVG of a figure's `series` (first column the time in seconds): the
    columns whose name starts with "delay" in an upper panel with the
    objective as a dashed line, the others ("replicas …") in a lower one."""
    cols, rows = f["series"]["columns"], f["series"]["rows"]
    objective = f.get("settings", {}).get("delayObjectiveSeconds")
    width, panel, left, top = 720, 150, 50, 24
    xs = [r[0] for r in rows]
    x_max = max(xs) or 1
    colors = ["#1f77b4", "#ff7f0e", "#2ca02c", "#d62728"]
    out = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{2 * panel + 3 * top}" font-family="sans-serif" font-size="11">',
           f'<rect width="100%" height="100%" fill="white"/>']
    def x(v):
        return left + (width - left - 10) * v / x_max
    panels = [("delay (s)", [i for i, c in enumerate(cols) if i and c.startswith("delay")]),
              ("replicas", [i for i, c in enumerate(cols) if i and not c.startswith("delay")])]
    for p, (label, idx) in enumerate(panels):
        y0 = top + p * (panel + top)
        values = [r[i] for r in rows for i in idx if r[i] is not None]
        extra = [objective] if p == 0 and objective else []
        y_max = max(values + extra + [1]) * 1.1
        def y(v):
            return y0 + panel - panel * v / y_max
        out.append(f'<text x="4" y="{y0 - 6}">{label}</text>')
        out.append(f'<line x1="{left}" y1="{y0 + panel}" x2="{width - 10}" y2="{y0 + panel}" stroke="#888"/>')
        out.append(f'<line x1="{left}" y1="{y0}" x2="{left}" y2="{y0 + panel}" stroke="#888"/>')
        out.append(f'<text x="{left - 4}" y="{y0 + 10}" text-anchor="end">{y_max:.0f}</text>')
        out.append(f'<text x="{left - 4}" y="{y0 + panel}" text-anchor="end">0</text>')
        if extra:
            out.append(f'<line x1="{left}" y1="{y(objective):.1f}" x2="{width - 10}" y2="{y(objective):.1f}" stroke="#d62728" stroke-dasharray="4 3"/>')
            out.append(f'<text x="{width - 12}" y="{y(objective) - 3:.1f}" text-anchor="end" fill="#d62728">objective {objective} s</text>')
        for n, i in enumerate(idx):
            points = " ".join(f"{x(r[0]):.1f},{y(r[i]):.1f}" for r in rows if r[i] is not None)
            color = colors[(n + 2 * p) % len(colors)]
            out.append(f'<polyline fill="none" stroke="{color}" stroke-width="1.5" points="{points}"/>')
            out.append(f'<text x="{left + 8 + 200 * n}" y="{y0 + 12}" fill="{color}">{cols[i]}</text>')
    out.append(f'<text x="{width - 10}" y="{2 * panel + 3 * top - 4}" text-anchor="end">seconds</text>')
    out.append("</svg>")
    return "\n".join(out) + "\n"

plots = {name: plot(name, f) for name, f in figures.items() if "series" in f}

def render(name, f):
    settings = ", ".join(f"{k}={json.dumps(v, ensure_ascii=False)}" for k, v in f.get("settings", {}).items())
    env = f.get("environment", {})
    where = ", ".join(f"{k} {env[k]}" for k in ("commit", "date", "machine") if k in env)
    commit = env.get("commit", "")
    if commit.endswith("-dirty"):
        where += " **(an uncommitted tree)**"
    changed = changes_since(name, commit.removesuffix("-dirty"))
    if changed is None:
        unknown_history.append(name)
    elif changed:
        where += f" **Stale: the code it measures changed in {changed} commit{'s' if changed > 1 else ''} since.**"
    header = "| " + " | ".join(f["columns"]) + " |\n|" + "---|" * len(f["columns"])
    rows = "\n".join("| " + " | ".join(cell(c) for c in row) + " |" for row in f["rows"])
    return (
        f"<!-- figure:{name} -->\n"
        f"{f['what']}. Settings: {settings}. Measured: {where or 'unknown'} "
        f"(`docs/figures/{name}.json`, written by the program that measured it).\n\n"
        f"{header}\n{rows}\n\n**{f['summary']}**\n"
        + (f"\n![{name}](figures/{name}.svg)\n" if name in plots else "")
        + 
        f"<!-- /figure:{name} -->"
    )

missing, unknown_history = [], []
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
stale_plots = [n for n, svg in plots.items() if not pathlib.Path(f"docs/figures/{n}.svg").exists()
               or pathlib.Path(f"docs/figures/{n}.svg").read_text() != svg]
dirty = sorted(n for n, f in figures.items() if f.get("environment", {}).get("commit", "").endswith("-dirty"))
if dirty and not allow_dirty:
    why = f"figures measured on an uncommitted tree: {', '.join(dirty)} (measure them again at a commit)"
    if check:
        sys.exit(why)
    print(why, file=sys.stderr)
stale_mark = re.compile(r" \*\*Stale: [^*]*\*\*")
if not check:
    pass
elif unknown_history:
    # No history to count changes in (a shallow clone): the stale marks are
    # not checked.
    print(f"no history for {', '.join(unknown_history)}: stale marks not checked", file=sys.stderr)
    generated, text = stale_mark.sub("", generated), stale_mark.sub("", text)
else:
    # A figure marked stale stays marked however many commits follow; one
    # that became stale must be marked (run this script and commit).
    generated, text = stale_mark.sub(" **Stale**", generated), stale_mark.sub(" **Stale**", text)
if check:
    if generated != text or stale_plots:
        sys.exit(f"docs/benchmarks.md or a plot ({', '.join(stale_plots)}) is stale: run bash scripts/docs-figures.sh")
    print("docs/benchmarks.md matches docs/figures/", file=sys.stderr)
else:
    for n, svg in plots.items():
        pathlib.Path(f"docs/figures/{n}.svg").write_text(svg)
    doc.write_text(generated)
    print("docs/benchmarks.md figures regenerated from docs/figures/", file=sys.stderr)
PY
