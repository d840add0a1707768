"""Redis or the database away: answers are 503 ``not_ready`` with Retry-After (never a 500), SSE
readers are told to reconnect, and nothing already stored is lost. Real processes: a private
redis-server killed with SIGKILL and started again; a database URL whose server is not there."""

from __future__ import annotations

from pathlib import Path

import httpx
import pytest

from server.settings import ServerSettings
from tests.services import RestartableRedis
from tests.stack import ServerThread, wait_for, worker_key
from tests.test_e2e_embedded import login
from tests.test_limits import IdleWorker, ask, new_turn
from tokentrail.launcher import free_port

pytestmark = [pytest.mark.redis]


def test_redis_away_answers_503_with_retry_after_and_readers_get_a_retry_hint(
    private_redis: RestartableRedis, tmp_path: Path
) -> None:
    settings = ServerSettings(
        data_dir=tmp_path,
        port=free_port(),
        redis_url=private_redis.url,
        auth_secret="outage-test-secret-0123456789abcdef",
        allow_debug_auth=True,
        worker_heartbeat_interval_s=0.5,
    )
    server = ServerThread(settings).start()
    idle = IdleWorker(server.url, worker_key(settings)).start()  # offers the model, takes nothing
    try:
        headers = login(server.url, "outage")
        chat, prompt = new_turn(server.url, headers)
        reply = ask(server.url, headers, chat, prompt)
        assert reply.status_code == 200, reply.text
        mid = reply.json()["id"]

        private_redis.kill()
        models = httpx.get(f"{server.url}/configs/model_configs", headers=headers)
        assert models.status_code == 503 and models.json()["code"] == "not_ready", models.text
        assert int(models.headers["Retry-After"]) >= 1
        ready = httpx.get(f"{server.url}/ready")
        assert ready.status_code == 503
        with httpx.stream(
            "GET", f"{server.url}/chats/{chat}/messages/{mid}/events", headers=headers, timeout=30
        ) as events:
            assert events.status_code == 200
            body = "".join(events.iter_text())
        assert "retry: " in body  # told to reconnect later, not a traceback
        # what is only SQL still works; nothing stored was lost
        stored = httpx.get(f"{server.url}/chats/{chat}/messages/{mid}", headers=headers)
        assert stored.status_code == 200 and stored.json()["state"] == "pending"

        private_redis.start()
        wait_for(lambda: httpx.get(f"{server.url}/ready").status_code == 200, 30, "ready again")
        wait_for(
            lambda: httpx.get(f"{server.url}/configs/model_configs", headers=headers).status_code == 200,
            30,
            "model list again",
        )
    finally:
        idle.stop()
        server.stop()


def test_database_away_answers_503_not_500(tmp_path: Path) -> None:
    dead = f"postgresql+asyncpg://nobody@127.0.0.1:{free_port()}/none"  # nothing listens there
    settings = ServerSettings(
        data_dir=tmp_path, port=free_port(), database_url=dead, migrate_on_start=False, allow_debug_auth=True
    )
    server = ServerThread(settings).start()
    try:
        for method, path in [("GET", "/auth/callback/debug?code=x"), ("GET", "/chats"), ("POST", "/chats")]:
            resp = httpx.request(
                method, f"{server.url}{path}", headers={"Authorization": "Bearer tt_u_whatever"}, json={}
            )
            assert resp.status_code == 503, (path, resp.status_code, resp.text)
            assert resp.json()["code"] == "not_ready" and int(resp.headers["Retry-After"]) >= 1
        assert httpx.get(f"{server.url}/ready").status_code == 503
        assert httpx.get(f"{server.url}/health").status_code == 200  # alive, not ready
    finally:
        server.stop()
