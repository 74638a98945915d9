#!/usr/bin/env bash
# Writes the values table of charts/streamfleet/README.md from
# charts/streamfleet/values.yaml: every key with its default and the comment
# written above it (helm-docs' convention without its binary), between the
# README's `values` markers. `--check` fails when the README differs from
# what values.yaml says (the test command runs it).
set -euo pipefail
cd "$(dirname "$0")/.."

mode=${1:-write}
python3 - "$mode" charts/streamfleet/values.yaml charts/streamfleet/README.md <<'EOF'
import re, sys

mode, values_path, readme_path = sys.argv[1:4]
BEGIN, END = "<!-- values:begin -->", "<!-- values:end -->"
KEY = re.compile(r"^( *)([A-Za-z0-9_.-]+):(?: (.*))?$")


def rows(lines):
    """(path, default, description) per key, in file order. A comment block
    directly above a key (no blank line between) describes it; a map's own
    row comes before its keys'."""
    out, comment, stack = [], [], []  # stack: (indent, name, described)
    # A described key that begins an unbroken run of keys at one indent: its
    # comment speaks for the uncommented keys right after it.
    run_owner, run_begun = None, False
    i = 0
    while i < len(lines):
        line = lines[i].rstrip("\n")
        stripped = line.strip()
        if not stripped:
            comment = []
            run_owner, run_begun = None, False
        elif stripped.startswith("#"):
            text = stripped[1:]
            if text.startswith("   "):
                # An indented example: kept in values.yaml, pointed to here.
                if "(example in values.yaml)" not in comment:
                    comment.append("(example in values.yaml)")
            else:
                comment.append(text[1:] if text.startswith(" ") else text)
        elif stripped.startswith("- "):
            comment = []  # an item of a list shown whole with its key
        else:
            m = KEY.match(line)
            if not m:
                raise SystemExit(f"{values_path}:{i + 1}: not a key this script reads: {line!r}")
            indent, name, value = len(m.group(1)), m.group(2), (m.group(3) or "").strip()
            while stack and stack[-1][0] >= indent:
                stack.pop()
            path = ".".join([n for _, n, _ in stack] + [name])
            if run_owner and run_owner[0] != indent:
                run_owner = None
            if value:
                default = value
            else:
                # A block: a list is shown whole; a map gets its keys' rows.
                j = i + 1
                block = []
                while j < len(lines) and (not lines[j].strip() or len(lines[j]) - len(lines[j].lstrip()) > indent):
                    if lines[j].strip() and not lines[j].strip().startswith("#"):
                        block.append(lines[j].strip())
                    j += 1
                if block and block[0].startswith("- "):
                    default = "[" + ", ".join(b[2:] for b in block if b.startswith("- ")) + "]"
                    i = j - 1
                else:
                    default = None
            description = " ".join(comment)
            if default is None:
                pass  # a map's row is its own comment's only
            elif description:
                run_owner = (indent, path) if not run_begun else None
            elif run_owner:
                description = f"As `{run_owner[1]}`, above."
            else:
                parent = next((".".join(n for _, n, _ in stack[: k + 1]) for k in range(len(stack) - 1, -1, -1) if stack[k][2]), None)
                if parent:
                    description = f"Part of `{parent}` (see there)."
            run_begun = default is not None
            if default is None:
                stack.append((indent, name, bool(" ".join(comment))))
            if default is not None or description:
                out.append((path, default, description))
            comment = []
        i += 1
    return out


def cell(text):
    # `<release>` would be read as an HTML tag and dropped.
    return text.replace("|", "\\|").replace("<", "&lt;").replace(">", "&gt;")


with open(values_path) as f:
    table = rows(f.readlines())
generated = [
    BEGIN,
    "<!-- Generated from values.yaml by scripts/chart-readme.sh: edit the comments there. -->",
    "",
    "| key | default | what it does |",
    "|---|---|---|",
]
for path, default, description in table:
    # In a code span `<` shows as it is; only `|` would end the cell.
    shown = "(a map: its keys follow)" if default is None else "`" + default.replace("|", "\\|") + "`"
    generated.append(f"| `{path}` | {shown} | {cell(description)} |")
generated.append(END)

with open(readme_path) as f:
    readme = f.read()
if BEGIN not in readme or END not in readme:
    raise SystemExit(f"{readme_path} has no {BEGIN} … {END} section")
head, rest = readme.split(BEGIN, 1)
_, tail = rest.split(END, 1)
new = head + "\n".join(generated) + tail
if mode == "--check":
    if new != readme:
        raise SystemExit(f"{readme_path} differs from {values_path}: run bash scripts/chart-readme.sh")
    print(f"{readme_path} matches {values_path}")
else:
    with open(readme_path, "w") as f:
        f.write(new)
    print(f"{readme_path}: values table written from {values_path} ({len(table)} rows)")
EOF
