#!/usr/bin/env bash
# Renders the plain install manifests in deploy/ from the Helm chart, so
# `kubectl apply -f deploy/` installs exactly what `helm install` does.
# Usage: render-manifests.sh [OUTPUT]; OUTPUT defaults to deploy/streamfleet.yaml
# (scripts/test.sh renders to a temporary file to check that one is current).
# Without the console: its serving certificate is generated at install time
# (Helm's genCA, kept across upgrades), which a file in the repository cannot
# be. Install with Helm for the console (docs/console.md).
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
out=${1:-$root/deploy/streamfleet.yaml}
helm=$root/target/tools/bin/helm
[ -x "$helm" ] || bash "$root/scripts/build-tools.sh"
{
  echo "# Rendered from charts/streamfleet by scripts/render-manifests.sh; do not edit."
  echo "# Install: kubectl apply --server-side -f deploy/crds/ && kubectl apply -f deploy/streamfleet.yaml"
  echo "apiVersion: v1"
  echo "kind: Namespace"
  echo "metadata:"
  echo "  name: streamfleet-system"
  "$helm" template streamfleet "$root/charts/streamfleet" --namespace streamfleet-system --kube-version 1.35.0 \
    --set console.enabled=false --set crds.install=false
} > "$out"
echo "${1:-deploy/streamfleet.yaml} rendered" >&2
