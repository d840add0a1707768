"""Work dispatched from this process's memory (the path cache) is the work SQL describes.

A real server and worker serve multi-turn conversations through both front doors (system prompts,
tools, client-written assistant turns with tool calls, an edit that forks, a regeneration, a raw
prompt). Every work item the hub built from memory is then rebuilt from SQL alone and the two frames
must be equal, field for field.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import httpx
import pytest

from server.admin import issue_user_key
from server.chats.path_cache import PathCache
from server.chats.work_store import WorkStore
from server.db import create_engine, create_session_factory
from server.models import Message, MessageTokens
from server.settings import ServerSettings
from server.workers.work_source import Work, WorkSource
from tests.stack import MODEL, ServerThread, WorkerThread, worker_key
from tokentrail.launcher import free_port
from worker.chat_format import ChatFormat
from worker.engines.hf import HFEngine

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Weather of a city",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
        },
    }
]


@pytest.fixture
def recorded(tmp_path: Path, tiny_model_dir: Path) -> Iterator[tuple[ServerThread, list[Work]]]:
    settings = ServerSettings(data_dir=tmp_path / "data", port=free_port(), rate_limit_per_minute=0)
    server = ServerThread(settings).start()
    source: WorkSource = server.server.config.app.state.tt.hub.source
    works: list[Work] = []
    load = source.load

    async def recording(item: Any) -> Work | None:
        work = await load(item)
        if work is not None:
            works.append(work)
        return work

    source.load = recording  # type: ignore[method-assign]
    fmt = ChatFormat.load(str(tiny_model_dir))
    worker = WorkerThread(server.url, worker_key(settings), MODEL, fmt, lambda: HFEngine(str(tiny_model_dir))).start()
    try:
        yield server, works
    finally:
        worker.stop()
        server.stop()


def _chat(client: httpx.Client, messages: list[dict[str, Any]], **extra: Any) -> dict[str, Any]:
    body = {"model": MODEL, "messages": messages, "max_tokens": 6, **extra}
    resp = client.post("/v1/chat/completions", json=body)
    assert resp.status_code == 200, resp.text
    return resp.json()["choices"][0]["message"]  # type: ignore[no-any-return]


def _openai_conversations(client: httpx.Client) -> None:
    messages: list[dict[str, Any]] = [{"role": "system", "content": "Be brief."}]
    for turn in range(3):
        messages.append({"role": "user", "content": f"question {turn}"})
        reply = _chat(client, messages, tools=TOOLS)
        messages.append({"role": "assistant", "content": reply.get("content") or ""})
    # the client writes an assistant turn itself (a tool call) and the tool's result
    call = {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'}}
    messages += [
        {"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny"},
    ]
    reply = _chat(client, messages, tools=TOOLS)
    messages += [{"role": "assistant", "content": reply.get("content") or ""}, {"role": "user", "content": "thanks"}]
    _chat(client, messages, tools=TOOLS)
    # an edited first question forks the conversation
    _chat(client, [messages[0], {"role": "user", "content": "question 0, edited"}], tools=TOOLS)
    raw = client.post("/v1/completions", json={"model": MODEL, "prompt": "Once upon", "max_tokens": 4})
    assert raw.status_code == 200, raw.text


def _oa_conversation(client: httpx.Client) -> None:
    chat = client.post("/chats", json={"system_prompt": "You are a lighthouse keeper."}).json()["id"]
    parent = None
    for turn in range(3):
        prompt = client.post(f"/chats/{chat}/prompter_message", json={"parent_id": parent, "content": f"hi {turn}"})
        for _ in range(2 if turn == 1 else 1):  # a regeneration on the second turn
            reply = client.post(
                f"/chats/{chat}/assistant_message",
                json={
                    "parent_id": prompt.json()["id"],
                    "model_config_name": MODEL,
                    "sampling_parameters": {"max_new_tokens": 8},
                },
            )
            assert reply.status_code == 200, reply.text
            parent = reply.json()["id"]
            events = client.get(f"/chats/{chat}/messages/{parent}/events")
            assert '"event_type":"message"' in events.text.replace(" ", ""), events.text[-300:]


def _columns(row: Any) -> dict[str, Any]:
    values = {c.key: getattr(row, c.key) for c in row.__table__.columns}
    for key, value in values.items():
        if isinstance(value, datetime) and value.tzinfo is None:  # SQLite hands datetimes back naive (UTC)
            values[key] = value.replace(tzinfo=UTC)
    return values


async def _finished_from_sql(settings: ServerSettings, ids: list[str]) -> dict[str, tuple[Message, MessageTokens]]:
    engine = create_engine(settings.effective_database_url)
    out = {}
    try:
        async with create_session_factory(engine)() as s:
            for message_id in ids:
                msg, tokens = await s.get(Message, message_id), await s.get(MessageTokens, message_id)
                assert msg is not None and tokens is not None
                out[message_id] = (msg, tokens)
    finally:
        await engine.dispose()
    return out


async def _from_sql(settings: ServerSettings, works: list[Work]) -> list[tuple[Work, Work | None]]:
    engine = create_engine(settings.effective_database_url)
    try:
        source = WorkSource(WorkStore(create_session_factory(engine)), PathCache())
        return [(w, await source.from_db(w.message_id)) for w in works]
    finally:
        await engine.dispose()


def test_work_from_memory_equals_work_from_sql(recorded: tuple[ServerThread, list[Work]]) -> None:
    server, works = recorded
    key = issue_user_key(server.settings, "paths")
    with httpx.Client(base_url=server.url, headers={"Authorization": f"Bearer {key}"}, timeout=120) as client:
        _openai_conversations(client)
        pair = client.get("/auth/callback/debug", params={"code": "paths-oa"}).json()
        client.headers["Authorization"] = f"Bearer {pair['access_token']['access_token']}"
        _oa_conversation(client)
    from_memory = [w for w in works if w.from_memory]
    assert len(from_memory) >= 8, f"only {len(from_memory)} of {len(works)} dispatches came from memory"
    for mine, theirs in asyncio.run(_from_sql(server.settings, from_memory)):
        assert theirs is not None
        seed = mine.params.seed
        assert mine.frame(MODEL, 1, seed, None) == theirs.frame(MODEL, 1, seed, None), mine.message_id
        assert (mine.parent_id, mine.parent_chain, mine.chat_id) == (
            theirs.parent_id,
            theirs.parent_chain,
            theirs.chat_id,
        )


def test_finished_replies_kept_in_memory_equal_their_rows(recorded: tuple[ServerThread, list[Work]]) -> None:
    """Readers on the storing process take a reply's final event from ``hub.finished`` (snapshots built
    without the ORM's constructor) rather than from SQL: every column must be what SQL holds."""
    server, works = recorded
    key = issue_user_key(server.settings, "finished")
    with httpx.Client(base_url=server.url, headers={"Authorization": f"Bearer {key}"}, timeout=120) as client:
        _openai_conversations(client)
    finished = server.server.config.app.state.tt.hub.finished
    kept = {w.message_id: f for w in works if (f := finished.get(w.message_id)) is not None}
    assert len(kept) >= 6, f"only {len(kept)} of {len(works)} replies were kept"
    rows = asyncio.run(_finished_from_sql(server.settings, list(kept)))
    for message_id, done in kept.items():
        msg, tokens = rows[message_id]
        assert done.tokens is not None
        assert _columns(done.message) == _columns(msg), message_id
        assert _columns(done.tokens) == _columns(tokens), message_id
