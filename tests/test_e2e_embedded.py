"""End to end on embedded defaults: real HTTP, SSE and websocket; a real worker with the tiny model.

The client side speaks the wire format directly (httpx + a plain SSE parser), the way
Open-Assistant's clients do: debug login, chat, prompter message, assistant message, events.
"""

from __future__ import annotations

import json
import threading
from typing import Any

import httpx
import pytest

from tests.stack import MODEL
from text_client.sse import parse_sse


@pytest.fixture(scope="module")
def stack(embedded_stack: str) -> str:
    return embedded_stack


def login(url: str, username: str) -> dict[str, str]:
    # OA's flow: /auth/login/debug redirects to /auth/callback/debug, which returns a token pair.
    resp = httpx.get(f"{url}/auth/login/debug", params={"username": username}, follow_redirects=True)
    resp.raise_for_status()
    pair = resp.json()
    assert pair["access_token"]["token_type"] == "bearer"
    return {"Authorization": f"Bearer {pair['access_token']['access_token']}"}


def events(
    url: str,
    path: str,
    headers: dict[str, str],
    last_event_id: int | None = None,
    sink: list[dict[str, Any]] | None = None,
) -> list[dict[str, Any]]:
    """Read an SSE stream to its final event; each payload gets the SSE id as ``_id``.
    Payloads are also appended to ``sink`` as they arrive."""
    hdrs = {**headers, "Accept": "text/event-stream"}
    if last_event_id is not None:
        hdrs["Last-Event-ID"] = str(last_event_id)
    out: list[dict[str, Any]] = sink if sink is not None else []
    with httpx.stream("GET", f"{url}{path}", headers=hdrs, timeout=httpx.Timeout(10, read=60)) as resp:
        assert resp.status_code == 200, resp.read()
        assert resp.headers["content-type"].startswith("text/event-stream")
        for ev in parse_sse(resp.iter_lines()):
            payload = json.loads(ev.data)
            payload["_id"] = ev.id
            out.append(payload)
            if payload["event_type"] in ("message", "error"):
                break
    return out


def turn(
    url: str, headers: dict[str, str], chat_id: str, parent: str | None, text: str, **sampling: Any
) -> tuple[dict[str, Any], dict[str, Any]]:
    prompt = httpx.post(
        f"{url}/chats/{chat_id}/prompter_message",
        json={"parent_id": parent, "content": text},
        headers=headers,
    )
    assert prompt.status_code == 200, prompt.text
    reply = httpx.post(
        f"{url}/chats/{chat_id}/assistant_message",
        json={
            "parent_id": prompt.json()["id"],
            "model_config_name": MODEL,
            "sampling_parameters": {"max_new_tokens": 12, **sampling},
        },
        headers=headers,
    )
    assert reply.status_code == 200, reply.text
    return prompt.json(), reply.json()


def test_oa_client_flow_streams_tokens_then_message(stack: str) -> None:
    headers = login(stack, "alice")
    assert httpx.get(f"{stack}/auth/check", headers=headers).json() == "alice"
    models = httpx.get(f"{stack}/configs/model_configs", headers=headers).json()
    assert [m["name"] for m in models] == [MODEL]
    chat = httpx.post(f"{stack}/chats", json={}, headers=headers).json()
    _, reply = turn(stack, headers, chat["id"], None, "Hello there", temperature=0.9, top_p=0.95, seed=7)
    assert reply["state"] == "pending" and reply["role"] == "assistant"

    evs = events(stack, f"/chats/{chat['id']}/messages/{reply['id']}/events", headers)
    tokens = [e for e in evs if e["event_type"] == "token"]
    assert tokens, evs
    assert evs[-1]["event_type"] == "message"
    assert [e["index"] for e in tokens] == list(range(len(tokens)))
    assert [e["_id"] for e in tokens] == [str(i) for i in range(len(tokens))]
    final = evs[-1]["message"]
    assert final["state"] == "complete"
    streamed_text = "".join(e["text"] for e in tokens)
    if not final["reasoning_content"] and not final["tool_calls"]:
        assert final["content"] == streamed_text.strip()  # the parser's documented whitespace policy

    stored = httpx.get(
        f"{stack}/chats/{chat['id']}/messages/{reply['id']}", params={"include": "tokens"}, headers=headers
    ).json()
    assert stored["completion_token_ids"] == [e["token_id"] for e in tokens]
    assert stored["logprobs"] == pytest.approx([e["logprob"] for e in tokens], abs=0)
    assert len(stored["prompt_token_ids"]) == stored["prompt_token_count"] > 0
    assert stored["finish_reason"] in ("stop", "length")


def test_multi_turn_branches_and_replay(stack: str) -> None:
    headers = login(stack, "bob")
    chat_id = httpx.post(f"{stack}/chats", json={}, headers=headers).json()["id"]
    prompt1, reply1 = turn(stack, headers, chat_id, None, "first question")
    events(stack, f"/chats/{chat_id}/messages/{reply1['id']}/events", headers)
    # regenerate: a second assistant child of the same prompter message
    regen = httpx.post(
        f"{stack}/chats/{chat_id}/assistant_message",
        json={
            "parent_id": prompt1["id"],
            "model_config_name": MODEL,
            "sampling_parameters": {"max_new_tokens": 5},
        },
        headers=headers,
    ).json()
    # two prompter children of one assistant message: an edit creates a branch
    _, reply2 = turn(stack, headers, chat_id, reply1["id"], "second question")
    _, reply2b = turn(stack, headers, chat_id, reply1["id"], "second question, edited")
    for msg in (regen, reply2, reply2b):
        assert events(stack, f"/chats/{chat_id}/messages/{msg['id']}/events", headers)[-1]["event_type"] == "message"

    tree = httpx.get(f"{stack}/chats/{chat_id}", headers=headers).json()
    by_parent: dict[str | None, list[str]] = {}
    for m in tree["messages"]:
        by_parent.setdefault(m["parent_id"], []).append(m["id"])
    assert sorted(by_parent[prompt1["id"]]) == sorted([reply1["id"], regen["id"]])
    assert len(by_parent[reply1["id"]]) == 2
    # the second turn's prompt contains the first turn: it is longer than the first prompt
    t1 = httpx.get(f"{stack}/chats/{chat_id}/messages/{reply1['id']}?include=tokens", headers=headers).json()
    t2 = httpx.get(f"{stack}/chats/{chat_id}/messages/{reply2['id']}?include=tokens", headers=headers).json()
    assert len(t2["prompt_token_ids"]) > len(t1["prompt_token_ids"]) + len(t1["completion_token_ids"]) - 1

    # a finished message replays from SQL, and Last-Event-ID resumes exactly after the given token
    replay = events(stack, f"/chats/{chat_id}/messages/{reply2['id']}/events", headers)
    ids = [e["token_id"] for e in replay if e["event_type"] == "token"]
    assert ids == t2["completion_token_ids"]
    if len(ids) >= 3:
        rest = events(stack, f"/chats/{chat_id}/messages/{reply2['id']}/events", headers, last_event_id=1)
        assert [e["token_id"] for e in rest if e["event_type"] == "token"] == ids[2:]
        assert rest[-1]["event_type"] == "message"


def test_two_live_readers_and_resume_get_every_token(stack: str) -> None:
    headers = login(stack, "carol")
    chat_id = httpx.post(f"{stack}/chats", json={}, headers=headers).json()["id"]
    # long enough that readers attach while it streams; no stop token so it runs to the limit
    _, reply = turn(stack, headers, chat_id, None, "tell me a long story", max_new_tokens=120, temperature=1.0)
    path = f"/chats/{chat_id}/messages/{reply['id']}/events"
    results: dict[str, list[dict[str, Any]]] = {}

    def read(name: str, last: int | None = None) -> None:
        results[name] = events(stack, path, headers, last_event_id=last)

    threads = [threading.Thread(target=read, args=(n,)) for n in ("a", "b")]
    threads.append(threading.Thread(target=read, args=("resumed", 4)))
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    stored = httpx.get(f"{stack}/chats/{chat_id}/messages/{reply['id']}?include=tokens", headers=headers).json()
    ids = stored["completion_token_ids"]
    for name in ("a", "b"):
        assert [e["token_id"] for e in results[name] if e["event_type"] == "token"] == ids
        assert results[name][-1]["event_type"] == "message"
    assert [e["token_id"] for e in results["resumed"] if e["event_type"] == "token"] == ids[5:]


def test_pending_event_reports_queue_position(stack: str) -> None:
    headers = login(stack, "dave")
    chat_id = httpx.post(f"{stack}/chats", json={}, headers=headers).json()["id"]
    _, reply = turn(stack, headers, chat_id, None, "hi")
    evs = events(stack, f"/chats/{chat_id}/messages/{reply['id']}/events", headers)
    pending = [e for e in evs if e["event_type"] == "pending"]
    for p in pending:
        assert p["queue_position"] >= 0 and p["queue_size"] >= p["queue_position"]
    assert evs[-1]["event_type"] == "message"
