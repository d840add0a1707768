#!/usr/bin/env bash
# Build (or complete) the separate virtual environments with third-party RL clients, for the tests that
# drive them against a real tokentrail server (tests/test_verifiers_clients.py). One call builds both:
#
#   scripts/clients_env.sh [DIR]   DIR defaults to $TOKENTRAIL_CLIENTS_VENV or ~/.cache/tokentrail/clients-venv
#
# - DIR: verifiers==0.4.0 (its v1 TrainClient: prime-rl's tokens-in path, and its v1 EvalClient),
#   renderers==0.1.12 (prompts rendered client-side with the tokenizer's chat template) and
#   transformers (the tokenizer). Drivers: tests/clients/verifiers_train.py, verifiers_eval.py.
# - $TOKENTRAIL_CLIENTS_VENV_031 or ~/.cache/tokentrail/clients-venv-031: verifiers==0.3.1, whose
#   verifiers.legacy holds the clients prime-rl used before the v1 API (the token client: /tokenize +
#   /v1/chat/completions/tokens; the plain chat client; RendererClient: renderers + POST
#   /inference/v1/generate), with renderers==0.1.10 (RendererClient imports its RendererPool, which
#   0.1.11 removed) and transformers. Driver: tests/clients/verifiers_legacy.py.
#
# verifiers' pins (openai>=2.54, mcp==2.0.0, uvicorn>=0.52, ...) are not the server's, and 0.3.1's are
# not 0.4.0's, so each gets an environment of its own and none goes in the main one. No torch: the
# renderers only need the tokenizer. This project is not installed there; the drivers talk to the
# server over HTTP only.
# Idempotent: an environment that already holds the pinned versions is left as it is (a second call
# returns in a few seconds); one that lacks them (or holds others) is completed in place.
set -euo pipefail

VENV="${1:-${TOKENTRAIL_CLIENTS_VENV:-$HOME/.cache/tokentrail/clients-venv}}"
VENV_031="${TOKENTRAIL_CLIENTS_VENV_031:-$HOME/.cache/tokentrail/clients-venv-031}"
PYTHON="${PYTHON:-python3}"

REPORT="import importlib.metadata as m; print(' '.join(f'{p}=={m.version(p)}' for p in ('verifiers', 'renderers', 'transformers', 'openai')))"

# installed SPEC...: are these exact pins (name==version; a bare name: any version) installed? Reads
# package metadata only (a second or two), not the imports (verifiers takes ~10 s of CPU to import).
INSTALLED='import importlib.metadata as m, sys
def ok(spec):
    name, _, pin = spec.partition("==")
    try:
        return not pin or m.version(name) == pin
    except m.PackageNotFoundError:
        return False
sys.exit(not all(ok(s) for s in sys.argv[1:]))'

# ensure DIR IMPORTS SPEC...: build or complete the environment at DIR: SPECs installed, IMPORTS import.
ensure() {
    local venv="$1" imports="$2"
    shift 2
    if [ -x "$venv/bin/python" ] && "$venv/bin/python" -c "$INSTALLED" "$@" >/dev/null 2>&1; then
        echo "clients venv ready: $venv ($("$venv/bin/python" -c "$REPORT"))"
        return 0
    fi
    if [ ! -x "$venv/bin/python" ]; then
        mkdir -p "$(dirname "$venv")"
        "$PYTHON" -m venv "$venv"
    fi
    local pip=("$venv/bin/python" -m pip --disable-pip-version-check)
    "${pip[@]}" install -q --upgrade pip
    "${pip[@]}" install "$@"
    # Nothing here needs torch; should a dependency ever pull it, it must be the local CPU wheel.
    if "$venv/bin/python" -c "import importlib.util, sys; sys.exit(importlib.util.find_spec('torch') is None)"; then
        "${pip[@]}" install "torch==2.13.0"
    fi
    "$venv/bin/python" -c "import $imports"
    "$venv/bin/python" -c "$INSTALLED" "$@"
    echo "clients venv ready: $venv ($("$venv/bin/python" -c "$REPORT"))"
}

ensure "$VENV" \
    "verifiers.v1.clients.train, verifiers.v1.clients.eval, renderers.client, transformers" \
    "verifiers==0.4.0" "renderers==0.1.12" "transformers"
ensure "$VENV_031" \
    "verifiers.legacy.envs.multiturn_env, verifiers.legacy.clients.openai_chat_completions_token_client, verifiers.legacy.clients.renderer_client, renderers.client, transformers" \
    "verifiers==0.3.1" "renderers==0.1.10" "transformers"
