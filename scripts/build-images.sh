#!/usr/bin/env bash
# Builds the operator and example-worker images without a container engine:
# static release binaries (glibc, crt-static), each packed by `build-image`
# into a one-layer OCI image layout under target/images/<name>/ — non-root
# (65532), no shell, CA roots for rediss://, every timestamp at
# SOURCE_DATE_EPOCH (default: the last commit's time), so the same binaries
# give the same digests. Prints each image's reference and manifest digest.
# Then packs the CLI for workstations (scripts/package-cli.sh: target/dist/).
#
#   STREAMFLEET_IMAGE_REGISTRY=ghcr.io/acme bash scripts/build-images.sh
#   target/tools/bin/crane push target/images/streamfleet ghcr.io/acme/streamfleet:0.1.0
#   target/tools/bin/crane push target/images/example-worker ghcr.io/acme/example-worker:0.1.0
#
# then install the chart with --set image.repository=ghcr.io/acme/streamfleet.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
cd "$root"
registry=${STREAMFLEET_IMAGE_REGISTRY:-streamfleet}
version=$(awk -F'"' '/^version = / {print $2; exit}' Cargo.toml)
tag=${STREAMFLEET_IMAGE_TAG:-$version}
revision=$(git rev-parse HEAD 2>/dev/null || echo unknown)
export SOURCE_DATE_EPOCH=${SOURCE_DATE_EPOCH:-$(git log -1 --format=%ct 2>/dev/null || echo 0)}
target=x86_64-unknown-linux-gnu

# Static: the image has no libc. Paths of this machine are kept out of the binaries.
RUSTFLAGS="-C target-feature=+crt-static --remap-path-prefix=$root=/src --remap-path-prefix=$HOME/.cargo=/cargo" \
  cargo build --release --locked --target "$target" -p streamfleet-operator -p streamfleet-example-worker \
  --bin streamfleet --bin example-worker
cargo build --locked -p streamfleet-images --bin build-image

pack() {
  "$root/target/debug/build-image" \
    --binary "$root/target/$target/release/$1" \
    --reference "$registry/$1:$tag" \
    --label "org.opencontainers.image.title=$1" \
    --label "org.opencontainers.image.version=$tag" \
    --label "org.opencontainers.image.revision=$revision" \
    --label "org.opencontainers.image.source=https://github.com/streamfleet/streamfleet" \
    --label "org.opencontainers.image.licenses=Apache-2.0" \
    --out "$2"
}
check=$(mktemp -d)
trap 'rm -rf "$check"' EXIT
for bin in streamfleet example-worker; do
  built=$(pack "$bin" "$root/target/images/$bin")
  # Packed twice, the same bytes: the image is a function of the binary.
  again=$(pack "$bin" "$check/$bin")
  if [ "$built" != "$again" ]; then
    echo "build-images: $bin is not reproducible: $built vs $again" >&2
    exit 1
  fi
  echo "$built"
done
# The same static binary, packed for workstations (and krew).
bash "$root/scripts/package-cli.sh" "$root/target/$target/release/streamfleet"
