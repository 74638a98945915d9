#!/usr/bin/env bash
# Runs every check and test, on a fresh machine too: installs Debian packages,
# builds (or reuses from cache) the Go-built control plane, then fmt, clippy,
# generated-file drift, and the unit, integration and end-to-end tests on the
# real local test bed.
#
# `--quick`: the tier for a one-line change, no control plane: fmt, clippy,
# and the unit and Redis-level integration tests (real redis-server and
# Redis Cluster; every crate but the end-to-end ones).
set -euo pipefail
case "${1:-}" in
  "" | --quick) ;;
  *) echo "usage: bash scripts/test.sh [--quick]" >&2; exit 2 ;;
esac
root=$(cd "$(dirname "$0")/.." && pwd)
cd "$root"
start=$(date +%s)
# Incremental caches only help an edit-compile loop; in a test run they
# doubled target/ (export CARGO_INCREMENTAL=1 to keep them).
export CARGO_INCREMENTAL="${CARGO_INCREMENTAL:-0}"
# What was there before this run: a fresh clone has no target/, and the
# Go-built tools come from ~/.cache/streamfleet once built.
if [ -d target/debug ]; then target_state=kept; else target_state=fresh; fi
if [ -n "$(find "${STREAMFLEET_CACHE:-$HOME/.cache/streamfleet}/tools" -mindepth 1 -maxdepth 1 2>/dev/null | head -n 1)" ]; then
  tools_state=cached
else
  tools_state=built
fi
steps=()
step() {
  steps+=("$(( $(date +%s) - start ))	$*")
  printf '\n==> %s (%ss)\n' "$*" "$(( $(date +%s) - start ))" >&2
}
# Writes the run's step timings to target/figures/$1.json (docs-figures.sh
# copies it to docs/figures/ and docs/benchmarks.md shows it): the test
# command's time is measured by the test command, never typed.
record_timings() {
  STEPS=$(printf '%s\n' "${steps[@]}") python3 - "$1" "$2" "$target_state" "$tools_state" "${cpu_busy:-}" <<'PY'
import json, os, pathlib, subprocess, sys
name, what, target, tools, busy = sys.argv[1:6]
marks = [line.split("\t", 1) for line in os.environ["STEPS"].splitlines() if line]
rows = [[label, int(marks[i + 1][0]) - int(at)] for i, (at, label) in enumerate(marks[:-1])]
total = int(marks[-1][0])
def out(*cmd):
    r = subprocess.run(cmd, capture_output=True, text=True)
    return r.stdout.strip() if r.returncode == 0 else ""
disk = out("du", "-s", "--block-size=1M", "target").split("\t")[0]
disk = f"{int(disk) / 1024:.1f} GiB" if disk else "unknown"
dirty = out("git", "status", "--porcelain", "--untracked-files=no", "--", ".", ":!docs/figures") != ""
cpu = next((l.split(":", 1)[1].strip() for l in open("/proc/cpuinfo") if l.startswith("model name")), "unknown CPU")
mem = next(int(l.split()[1]) for l in open("/proc/meminfo") if l.startswith("MemTotal:")) // 1024 // 1024
figure = {
    "what": what,
    "settings": {
        "target/ before the run": target,
        "Go-built tools": tools,
        "RUST_TEST_THREADS": os.environ.get("RUST_TEST_THREADS", "4"),
        "target/ after the run": disk,
        **({"test lanes": os.environ["STREAMFLEET_TEST_LANES"], "cores busy during the tests step (the niced images build included)": busy} if busy else {}),
    },
    "columns": ["step", "seconds"],
    "rows": rows,
    "summary": f"{total // 60} min {total % 60} s in all (target/ {target}, tools {tools})",
    "environment": {
        "commit": out("git", "rev-parse", "--short=12", "HEAD") + ("-dirty" if dirty else ""),
        "date": out("date", "-u", "+%Y-%m-%d"),
        "machine": f"{os.cpu_count()} cores ({cpu}), {mem} GiB",
    },
}
path = pathlib.Path("target/figures") / f"{name}.json"
path.parent.mkdir(parents=True, exist_ok=True)
path.write_text(json.dumps(figure, indent=2, ensure_ascii=False) + "\n")
print(f"timings written to {path}", file=sys.stderr)
PY
}

# How busy the cores were since `$1` (a /proc/stat "cpu" line), in percent:
# whether more test lanes could use them.
busy_since() {
  local before now
  read -r -a before <<< "$1"
  read -r -a now < /proc/stat
  awk -v b="${before[*]}" -v n="${now[*]}" 'BEGIN {
    split(b, x); split(n, y); total = 0
    for (i = 2; i <= 9; i++) total += y[i] - x[i]
    idle = (y[5] - x[5]) + (y[6] - x[6])
    printf "%d%%", (total > 0 ? 100 * (total - idle) / total : 0)
  }'
}

step "install Debian packages"
bash scripts/install-deps.sh

step "shellcheck (the project's scripts)"
shellcheck -S style scripts/*.sh .ci/run

# The crates users embed carry only what they need: the worker library
# without its `admin` feature builds, lints clean and has no HTTP stack; the
# CRD crate has no Kubernetes client.
lean_crates() {
  cargo clippy -p streamfleet-worker --lib --no-default-features --locked -- -D warnings
  if cargo tree -p streamfleet-worker --no-default-features -e normal --locked | grep -E '(axum|hyper) v'; then
    echo "streamfleet-worker without its admin feature still depends on an HTTP stack" >&2
    return 1
  fi
  if cargo tree -p streamfleet-crd -e normal --locked | grep -E '(kube-client|kube-runtime|hyper) v'; then
    echo "streamfleet-crd depends on a Kubernetes client" >&2
    return 1
  fi
}

if [[ "${1:-}" == "--quick" ]]; then
  step "cargo fmt --check"
  cargo fmt --all -- --check
  step "cargo clippy"
  cargo clippy --workspace --all-targets --locked -- -D warnings
  lean_crates
  step "unit and Redis-level integration tests"
  RUST_TEST_THREADS=${RUST_TEST_THREADS:-4} cargo test --locked --no-fail-fast \
    -p streamfleet-contract -p streamfleet-crd -p streamfleet-streams -p streamfleet-process \
    -p streamfleet-worker -p streamfleet-operator -p streamfleet-images -p streamfleet-bench
  cargo test --locked -p streamfleet-testbed --lib --test redis
  step "done (quick tier: no control plane, no end-to-end tests)"
  record_timings test-command-quick "The quick tier (bash scripts/test.sh --quick): fmt, clippy, unit and Redis-level integration tests, no control plane; seconds per step"
  exit 0
fi
step "build control-plane tools (cached after the first run)"
bash scripts/build-tools.sh

step "cargo fmt --check"
cargo fmt --all -- --check
step "cargo clippy"
cargo clippy --workspace --all-targets --locked -- -D warnings
# The interleaving tests build the worker with its failpoints on.
cargo clippy -p streamfleet-worker --all-targets --features failpoints --locked -- -D warnings
# crdgen (the committed CRD YAML) is built only with its feature.
cargo clippy -p streamfleet-crd --all-targets --features crdgen --locked -- -D warnings
lean_crates

step "no unused dependencies (cargo machete)"
cargo machete

step "licences, banned crates, sources (cargo deny, offline; deny.toml)"
# cargo deny reads the metadata of every package in Cargo.lock, for every
# platform; a build downloads only the host's, so a fresh clone fetches the
# rest first (from the registry: the checks themselves stay offline).
cargo fetch --locked
cargo deny --offline check licenses bans sources

step "rendered manifests up to date"
# Render to a temporary file and compare: the tracked file is never written.
rendered=$(mktemp)
trap 'rm -f "$rendered"' EXIT
bash scripts/render-manifests.sh "$rendered"
if ! diff -u deploy/streamfleet.yaml "$rendered"; then
  echo "deploy/streamfleet.yaml is stale: run scripts/render-manifests.sh" >&2
  exit 1
fi
"$root/target/tools/bin/helm" lint charts/streamfleet --strict

step "alert rules: promtool check and unit tests"
"$root/target/tools/bin/promtool" check rules charts/streamfleet/files/alerts.yaml
"$root/target/tools/bin/promtool" test rules tests/monitoring/alerts.test.yaml

step "benchmark tables match their figure files"
bash scripts/docs-figures.sh --check

step "the chart README's values table matches values.yaml"
bash scripts/chart-readme.sh --check

step "build binaries (the kubelet stand-in runs them as pods)"
cargo build --workspace --bins --locked
step "build the tests"
# Every test job of the next step, each with the packages and features it
# runs with (so that building it here is what it runs: nothing is rebuilt
# while the jobs run side by side). One per line: a name, then the
# arguments of `cargo test`. The longest first: they start in this order
# (a run after another starts them by that run's times: scripts/test-lanes.sh).
valkey=$(printf '%q' "${HOME}/.cache/streamfleet/bin/valkey-server")
jobs=()
e2e_first=(drill delay_objective recovery api_at_rest status_truth retries pipeline console_outage sharding)
for name in "${e2e_first[@]}"; do
  jobs+=("e2e-$name -p streamfleet-e2e --test $name")
done
# The server matrix: the same tests on valkey-server (scripts/install-deps.sh),
# started by the test bed in place of redis-server; the first test checks it
# did. Its build has no TLS: the TLS tests stay with Redis.
jobs+=("valkey-redis-level -p streamfleet-streams -p streamfleet-worker")
jobs+=("valkey-e2e-pipeline -p streamfleet-e2e --test pipeline")
for file in tests/e2e/tests/*.rs; do
  name=$(basename "$file" .rs)
  if [[ " ${e2e_first[*]} images " != *" $name "* ]]; then
    jobs+=("e2e-$name -p streamfleet-e2e --test $name")
  fi
done
jobs+=("streams -p streamfleet-streams")
jobs+=("worker -p streamfleet-worker")
# The interleaving tests build the worker with its failpoints on.
jobs+=("worker-interleavings -p streamfleet-worker --features failpoints --test interleavings")
jobs+=("testbed -p streamfleet-testbed")
jobs+=("crates -p streamfleet-contract -p streamfleet-crd -p streamfleet-process -p streamfleet-operator -p streamfleet-example-worker -p streamfleet-images -p streamfleet-bench")
# Last: it waits for the images, built beside the other jobs.
jobs+=("e2e-images -p streamfleet-e2e --test images")
for job in "${jobs[@]}"; do
  read -r -a args <<< "${job#* }"
  cargo test --locked --no-run "${args[@]}"
done
# What scripts/build-images.sh builds in target/debug, built here: built
# there, it would hold target/debug's lock (niced) while the jobs wait on it.
cargo build --locked -p streamfleet-images --bin build-image
# Every workspace package has its tests in some job.
for package in $(cargo metadata --no-deps --format-version 1 --locked | python3 -c 'import json, sys; print(" ".join(p["name"] for p in json.load(sys.stdin)["packages"]))'); do
  if [[ " ${jobs[*]} " != *" -p $package "* ]]; then
    echo "scripts/test.sh: no test job runs $package" >&2
    exit 1
  fi
done

export STREAMFLEET_TEST_LANES=${STREAMFLEET_TEST_LANES:-4}
cpu_before=$(head -n 1 /proc/stat)
step "tests and the images, side by side (scripts/test-lanes.sh; the server matrix, docs/compatibility.md, among them)"
# The images (OCI layouts in target/images; tests/e2e/tests/images.rs checks
# and runs them) are built beside the tests, niced: their release build
# takes what the tests leave of the cores, and no lane.
images=target/test-logs/images-build
mkdir -p "$(dirname "$images")"
rm -f "$images.rc"
# Its exit status is written whole (renamed into place), whatever it is.
(
  rc=0
  STREAMFLEET_IMAGE_REGISTRY=testbed.local nice -n 19 bash scripts/build-images.sh > "$images.log" 2>&1 || rc=$?
  echo "$rc" > "$images.rc.tmp" && mv "$images.rc.tmp" "$images.rc"
) &
# Tests mostly wait on the control plane, Redis and the clock: each job runs
# more than one test per core, and more than one job at a time.
export RUST_TEST_THREADS=${RUST_TEST_THREADS:-4}
for job in "${jobs[@]}"; do
  name=${job%% *}
  command="cargo test --locked --no-fail-fast ${job#* }"
  case "$name" in
    valkey-redis-level)
      command="export STREAMFLEET_REDIS_SERVER=$valkey STREAMFLEET_EXPECT_SERVER=valkey; cargo test --locked -p streamfleet-testbed --test redis && $command -- --skip tls_with_a_private_ca --skip tls_with_a_client_certificate" ;;
    e2e-images)
      # Waits for the images (an hour at most: the build's own steps time out sooner).
      command="for _ in \$(seq 1800); do [ -f $images.rc ] && break; sleep 2; done; if [ \"\$(cat $images.rc 2>/dev/null)\" != 0 ]; then cat $images.log; echo 'building the images failed or did not end' >&2; exit 1; fi; $command" ;;
    valkey-*)
      command="export STREAMFLEET_REDIS_SERVER=$valkey STREAMFLEET_EXPECT_SERVER=valkey; $command" ;;
  esac
  printf '%s %s\n' "$name" "$command"
done | bash scripts/test-lanes.sh
cpu_busy=$(busy_since "$cpu_before")
step "done"
# A run from a fresh clone and a run again over its target/ are figures of their own.
if [ "$target_state" = fresh ]; then
  record_timings test-command "The test command (bash scripts/test.sh, what CI runs) from a fresh clone: seconds per step"
else
  record_timings test-command-warm "The test command (bash scripts/test.sh) run again, target/ kept: seconds per step"
fi
