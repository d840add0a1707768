"""Drives verifiers' ``TrainClient`` (prime-rl's tokens-in path) against a tokentrail server.

Runs with the clients environment's python (scripts/clients_env.sh), never tokentrail's: it imports no
tokentrail code and reaches the server over HTTP only, exactly as prime-rl does. Each turn the client
renders the conversation client-side with ``renderers``' DefaultRenderer (the tokenizer's chat
template), POSTs the ids to ``/inference/v1/generate`` and parses the answer with ``renderers.client``'s
checks (a ``MalformedGenerateResponseError`` on a shape it rejects).

    python tests/clients/verifiers_train.py --base-url URL --api-key KEY --model NAME --tokenizer-dir DIR

Prints one JSON line per turn: what the typed ``Response`` carries (id, finish reason, content, usage,
``tokens``: prompt ids, completion ids, completion logprobs) plus what went over the wire, observed by
httpx event hooks on the client's own connection (the token ids the client sent, the server's
``request_id`` and per-choice ``tokentrail`` info). Any exception: printed, exit status 1.
"""

# mypy: disable-error-code="import-untyped,import-not-found"
from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
from typing import Any

from renderers import DefaultRendererConfig
from verifiers.v1.clients.train import TrainClient
from verifiers.v1.configs.client import TrainClientConfig
from verifiers.v1.dialects import ChatDialect
from verifiers.v1.types import SamplingConfig
from wire import WireLog, driver_options, failed  # this folder: on sys.path when run as a script

API_KEY_VAR = "TOKENTRAIL_CLIENT_API_KEY"
GENERATE_PATH = "/inference/v1/generate"
USER_TURNS = [
    "Hello there. Tell me about the sea.",
    "And what about rivers?",
    "Say something about mountains.",
    "Last one: the sky?",
    "One more: the desert.",
    "And forests?",
]


async def run(args: argparse.Namespace) -> int:
    os.environ[API_KEY_VAR] = args.api_key
    config = TrainClientConfig(
        base_url=f"{args.base_url.rstrip('/')}/v1",
        api_key_var=API_KEY_VAR,
        renderer=DefaultRendererConfig(),
        renderer_model_name=args.tokenizer_dir,
    )
    client = TrainClient(config)
    wire = WireLog(GENERATE_PATH)
    http = client.client._client  # the SDK's httpx.AsyncClient (verifiers builds it: build_async_httpx)
    wire.hook(http)

    messages: list[dict[str, Any]] = [{"role": "system", "content": "You are a terse assistant."}]
    try:
        for turn in range(args.turns):
            messages.append({"role": "user", "content": USER_TURNS[turn % len(USER_TURNS)]})
            body = {"model": args.model, "messages": list(messages)}
            sampling = SamplingConfig(max_tokens=args.max_tokens, temperature=1.0, seed=args.seed + turn)
            before = len(wire.received)
            try:
                response = await client.get_response(ChatDialect(), body, sampling)
            except BaseException:
                if len(wire.received) > before:
                    print(json.dumps({"turn": turn, "error_wire": wire.received[-1]}), flush=True)
                raise
            tokens = response.tokens
            assert tokens is not None, "TrainClient returned a Response without tokens"
            sent, received = wire.sent[-1], wire.received[-1]
            choice = (received["body"].get("choices") or [{}])[0]
            line = {
                "turn": turn,
                "response_id": response.id,
                "model": response.model,
                "finish_reason": response.finish_reason,
                "content": response.message.content,
                "usage": response.usage.model_dump() if response.usage else None,
                "prompt_ids": tokens.prompt_ids,
                "completion_ids": tokens.completion_ids,
                "completion_logprobs": tokens.completion_logprobs,
                "sent_token_ids": sent["token_ids"],
                "sent_sampling_params": sent["sampling_params"],
                "wire_status": received["status"],
                "wire_keys": sorted(received["body"]),
                "wire_choice_keys": sorted(choice),
                "wire_request_id": received["body"].get("request_id"),
                "wire_prompt_token_ids": received["body"].get("prompt_token_ids"),
                "wire_stop_reason": choice.get("stop_reason"),
                "wire_logprob_entry": (choice.get("logprobs") or {}).get("content", [None])[0],
                "tokentrail": choice.get("tokentrail"),
            }
            print(json.dumps(line), flush=True)
            messages.append({"role": "assistant", "content": response.message.content or ""})
    except BaseException as exc:
        return failed(exc)
    finally:
        await client.close()
    return 0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    driver_options(parser, turns=4, max_tokens=12)
    return asyncio.run(run(parser.parse_args()))


if __name__ == "__main__":
    sys.exit(main())
