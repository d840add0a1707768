"""POST /chats/{chat_id}/messages/{message_id}/cancel, with a real worker and real SSE readers.

Running: the worker aborts within an engine step; the message ends ``cancelled`` with the tokens
generated so far stored (equal to what readers saw) and exported with finish_reason "abort".
Queued: it never starts. Finished: 409. Readers get a final error event with code ``cancelled``.
"""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

import httpx
import pytest

from server.settings import ServerSettings
from tests.stack import MODEL, ServerThread, start_reply, wait_for, worker_key
from tests.test_api_errors import expect
from tests.test_e2e_embedded import events, login
from tests.test_export import export
from tests.test_limits import MODEL as IDLE_MODEL
from tests.test_limits import IdleWorker
from tokentrail.launcher import free_port


def test_cancel_a_running_message_keeps_its_tokens(
    embedded_stack: str, embedded_settings: ServerSettings, tmp_path: Path
) -> None:
    url = embedded_stack
    headers = login(url, "canceller")
    chat, mid = start_reply(url, headers, MODEL, 4000)
    seen: list[dict[str, Any]] = []
    reader = threading.Thread(target=events, args=(url, f"/chats/{chat}/messages/{mid}/events", headers, None, seen))
    reader.start()
    wait_for(lambda: sum(e["event_type"] == "token" for e in seen) >= 5, 60, "tokens to stream")
    resp = httpx.post(f"{url}/chats/{chat}/messages/{mid}/cancel", headers=headers)
    assert resp.status_code == 200, resp.text
    assert resp.json()["state"] == "cancelled"
    reader.join(timeout=30)
    assert not reader.is_alive(), "the reader got no final event"
    assert seen[-1]["event_type"] == "error" and seen[-1]["code"] == "cancelled", seen[-1]
    streamed = [e["token_id"] for e in seen if e["event_type"] == "token"]

    wait_for(
        lambda: (
            httpx.get(f"{url}/chats/{chat}/messages/{mid}", params={"include": "tokens"}, headers=headers).json()[
                "completion_token_ids"
            ]
            != []
        ),
        30,
        "the tokens so far to be stored",
    )
    msg = httpx.get(f"{url}/chats/{chat}/messages/{mid}", params={"include": "tokens"}, headers=headers).json()
    assert msg["state"] == "cancelled"
    stored = msg["completion_token_ids"]
    assert 5 <= len(stored) < 4000
    assert stored[: len(streamed)] == streamed  # readers saw a prefix of what is stored (at most a step less)
    assert len(stored) - len(streamed) <= 8  # the abort lands within an engine step or so

    again = httpx.post(f"{url}/chats/{chat}/messages/{mid}/cancel", headers=headers)  # idempotent
    assert again.status_code == 200 and again.json()["state"] == "cancelled"

    rollouts = export(embedded_settings, tmp_path / "out.jsonl", "--user", "canceller")
    [rollout] = [r for r in rollouts if r["leaf_message_id"] == mid]
    assert rollout["turns"][-1]["finish_reason"] == "abort"
    assert rollout["turns"][-1]["completion_ids"] == stored


def test_cancel_a_finished_message_is_409(embedded_stack: str) -> None:
    url = embedded_stack
    headers = login(url, "late-canceller")
    chat, mid = start_reply(url, headers, MODEL, 3)
    assert events(url, f"/chats/{chat}/messages/{mid}/events", headers)[-1]["event_type"] == "message"
    expect(httpx.post(f"{url}/chats/{chat}/messages/{mid}/cancel", headers=headers), 409, "message_finished")
    other = login(url, "not-the-owner")
    expect(httpx.post(f"{url}/chats/{chat}/messages/{mid}/cancel", headers=other), 404, "chat_not_found")


@pytest.fixture
def idle_server(tmp_path: Path) -> Any:
    settings = ServerSettings(data_dir=tmp_path, port=free_port())
    server = ServerThread(settings).start()
    worker = IdleWorker(server.url, worker_key(settings)).start()
    yield server
    worker.stop()
    server.stop()


def test_cancel_a_queued_message(idle_server: ServerThread) -> None:
    url = idle_server.url
    headers = login(url, "queued-canceller")
    chat, mid = start_reply(url, headers, IDLE_MODEL, 10)
    seen: list[dict[str, Any]] = []
    reader = threading.Thread(target=events, args=(url, f"/chats/{chat}/messages/{mid}/events", headers, None, seen))
    reader.start()
    wait_for(lambda: any(e["event_type"] == "pending" for e in seen), 30, "the pending event")
    resp = httpx.post(f"{url}/chats/{chat}/messages/{mid}/cancel", headers=headers)
    assert resp.status_code == 200 and resp.json()["state"] == "cancelled", resp.text
    reader.join(timeout=30)
    assert not reader.is_alive()
    assert seen[-1]["event_type"] == "error" and seen[-1]["code"] == "cancelled"
    assert not any(e["event_type"] == "token" for e in seen)
