#!/usr/bin/env bash
# Regenerates the committed CRD YAML from the Rust types (crd/), for deploy/ and the chart,
# and the field reference docs/crd-reference.md.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
cd "$root"
yaml=$(cargo run -q -p streamfleet-crd --features crdgen --bin crdgen)
for f in deploy/crds/streamconsumergroups.streamfleet.io.yaml charts/streamfleet/files/crds/streamconsumergroups.streamfleet.io.yaml; do
  printf '%s\n' "$yaml" > "$f"
done
cargo run -q -p streamfleet-crd --features crdgen --bin crdgen -- --reference > docs/crd-reference.md
echo "CRD written to deploy/crds and charts/streamfleet/files/crds, field reference to docs/crd-reference.md" >&2
