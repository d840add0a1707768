"""Cache-aware routing across workers (DESIGN D5, issue 26), lineage decisions and session hints, with
real server and worker processes: two hf workers on embedded defaults, and two workers on two server
replicas sharing PostgreSQL + Redis (each turn sent to the other replica than the last)."""

from __future__ import annotations

import contextlib
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from server.admin import issue_user_key
from server.settings import ServerSettings
from tests.stack import MODEL, wait_for, worker_key
from tokentrail.launcher import free_port, spawn, stop

SECRET = "routing-test-secret-0123456789"


@contextlib.contextmanager
def cluster(
    env: dict[str, str], settings: ServerSettings, model_dir: Path, logs: Path, replicas: int
) -> Iterator[tuple[list[str], str]]:
    """``replicas`` server processes and two worker processes (worker k on replica k % replicas);
    yields the servers' URLs and a user API key."""
    env = {"TOKENTRAIL_ALLOW_DEBUG_AUTH": "true", "TOKENTRAIL_RATE_LIMIT_PER_MINUTE": "0", **env}
    if "TOKENTRAIL_DATABASE_URL" in env:
        up = spawn(["db", "upgrade"], env=env, output=logs / "upgrade.log")
        assert up.wait(timeout=120) == 0, (logs / "upgrade.log").read_text()
    key = worker_key(settings)
    user_key = issue_user_key(settings, "router")
    ports = [free_port() for _ in range(replicas)]
    procs = [spawn(["serve", "--port", str(p)], env=env, output=logs / f"server{p}.log") for p in ports]
    urls = [f"http://127.0.0.1:{p}" for p in ports]
    try:
        for url in urls:
            wait_for(lambda u=url: httpx.get(f"{u}/health").status_code == 200, 60, "server")  # type: ignore[misc]
        for k in range(2):
            procs.append(
                spawn(
                    ["worker", "--server-url", urls[k % replicas], "--api-key", key, "--model", str(model_dir),
                     "--served-model-name", MODEL, "--max-parallel", "4"],
                    env=env,
                    output=logs / f"worker{k}.log",
                )
            )  # fmt: skip

        def two_workers() -> bool:
            text = httpx.get(f"{urls[0]}/metrics").text
            found = re.search(rf'tokentrail_cluster_workers\{{model="{MODEL}"\}} (\S+)', text)
            return found is not None and float(found.group(1)) >= 2

        wait_for(two_workers, 120, "two workers")
        yield urls, user_key
    finally:
        for p in reversed(procs):
            stop(p, "process")


@pytest.fixture(scope="module")
def embedded(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[list[str], str]]:
    data = tmp_path_factory.mktemp("routing-data")
    # a generous bound: these tests check where turns go, not how long a busy holder is waited for
    env = {"TOKENTRAIL_DATA_DIR": str(data), "TOKENTRAIL_ROUTE_WAIT_S": "5", "TOKENTRAIL_ROUTING": "on"}
    settings = ServerSettings(data_dir=data, migrate_on_start=True)
    with cluster(env, settings, tiny_model_dir, tmp_path_factory.mktemp("routing-logs"), replicas=1) as c:
        yield c


def chat(url: str, key: str, messages: list[dict[str, Any]], session: str | None = None, **body: Any) -> dict[str, Any]:
    headers = {"Authorization": f"Bearer {key}"}
    if session is not None:
        headers["X-Session-ID"] = session
    payload = {"model": MODEL, "messages": messages, "max_tokens": 8, **body}
    resp = httpx.post(f"{url}/v1/chat/completions", json=payload, headers=headers, timeout=120)
    assert resp.status_code == 200, resp.text
    return resp.json()  # type: ignore[no-any-return]


def loops(urls: list[str], key: str, conversations: int, turns: int, tag: str) -> list[list[str]]:
    """Agent loops (history echoed back), each turn through the next replica; the serving worker of
    every turn, per conversation."""
    served: list[list[str]] = []
    for c in range(conversations):
        messages: list[dict[str, Any]] = [{"role": "system", "content": "route me"}]
        workers = []
        for t in range(turns):
            messages.append({"role": "user", "content": f"{tag} conversation {c} turn {t}"})
            body = chat(urls[t % len(urls)], key, messages)
            workers.append(body["tokentrail"]["worker_id"])
            messages.append({"role": "assistant", "content": body["choices"][0]["message"]["content"]})
        served.append(workers)
    return served


def metric(urls: list[str], name: str, **labels: str) -> float:
    """A counter summed over the replicas (each has its own registry)."""
    want = ",".join(f'{k}="{v}"' for k, v in sorted(labels.items()))
    total = 0.0
    for url in urls:
        for line in httpx.get(f"{url}/metrics").text.splitlines():
            if line.startswith(f"{name}_total{{"):
                got = ",".join(sorted(line[line.index("{") + 1 : line.index("}")].split(",")))
                if got == want:
                    total += float(line.rsplit(" ", 1)[1])
    return total


def assert_sticky(served: list[list[str]]) -> None:
    for workers in served:
        assert None not in workers
        assert len(set(workers)) == 1, workers  # every later turn on the worker that served the first


def test_later_turns_go_to_the_worker_holding_the_prefix(embedded: tuple[list[str], str]) -> None:
    urls, key = embedded
    before = metric(urls, "tokentrail_routing_dispatches", model=MODEL, outcome="preferred")
    served = loops(urls, key, conversations=6, turns=4, tag="sticky")
    assert_sticky(served)  # (first turns, without a preference, may all go to one worker)
    assert metric(urls, "tokentrail_routing_dispatches", model=MODEL, outcome="preferred") - before == 6 * 3


def test_session_hint_routes_first_turns_and_breaks_ties(embedded: tuple[list[str], str]) -> None:
    urls, key = embedded
    # a new conversation's first turn goes to its session's worker: one session, one worker; many, both
    first: dict[int, set[str]] = {}
    for s in range(16):
        for c in range(2):
            body = chat(urls[0], key, [{"role": "user", "content": f"session {s} conversation {c}"}], f"s-{s}")
            first.setdefault(s, set()).add(body["tokentrail"]["worker_id"])
    assert all(len(w) == 1 for w in first.values()), first
    assert len(set().union(*first.values())) == 2, first
    # two rollouts with the same opening and identical (greedy) replies: each continues its own
    opening = [{"role": "user", "content": "the same opening for both rollouts"}]
    greedy = {"temperature": 0, "seed": 7}
    a = chat(urls[0], key, opening, "rollout-a", **greedy)
    b = chat(urls[0], key, opening, "rollout-b", **greedy)
    reply = a["choices"][0]["message"]["content"]
    assert b["choices"][0]["message"]["content"] == reply
    for name, first_turn in (("rollout-a", a), ("rollout-b", b)):
        history = [*opening, {"role": "assistant", "content": reply}, {"role": "user", "content": "and then?"}]
        nxt = chat(urls[0], key, history, name, **greedy)
        info = nxt["tokentrail"]
        assert info["lineage"] == {"decision": "extended", "matched_messages": 2, "stopped": "end_of_stored_path"}
        user = httpx.get(
            f"{urls[0]}/chats/{info['chat_id']}/messages/{info['parent_id']}",
            headers={"Authorization": f"Bearer {key}"},
        ).json()
        assert user["parent_id"] == first_turn["tokentrail"]["message_id"], name


def test_lineage_decisions_and_prefix_breaks(embedded: tuple[list[str], str]) -> None:
    urls, key = embedded
    breaks = metric(urls, "tokentrail_prefix_breaks", model=MODEL)
    forks = metric(urls, "tokentrail_lineage_decisions", model=MODEL, decision="forked")
    messages: list[dict[str, Any]] = [{"role": "user", "content": "lineage one"}]
    one = chat(urls[0], key, messages)
    assert one["tokentrail"]["lineage"] == {"decision": "root", "matched_messages": 0, "stopped": "no_stored_prefix"}
    reply = one["choices"][0]["message"]["content"]
    assert one["tokentrail"]["worker_id"] and "cached_tokens" in one["tokentrail"]
    stored = httpx.get(
        f"{urls[0]}/chats/{one['tokentrail']['chat_id']}/messages/{one['tokentrail']['message_id']}",
        headers={"Authorization": f"Bearer {key}"},
    ).json()
    assert stored["worker_id"] == one["tokentrail"]["worker_id"]  # the native API names the worker too
    two = chat(urls[0], key, [*messages, {"role": "assistant", "content": reply}, {"role": "user", "content": "2"}])
    assert two["tokentrail"]["lineage"]["decision"] == "extended"
    edited = [*messages, {"role": "assistant", "content": reply + " (edited)"}, {"role": "user", "content": "2"}]
    three = chat(urls[0], key, edited)
    assert three["tokentrail"]["lineage"] == {
        "decision": "forked",
        "matched_messages": 1,
        "stopped": "differs_from_stored_assistant",
    }
    assert metric(urls, "tokentrail_prefix_breaks", model=MODEL) - breaks == 1
    assert metric(urls, "tokentrail_lineage_decisions", model=MODEL, decision="forked") - forks == 1


@pytest.mark.postgres
@pytest.mark.redis
@pytest.mark.slow
def test_routing_across_replicas_on_postgres_and_redis(
    postgres_url: str, redis_url: str, tiny_model_dir: Path, tmp_path: Path
) -> None:
    """Each worker is connected to a different replica, and each turn is sent to the other replica than
    the last: the replica that queues a turn is often not the one holding its worker's connection."""
    env = {
        "TOKENTRAIL_DATABASE_URL": postgres_url,
        "TOKENTRAIL_REDIS_URL": redis_url,
        "TOKENTRAIL_AUTH_SECRET": SECRET,
        "TOKENTRAIL_DATA_DIR": str(tmp_path / "data"),
        "TOKENTRAIL_ROUTE_WAIT_S": "5",
        "TOKENTRAIL_ROUTING": "on",  # the hf engine keeps no prefix cache: "auto" would not route it
    }
    settings = ServerSettings(database_url=postgres_url, migrate_on_start=False)
    with cluster(env, settings, tiny_model_dir, tmp_path, replicas=2) as (urls, key):
        before = metric(urls, "tokentrail_routing_dispatches", model=MODEL, outcome="preferred")
        served = loops(urls, key, conversations=6, turns=4, tag="replicas")
        assert_sticky(served)
        assert metric(urls, "tokentrail_routing_dispatches", model=MODEL, outcome="preferred") - before == 6 * 3


async def test_router_prefers_the_live_holder_then_the_session() -> None:
    """The router alone, over a directory of entries: which worker a turn is held for."""
    from server.queue.memory import MemoryWorkerDirectory
    from server.queue.protocol import WorkerEntry
    from server.workers.routing import Router

    directory = MemoryWorkerDirectory()
    for wid, engine, state in (("v1", "vllm", "ready"), ("v2", "vllm", "ready"), ("v3", "vllm", "restarting")):
        await directory.register(WorkerEntry(wid, MODEL, "c", engine, None, 4, engine_state=state), ttl_s=60)
    for wid in ("h1", "h2"):
        await directory.register(WorkerEntry(wid, "hf-model", "c", "hf", None, 4), ttl_s=60)
    auto = Router(directory, "auto")
    assert await auto.prefer(MODEL, "v2", None) == "v2"
    assert await auto.prefer(MODEL, "v3", None) == ""  # its engine is restarting: any worker
    assert await auto.prefer(MODEL, "gone", None) == ""
    by_session = {await auto.prefer(MODEL, "gone", f"s{k}") for k in range(32)}
    assert by_session == {"v1", "v2"}  # sessions spread over the live workers, the same on every call
    for k in range(8):  # the same session, the same worker, on every call
        assert len({await auto.prefer(MODEL, None, f"s{k}") for _ in range(3)}) == 1
    assert await auto.prefer("hf-model", "h1", "s") == ""  # no prefix cache to win: auto leaves hf unrouted
    assert await Router(directory, "on").prefer("hf-model", "h1", None) == "h1"
    assert await Router(directory, "off").prefer(MODEL, "v2", "s") == ""
