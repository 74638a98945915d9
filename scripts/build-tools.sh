#!/usr/bin/env bash
# Builds the real components the test bed runs and links them into target/tools/bin:
#   kube-apiserver, kube-controller-manager, kubectl  (tests/testbed/tools/k8s)
#   etcd                                              (tests/testbed/tools/etcd)
#   helm                                              (helm.sh/helm/v3, go install)
#   prometheus, promtool                              (github.com/prometheus/prometheus, go install):
#                                                     alert rules are checked and unit-tested with
#                                                     promtool, and an e2e test scrapes with Prometheus
#   crane                                             (github.com/google/go-containerregistry, go install):
#                                                     pushes the OCI images scripts/build-images.sh
#                                                     writes; an e2e test validates them in its registry
#   krew                                              (sigs.k8s.io/krew, go install): an e2e test installs
#                                                     the CLI archive with the krew manifest
#                                                     scripts/package-cli.sh writes
# Each build is cached under $STREAMFLEET_CACHE (default ~/.cache/streamfleet),
# keyed by a hash of the Go module that produces it, so a rerun builds nothing.
set -euo pipefail

root=$(cd "$(dirname "$0")/.." && pwd)
cache=${STREAMFLEET_CACHE:-$HOME/.cache/streamfleet}
out=$root/target/tools/bin
helm_version=v3.20.2
# Prometheus 3.x is published as Go module versions v0.3xx.
prometheus_module_version=v0.316.0
crane_version=v0.22.1
krew_version=v0.4.3
mkdir -p "$cache/tools" "$out"
export GOFLAGS="-mod=mod -buildvcs=false"

log() { printf '[build-tools] %s\n' "$*" >&2; }

# build_module DIR [LDFLAGS]: builds every main package in the Go module at DIR into
# a cache folder named after the hash of the module's files, then links the results.
build_module() {
  local dir=$1 ldflags="-s -w ${2:-}" key dest
  key=$( (cd "$dir" && find . -type f \( -name '*.go' -o -name 'go.mod' -o -name 'go.sum' \) -print0 \
        | sort -z | xargs -0 sha256sum; echo "$ldflags") | sha256sum | cut -c1-16)
  dest=$cache/tools/$(basename "$dir")-$key
  if [ ! -f "$dest/.complete" ]; then
    log "building $(basename "$dir") (cold; cached afterwards in $dest)"
    rm -rf "$dest.tmp" && mkdir -p "$dest.tmp"
    (cd "$dir" && go build -trimpath -ldflags="$ldflags" -o "$dest.tmp/" ./...)
    touch "$dest.tmp/.complete"
    rm -rf "$dest" && mv "$dest.tmp" "$dest"
    # Drop builds of earlier versions of this module.
    find "$cache/tools" -maxdepth 1 -name "$(basename "$dir")-*" ! -path "$dest" -exec rm -rf {} +
  fi
  for bin in "$dest"/*; do ln -sf "$bin" "$out/$(basename "$bin")"; done
}

build_helm() {
  local dest=$cache/tools/helm-$helm_version
  if [ ! -x "$dest/helm" ]; then
    log "building helm $helm_version (cold; cached afterwards in $dest)"
    rm -rf "$dest.tmp" && mkdir -p "$dest.tmp"
    GOBIN=$dest.tmp go install -trimpath \
      -ldflags="-s -w -X helm.sh/helm/v3/internal/version.version=$helm_version" \
      "helm.sh/helm/v3/cmd/helm@$helm_version"
    rm -rf "$dest" && mv "$dest.tmp" "$dest"
  fi
  ln -sf "$dest/helm" "$out/helm"
}

build_prometheus() {
  local dest=$cache/tools/prometheus-$prometheus_module_version
  if [ ! -x "$dest/promtool" ] || [ ! -x "$dest/prometheus" ]; then
    log "building prometheus and promtool $prometheus_module_version (cold; cached afterwards in $dest)"
    rm -rf "$dest.tmp" && mkdir -p "$dest.tmp"
    GOBIN=$dest.tmp go install -trimpath -ldflags="-s -w" \
      "github.com/prometheus/prometheus/cmd/promtool@$prometheus_module_version" \
      "github.com/prometheus/prometheus/cmd/prometheus@$prometheus_module_version"
    rm -rf "$dest" && mv "$dest.tmp" "$dest"
  fi
  ln -sf "$dest/promtool" "$out/promtool"
  ln -sf "$dest/prometheus" "$out/prometheus"
}

build_crane() {
  local dest=$cache/tools/crane-$crane_version
  if [ ! -x "$dest/crane" ]; then
    log "building crane $crane_version (cold; cached afterwards in $dest)"
    rm -rf "$dest.tmp" && mkdir -p "$dest.tmp"
    GOBIN=$dest.tmp go install -trimpath -ldflags="-s -w" \
      "github.com/google/go-containerregistry/cmd/crane@$crane_version"
    rm -rf "$dest" && mv "$dest.tmp" "$dest"
  fi
  ln -sf "$dest/crane" "$out/crane"
}

build_krew() {
  local dest=$cache/tools/krew-$krew_version
  if [ ! -x "$dest/krew" ]; then
    log "building krew $krew_version (cold; cached afterwards in $dest)"
    rm -rf "$dest.tmp" && mkdir -p "$dest.tmp"
    GOBIN=$dest.tmp go install -trimpath -ldflags="-s -w" "sigs.k8s.io/krew/cmd/krew@$krew_version"
    rm -rf "$dest" && mv "$dest.tmp" "$dest"
  fi
  ln -sf "$dest/krew" "$out/krew"
}

build_module "$root/tests/testbed/tools/etcd"
# Stamp the release into the binaries, as upstream's build does, so discovery
# (kubectl version, helm's kubeVersion checks) reports the real version.
k8s_version=$(awk '$1 == "k8s.io/kubernetes" && $2 ~ /^v/ {print $2; exit}' "$root/tests/testbed/tools/k8s/go.mod")
k8s_minor=$(echo "$k8s_version" | cut -d. -f2)
stamp=""
for pkg in k8s.io/component-base/version k8s.io/client-go/pkg/version; do
  stamp+=" -X $pkg.gitVersion=$k8s_version -X $pkg.gitMajor=1 -X $pkg.gitMinor=$k8s_minor -X $pkg.gitTreeState=clean"
done
build_module "$root/tests/testbed/tools/k8s" "$stamp"
build_helm
build_prometheus
build_crane
build_krew
log "tools ready in $out"
