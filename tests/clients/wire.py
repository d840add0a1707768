"""What the client drivers share (each runs with a clients environment's python, imports no tokentrail
code): a log of the client's own httpx connection and the options every driver takes."""

# mypy: disable-error-code="import-untyped,import-not-found"
from __future__ import annotations

import argparse
import json
import traceback
from typing import Any

import httpx


class WireLog:
    """The requests and responses on the client's httpx connection whose path ends with one of
    ``paths``, in order: ``sent`` and ``received`` ({status, body}) lists."""

    def __init__(self, *paths: str) -> None:
        self.paths = paths
        self.sent: list[dict[str, Any]] = []
        self.received: list[dict[str, Any]] = []

    def hook(self, http: httpx.AsyncClient) -> None:
        http.event_hooks["request"].append(self.on_request)
        http.event_hooks["response"].append(self.on_response)

    async def on_request(self, request: httpx.Request) -> None:
        if request.url.path.endswith(self.paths):
            self.sent.append(json.loads(request.content))

    async def on_response(self, response: httpx.Response) -> None:
        if response.request.url.path.endswith(self.paths):
            await response.aread()  # cached: the SDK reads the same bytes after the hook
            try:
                body = response.json()
            except ValueError:
                body = {"unparsed": response.text[:2000]}
            self.received.append({"status": response.status_code, "body": body})


def driver_options(parser: argparse.ArgumentParser, *, turns: int, max_tokens: int, tokenizer: bool = True) -> None:
    """The options every driver takes: the server, the model, its directory (``tokenizer``: required,
    else accepted and unused) and the conversation's length, reply length and first seed."""
    parser.add_argument("--base-url", required=True, help="the tokentrail server, e.g. http://127.0.0.1:8000")
    parser.add_argument("--api-key", required=True, help="a tokentrail user API key")
    parser.add_argument("--model", required=True, help="the served model name")
    help_ = "the model's directory (tokenizer + chat template)" if tokenizer else "unused; accepted like the others"
    parser.add_argument("--tokenizer-dir", required=tokenizer, help=help_)
    parser.add_argument("--turns", type=int, default=turns)
    parser.add_argument("--max-tokens", type=int, default=max_tokens)
    parser.add_argument("--seed", type=int, default=7)


def failed(exc: BaseException) -> int:
    """The driver's failure, reported as the tests read it: the traceback, then one JSON line; exit 1."""
    traceback.print_exc()
    print(json.dumps({"error": f"{type(exc).__name__}: {exc}"}), flush=True)
    return 1
