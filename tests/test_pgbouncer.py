"""PostgreSQL behind a transaction pooler: a real PgBouncer (``pool_mode = transaction``, two server
connections shared by every client connection) in front of a fresh database, the migrations, a server and
an hf worker, concurrent OpenAI agent turns and Open-Assistant replies, and the export (its own worker
processes, and through the API), all through the pooler with ``db_pooler = transaction``; and PostgreSQL
killed and started again behind it."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import httpx
import pyarrow.parquet as pq
import pytest
from sqlalchemy import text
from sqlalchemy.engine.url import make_url

from server import migrate
from server.admin import issue_user_key
from server.db import create_engine
from server.export.run import run_export
from server.settings import ServerSettings
from tests import services
from tests.conftest import _enter_or_skip
from tests.services import RestartablePostgres
from tests.stack import MODEL, ServerThread, hf_stack, start_reply, wait_for, worker_key
from tests.test_limits import MODEL as IDLE_MODEL
from tests.test_limits import IdleWorker
from tokentrail.launcher import free_port, spawn

pytestmark = [pytest.mark.postgres, pytest.mark.slow]


@pytest.fixture
def pooled_url(postgres_url: str) -> Iterator[str]:
    with ExitStack() as stack:
        yield _enter_or_skip(stack, services.pgbouncer_service(postgres_url, server_connections=2))


def _db_upgrade(url: str, log: Path, **env: str) -> int:
    """``tokentrail db upgrade`` in a process of its own, as a deployment runs it."""
    return spawn(["db", "upgrade"], env={"TOKENTRAIL_DATABASE_URL": url, **env}, output=log).wait(timeout=120)


def test_the_migrations_need_the_setting_behind_a_transaction_pooler(pooled_url: str, tmp_path: Path) -> None:
    """The pooler really pools by transaction: without the setting, the statement names asyncpg counts
    from 1 in every process collide on the shared server connections."""
    logs = [tmp_path / f"plain-{i}.log" for i in range(2)]
    codes = [_db_upgrade(pooled_url, log) for log in logs]
    assert codes[-1] != 0 and "prepared statement" in logs[-1].read_text(), (codes, logs[-1].read_text())
    log = tmp_path / "pooled.log"
    assert _db_upgrade(pooled_url, log, TOKENTRAIL_DB_POOLER="transaction") == 0, log.read_text()
    assert _count(pooled_url, "SELECT count(*) FROM alembic_version") == 1


def _agent_loop(url: str, headers: dict[str, str], i: int, turns: int) -> list[dict[str, Any]]:
    messages: list[dict[str, Any]] = [{"role": "user", "content": f"hello number {i}"}]
    bodies = []
    for _ in range(turns):
        while True:
            r = httpx.post(
                f"{url}/v1/chat/completions",
                json={"model": MODEL, "messages": messages, "max_tokens": 8, "logprobs": True},
                headers=headers,
                timeout=120,
            )
            if r.status_code != 429:  # the per-user generation limit: wait as a client would
                break
            time.sleep(0.2)
        assert r.status_code == 200, r.text
        body = r.json()
        bodies.append(body)
        messages += [body["choices"][0]["message"], {"role": "user", "content": "and then?"}]
    return bodies


def _count(url: str, sql: str) -> int:
    async def go() -> int:
        engine = create_engine(url, pooler="transaction")
        try:
            async with engine.connect() as conn:
                return int((await conn.execute(text(sql))).scalar_one())
        finally:
            await engine.dispose()

    return asyncio.run(go())


def _prepared_per_server_connection(url: str, connections: int = 2) -> list[int]:
    """The statements left prepared on each of the pooler's server connections: one open transaction per
    server connection holds them all at once, each asking its own session."""
    import asyncpg  # type: ignore[import-untyped]

    async def go() -> list[int]:
        dsn = make_url(url).set(drivername="postgresql").render_as_string(hide_password=False)
        clients = [await asyncpg.connect(dsn, statement_cache_size=0) for _ in range(connections)]
        try:
            for c in clients:
                await c.execute("BEGIN")
            pids = [await c.fetchval("SELECT pg_backend_pid()") for c in clients]
            assert len(set(pids)) == connections, pids  # each client holds a server connection of its own
            return [int(await c.fetchval("SELECT count(*) FROM pg_prepared_statements")) for c in clients]
        finally:
            for c in clients:
                await c.close()

    return asyncio.run(go())


def test_chats_and_exports_through_a_transaction_pooler(
    pooled_url: str, postgres_url: str, tiny_model_dir: Path, tmp_path: Path
) -> None:
    migrate.upgrade(pooled_url, pooler="transaction")
    with hf_stack(tmp_path, tiny_model_dir, max_batch_size=8, database_url=pooled_url, db_pooler="transaction") as (
        url,
        settings,
    ):
        user = {"Authorization": f"Bearer {issue_user_key(settings, 'player')}"}
        admin = {"Authorization": f"Bearer {issue_user_key(settings, 'trainer', admin=True)}"}
        loops, turns = 12, 3
        with ThreadPoolExecutor(8) as pool:
            replies = [pool.submit(start_reply, url, user, MODEL, 6) for _ in range(4)]
            agents = list(pool.map(lambda i: _agent_loop(url, user, i, turns), range(loops)))
            oa = [f.result() for f in replies]
        for bodies in agents:
            assert [b["choices"][0]["finish_reason"] in ("stop", "length") for b in bodies] == [True] * turns
            assert all(b["choices"][0]["logprobs"]["content"] for b in bodies)

        def finished() -> bool:
            states = [httpx.get(f"{url}/chats/{c}/messages/{m}", headers=user).json()["state"] for c, m in oa]
            return states == ["complete"] * len(oa)

        wait_for(finished, 120, "the Open-Assistant replies")
        chats = loops + len(oa)
        assert _prepared_per_server_connection(pooled_url) == [0, 0]  # nothing left behind by the server
        assert _count(pooled_url, "SELECT count(*) FROM chats") == chats
        assert _count(pooled_url, "SELECT count(*) FROM messages WHERE state = 'complete'") == loops * turns + len(oa)

        # the export, through the pooler (its own worker processes, or this one alone) and straight to
        # PostgreSQL: the same rollouts, byte for byte
        direct = make_url(pooled_url).set(port=make_url(postgres_url).port).render_as_string(hide_password=False)
        exports: dict[str, bytes] = {}
        for name, db_url, pooler, workers in (
            ("pooled", pooled_url, "transaction", 2),
            ("pooled-1", pooled_url, "transaction", 1),
            ("direct", direct, "none", 2),
        ):
            out = tmp_path / f"{name}.jsonl"
            asyncio.run(
                run_export(
                    settings.model_copy(update={"database_url": db_url, "db_pooler": pooler}),
                    out,
                    fmt="jsonl",
                    schema="tokentrail",
                    progress=False,
                    workers=workers,
                )
            )
            exports[name] = out.read_bytes()
        assert exports["pooled"] == exports["direct"] == exports["pooled-1"]
        rollouts = [json.loads(line) for line in exports["pooled"].splitlines()]
        assert len(rollouts) == chats
        for rollout in rollouts:
            (sample,) = rollout["samples"]
            assert len(sample["token_ids"]) == len(sample["loss_mask"]) > sample["prompt_length"] > 0
        parquet = tmp_path / "pooled.parquet"
        asyncio.run(run_export(settings, parquet, fmt="parquet", schema="tokentrail", progress=False, workers=2))
        assert pq.read_table(parquet).num_rows == chats
        streamed = httpx.get(f"{url}/admin/export", headers=admin, timeout=60)
        assert streamed.status_code == 200, streamed.text
        assert len(streamed.text.splitlines()) == chats


def test_a_postgres_restart_behind_the_pooler_is_503_then_served(tmp_path: Path) -> None:
    """PostgreSQL SIGKILLed behind the pooler and started again: every answer meanwhile is 503 with
    Retry-After (the pooler's own errors are an outage, not a bug), and the server serves again after.
    The pooler is set as docs/production.md advises (``query_wait_timeout``, ``server_login_retry``)."""
    try:
        pg = RestartablePostgres().start()
    except services.ServiceUnavailable as exc:
        pytest.skip(str(exc))
    with ExitStack() as stack:
        stack.callback(pg.stop)
        pooled = _enter_or_skip(stack, services.pgbouncer_service(pg.url, server_connections=2))
        migrate.upgrade(pooled, pooler="transaction")
        settings = ServerSettings(data_dir=tmp_path, port=free_port(), database_url=pooled, db_pooler="transaction")
        server = ServerThread(settings).start()
        stack.callback(server.stop)
        user = {"Authorization": f"Bearer {issue_user_key(settings, 'player')}"}
        idle = IdleWorker(server.url, worker_key(settings)).start()  # its model is offered: requests reach SQL
        stack.callback(idle.stop)
        body = {"model": IDLE_MODEL, "messages": [{"role": "user", "content": "hi"}]}
        assert httpx.post(f"{server.url}/chats", json={}, headers=user).status_code == 200
        pg.kill()
        statuses: list[int] = []
        for _ in range(3):
            for call, openai in (
                (lambda: httpx.get(f"{server.url}/chats", headers=user, timeout=30), False),
                (lambda: httpx.post(f"{server.url}/chats", json={}, headers=user, timeout=30), False),
                (lambda: httpx.post(f"{server.url}/v1/chat/completions", json=body, headers=user, timeout=30), True),
            ):
                resp = call()
                statuses.append(resp.status_code)
                assert resp.status_code == 503 and int(resp.headers["Retry-After"]) >= 1, resp.text
                assert (resp.json()["error"]["code"] if openai else resp.json()["code"]) == "not_ready"
        pg.start()

        def served() -> bool:
            resp = httpx.get(f"{server.url}/chats", headers=user, timeout=30)
            statuses.append(resp.status_code)
            return resp.status_code == 200

        wait_for(served, 90, "the server serving again")
        assert set(statuses) <= {200, 503}, statuses
        assert len(httpx.get(f"{server.url}/chats", headers=user).json()["chats"]) == 1  # made before: kept
