"""``--api openai``: drive the scripted conversations through ``/v1/chat/completions``.

The client is what an unmodified agent framework does: it keeps the conversation as OpenAI messages,
sends all of them on every request (streamed, with logprobs), and echoes each assistant reply back as
``{"role": "assistant", "content", "tool_calls"}`` (reasoning dropped, as most clients do) followed by
the tool results. It never sends token ids or chat ids; the server's prefix index finds the stored
turn. Ground truth is the same as for the chat API: the streamed token ids and logprobs, and the stored
record read back with ``?include=tokens``.
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import AsyncGenerator
from typing import Any

import httpx

from benchmarks.exactness.conversation import Conversation, Turn
from benchmarks.exactness.script import MAX_TOOL_ROUNDS, Script
from shared.protocol import WorkMessage

_SAMPLING_NAMES = {"max_new_tokens": "max_tokens"}
_MIN_LOGPROB = -9999.0  # the API's stand-in for -inf


async def post_events(
    client: httpx.AsyncClient, path: str, body: dict[str, Any]
) -> AsyncGenerator[dict[str, Any], None]:
    """The JSON ``data:`` of a streamed POST's server-sent events, up to ``[DONE]`` if it sends one."""
    async with client.stream("POST", path, json=body) as resp:
        if resp.status_code >= 400:
            await resp.aread()
            raise RuntimeError(f"HTTP {resp.status_code} {resp.text[:300]}")
        async for line in resp.aiter_lines():
            if not line.startswith("data:"):
                continue
            data = line[5:].strip()
            if data == "[DONE]":
                return
            yield json.loads(data)


async def read_stored(client: httpx.AsyncClient, turn: Turn, info: dict[str, Any]) -> bool:
    """Reads the stored record of the turn ``info`` (a ``tokentrail`` object) names into ``turn``; False
    (and ``turn.error``) if the message did not complete."""
    turn.message_id = info["message_id"]
    resp = await client.get(f"/chats/{info['chat_id']}/messages/{turn.message_id}", params={"include": "tokens"})
    resp.raise_for_status()
    turn.stored = resp.json()
    if turn.stored.get("state") != "complete":
        turn.error = f"message ended {turn.stored.get('state')}: {turn.stored.get('error')}"
        return False
    return True


async def _turn(
    client: httpx.AsyncClient, arm: str, script: Script, wire: list[dict[str, Any]], turn: Turn
) -> dict[str, Any] | None:
    """One streamed request; fills ``turn`` and returns the assistant message as the client saw it."""
    sampling = {_SAMPLING_NAMES.get(k, k): v for k, v in turn.sampling.items()}
    body = {"model": arm, "messages": wire, "stream": True, "logprobs": True, **sampling}
    if script.tools:
        body["tools"] = script.tools
    content, calls, info = "", [], None
    async with contextlib.aclosing(post_events(client, "/v1/chat/completions", body)) as chunks:
        async for chunk in chunks:
            if "error" in chunk:
                turn.error = f"{chunk['error'].get('code')}: {chunk['error'].get('message')}"
                return None
            info = chunk.get("tokentrail", info)
            for choice in chunk.get("choices", []):
                delta = choice.get("delta", {})
                content += delta.get("content") or ""
                calls += delta.get("tool_calls") or []
                turn.streamed_ids += choice.get("token_ids") or []
                for entry in (choice.get("logprobs") or {}).get("content") or []:
                    lp = entry["logprob"]
                    turn.streamed_logprobs.append(None if lp == _MIN_LOGPROB else lp)
    if info is None:
        turn.error = "the stream ended without its final chunk"
        return None
    if not await read_stored(client, turn, info):
        return None
    calls = [{k: v for k, v in c.items() if k != "index"} for c in calls]
    return {"role": "assistant", "content": content or None, **({"tool_calls": calls} if calls else {})}


async def run_conversation_openai(client: httpx.AsyncClient, arm: str, script: Script) -> Conversation:
    conv = Conversation(arm, script)
    msgs = conv.messages  # what the oracle renders: the stored fields, like the chat-API driver
    wire: list[dict[str, Any]] = []
    if script.system_prompt is not None:
        wire.append({"role": "system", "content": script.system_prompt})
        msgs.append(WorkMessage(id="system", role="system", content=script.system_prompt))
    new_from = 0
    for t, text in enumerate(script.user_texts):
        wire.append({"role": "user", "content": text})
        msgs.append(WorkMessage(id=f"user-{t}", role="user", content=text))
        written = script.written(t)
        if written is not None:  # the client's own assistant message, echoed like any other
            calls = written["tool_calls"]
            mine = {"role": "assistant", "content": written["content"] or None}
            wire.append({**mine, "tool_calls": calls} if calls else mine)
            msgs.append(WorkMessage(id=f"written-{t}", role="assistant", content=written["content"], tool_calls=calls))
            if written["result"] is None:
                continue
            call_id, result = calls[0]["id"], written["result"]
            wire.append({"role": "tool", "tool_call_id": call_id, "content": result})
            msgs.append(WorkMessage(id=f"written-tool-{t}", role="tool", content=result, tool_call_id=call_id))
        for r in range(MAX_TOOL_ROUNDS + 1):
            turn = Turn(at=len(msgs), new_from=new_from, turn=t, round=r, sampling=script.sampling(t, r))
            echo = await _turn(client, arm, script, wire, turn)
            if echo is None:
                conv.failed.append(turn)
                return conv
            msgs.append(turn.as_message())
            wire.append(echo)
            conv.turns.append(turn)
            new_from = len(msgs)
            calls = echo.get("tool_calls") or []
            if not calls or r == MAX_TOOL_ROUNDS:
                break
            for j, call in enumerate(calls):
                content = script.tool_result(t, r, j, call)
                wire.append({"role": "tool", "tool_call_id": call["id"], "content": content})
                msgs.append(WorkMessage(id=f"tool-{t}-{r}-{j}", role="tool", content=content, tool_call_id=call["id"]))
    return conv
