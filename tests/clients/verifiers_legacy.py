"""Drives verifiers 0.3.1's legacy clients through a real legacy ``MultiTurnEnv`` rollout against a
tokentrail server.

Runs with the 0.3.1 clients environment's python (scripts/clients_env.sh), never tokentrail's: it
imports no tokentrail code and reaches the server over HTTP only, as prime-rl's orchestrator does. The
clients are verifiers' own, unmodified:

- ``token``: ``OpenAIChatCompletionsTokenClient``. Its first turn is a plain ``POST
  /v1/chat/completions``; later turns stitch the prompt from the last turn's token ids plus a bridge
  (two ``POST /tokenize`` calls) and send it to ``POST /v1/chat/completions/tokens``. Where it cannot
  stitch (a truncated turn, or new messages that hold an assistant message it did not sample) it
  falls back to plain ``/v1/chat/completions`` and tokentrail must keep the stored prefix itself.
- ``plain``: ``OpenAIChatCompletionsClient``: every turn ``POST /v1/chat/completions`` with the whole
  conversation as messages.
- ``renderer``: ``RendererClient``: prompts rendered client-side with ``renderers`` (a renderer
  config named by ``--renderer``), bridged from the last turn's ids where the renderer can, then
  ``POST /inference/v1/generate``.

The environment's script (``ScriptedEnv.env_response``) answers any tool call the model made, and
besides ordinary user turns writes assistant turns itself: once a tool call with ``content`` None
followed by its result and a user message, once a plain-text assistant message followed by a user
message (what agents do, and what breaks naive stitching). Sampling arguments are prime-rl's
(``get_sampling_args``: logprobs, ``extra_body.return_token_ids`` ...), with a seed that moves on each
turn so that runs are reproducible.

    python tests/clients/verifiers_legacy.py --client token --base-url URL --api-key KEY --model NAME \
        --tokenizer-dir DIR [--renderer default|qwen3] [--turns 6] [--max-tokens 48] [--seed 7]

Prints one JSON line per model turn: the route it took, what it sent (messages, prompt token ids),
what the client's typed ``Response`` carries (prompt ids, completion ids, logprobs, finish reason,
content, reasoning, tool calls), and the per-choice ``tokentrail`` info read off the wire by httpx
event hooks on the client's own connection. Any exception or rollout error: printed, exit status 1.
"""

# mypy: disable-error-code="import-untyped,import-not-found"
from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
from typing import Any

import httpx
import verifiers.legacy as vf
from verifiers.legacy.types import (
    AssistantMessage,
    ClientConfig,
    Messages,
    State,
    Tool,
    ToolCall,
    ToolMessage,
    UserMessage,
)
from wire import driver_options  # this folder: on sys.path when run as a script

API_KEY_VAR = "TOKENTRAIL_CLIENT_API_KEY"
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
WEATHER_TOOL = Tool(
    name="get_weather",
    description="Get the current weather for a city.",
    parameters={"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
)
# The turns after which the environment writes an assistant turn itself (counted in model turns done).
WRITTEN_TOOL_CALL_AFTER = 2
WRITTEN_TEXT_AFTER = 4
MODEL_TURN_PATHS = ("/chat/completions", "/chat/completions/tokens", "/inference/v1/generate")


def scripted_messages(done: int) -> tuple[str, list[Any]]:
    """What the environment appends after ``done`` model turns (besides tool results): (kind, messages)."""
    if done == WRITTEN_TOOL_CALL_AFTER:
        call = ToolCall(id="call_env_1", name="get_weather", arguments=json.dumps({"city": "Paris"}))
        return "written-tool-call", [
            AssistantMessage(content=None, tool_calls=[call]),
            ToolMessage(tool_call_id="call_env_1", content="Sunny, 21 C."),
            UserMessage(content="The tool says it is sunny in Paris. Say it in a few words."),
        ]
    if done == WRITTEN_TEXT_AFTER:
        return "written-text", [
            AssistantMessage(content="Let me add something myself: rivers run to the sea."),
            UserMessage(content="Go on from there."),
        ]
    return "user", [UserMessage(content=USER_TURNS[(done - 1) % len(USER_TURNS)])]


class ScriptedEnv(vf.MultiTurnEnv):
    """A scripted multi-turn environment: the model's tool calls are answered, then the script's turn."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.kinds: list[str] = ["user"]  # per model turn: what preceded it (the first: the user prompt)

    async def env_response(self, messages: Messages, state: State, **kwargs: Any) -> Messages:
        last = messages[-1]
        out: list[Any] = [
            ToolMessage(tool_call_id=call.id, content="No result.")
            for call in (getattr(last, "tool_calls", None) or [])
        ]
        kind, scripted = scripted_messages(len(state["trajectory"]))
        self.kinds.append(kind)
        return [*out, *scripted]

    async def get_model_response(self, state: State, prompt: Messages, *args: Any, **kwargs: Any) -> Any:
        """The rollout's sampling arguments, with the seed moved on each turn (one sampled stream per
        turn, reproducible)."""
        sampling = dict(kwargs.pop("sampling_args", None) or state["sampling_args"] or {})
        if sampling.get("seed") is not None:
            sampling["seed"] += len(state["trajectory"])
        return await super().get_model_response(state, prompt, *args, sampling_args=sampling, **kwargs)


class WireLog:
    """Every request and response of the client's httpx connection, in order."""

    def __init__(self) -> None:
        self.exchanges: list[dict[str, Any]] = []

    async def on_request(self, request: httpx.Request) -> None:
        try:
            body = json.loads(request.content) if request.content else None
        except ValueError:
            body = None
        self.exchanges.append({"path": request.url.path, "sent": body})

    async def on_response(self, response: httpx.Response) -> None:
        await response.aread()  # cached: the SDK reads the same bytes after the hook
        try:
            body = response.json()
        except ValueError:
            body = {"unparsed": response.text[:2000]}
        entry = next(e for e in reversed(self.exchanges) if e["path"] == response.request.url.path)
        entry.update(status=response.status_code, received=body)

    def model_turns(self) -> list[dict[str, Any]]:
        return [e for e in self.exchanges if e["path"].endswith(MODEL_TURN_PATHS)]


def renderer_config(name: str) -> Any:
    import renderers

    if name == "qwen3":
        # thinking_retention "all": bridge across user turns from the sampled ids (the default,
        # "template", re-renders every turn from text, as Qwen3's template drops earlier reasoning)
        return renderers.Qwen3RendererConfig(thinking_retention="all")
    # the tiny chatml template writes Qwen-style <tool_call> JSON and <think> blocks
    return renderers.DefaultRendererConfig(tool_parser="qwen3", reasoning_parser="think")


def make_client(args: argparse.Namespace) -> Any:
    from verifiers.legacy.clients import resolve_client

    client_type = {
        "token": "openai_chat_completions_token",
        "plain": "openai_chat_completions",
        "renderer": "renderer",
    }[args.client]
    config = ClientConfig(
        client_type=client_type,
        api_base_url=f"{args.base_url.rstrip('/')}/v1",
        api_key_var=API_KEY_VAR,
        max_retries=0,
        timeout=120.0,
        renderer_model_name=args.tokenizer_dir if args.client == "renderer" else None,
        renderer_config=renderer_config(args.renderer) if args.client == "renderer" else None,
    )
    return resolve_client(config)


def prime_rl_sampling(args: argparse.Namespace) -> dict[str, Any]:
    """prime-rl's ``get_sampling_args`` for a sampling config of temperature 1 and max_tokens."""
    return {
        "temperature": 1.0,
        "max_tokens": args.max_tokens,
        "seed": args.seed,
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


def dump(messages: Any) -> list[dict[str, Any]]:
    return [m.model_dump(exclude_none=True) if hasattr(m, "model_dump") else dict(m) for m in messages]


def route_of(path: str) -> str:
    if path.endswith("/chat/completions/tokens"):
        return "tokens"
    if path.endswith("/inference/v1/generate"):
        return "generate"
    return "plain"


def turn_line(turn: int, kind: str, step: Any, wire: dict[str, Any]) -> dict[str, Any]:
    response = step["response"]
    message = response.message
    tokens = message.tokens
    sent, received = wire.get("sent") or {}, wire.get("received") or {}
    choice = (received.get("choices") or [{}])[0]
    return {
        "turn": turn,
        "kind": kind,  # what the environment wrote before this turn: user | written-tool-call | written-text
        "route": route_of(wire["path"]),
        "path": wire["path"],
        "wire_status": wire.get("status"),
        "messages": dump(step["prompt"]),
        "sent_messages": sent.get("messages"),
        "sent_tools": sent.get("tools"),
        "sent_prompt_ids": sent.get("tokens", sent.get("token_ids")),
        "sent_sampling": {k: v for k, v in sent.items() if k not in ("messages", "tools", "tokens", "token_ids")},
        "response_id": response.id,
        "finish_reason": message.finish_reason,
        "is_truncated": message.is_truncated,
        "content": message.content,
        "reasoning_content": message.reasoning_content,
        "tool_calls": [c.model_dump() for c in message.tool_calls or []],
        "prompt_ids": tokens.prompt_ids if tokens else None,
        "completion_ids": tokens.completion_ids if tokens else None,
        "completion_logprobs": tokens.completion_logprobs if tokens else None,
        "wire_prompt_token_ids": received.get("prompt_token_ids"),
        "wire_token_ids": choice.get("token_ids"),
        "wire_finish_reason": choice.get("finish_reason"),
        "tokentrail": choice.get("tokentrail"),
        "request_tokentrail": received.get("tokentrail"),
    }


async def run(args: argparse.Namespace) -> int:
    os.environ[API_KEY_VAR] = args.api_key
    client = make_client(args)
    wire = WireLog()
    http = client.client._client  # the SDK's httpx.AsyncClient (verifiers builds it: setup_openai_client)
    http.event_hooks["request"].append(wire.on_request)
    http.event_hooks["response"].append(wire.on_response)

    def dataset() -> Any:  # never built: the rollout is run directly
        from datasets import Dataset

        return Dataset.from_list([{"prompt": [], "example_id": 0}])

    env = ScriptedEnv(eval_dataset=dataset, tool_defs=[WEATHER_TOOL], max_turns=args.turns)
    prompt = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": FIRST_USER}]
    try:
        state = await env.rollout({"prompt": prompt, "example_id": 0}, client, args.model, prime_rl_sampling(args))
        trajectory = state["trajectory"]
        turns = wire.model_turns()
        if len(turns) < len(trajectory):
            raise RuntimeError(f"{len(trajectory)} trajectory steps but {len(turns)} model requests on the wire")
        for i, step in enumerate(trajectory):
            print(json.dumps(turn_line(i, env.kinds[i], step, turns[i])), flush=True)
        if state.get("error") is not None:
            failed = turns[len(trajectory)] if len(turns) > len(trajectory) else None
            if failed is not None:
                print(json.dumps({"turn": len(trajectory), "error_wire": failed}), flush=True)
            error = state["error"]
            cause = error.__cause__ or error.__context__
            raise RuntimeError(f"rollout error: {type(error).__name__}: {error} (cause: {cause!r})")
    except BaseException as exc:
        return failed(exc)
    finally:
        await client.close()
    return 0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--client", required=True, choices=("token", "plain", "renderer"))
    driver_options(parser, turns=6, max_tokens=48)
    parser.add_argument("--renderer", default="default", choices=("default", "qwen3"), help="renderer client only")
    parser.add_argument(
        "--chat-template-kwargs", type=json.loads, default=None, help='JSON, e.g. {"enable_thinking": false}'
    )
    return asyncio.run(run(parser.parse_args()))


if __name__ == "__main__":
    sys.exit(main())
