"""The database is the source of truth: queued messages survive a Redis restart that lost the queue.

A private redis-server (no persistence) is killed with SIGKILL while three assistant messages wait in
its queue, then started again, empty, on the same port. The sweep finds the pending messages the queue
no longer holds and requeues them; a worker that connects afterwards completes all three.
"""

from __future__ import annotations

import time
from pathlib import Path

import httpx
import pytest
import redis

from server.constants import WORK_STREAM, WORK_TICKET
from server.settings import ServerSettings
from tests.services import RestartableRedis
from tests.stack import ServerThread, WorkerThread, wait_for, worker_key
from tests.test_e2e_embedded import events, login
from tests.test_limits import MODEL, IdleWorker, ask, new_turn
from tokentrail.launcher import free_port
from worker.chat_format import ChatFormat
from worker.engines.hf import HFEngine

pytestmark = [pytest.mark.redis]


def _on_redis(
    redis: RestartableRedis, data_dir: Path, *, sweep_interval_s: float, sweep_grace_s: float
) -> ServerSettings:
    """A server on a private Redis whose heartbeats run every half second."""
    return ServerSettings(
        data_dir=data_dir,
        port=free_port(),
        redis_url=redis.url,
        auth_secret="sweep-test-secret-0123456789abcdef",
        allow_debug_auth=True,
        worker_heartbeat_interval_s=0.5,
        sweep_interval_s=sweep_interval_s,
        sweep_grace_s=sweep_grace_s,
    )


def _completes_once_a_worker_connects(
    url: str, key: str, model_dir: Path, headers: dict[str, str], chat: str, mid: str
) -> None:
    """A real worker connects; the message's events end with the message."""
    fmt = ChatFormat.load(str(model_dir))
    worker = WorkerThread(url, key, MODEL, fmt, lambda: HFEngine(str(model_dir), max_batch_size=4)).start()
    try:
        final = events(url, f"/chats/{chat}/messages/{mid}/events", headers)[-1]
        assert final["event_type"] == "message", final
    finally:
        worker.stop()


def test_messages_queued_in_a_redis_that_restarts_empty_are_requeued(
    private_redis: RestartableRedis, tiny_model_dir: Path, tmp_path: Path
) -> None:
    settings = _on_redis(private_redis, tmp_path, sweep_interval_s=0.5, sweep_grace_s=1.0)
    server = ServerThread(settings).start()
    key = worker_key(settings)
    idle = IdleWorker(server.url, key).start()  # offers the model, takes nothing
    try:
        headers = login(server.url, "sweep")
        turns = []
        for _ in range(3):
            chat, prompt = new_turn(server.url, headers)
            reply = ask(server.url, headers, chat, prompt)
            assert reply.status_code == 200, reply.text
            turns.append((chat, reply.json()["id"]))
        idle.stop()

        private_redis.kill()  # the queue, tickets and worker directory are gone with it
        private_redis.start()

        fmt = ChatFormat.load(str(tiny_model_dir))
        worker = WorkerThread(
            server.url, key, MODEL, fmt, lambda: HFEngine(str(tiny_model_dir), max_batch_size=4)
        ).start()
        try:
            deadline = time.monotonic() + 60
            for chat, mid in turns:
                final = events(server.url, f"/chats/{chat}/messages/{mid}/events", headers)[-1]
                assert final["event_type"] == "message", final
                assert time.monotonic() < deadline
                msg = httpx.get(f"{server.url}/chats/{chat}/messages/{mid}", headers=headers).json()
                assert msg["state"] == "complete", msg
        finally:
            worker.stop()
    finally:
        server.stop()


def test_a_redis_that_came_back_empty_has_its_pending_messages_queued_at_once(
    private_redis: RestartableRedis, tiny_model_dir: Path, tmp_path: Path
) -> None:
    """As above with the sweep kept out of the way: the server's presence beat finds Redis new and
    queues the pending messages it lost itself."""
    settings = _on_redis(private_redis, tmp_path, sweep_interval_s=3600.0, sweep_grace_s=3600.0)
    server = ServerThread(settings).start()
    key = worker_key(settings)
    idle = IdleWorker(server.url, key).start()
    try:
        headers = login(server.url, "redis-new")
        chat, prompt = new_turn(server.url, headers)
        reply = ask(server.url, headers, chat, prompt)
        assert reply.status_code == 200, reply.text
        idle.stop()
        private_redis.kill()
        private_redis.start()
        _completes_once_a_worker_connects(server.url, key, tiny_model_dir, headers, chat, reply.json()["id"])
    finally:
        server.stop()


def test_a_model_whose_workers_left_is_queued_for_a_grace_period(tmp_path: Path) -> None:
    settings = ServerSettings(
        data_dir=tmp_path, port=free_port(), model_grace_s=3.0, sweep_interval_s=0.5, sweep_grace_s=0.5
    )
    server = ServerThread(settings).start()
    try:
        idle = IdleWorker(server.url, worker_key(settings)).start()
        idle.stop()  # the model's only worker goes away (a restart, a deploy)
        wait_for(lambda: httpx.get(f"{server.url}/configs/model_configs").json() == [], 30, "the worker to leave")
        headers = login(server.url, "grace")
        chat, prompt = new_turn(server.url, headers)
        reply = ask(server.url, headers, chat, prompt)
        assert reply.status_code == 200, reply.text  # queued, not refused
        final = events(server.url, f"/chats/{chat}/messages/{reply.json()['id']}/events", headers)[-1]
        assert final["event_type"] == "error" and final["code"] == "no_worker", final  # no worker came back
        resp = ask(server.url, headers, chat, prompt)
        assert resp.status_code == 422 and resp.json()["code"] == "unknown_model", resp.text
    finally:
        server.stop()


def test_a_retry_with_its_key_queues_a_message_the_queue_lost_at_once(
    private_redis: RestartableRedis, tiny_model_dir: Path, tmp_path: Path
) -> None:
    """As when the first request's replica died between its commit and its enqueue: the message is
    pending and no queue holds it. Its client's retry (same Idempotency-Key) queues it; the sweep,
    which would find it much later, is kept out of the way. Only the queue's keys are dropped, not the
    whole Redis: a Redis found new would queue it again by itself and race the retry for the attempt."""
    settings = _on_redis(private_redis, tmp_path, sweep_interval_s=3600.0, sweep_grace_s=3600.0)
    server = ServerThread(settings).start()
    key = worker_key(settings)
    idle = IdleWorker(server.url, key).start()
    try:
        headers = login(server.url, "sweep-retry")
        chat, prompt = new_turn(server.url, headers)
        body = {"parent_id": prompt, "model_config_name": MODEL, "sampling_parameters": {"max_new_tokens": 4}}
        retry = {**headers, "Idempotency-Key": "lost-in-the-queue"}
        first = httpx.post(f"{server.url}/chats/{chat}/assistant_message", json=body, headers=retry)
        assert first.status_code == 200, first.text
        idle.stop()
        message = first.json()["id"]
        with redis.Redis.from_url(private_redis.url) as client:
            lost = client.delete(WORK_TICKET.format(message_id=message), WORK_STREAM.format(model=MODEL))
        assert lost == 2, "the queue held the message"
        again = httpx.post(f"{server.url}/chats/{chat}/assistant_message", json=body, headers=retry)
        assert again.status_code == 200 and again.json()["id"] == first.json()["id"]
        assert again.json()["attempt"] == 2  # fenced: a late enqueue of attempt 1 is dropped

        _completes_once_a_worker_connects(server.url, key, tiny_model_dir, headers, chat, first.json()["id"])
    finally:
        server.stop()
