#!/usr/bin/env bash
# Regenerates the committed CRD YAML from the Rust types (crd/), for deploy/ and the chart.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
cd "$root"
yaml=$(cargo run -q -p streamfleet-crd --bin crdgen)
for f in deploy/crds/streamconsumergroups.streamfleet.io.yaml charts/streamfleet/crds/streamconsumergroups.streamfleet.io.yaml; do
  printf '%s\n' "$yaml" > "$f"
done
echo "CRD written to deploy/crds and charts/streamfleet/crds" >&2
