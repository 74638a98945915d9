#!/usr/bin/env bash
# Renders the plain install manifests in deploy/ from the Helm chart, so
# `kubectl apply -f deploy/` installs exactly what `helm install` does.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
helm=$root/target/tools/bin/helm
[ -x "$helm" ] || bash "$root/scripts/build-tools.sh"
{
  echo "# Rendered from charts/streamfleet by scripts/render-manifests.sh; do not edit."
  echo "# Install: kubectl apply --server-side -f deploy/crds/ && kubectl apply -f deploy/streamfleet.yaml"
  echo "apiVersion: v1"
  echo "kind: Namespace"
  echo "metadata:"
  echo "  name: streamfleet-system"
  "$helm" template streamfleet "$root/charts/streamfleet" --namespace streamfleet-system --kube-version 1.35.0
} > "$root/deploy/streamfleet.yaml"
echo "deploy/streamfleet.yaml rendered" >&2
