"""Drives the scripts through a server over HTTP + SSE: every script on every arm, ``concurrency`` at a time
per arm, through the chat API (here) or ``/v1/chat/completions`` (``openai.py``).
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import json
from collections.abc import AsyncGenerator, Awaitable, Callable, Sequence
from typing import Any

import httpx

from benchmarks.exactness.conversation import Conversation, Turn
from benchmarks.exactness.dialects import MESSAGES, RESPONSES, run_conversation_dialect
from benchmarks.exactness.openai import run_conversation_openai
from benchmarks.exactness.script import MAX_TOOL_ROUNDS, Script
from benchmarks.progress import say
from shared.protocol import WorkMessage


async def _sse(client: httpx.AsyncClient, url: str) -> AsyncGenerator[dict[str, Any], None]:
    async with client.stream("GET", url, headers={"Accept": "text/event-stream"}) as resp:
        resp.raise_for_status()
        data: list[str] = []
        async for line in resp.aiter_lines():
            if line.startswith("data:"):
                data.append(line[5:].removeprefix(" "))
            elif not line and data:
                yield json.loads("\n".join(data))
                data = []


async def _post(client: httpx.AsyncClient, path: str, body: dict[str, Any]) -> dict[str, Any]:
    resp = await client.post(path, json=body)
    if resp.status_code >= 400:
        raise RuntimeError(f"POST {path}: HTTP {resp.status_code} {resp.text[:500]}")
    result: dict[str, Any] = resp.json()
    return result


async def _generate(client: httpx.AsyncClient, arm: str, chat_id: str, parent_id: str, turn: Turn) -> None:
    body = {"parent_id": parent_id, "model_config_name": arm, "sampling_parameters": turn.sampling}
    turn.message_id = (await _post(client, f"/chats/{chat_id}/assistant_message", body))["id"]
    ids: list[int] = []
    lps: list[float | None] = []
    url = f"/chats/{chat_id}/messages/{turn.message_id}/events"
    async with contextlib.aclosing(_sse(client, url)) as events:
        async for event in events:
            kind = event.get("event_type")
            if kind == "token":
                index = int(event["index"])
                if index > len(ids):
                    turn.error = f"the token stream skipped from index {len(ids)} to {index}"
                    return
                del ids[index:], lps[index:]  # a replayed index overwrites
                ids.append(int(event["token_id"]))
                lps.append(event["logprob"])
            elif kind == "reset":
                del ids[int(event["from_index"]) :], lps[int(event["from_index"]) :]
            elif kind == "error":
                turn.error = f"{event.get('code')}: {event.get('error') or event.get('message')}"
                return
            elif kind == "message":
                break
    turn.streamed_ids, turn.streamed_logprobs = ids, lps
    resp = await client.get(f"/chats/{chat_id}/messages/{turn.message_id}", params={"include": "tokens"})
    resp.raise_for_status()
    turn.stored = resp.json()
    if turn.stored.get("state") != "complete":
        turn.error = f"message ended {turn.stored.get('state')}: {turn.stored.get('error')}"


async def run_conversation(client: httpx.AsyncClient, arm: str, script: Script) -> Conversation:
    conv = Conversation(arm, script)
    chat = await _post(client, "/chats", {"system_prompt": script.system_prompt, "tools": script.tools})
    chat_id = chat["id"]
    msgs = conv.messages
    if script.system_prompt is not None:
        msgs.append(WorkMessage(id="system", role="system", content=script.system_prompt))
    parent: str | None = None
    new_from = 0
    for t, text in enumerate(script.user_texts):
        user = await _post(client, f"/chats/{chat_id}/prompter_message", {"parent_id": parent, "content": text})
        msgs.append(WorkMessage(id=user["id"], role="user", content=text))
        ask_under = user["id"]
        written = script.written(t)
        if written is not None:
            body = {"parent_id": ask_under, "content": written["content"], "tool_calls": written["tool_calls"]}
            mine = await _post(client, f"/chats/{chat_id}/written_assistant_message", body)
            msgs.append(WorkMessage(id=mine["id"], role="assistant", content=written["content"],
                                    tool_calls=written["tool_calls"]))  # fmt: skip
            if written["result"] is None:  # a typed reply: the next user message follows it
                parent = mine["id"]
                continue
            call_id = written["tool_calls"][0]["id"]
            body = {"parent_id": mine["id"], "tool_call_id": call_id, "content": written["result"]}
            tool = await _post(client, f"/chats/{chat_id}/tool_message", body)
            msgs.append(WorkMessage(id=tool["id"], role="tool", content=written["result"], tool_call_id=call_id))
            ask_under = tool["id"]  # the model answers under the result of the client's own call
        for r in range(MAX_TOOL_ROUNDS + 1):
            turn = Turn(at=len(msgs), new_from=new_from, turn=t, round=r, sampling=script.sampling(t, r))
            await _generate(client, arm, chat_id, ask_under, turn)
            if turn.error is not None:
                conv.failed.append(turn)
                return conv
            stored = turn.stored
            msgs.append(turn.as_message())
            conv.turns.append(turn)
            parent, new_from = turn.message_id, len(msgs)
            calls = stored.get("tool_calls") or []
            if not calls or r == MAX_TOOL_ROUNDS:
                break
            last = turn.message_id
            for j, call in enumerate(calls):
                content = script.tool_result(t, r, j, call)
                body = {"parent_id": last, "tool_call_id": call["id"], "content": content}
                tool = await _post(client, f"/chats/{chat_id}/tool_message", body)
                msgs.append(WorkMessage(id=tool["id"], role="tool", content=content, tool_call_id=call["id"]))
                last = tool["id"]
            ask_under = last
    return conv


async def drive(
    url: str, scripts: list[Script], concurrency: int, arms: Sequence[str], api: str = "chat"
) -> dict[str, list[Conversation]]:
    """Run every script on every arm; ``api``: "chat" (the native API), "openai" (``/v1/chat/completions``),
    "responses" (``/v1/responses``) or "messages" (``/v1/messages``)."""
    runners: dict[str, Callable[[httpx.AsyncClient, str, Script], Awaitable[Conversation]]] = {
        "chat": run_conversation,
        "openai": run_conversation_openai,
        "responses": functools.partial(run_conversation_dialect, RESPONSES),
        "messages": functools.partial(run_conversation_dialect, MESSAGES),
    }
    runner = runners[api]
    timeout = httpx.Timeout(60.0, read=600.0)
    async with httpx.AsyncClient(base_url=url, timeout=timeout) as client:
        resp = await client.get("/auth/callback/debug", params={"code": "exactness"})
        resp.raise_for_status()
        client.headers["Authorization"] = f"Bearer {resp.json()['access_token']['access_token']}"
        done = dict.fromkeys(arms, 0)
        gates = {arm: asyncio.Semaphore(concurrency) for arm in arms}

        async def one(arm: str, script: Script) -> Conversation:
            async with gates[arm]:
                conv = await runner(client, arm, script)
            done[arm] += 1
            say("conversations done: " + ", ".join(f"{a} {done[a]}/{len(scripts)}" for a in arms))
            return conv

        results = await asyncio.gather(*(one(arm, s) for arm in arms for s in scripts))
    return {arm: [c for c in results if c.arm == arm] for arm in arms}
