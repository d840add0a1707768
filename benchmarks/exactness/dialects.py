"""``--api responses`` and ``--api messages``: the scripted conversations through OpenAI's Responses API
(``/v1/responses``) and Anthropic's Messages API (``/v1/messages``), as an unmodified agent harness of
that dialect does: the whole conversation sent every request (streamed), each reply echoed back as
returned (Responses output items with their token fields; Anthropic content blocks), tool results as
``function_call_output`` items / ``tool_result`` blocks. No chat ids: the server's prefix index finds
the stored turn, as on ``--api openai``.

Ground truth: neither dialect streams token ids per delta, so the "streamed" ids and logprobs are the
token fields of the stream's final event (``generation_token_ids``, ``generation_log_probs``), checked
against the stored record read back with ``?include=tokens``; the streamed text deltas must add up to
the stored content. Anthropic's API has no ``repetition_penalty`` or ``stop_token_ids``: the messages
arms run the script's sampling without them (both arms alike).
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import Callable
from typing import Any

import httpx

from benchmarks.exactness.conversation import Conversation, Turn
from benchmarks.exactness.openai import post_events, read_stored
from benchmarks.exactness.script import MAX_TOOL_ROUNDS, Script
from shared.protocol import WorkMessage

Wire = list[dict[str, Any]]


async def _stored(client: httpx.AsyncClient, turn: Turn, info: dict[str, Any], text: str) -> bool:
    """``read_stored``, and the streamed text must be the stored content."""
    if not await read_stored(client, turn, info):
        return False
    if text != (turn.stored.get("content") or ""):
        turn.error = "the streamed text differs from the stored content"
        return False
    return True


# ---- OpenAI Responses ------------------------------------------------------------------------------
def _responses_tools(script: Script) -> list[dict[str, Any]] | None:
    return [{"type": "function", **t["function"]} for t in script.tools] if script.tools else None


async def _responses_turn(client: httpx.AsyncClient, arm: str, script: Script, wire: Wire, turn: Turn) -> Wire | None:
    s = turn.sampling
    body: dict[str, Any] = {"model": arm, "input": wire, "stream": True, "max_output_tokens": s["max_new_tokens"]}
    body |= {k: v for k, v in s.items() if k != "max_new_tokens"}  # vLLM's sampling extensions
    if script.system_prompt is not None:
        body["instructions"] = script.system_prompt
    if script.tools:
        body["tools"] = _responses_tools(script)
    text, final = "", None
    async with contextlib.aclosing(post_events(client, "/v1/responses", body)) as events:
        async for event in events:
            kind = event.get("type")
            if kind == "response.output_text.delta":
                text += event["delta"]
            elif kind in ("response.completed", "response.incomplete"):
                final = event["response"]
            elif kind in ("response.failed", "error"):
                turn.error = f"{kind}: {json.dumps(event)[:300]}"
                return None
    if final is None:
        turn.error = "the stream ended without response.completed"
        return None
    fields = final["output"][-1]
    turn.streamed_ids, turn.streamed_logprobs = fields["generation_token_ids"], fields["generation_log_probs"]
    if not await _stored(client, turn, final["tokentrail"], text):
        return None
    return list(final["output"])  # echoed as returned, token fields included


def _responses_results(call_ids: list[str], results: list[str]) -> Wire:
    return [{"type": "function_call_output", "call_id": c, "output": r} for c, r in zip(call_ids, results, strict=True)]


def _responses_calls(echo: Wire) -> list[dict[str, Any]]:
    return [
        {"id": i["call_id"], "type": "function", "function": {"name": i["name"], "arguments": i["arguments"]}}
        for i in echo
        if i.get("type") == "function_call"
    ]


def _responses_written(written: dict[str, Any]) -> Wire:
    calls = written["tool_calls"] or []
    if not calls:
        return [{"role": "assistant", "content": written["content"]}]
    return [
        {
            "type": "function_call",
            "call_id": c["id"],
            "name": c["function"]["name"],
            "arguments": c["function"]["arguments"],
        }
        for c in calls
    ]


# ---- Anthropic Messages ----------------------------------------------------------------------------
_ANTHROPIC_SAMPLING = ("temperature", "top_p", "top_k", "seed")


async def _messages_turn(client: httpx.AsyncClient, arm: str, script: Script, wire: Wire, turn: Turn) -> Wire | None:
    s = turn.sampling
    body: dict[str, Any] = {"model": arm, "messages": wire, "stream": True, "max_tokens": s["max_new_tokens"]}
    body |= {k: s[k] for k in _ANTHROPIC_SAMPLING if k in s}
    # what was applied, for re-scoring: the dialect has no repetition_penalty or stop_token_ids
    turn.sampling = {"max_new_tokens": s["max_new_tokens"], **{k: s[k] for k in _ANTHROPIC_SAMPLING if k in s}}
    if script.system_prompt is not None:
        body["system"] = script.system_prompt
    if script.tools:
        body["tools"] = [
            {"name": f["name"], "description": f.get("description", ""), "input_schema": f["parameters"]}
            for f in (t["function"] for t in script.tools)
        ]
    blocks: dict[int, dict[str, Any]] = {}
    text, end = "", None
    async with contextlib.aclosing(post_events(client, "/v1/messages", body)) as events:
        async for event in events:
            kind = event.get("type")
            if kind == "content_block_start":
                blocks[event["index"]] = dict(event["content_block"])
            elif kind == "content_block_delta":
                block, delta = blocks[event["index"]], event["delta"]
                if delta["type"] == "text_delta":
                    block["text"] = block.get("text", "") + delta["text"]
                    text += delta["text"]
                elif delta["type"] == "thinking_delta":
                    block["thinking"] = block.get("thinking", "") + delta["thinking"]
                elif delta["type"] == "input_json_delta":
                    block["_json"] = block.get("_json", "") + delta["partial_json"]
            elif kind == "message_delta":
                end = event
            elif kind == "error":
                turn.error = f"error: {json.dumps(event)[:300]}"
                return None
    if end is None:
        turn.error = "the stream ended without message_delta"
        return None
    turn.streamed_ids, turn.streamed_logprobs = end["generation_token_ids"], end["generation_log_probs"]
    if not await _stored(client, turn, end["tokentrail"], text):
        return None
    content = []
    for _, block in sorted(blocks.items()):
        if "_json" in block:
            block["input"] = json.loads(block.pop("_json") or "{}")
        content.append(block)
    return [{"role": "assistant", "content": content}]  # the blocks echoed as returned


def _messages_calls(echo: Wire) -> list[dict[str, Any]]:
    return [
        {"id": b["id"], "type": "function", "function": {"name": b["name"], "arguments": json.dumps(b["input"])}}
        for b in echo[0]["content"]
        if b.get("type") == "tool_use"
    ]


def _messages_results(call_ids: list[str], results: list[str]) -> Wire:
    blocks = [{"type": "tool_result", "tool_use_id": c, "content": r} for c, r in zip(call_ids, results, strict=True)]
    return [{"role": "user", "content": blocks}]


def _messages_written(written: dict[str, Any]) -> Wire:
    calls = written["tool_calls"] or []
    if not calls:
        return [{"role": "assistant", "content": [{"type": "text", "text": written["content"]}]}]
    uses = [
        {
            "type": "tool_use",
            "id": c["id"],
            "name": c["function"]["name"],
            "input": json.loads(c["function"]["arguments"]),
        }
        for c in calls
    ]
    return [{"role": "assistant", "content": uses}]


# ---- the loop, the same for both ---------------------------------------------------------------------
class _Dialect:
    """How a dialect asks for a turn, finds the tool calls in a reply, sends tool results and writes a
    client-written assistant turn."""

    def __init__(
        self,
        ask: Callable[..., Any],
        calls: Callable[[Wire], list[dict[str, Any]]],
        results: Callable[[list[str], list[str]], Wire],
        written: Callable[[dict[str, Any]], Wire],
    ) -> None:
        self.ask, self.calls, self.results, self.written = ask, calls, results, written


RESPONSES = _Dialect(_responses_turn, _responses_calls, _responses_results, _responses_written)
MESSAGES = _Dialect(_messages_turn, _messages_calls, _messages_results, _messages_written)


async def run_conversation_dialect(
    dialect: _Dialect, client: httpx.AsyncClient, arm: str, script: Script
) -> Conversation:
    conv = Conversation(arm, script)
    msgs = conv.messages  # what the oracle renders: the stored fields, like the chat-API driver
    wire: Wire = []
    if script.system_prompt is not None:
        msgs.append(WorkMessage(id="system", role="system", content=script.system_prompt))
    new_from = 0
    for t, text in enumerate(script.user_texts):
        wire.append({"role": "user", "content": text})
        msgs.append(WorkMessage(id=f"user-{t}", role="user", content=text))
        written = script.written(t)
        if written is not None:  # the client's own assistant message, in the dialect's shape
            calls = written["tool_calls"]
            wire += dialect.written(written)
            msgs.append(WorkMessage(id=f"written-{t}", role="assistant", content=written["content"], tool_calls=calls))
            if written["result"] is None:
                continue
            wire += dialect.results([calls[0]["id"]], [written["result"]])
            msgs.append(
                WorkMessage(id=f"written-tool-{t}", role="tool", content=written["result"], tool_call_id=calls[0]["id"])
            )
        for r in range(MAX_TOOL_ROUNDS + 1):
            turn = Turn(at=len(msgs), new_from=new_from, turn=t, round=r, sampling=script.sampling(t, r))
            echo = await dialect.ask(client, arm, script, wire, turn)
            if echo is None:
                conv.failed.append(turn)
                return conv
            msgs.append(turn.as_message())
            wire += echo
            conv.turns.append(turn)
            new_from = len(msgs)
            calls = dialect.calls(echo)
            if not calls or r == MAX_TOOL_ROUNDS:
                break
            results = [script.tool_result(t, r, j, call) for j, call in enumerate(calls)]
            wire += dialect.results([c["id"] for c in calls], results)
            msgs += [
                WorkMessage(id=f"tool-{t}-{r}-{j}", role="tool", content=content, tool_call_id=call["id"])
                for j, (call, content) in enumerate(zip(calls, results, strict=True))
            ]
    return conv
