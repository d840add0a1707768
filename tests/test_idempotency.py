"""Idempotency-Key on the creating POSTs (server/idempotency.py), on embedded defaults with a real worker.

A retry with the same key and body creates nothing and answers as the first request did (the same ids;
a stream follows the same message from its first token); the same key with another body is a 422; a key
is its user's alone; requests racing with one key make one thing. The PostgreSQL + Redis path (a retry
on another replica, a key raced across replicas) is in tests/test_e2e_postgres_redis.py.
"""

from __future__ import annotations

import asyncio
import json
import uuid
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from datetime import timedelta
from typing import Any

import httpx
import openai
import pytest
from sqlalchemy import func, select

from server.admin import issue_user_key
from server.db import create_engine, create_session_factory
from server.idempotency import IdempotencyKey, fingerprint, parse_key
from server.models import IdempotencyRecord, Message, utcnow
from server.settings import ServerSettings
from tests.stack import MODEL
from tests.test_e2e_embedded import events, login


def key() -> dict[str, str]:
    return {"Idempotency-Key": str(uuid.uuid4())}


def children(url: str, headers: dict[str, str], chat: str) -> list[dict[str, Any]]:
    resp = httpx.get(f"{url}/chats/{chat}", headers=headers)
    assert resp.status_code == 200, resp.text
    messages: list[dict[str, Any]] = resp.json()["messages"]
    return messages


def test_oa_flow_retried_with_keys_makes_each_thing_once(embedded_stack: str) -> None:
    url, headers = embedded_stack, login(embedded_stack, "idem-oa")
    k_chat, k_prompt, k_reply = key(), key(), key()
    chats = [httpx.post(f"{url}/chats", json={}, headers={**headers, **k_chat}) for _ in range(2)]
    assert chats[0].status_code == chats[1].status_code == 200
    chat = chats[0].json()["id"]
    assert chats[1].json()["id"] == chat
    body = {"parent_id": None, "content": "hello"}
    prompts = [httpx.post(f"{url}/chats/{chat}/prompter_message", json=body, headers={**headers, **k_prompt})]
    prompts.append(httpx.post(f"{url}/chats/{chat}/prompter_message", json=body, headers={**headers, **k_prompt}))
    assert prompts[0].json()["id"] == prompts[1].json()["id"]
    ask = {"parent_id": prompts[0].json()["id"], "model_config_name": MODEL,
           "sampling_parameters": {"max_new_tokens": 8, "ignore_eos": True}}  # fmt: skip
    first = httpx.post(f"{url}/chats/{chat}/assistant_message", json=ask, headers={**headers, **k_reply})
    assert first.status_code == 200, first.text
    mid = first.json()["id"]
    final = events(url, f"/chats/{chat}/messages/{mid}/events", headers)[-1]
    assert final["event_type"] == "message"
    again = httpx.post(f"{url}/chats/{chat}/assistant_message", json=ask, headers={**headers, **k_reply})
    assert again.status_code == 200 and again.json()["id"] == mid
    assert again.json()["state"] == "complete"  # the message as it stands now
    roles = [m["role"] for m in children(url, headers, chat)]
    assert roles == ["prompter", "assistant"]  # nothing made twice

    # the same key with another request: refused, nothing stored
    other = httpx.post(f"{url}/chats/{chat}/prompter_message", json={**body, "content": "bye"},
                       headers={**headers, **k_prompt})  # fmt: skip
    assert other.status_code == 422 and other.json()["code"] == "idempotency_key_reused", other.text
    assert len(children(url, headers, chat)) == 2

    # another user's request with the same key value is a request of its own
    theirs = login(url, "idem-oa-other")
    own = httpx.post(f"{url}/chats", json={}, headers={**theirs, **k_chat})
    assert own.status_code == 200 and own.json()["id"] != chat


def test_bad_keys_are_refused_with_a_code(embedded_stack: str) -> None:
    headers = login(embedded_stack, "idem-bad")
    for value in (b"", b"x" * 256, "caf\u00e9".encode("latin-1"), b"a\tb"):
        resp = httpx.post(f"{embedded_stack}/chats", json={}, headers={**headers, "Idempotency-Key": value})
        assert resp.status_code == 400, (value, resp.text)
        assert resp.json()["code"] == "invalid_idempotency_key"
    assert parse_key('"abc \\"q\\""') == 'abc "q"'  # the draft's structured-field string
    assert parse_key(" token ") == "token"


def test_the_fingerprint_ignores_json_key_order_and_spacing() -> None:
    a = fingerprint("POST", "/v1/chat/completions", b'{"a": 1, "b": [1, 2]}')
    assert a == fingerprint("post", "/v1/chat/completions", b'{"b":[1,2],"a":1}')
    assert a != fingerprint("POST", "/v1/completions", b'{"a": 1, "b": [1, 2]}')
    assert a != fingerprint("POST", "/v1/chat/completions", b'{"a": 2, "b": [1, 2]}')


@pytest.fixture(scope="module")
def api(embedded_stack: str, embedded_settings: ServerSettings) -> Callable[[str], openai.OpenAI]:
    return lambda user: openai.OpenAI(
        base_url=f"{embedded_stack}/v1", api_key=issue_user_key(embedded_settings, user), max_retries=0
    )


def test_openai_sdk_retries_with_a_key_get_the_same_turn(api: Callable[[str], openai.OpenAI]) -> None:
    client = api("idem-sdk")
    messages: Any = [{"role": "user", "content": "count"}]
    headers = key()
    first = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=12, extra_headers=headers)
    again = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=12, extra_headers=headers)
    info = dict(first.model_extra or {})["tokentrail"]
    assert dict(again.model_extra or {})["tokentrail"]["message_ids"] == info["message_ids"]
    assert again.id == first.id and again.created == first.created
    assert again.choices[0].message.content == first.choices[0].message.content

    # a stream replayed with the same key: the same message from its first token
    headers = key()
    streamed = []
    for _ in range(2):
        stream = client.chat.completions.create(
            model=MODEL,
            messages=messages,
            max_tokens=12,
            stream=True,
            extra_headers=headers,
            extra_body={"ignore_eos": True},  # the random model may end early: 12 tokens, always
        )
        ids: list[int] = []
        chunk_ids = set()
        for chunk in stream:
            chunk_ids.add(chunk.id)
            for choice in chunk.choices:
                ids += dict(choice.model_extra or {}).get("token_ids") or []
        streamed.append((chunk_ids, ids))
    assert streamed[0] == streamed[1] and len(streamed[0][1]) == 12

    # another request under a used key
    with pytest.raises(openai.UnprocessableEntityError) as err:
        client.chat.completions.create(model=MODEL, messages=messages, max_tokens=13, extra_headers=headers)
    assert err.value.code == "idempotency_key_reused"


def test_every_dialect_and_raw_route_answers_a_retry_from_the_first_request(
    embedded_stack: str, embedded_settings: ServerSettings
) -> None:
    api_key = issue_user_key(embedded_settings, "idem-routes")
    auth = {"Authorization": f"Bearer {api_key}"}
    requests: list[tuple[str, dict[str, Any], Callable[[dict[str, Any]], Any]]] = [
        ("/v1/responses", {"model": MODEL, "input": "hi", "max_output_tokens": 6}, lambda r: r["id"]),
        (
            "/v1/messages",
            {"model": MODEL, "max_tokens": 6, "messages": [{"role": "user", "content": "hi"}]},
            lambda r: r["id"],
        ),
        (
            "/v1/completions",
            {"model": MODEL, "prompt": ["a", "b"], "max_tokens": 5, "n": 2},
            lambda r: [c["tokentrail"]["message_id"] for c in r["choices"]],
        ),
        (
            "/inference/v1/generate",
            {"model": MODEL, "token_ids": [5, 6, 7], "sampling_params": {"max_tokens": 5}},
            lambda r: [c["tokentrail"]["message_id"] for c in r["choices"]],
        ),
    ]
    for path, body, ident in requests:
        headers = {**auth, **key()}
        first = httpx.post(embedded_stack + path, json=body, headers=headers, timeout=60)
        again = httpx.post(embedded_stack + path, json=body, headers=headers, timeout=60)
        assert first.status_code == again.status_code == 200, (path, first.text, again.text)
        assert ident(first.json()) == ident(again.json()), path
        assert first.json() == again.json(), path  # the same answer, down to its time


def test_requests_racing_with_one_key_make_one_turn(
    api: Callable[[str], openai.OpenAI], embedded_settings: ServerSettings
) -> None:
    client = api("idem-race")
    headers = key()
    content = f"race {uuid.uuid4()}"

    def ask(_: int) -> Any:
        return client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": content}], max_tokens=6, extra_headers=headers
        )

    with ThreadPoolExecutor(6) as pool:
        answers = list(pool.map(ask, range(6)))
    ids = {tuple(dict(a.model_extra or {})["tokentrail"]["message_ids"]) for a in answers}
    assert len(ids) == 1
    chat_id = dict(answers[0].model_extra or {})["tokentrail"]["chat_id"]

    async def count() -> int:
        engine = create_engine(embedded_settings.effective_database_url)
        try:
            async with create_session_factory(engine)() as s:
                return int(await s.scalar(select(func.count()).where(Message.chat_id == chat_id)) or 0)
        finally:
            await engine.dispose()

    assert asyncio.run(count()) == 2  # one user message, one reply


def test_an_expired_key_is_free_again(embedded_stack: str, embedded_settings: ServerSettings) -> None:
    headers = login(embedded_stack, "idem-expiry")
    used = key()
    first = httpx.post(f"{embedded_stack}/chats", json={}, headers={**headers, **used}).json()["id"]

    async def age_and_check() -> None:
        engine = create_engine(embedded_settings.effective_database_url)
        try:
            sessions = create_session_factory(engine)
            async with sessions() as s:
                rec = await s.scalar(select(IdempotencyRecord).where(IdempotencyRecord.key == used["Idempotency-Key"]))
                assert rec is not None and json.dumps(rec.result) == json.dumps({"chat_id": first})
                rec.created_at = utcnow() - timedelta(days=2)
                await s.commit()
            async with sessions() as s:
                idem = IdempotencyKey(rec.user_id, rec.key, "another fingerprint", ttl_s=86400)
                assert await idem.find(s) is None  # expired: not a reuse, and freed
        finally:
            await engine.dispose()

    asyncio.run(age_and_check())
    again = httpx.post(f"{embedded_stack}/chats", json={}, headers={**headers, **used})
    assert again.status_code == 200 and again.json()["id"] != first
