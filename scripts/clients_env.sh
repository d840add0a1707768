#!/usr/bin/env bash
# Build (or complete) a separate virtual environment with third-party RL clients, for the tests that
# drive them against a real tokentrail server (tests/test_verifiers_clients.py).
#
#   scripts/clients_env.sh [DIR]   DIR defaults to $TOKENTRAIL_CLIENTS_VENV or ~/.cache/tokentrail/clients-venv
#
# verifiers' pins (openai>=2.54, mcp==2.0.0, uvicorn>=0.52, ...) are not the server's, so it never goes
# in the main environment. Holds verifiers==0.4.0 (its TrainClient: prime-rl's tokens-in path),
# renderers==0.1.12 (prompts rendered client-side with the tokenizer's chat template) and transformers
# (the tokenizer). No torch: the renderer only needs the tokenizer. This project is not installed
# there; the drivers under tests/clients/ talk to the server over HTTP only.
# Idempotent: returns at once when the environment already imports what the drivers need.
set -euo pipefail

VENV="${1:-${TOKENTRAIL_CLIENTS_VENV:-$HOME/.cache/tokentrail/clients-venv}}"
PYTHON="${PYTHON:-python3}"

PACKAGES=("verifiers==0.4.0" "renderers==0.1.12" "transformers")
CHECK="import verifiers.v1.clients.train, renderers.client, transformers"
REPORT="import importlib.metadata as m; print(' '.join(f'{p}=={m.version(p)}' for p in ('verifiers', 'renderers', 'transformers', 'openai')))"

if [ -x "$VENV/bin/python" ] && "$VENV/bin/python" -c "$CHECK" >/dev/null 2>&1; then
    echo "clients venv ready: $VENV ($("$VENV/bin/python" -c "$REPORT"))"
    exit 0
fi

if [ ! -x "$VENV/bin/python" ]; then
    mkdir -p "$(dirname "$VENV")"
    "$PYTHON" -m venv "$VENV"
fi
PIP=("$VENV/bin/python" -m pip --disable-pip-version-check)

"${PIP[@]}" install -q --upgrade pip
"${PIP[@]}" install "${PACKAGES[@]}"
# Nothing here needs torch; should a dependency ever pull it, it must be the local CPU wheel.
if "$VENV/bin/python" -c "import importlib.util, sys; sys.exit(importlib.util.find_spec('torch') is None)"; then
    "${PIP[@]}" install "torch==2.13.0"
fi

"$VENV/bin/python" -c "$CHECK"
echo "clients venv ready: $VENV ($("$VENV/bin/python" -c "$REPORT"))"
