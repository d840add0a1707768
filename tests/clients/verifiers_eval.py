"""Drives verifiers 0.4.0's v1 ``EvalClient`` (the eval path: a harness's chat request relayed to the
provider as native JSON) through a scripted multi-turn agent loop against a tokentrail server.

Runs with the clients environment's python (scripts/clients_env.sh), never tokentrail's: it imports no
tokentrail code and reaches the server over HTTP only. Each turn the conversation so far goes through
``ChatDialect.apply_overrides`` (the eval's model and sampling imposed, as verifiers' interception
server does: prime-rl's sampling arguments, ``logprobs`` and ``return_token_ids`` among them), then
``EvalClient.get_response`` POSTs it to ``/v1/chat/completions`` and parses the answer with the
dialect's own validation (a malformed response raises).

The loop echoes each reply back as an OpenAI agent does (content, tool calls, reasoning), answers
the model's tool calls, and besides ordinary user turns writes assistant turns itself: once a tool
call with ``content`` None followed by its result and a user message, once a plain-text assistant
message followed by a user message (the same script as tests/clients/verifiers_legacy.py).

    python tests/clients/verifiers_eval.py --base-url URL --api-key KEY --model NAME --tokenizer-dir DIR

Prints one JSON line per model turn: the messages sent, what the typed ``Response`` carries (id,
finish reason, content, tool calls), the raw answer's token fields (``prompt_token_ids``, the
choice's ``token_ids`` and logprobs) and its per-choice ``tokentrail`` info, plus what went over the
wire (httpx event hooks on the client's own connection). Any exception: printed, exit status 1.
"""

# mypy: disable-error-code="import-untyped,import-not-found"
from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
from typing import Any

from verifiers.v1.clients.eval import EvalClient
from verifiers.v1.configs.client import EvalClientConfig
from verifiers.v1.dialects import ChatDialect
from verifiers.v1.types import SamplingConfig
from wire import WireLog, driver_options, failed  # this folder: on sys.path when run as a script

API_KEY_VAR = "TOKENTRAIL_CLIENT_API_KEY"
CHAT_PATH = "/v1/chat/completions"
SYSTEM = "You are a terse assistant with a weather tool."
FIRST_USER = "Hello there. Tell me about the sea."
USER_TURNS = [
    "And what about rivers?",
    "Say something about mountains.",
    "Last one: the sky?",
    "One more: the desert.",
    "And forests?",
    "Anything about lakes?",
]
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Get the current weather for a city.",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
        },
    }
]
WRITTEN_TOOL_CALL_AFTER = 2
WRITTEN_TEXT_AFTER = 4


def scripted_messages(done: int) -> tuple[str, list[dict[str, Any]]]:
    """What the loop appends after ``done`` model turns (besides tool results): (kind, messages)."""
    if done == WRITTEN_TOOL_CALL_AFTER:
        function = {"name": "get_weather", "arguments": json.dumps({"city": "Paris"})}
        call = {"id": "call_env_1", "type": "function", "function": function}
        return "written-tool-call", [
            {"role": "assistant", "content": None, "tool_calls": [call]},
            {"role": "tool", "tool_call_id": "call_env_1", "content": "Sunny, 21 C."},
            {"role": "user", "content": "The tool says it is sunny in Paris. Say it in a few words."},
        ]
    if done == WRITTEN_TEXT_AFTER:
        return "written-text", [
            {"role": "assistant", "content": "Let me add something myself: rivers run to the sea."},
            {"role": "user", "content": "Go on from there."},
        ]
    return "user", [{"role": "user", "content": USER_TURNS[(done - 1) % len(USER_TURNS)]}]


def echoed(message: dict[str, Any]) -> list[dict[str, Any]]:
    """The reply as an OpenAI agent loop appends it, then a result for each tool call it made."""
    reply: dict[str, Any] = {"role": "assistant", "content": message.get("content")}
    calls = message.get("tool_calls") or []
    if calls:
        reply["tool_calls"] = calls
    if message.get("reasoning_content") is not None:
        reply["reasoning_content"] = message["reasoning_content"]
    results = [{"role": "tool", "tool_call_id": c["id"], "content": "No result."} for c in calls]
    return [reply, *results]


def prime_rl_sampling(args: argparse.Namespace, turn: int) -> SamplingConfig:
    """prime-rl's ``get_sampling_args`` for a sampling config of temperature 1 and max_tokens, with a
    seed that moves on each turn (reproducible runs)."""
    return SamplingConfig.model_validate(
        {
            "temperature": 1.0,
            "max_tokens": args.max_tokens,
            "seed": args.seed + turn,
            "top_p": 1.0,
            "logprobs": True,
            "extra_body": {
                "return_token_ids": True,
                "top_k": -1,
                "min_p": 0.0,
                "min_tokens": 0,
                "repetition_penalty": 1.0,
                **({"chat_template_kwargs": args.chat_template_kwargs} if args.chat_template_kwargs else {}),
            },
        }
    )


async def run(args: argparse.Namespace) -> int:
    os.environ[API_KEY_VAR] = args.api_key
    client = EvalClient(EvalClientConfig(base_url=f"{args.base_url.rstrip('/')}/v1", api_key_var=API_KEY_VAR))
    wire = WireLog(CHAT_PATH)
    wire.hook(client.client)
    dialect = ChatDialect()

    messages: list[dict[str, Any]] = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": FIRST_USER}]
    kind = "user"
    try:
        for turn in range(args.turns):
            if turn:
                kind, scripted = scripted_messages(turn)
                messages.extend(scripted)
            sampling = prime_rl_sampling(args, turn)
            body = dialect.apply_overrides({"messages": list(messages), "tools": TOOLS}, args.model, sampling)
            before = len(wire.received)
            try:
                response = await client.get_response(dialect, body, sampling)
            except BaseException:
                if len(wire.received) > before:
                    print(json.dumps({"turn": turn, "error_wire": wire.received[-1]}), flush=True)
                raise
            raw = response.raw or {}
            choice = (raw.get("choices") or [{}])[0]
            sent = wire.sent[-1]
            line = {
                "turn": turn,
                "kind": kind,
                "route": "plain",
                "wire_status": wire.received[-1]["status"],
                "sent_messages": sent["messages"],
                "sent_sampling": {k: v for k, v in sent.items() if k not in ("messages", "tools")},
                "sent_tools": sent.get("tools"),
                "response_id": response.id,
                "finish_reason": response.finish_reason,
                "content": response.message.content,
                "reasoning_content": getattr(response.message, "reasoning_content", None),
                "tool_calls": [c.model_dump() for c in response.message.tool_calls or []],
                "usage": response.usage.model_dump() if response.usage else None,
                "prompt_ids": raw.get("prompt_token_ids"),
                "completion_ids": choice.get("token_ids"),
                "completion_logprobs": [e["logprob"] for e in (choice.get("logprobs") or {}).get("content") or []],
                "wire_finish_reason": choice.get("finish_reason"),
                "tokentrail": choice.get("tokentrail"),
                "request_tokentrail": raw.get("tokentrail"),
            }
            print(json.dumps(line), flush=True)
            messages.extend(echoed(choice.get("message") or {}))
    except BaseException as exc:
        return failed(exc)
    finally:
        await client.close()
    return 0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    driver_options(parser, turns=6, max_tokens=48, tokenizer=False)  # the eval client sends messages
    parser.add_argument(
        "--chat-template-kwargs", type=json.loads, default=None, help='JSON, e.g. {"enable_thinking": false}'
    )
    return asyncio.run(run(parser.parse_args()))


if __name__ == "__main__":
    sys.exit(main())
