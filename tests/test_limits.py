"""Limits checked before anything is read or stored: body size, NUL characters, tools and chat size,
and fair load (per-user rate and queue share, 429 with Retry-After; a refused request leaves no row).

The server runs in a thread with small fair-load settings. A real websocket peer says hello for the
model and never grants credits, so the assistant messages it is offered stay pending (open).
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import websockets

from server.chats.admission import RateLimiter
from server.settings import ServerSettings
from tests.stack import ServerThread, fake_hello, worker_key
from tests.test_e2e_embedded import login
from tokentrail.launcher import free_port

MODEL = "idle-model"


class IdleWorker:
    """Connects, says hello for MODEL and holds no credits: nothing offered to it starts."""

    def __init__(self, url: str, key: str) -> None:
        self.url = url.replace("http://", "ws://") + "/workers/work"
        self.key = key
        self.loop = asyncio.new_event_loop()
        self.welcomed = threading.Event()
        self.stop_event: asyncio.Event | None = None
        self.thread = threading.Thread(target=self.loop.run_until_complete, args=(self._run(),), daemon=True)

    async def _run(self) -> None:
        self.stop_event = asyncio.Event()
        hello = fake_hello(MODEL)
        async with websockets.connect(self.url, additional_headers={"Authorization": f"Bearer {self.key}"}) as ws:
            await ws.send(hello.model_dump_json())
            await ws.recv()
            self.welcomed.set()
            while not self.stop_event.is_set():
                await ws.send('{"type": "heartbeat"}')
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self.stop_event.wait(), timeout=2)

    def start(self) -> IdleWorker:
        self.thread.start()
        assert self.welcomed.wait(30), "the idle worker was not welcomed"
        return self

    def stop(self) -> None:
        if self.stop_event is not None:
            self.loop.call_soon_threadsafe(self.stop_event.set)
        self.thread.join(timeout=10)


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerThread]:
    settings = ServerSettings(
        data_dir=Path(tmp_path_factory.mktemp("limits")),
        port=free_port(),
        rate_limit_per_minute=60,  # one a second
        rate_limit_burst=3,
        max_queue_size=10,
        user_queue_share=0.4,  # 4 open generations per user and model
    )
    srv = ServerThread(settings).start()
    worker = IdleWorker(srv.url, worker_key(settings)).start()
    yield srv
    worker.stop()
    srv.stop()


def expect(resp: httpx.Response, status: int, code: str) -> dict[str, Any]:
    assert resp.status_code == status, resp.text
    body: dict[str, Any] = resp.json()
    assert body.get("code", body.get("error", {}).get("code")) == code, body
    return body


def new_turn(url: str, headers: dict[str, str]) -> tuple[str, str]:
    chat = httpx.post(f"{url}/chats", json={}, headers=headers).json()["id"]
    prompt = httpx.post(
        f"{url}/chats/{chat}/prompter_message", json={"parent_id": None, "content": "hi"}, headers=headers
    ).json()["id"]
    return chat, prompt


def ask(url: str, headers: dict[str, str], chat: str, parent: str) -> httpx.Response:
    return httpx.post(
        f"{url}/chats/{chat}/assistant_message",
        json={"parent_id": parent, "model_config_name": MODEL, "sampling_parameters": {"max_new_tokens": 4}},
        headers=headers,
    )


def assistant_rows(url: str, headers: dict[str, str], chat: str) -> list[dict[str, Any]]:
    tree = httpx.get(f"{url}/chats/{chat}", headers=headers).json()
    return [m for m in tree["messages"] if m["role"] == "assistant"]


def test_oversized_bodies_are_refused_before_they_are_read(server: ServerThread) -> None:
    headers = login(server.url, "big")
    limit = server.settings.max_body_bytes
    blob = b'{"system_prompt": "' + b"x" * limit + b'"}'
    resp = httpx.post(f"{server.url}/chats", content=blob, headers={**headers, "Content-Type": "application/json"})
    expect(resp, 413, "request_too_large")

    def chunks() -> Iterator[bytes]:  # no Content-Length: refused once the streamed body passes the limit
        yield b'{"system_prompt": "'
        for _ in range(limit // 65536 + 2):
            yield b"x" * 65536
        yield b'"}'

    resp = httpx.post(f"{server.url}/chats", content=chunks(), headers={**headers, "Content-Type": "application/json"})
    expect(resp, 413, "request_too_large")
    body = expect(
        httpx.post(
            f"{server.url}/v1/chat/completions", content=blob, headers={**headers, "Content-Type": "application/json"}
        ),
        413,
        "request_too_large",
    )
    assert body["error"]["type"] == "invalid_request_error"  # OpenAI's error shape on OpenAI routes
    assert httpx.get(f"{server.url}/chats", headers=headers).status_code == 200


def test_nul_characters_are_refused_with_400(server: ServerThread) -> None:
    headers = login(server.url, "nul")
    chat, _prompt = new_turn(server.url, headers)
    before = httpx.get(f"{server.url}/chats/{chat}", headers=headers).json()
    resp = httpx.post(
        f"{server.url}/chats/{chat}/prompter_message", json={"parent_id": None, "content": "a\u0000b"}, headers=headers
    )
    expect(resp, 400, "bad_request")
    expect(httpx.post(f"{server.url}/chats", json={"tools": [{"\u0000": 1}]}, headers=headers), 400, "bad_request")
    expect(httpx.get(f"{server.url}/chats", params={"after": "a\u0000"}, headers=headers), 400, "bad_request")
    expect(httpx.get(f"{server.url}/chats/a%00b", headers=headers), 400, "bad_request")
    body = expect(
        httpx.post(
            f"{server.url}/v1/chat/completions",
            json={"model": MODEL, "messages": [{"role": "user", "content": "\u0000"}]},
            headers=headers,
        ),
        400,
        "bad_request",
    )
    assert body["error"]["message"]
    # A backslash followed by "u0000" is text, not NUL, and is stored as sent.
    resp = httpx.post(
        f"{server.url}/chats/{chat}/prompter_message", json={"parent_id": None, "content": "\\u0000"}, headers=headers
    )
    assert resp.status_code == 200 and resp.json()["content"] == "\\u0000", resp.text
    after = httpx.get(f"{server.url}/chats/{chat}", headers=headers).json()
    assert len(after["messages"]) == len(before["messages"]) + 1


def test_tools_and_chat_size_are_capped(server: ServerThread, monkeypatch: pytest.MonkeyPatch) -> None:
    headers = login(server.url, "sizes")
    huge = [{"type": "function", "function": {"name": "f", "description": "d" * 300_000}}]
    resp = httpx.post(f"{server.url}/chats", json={"tools": huge}, headers=headers)
    assert resp.status_code == 422 and resp.json()["code"] == "validation_error", resp.text
    resp = httpx.post(
        f"{server.url}/v1/chat/completions",
        json={"model": MODEL, "messages": [{"role": "user", "content": "x"}], "tools": huge},
        headers=headers,
    )
    assert resp.status_code == 400 and resp.json()["error"]["param"] == "tools", resp.text
    calls = [{"id": "c1", "type": "function", "function": {"name": "f", "arguments": "x" * 70_000}}]
    messages = [
        {"role": "user", "content": "x"},
        {"role": "assistant", "content": "", "tool_calls": calls},
        {"role": "tool", "tool_call_id": "c1", "content": "y"},
    ]
    resp = httpx.post(f"{server.url}/v1/chat/completions", json={"model": MODEL, "messages": messages}, headers=headers)
    assert resp.status_code == 400 and "arguments" in resp.json()["error"]["message"], resp.text

    import server.chats.repository as repository

    monkeypatch.setattr(repository, "MAX_MESSAGES_PER_CHAT", 2)
    chat, prompt = new_turn(server.url, headers)  # message 1
    assert ask(server.url, headers, chat, prompt).status_code == 200  # message 2
    resp = httpx.post(
        f"{server.url}/chats/{chat}/prompter_message", json={"parent_id": None, "content": "again"}, headers=headers
    )
    expect(resp, 409, "chat_too_long")
    assert len(httpx.get(f"{server.url}/chats/{chat}", headers=headers).json()["messages"]) == 2


def test_rate_limit_and_queue_share_answer_429_and_leave_no_rows(server: ServerThread) -> None:
    url = server.url
    alice = login(url, "fair-alice")
    chat, prompt = new_turn(url, alice)
    for _ in range(3):  # the burst
        assert ask(url, alice, chat, prompt).status_code == 200
    resp = ask(url, alice, chat, prompt)
    expect(resp, 429, "rate_limited")
    assert int(resp.headers["Retry-After"]) >= 1
    assert len(assistant_rows(url, alice, chat)) == 3
    time.sleep(1.1)  # one more a second
    assert ask(url, alice, chat, prompt).status_code == 200
    time.sleep(1.1)
    resp = ask(url, alice, chat, prompt)  # 4 open: her share of the queue is used up
    expect(resp, 429, "queue_share_exceeded")
    assert "Retry-After" in resp.headers
    assert len(assistant_rows(url, alice, chat)) == 4
    # OpenAI routes count against the same budget, answer in OpenAI's shape, and store nothing.
    before = httpx.get(f"{url}/chats", headers=alice, params={"limit": 100}).json()["chats"]
    resp = httpx.post(
        f"{url}/v1/chat/completions",
        json={"model": MODEL, "messages": [{"role": "user", "content": "x"}]},
        headers=alice,
    )
    assert resp.status_code == 429 and resp.json()["error"]["type"] == "rate_limit_error", resp.text
    assert httpx.get(f"{url}/chats", headers=alice, params={"limit": 100}).json()["chats"] == before

    # Other users are not held back by alice; then the queue (10 in all) fills up.
    bob = login(url, "fair-bob")
    c, p = new_turn(url, bob)
    for _ in range(3):
        assert ask(url, bob, c, p).status_code == 200
    for k in range(10):
        user = login(url, f"fair-filler-{k}")
        c, p = new_turn(url, user)
        resp = ask(url, user, c, p)
        if resp.status_code != 200:
            break
    expect(resp, 503, "queue_full")
    assert "Retry-After" in resp.headers
    assert assistant_rows(url, user, c) == []  # the refused message left no row
    assert httpx.get(f"{url}/chats/{c}", headers=user).json()["active_thread_tail_message_id"] == p


@pytest.mark.parametrize("backend", ["memory", "redis"])
def test_rate_limiter_allows_the_burst_then_the_rate(backend: str, request: pytest.FixtureRequest) -> None:
    async def run() -> list[float]:
        redis = None
        if backend == "redis":
            from redis.asyncio import Redis

            redis = Redis.from_url(request.getfixturevalue("redis_url"))
        try:
            limiter = RateLimiter(per_minute=600, burst=4, redis=redis)  # one per 100 ms
            user = f"u-{time.monotonic_ns()}"
            start = time.monotonic()
            waits = [await limiter.wait_ms(user) for _ in range(5)]
            await asyncio.sleep(0.25)
            waits += [await limiter.wait_ms(user) for _ in range(2)]
            eighth_at.append(time.monotonic() - start)
            waits.append(await limiter.wait_ms(user))
            waits.append(await limiter.wait_ms(f"{user}-other", cost=4))
            waits.append(await limiter.wait_ms(f"{user}-big", cost=5))
            return waits
        finally:
            if redis is not None:
                await redis.aclose()

    eighth_at: list[float] = []
    waits = asyncio.run(run())
    assert waits[:4] == [0, 0, 0, 0]  # the burst
    assert 0 < waits[4] <= 100  # the fifth waits for the next slot
    assert waits[5:7] == [0, 0]  # 250 ms later: two more slots
    # a third one frees 300 ms after the start: a busy machine (a parallel test run) may get there first
    if eighth_at[0] < 0.29:
        assert waits[7] > 0
    assert waits[8] == 0  # another user has a budget of its own
    assert waits[9] == 0  # a request larger than the burst takes all of it (it would never fit)


def test_options_and_405_name_every_method_of_the_path(server: ServerThread) -> None:
    headers = login(server.url, "methods")
    chat, _ = new_turn(server.url, headers)
    resp = httpx.options(f"{server.url}/chats/{chat}", headers=headers)
    assert resp.status_code == 204
    assert set(resp.headers["Allow"].split(", ")) == {"DELETE", "GET", "PUT"}
    resp = httpx.patch(f"{server.url}/chats/{chat}", headers=headers)
    assert resp.status_code == 405 and resp.json()["code"] == "bad_request"
    assert set(resp.headers["Allow"].split(", ")) == {"DELETE", "GET", "PUT"}
