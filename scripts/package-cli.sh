#!/usr/bin/env bash
# Packs the CLI for workstations: the static `streamfleet` binary that
# scripts/build-images.sh builds (glibc, crt-static: it runs on any
# linux/amd64), as target/dist/streamfleet_<version>_linux_amd64.tar.gz
# (with LICENSE; every timestamp at SOURCE_DATE_EPOCH, so the same binary
# gives the same bytes), its .sha256, and the krew plugin manifest
# target/dist/streamfleet.krew.yaml pointing at it:
#
#   kubectl krew install --manifest=target/dist/streamfleet.krew.yaml \
#     --archive=target/dist/streamfleet_0.1.0_linux_amd64.tar.gz
#
# linux/arm64 is not built here: this machine's Rust toolchain has the
# standard library for x86_64-unknown-linux-gnu only, and rustup's
# downloads cannot be reached (docs/dead-letters.md#getting-the-cli).
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
cd "$root"
version=$(awk -F'"' '/^version = / {print $2; exit}' Cargo.toml)
binary=${1:-$root/target/x86_64-unknown-linux-gnu/release/streamfleet}
export SOURCE_DATE_EPOCH=${SOURCE_DATE_EPOCH:-$(git log -1 --format=%ct 2>/dev/null || echo 0)}
dist=$root/target/dist
archive=streamfleet_${version}_linux_amd64.tar.gz
[ -x "$binary" ] || { echo "package-cli: no binary at $binary (run scripts/build-images.sh)" >&2; exit 1; }

stage=$(mktemp -d)
trap 'rm -rf "$stage"' EXIT
mkdir -p "$dist"
cp "$binary" "$stage/streamfleet"
cp LICENSE "$stage/LICENSE"
tar --sort=name --mtime="@$SOURCE_DATE_EPOCH" --owner=0 --group=0 --numeric-owner \
  -C "$stage" -cf - LICENSE streamfleet | gzip -n -9 > "$dist/$archive"
sha=$(sha256sum "$dist/$archive" | cut -d' ' -f1)
echo "$sha  $archive" > "$dist/$archive.sha256"

cat > "$dist/streamfleet.krew.yaml" <<YAML
apiVersion: krew.googlecontainertools.github.com/v1alpha2
kind: Plugin
metadata:
  name: streamfleet
spec:
  version: v$version
  homepage: https://github.com/streamfleet/streamfleet
  shortDescription: Dead letters and in-flight entries of streamfleet pipelines
  description: |
    Lists, shows, counts, replays and purges the dead letters of a
    StreamConsumerGroup, and lists its in-flight entries, through the
    Kubernetes API server with your kubeconfig and RBAC: no Redis
    password on your workstation. Also suspends and resumes pipelines.
  platforms:
    - selector:
        matchLabels:
          os: linux
          arch: amd64
      uri: https://github.com/streamfleet/streamfleet/releases/download/v$version/$archive
      sha256: $sha
      files:
        - from: streamfleet
          to: .
        - from: LICENSE
          to: .
      bin: streamfleet
YAML
echo "$dist/$archive"
