"""``tokentrail serve --model``: the worker in the server's process, on an in-memory link to the hub.

End to end through real HTTP and SSE with the tiny model: the in-process worker serves the OA chat flow
and the OpenAI route with the token IDs a websocket worker produces for the same seeded request; a
cancel aborts it; shutdown drains it (work in hand is finished, or handed back and finished after a
restart); a websocket worker serves next to it, and resumes its message when the in-process worker dies.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from server.admin import issue_user_key
from server.settings import ServerSettings
from tests.stack import MODEL, ServerThread, WorkerThread, start_reply, wait_for, worker_key
from tests.test_e2e_embedded import events, login
from tokentrail.launcher import free_port
from worker.chat_format import ChatFormat
from worker.in_process import InProcessWorker
from worker.spec import ModelSpec

pytestmark = pytest.mark.slow


def local_worker(model_dir: Path) -> InProcessWorker:
    return InProcessWorker(ModelSpec(model=str(model_dir), served_model_name=MODEL, max_parallel=4))


def local_server(settings: ServerSettings, model_dir: Path) -> ServerThread:
    return ServerThread(settings, local_worker(model_dir)).start()


@pytest.fixture(scope="module")
def local_stack(tmp_path_factory: pytest.TempPathFactory, tiny_model_dir: Path) -> Iterator[ServerThread]:
    settings = ServerSettings(data_dir=tmp_path_factory.mktemp("local"), port=free_port())
    server = local_server(settings, tiny_model_dir)
    yield server
    server.stop()


def message(url: str, headers: dict[str, str], chat: str, mid: str) -> dict[str, Any]:
    resp = httpx.get(f"{url}/chats/{chat}/messages/{mid}", params={"include": "tokens"}, headers=headers)
    assert resp.status_code == 200, resp.text
    return dict(resp.json())


def oa_conversation(url: str) -> list[dict[str, Any]]:
    """Two seeded turns of an OA chat, each read over SSE; the stored messages, checked against what streamed."""
    headers = login(url, "twin")
    chat = httpx.post(f"{url}/chats", json={}, headers=headers).json()["id"]
    parent = None
    stored = []
    for turn, text in enumerate(("Hello there.", "And then?")):
        prompt = httpx.post(
            f"{url}/chats/{chat}/prompter_message", json={"parent_id": parent, "content": text}, headers=headers
        ).json()["id"]
        reply = httpx.post(
            f"{url}/chats/{chat}/assistant_message",
            json={
                "parent_id": prompt,
                "model_config_name": MODEL,
                "sampling_parameters": {"max_new_tokens": 16, "seed": 11 + turn, "temperature": 1.0},
            },
            headers=headers,
        )
        assert reply.status_code == 200, reply.text
        mid = reply.json()["id"]
        evs = events(url, f"/chats/{chat}/messages/{mid}/events", headers)
        assert evs[-1]["event_type"] == "message", evs[-1]
        record = message(url, headers, chat, mid)
        assert record["state"] == "complete"
        assert record["completion_token_ids"] == [e["token_id"] for e in evs if e["event_type"] == "token"]
        stored.append(record)
        parent = mid
    return stored


def test_oa_chat_over_sse_has_the_tokens_of_a_socket_worker(local_stack: ServerThread, embedded_stack: str) -> None:
    local, remote = oa_conversation(local_stack.url), oa_conversation(embedded_stack)
    for mine, theirs in zip(local, remote, strict=True):
        assert mine["prompt_token_ids"] == theirs["prompt_token_ids"]
        assert mine["completion_token_ids"] == theirs["completion_token_ids"]
        assert len(mine["completion_token_ids"]) > 0
    # the second turn was stitched from the first's stored tokens
    first, second = local
    assert second["prompt_token_ids"][: len(first["prompt_token_ids"])] == first["prompt_token_ids"]


def test_openai_completion_has_the_tokens_of_a_socket_worker(
    local_stack: ServerThread, embedded_stack: str, embedded_settings: ServerSettings
) -> None:
    def complete(url: str, settings: ServerSettings) -> tuple[list[int], list[int]]:
        client = openai.OpenAI(base_url=f"{url}/v1", api_key=issue_user_key(settings, "sdk"), max_retries=0)
        resp = client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "Count to three."}], max_tokens=16, seed=5
        )
        extra = resp.model_extra or {}
        choice_extra = resp.choices[0].model_extra or {}
        return extra["prompt_token_ids"], choice_extra["token_ids"]

    local = complete(local_stack.url, local_stack.settings)
    assert local == complete(embedded_stack, embedded_settings)
    assert local[1]


def test_cancel_aborts_the_in_process_worker(local_stack: ServerThread) -> None:
    url = local_stack.url
    headers = login(url, "canceller")
    chat, mid = start_reply(url, headers, MODEL, 1500)
    seen: list[dict[str, Any]] = []
    reader = threading.Thread(target=events, args=(url, f"/chats/{chat}/messages/{mid}/events", headers, None, seen))
    reader.start()
    wait_for(lambda: sum(e["event_type"] == "token" for e in seen) >= 3, 60, "tokens to stream")
    resp = httpx.post(f"{url}/chats/{chat}/messages/{mid}/cancel", headers=headers)
    assert resp.status_code == 200, resp.text
    reader.join(timeout=30)
    assert seen[-1]["event_type"] == "error" and seen[-1]["code"] == "cancelled", seen[-1]
    wait_for(lambda: message(url, headers, chat, mid)["completion_token_ids"] != [], 30, "the tokens so far stored")
    record = message(url, headers, chat, mid)
    assert record["state"] == "cancelled" and 3 <= len(record["completion_token_ids"]) < 1500
    # the slot is free again: the next reply is generated
    chat2, mid2 = start_reply(url, headers, MODEL, 5)
    assert events(url, f"/chats/{chat2}/messages/{mid2}/events", headers)[-1]["event_type"] == "message"


def workers(url: str) -> int:
    [config] = httpx.get(f"{url}/configs/model_configs").json()
    return int(config["workers"])


def _started(url: str, headers: dict[str, str], chat: str, mid: str) -> bool:
    return bool(message(url, headers, chat, mid)["state"] == "in_progress")


def test_shutdown_finishes_the_work_in_hand(tmp_path: Path, tiny_model_dir: Path) -> None:
    settings = ServerSettings(data_dir=tmp_path, port=free_port(), local_drain_timeout_s=120)
    server = local_server(settings, tiny_model_dir)
    headers = login(server.url, "drain")
    chat, mid = start_reply(server.url, headers, MODEL, 120)
    wait_for(lambda: _started(server.url, headers, chat, mid), 60, "the reply to start")
    server.stop()
    assert not server.thread.is_alive()
    after = ServerThread(settings).start()  # no worker: only the database tells
    try:
        record = message(after.url, login(after.url, "drain"), chat, mid)
        assert record["state"] == "complete" and len(record["completion_token_ids"]) == 120
    finally:
        after.stop()


def test_shutdown_hands_back_what_it_cannot_finish(tmp_path: Path, tiny_model_dir: Path) -> None:
    settings = ServerSettings(
        data_dir=tmp_path, port=free_port(), local_drain_timeout_s=0, sweep_interval_s=0.5, sweep_grace_s=0.5
    )
    server = local_server(settings, tiny_model_dir)
    headers = login(server.url, "handback")
    chat, mid = start_reply(server.url, headers, MODEL, 1000)
    wait_for(lambda: _started(server.url, headers, chat, mid), 60, "the reply to start")
    server.stop()
    assert not server.thread.is_alive()
    # its sweep must not touch the message: its first pass runs at startup and would fail a pending
    # message that no worker offers once the message is older than the grace (a slow machine)
    idle = ServerThread(settings.model_copy(update={"sweep_interval_s": 600.0, "sweep_grace_s": 600.0})).start()
    try:  # handed back: waiting for a worker, not held by one that is gone
        assert message(idle.url, login(idle.url, "handback"), chat, mid)["state"] == "pending"
    finally:
        idle.stop()
    again = local_server(settings, tiny_model_dir)  # its sweep requeues the message
    try:
        headers = login(again.url, "handback")
        wait_for(lambda: message(again.url, headers, chat, mid)["state"] == "complete", 120, "the reply to finish")
        assert len(message(again.url, headers, chat, mid)["completion_token_ids"]) == 1000
    finally:
        again.stop()


def test_a_socket_worker_serves_beside_it_and_resumes_its_message_when_it_dies(
    tmp_path: Path, tiny_model_dir: Path
) -> None:
    from worker.engines.hf import HFEngine

    settings = ServerSettings(data_dir=tmp_path, port=free_port())
    local = local_worker(tiny_model_dir)
    server = ServerThread(settings, local).start()
    remote: WorkerThread | None = None
    try:
        url = server.url
        headers = login(url, "mixed")
        chat, mid = start_reply(url, headers, MODEL, 800)
        seen: list[dict[str, Any]] = []
        path = f"/chats/{chat}/messages/{mid}/events"
        reader = threading.Thread(target=events, args=(url, path, headers, None, seen))
        reader.start()
        wait_for(lambda: sum(e["event_type"] == "token" for e in seen) >= 5, 60, "tokens from the local worker")
        fmt = ChatFormat.load(str(tiny_model_dir))
        engine = lambda: HFEngine(str(tiny_model_dir), max_batch_size=4)  # noqa: E731
        remote = WorkerThread(url, worker_key(settings), MODEL, fmt, engine).start()
        wait_for(lambda: workers(url) == 2, 60, "the socket worker beside the local one")

        task = local._task  # the in-process worker dies (as a crash would end it)
        assert task is not None
        task.get_loop().call_soon_threadsafe(task.cancel)
        reader.join(timeout=120)
        assert seen[-1]["event_type"] == "message", seen[-1]
        streamed = [e["token_id"] for e in seen if e["event_type"] == "token"]
        assert [int(e["_id"]) for e in seen if e["event_type"] == "token"] == list(range(800))  # one stream
        record = message(url, headers, chat, mid)
        assert record["state"] == "complete" and record["completion_token_ids"] == streamed
        assert record["attempt"] == 2  # continued by the socket worker
        wait_for(lambda: workers(url) == 1, 30, "the socket worker alone")
        chat2, mid2 = start_reply(url, headers, MODEL, 5)  # served by the socket worker
        assert events(url, f"/chats/{chat2}/messages/{mid2}/events", headers)[-1]["event_type"] == "message"
    finally:
        if remote is not None:
            remote.stop()
        server.stop()
