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
root=$(cd "$(dirname "$0")/.." && pwd)
cd "$root"
start=$(date +%s)
step() { printf '\n==> %s (%ss)\n' "$*" "$(( $(date +%s) - start ))" >&2; }

step "install Debian packages"
bash scripts/install-deps.sh

if [[ "${1:-}" == "--quick" ]]; then
  step "cargo fmt --check"
  cargo fmt --all -- --check
  step "cargo clippy"
  cargo clippy --workspace --all-targets --locked -- -D warnings
  step "unit and Redis-level integration tests"
  RUST_TEST_THREADS=${RUST_TEST_THREADS:-4} cargo test --locked --no-fail-fast \
    -p streamfleet-contract -p streamfleet-crd -p streamfleet-streams -p streamfleet-process \
    -p streamfleet-worker -p streamfleet-operator -p streamfleet-images -p streamfleet-bench
  cargo test --locked -p streamfleet-testbed --lib --test redis
  step "done (quick tier: no control plane, no end-to-end tests)"
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

step "no unused dependencies (cargo machete)"
cargo machete

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

step "build binaries (the kubelet stand-in runs them as pods)"
cargo build --workspace --bins --locked
step "build the images (OCI layouts in target/images; tests/e2e/tests/images.rs checks and runs them)"
STREAMFLEET_IMAGE_REGISTRY=testbed.local bash scripts/build-images.sh
step "tests"
# Tests mostly wait on the control plane and Redis: run more than one per core.
RUST_TEST_THREADS=${RUST_TEST_THREADS:-4} cargo test --workspace --locked --no-fail-fast
step "interleaving tests (failpoints)"
cargo test -p streamfleet-worker --features failpoints --test interleavings --locked
step "server matrix: the Redis-level tests and the e2e pipeline again on Valkey 9 (docs/compatibility.md)"
# The same tests on valkey-server (scripts/install-deps.sh): the test bed
# starts it in place of redis-server, and the first test checks it did. Its
# build has no TLS: the TLS test stays with Redis.
export STREAMFLEET_REDIS_SERVER="${HOME}/.cache/streamfleet/bin/valkey-server" STREAMFLEET_EXPECT_SERVER=valkey
cargo test -p streamfleet-testbed --test redis --locked
RUST_TEST_THREADS=${RUST_TEST_THREADS:-4} cargo test -p streamfleet-streams -p streamfleet-worker --locked --no-fail-fast \
  -- --skip tls_with_a_private_ca
RUST_TEST_THREADS=${RUST_TEST_THREADS:-4} cargo test -p streamfleet-e2e --test pipeline --locked
unset STREAMFLEET_REDIS_SERVER STREAMFLEET_EXPECT_SERVER
step "done"
