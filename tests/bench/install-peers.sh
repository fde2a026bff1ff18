#!/usr/bin/env bash
# The peer routers the benchmark compares against, pinned, in their own venv
# (not the Envoy venv): $KVROUTE_BENCH_VENV or ~/.cache/kvroute/bench-venv.
# Idempotent: quick when both are installed at the pinned versions.
set -euo pipefail
venv=${KVROUTE_BENCH_VENV:-$HOME/.cache/kvroute/bench-venv}
want=("vllm-router==0.1.17" "sglang-router==0.3.2")
if [ -x "$venv/bin/python" ] && "$venv/bin/python" -m pip freeze 2>/dev/null \
    | grep -qx "vllm-router==0.1.17" && "$venv/bin/python" -m pip freeze 2>/dev/null \
    | grep -qx "sglang-router==0.3.2"; then
  exit 0
fi
echo "==> bench venv $venv: ${want[*]}"
python3 -m venv "$venv"
"$venv/bin/python" -m pip install --quiet "${want[@]}"
