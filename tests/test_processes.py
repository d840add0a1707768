"""``tokentrail serve --processes 2``: two server processes on one port (PostgreSQL + Redis) look like one
server to workers and clients: connections land on both, the OA flow's SSE and streamed chat completions
come out whole whichever process takes the request or holds the worker, a killed process is started
again, and the configuration that cannot be shared is refused."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import orjson
import pytest
from prometheus_client import generate_latest
from transformers import AutoTokenizer

from server.settings import ServerSettings
from server.workers.ingest import without_nul
from tests.stack import MODEL, wait_for, worker_key
from tests.test_e2e_embedded import events, login
from tokentrail.launcher import free_port, spawn

pytestmark = [pytest.mark.postgres, pytest.mark.redis, pytest.mark.slow]

SECRET = "test-secret-processes-0123456789"


@pytest.fixture(scope="module")
def two_processes(
    postgres_url: str, redis_url: str, tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[tuple[str, subprocess.Popen[bytes]]]:
    logs = tmp_path_factory.mktemp("logs")
    env = {
        "TOKENTRAIL_DATABASE_URL": postgres_url,
        "TOKENTRAIL_REDIS_URL": redis_url,
        "TOKENTRAIL_AUTH_SECRET": SECRET,
        "TOKENTRAIL_ALLOW_DEBUG_AUTH": "true",
        "TOKENTRAIL_MIGRATE_ON_START": "true",
        "TOKENTRAIL_DATA_DIR": str(tmp_path_factory.mktemp("data")),
    }
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    server = spawn(["serve", "--port", str(port), "--processes", "2"], env=env, output=logs / "server.log")
    procs = [server]
    try:
        wait_for(lambda: _answers(url), 90, "server processes")
        key = worker_key(ServerSettings(database_url=postgres_url, migrate_on_start=False))
        procs.append(
            spawn(
                ["worker", "--server-url", url, "--api-key", key, "--model", str(tiny_model_dir),
                 "--served-model-name", MODEL, "--max-parallel", "4"],
                output=logs / "worker.log",
            )
        )  # fmt: skip
        wait_for(lambda: _offered_everywhere(url), 120, "the worker, seen by both processes")
        yield url, server
    finally:
        for p in reversed(procs):
            p.terminate()
        for p in procs:
            try:
                p.wait(timeout=60)
            except subprocess.TimeoutExpired:
                p.kill()


def _answers(url: str) -> bool:
    try:
        return httpx.get(f"{url}/health", timeout=2).status_code == 200
    except httpx.HTTPError:
        return False


def _servers(url: str, tries: int = 40) -> set[str]:
    """The server ids that answer new connections (each request on a connection of its own)."""
    seen = set()
    for _ in range(tries):
        seen.add(httpx.get(f"{url}/ready", timeout=10).json()["server_id"])
    return seen


def _offered_everywhere(url: str) -> bool:
    """The model offered through both processes (the worker's websocket is held by one of them)."""
    answers = set()
    for _ in range(20):
        answers.add(any(m["name"] == MODEL for m in httpx.get(f"{url}/configs/model_configs").json()))
    return answers == {True}


def test_connections_land_on_both_processes(two_processes: tuple[str, Any]) -> None:
    url, _ = two_processes
    assert len(_servers(url)) == 2


def test_chats_and_streams_come_out_whole_through_either_process(
    two_processes: tuple[str, Any], tiny_model_dir: Path
) -> None:
    url, _ = two_processes
    tokenizer = AutoTokenizer.from_pretrained(str(tiny_model_dir))
    headers = login(url, "procs")
    for i in range(6):  # new connections: the kernel spreads them over the processes
        chat = httpx.post(f"{url}/chats", json={}, headers=headers).json()["id"]
        prompt = httpx.post(f"{url}/chats/{chat}/prompter_message", json={"parent_id": None, "content": f"hi {i}"},
                            headers=headers).json()["id"]  # fmt: skip
        ask = {"parent_id": prompt, "model_config_name": MODEL, "sampling_parameters": {"max_new_tokens": 8}}
        reply = httpx.post(f"{url}/chats/{chat}/assistant_message", json=ask, headers=headers)
        assert reply.status_code == 200, reply.text
        path = f"/chats/{chat}/messages/{reply.json()['id']}/events"
        evs = events(url, path, headers)
        assert evs[-1]["event_type"] == "message", evs[-1]
        streamed = [(e["token_id"], e["text"]) for e in evs if e["event_type"] == "token"]
        # read again once stored, on whichever process answers; and the stored ids' text
        again = events(url, path, headers)
        assert streamed and streamed == [(e["token_id"], e["text"]) for e in again if e["event_type"] == "token"]
        stored = httpx.get(f"{url}{path.removesuffix('/events')}?include=tokens", headers=headers).json()
        assert [t for t, _ in streamed] == stored["completion_token_ids"]
        decoded = str(tokenizer.decode(stored["completion_token_ids"], skip_special_tokens=True))
        full = without_nul(decoded)
        assert "".join(text for _, text in streamed) == full  # a character the reply stopped inside of too

        body = {"model": MODEL, "messages": [{"role": "user", "content": f"stream {i}"}], "stream": True,
                "max_tokens": 8}  # fmt: skip
        text, ids = [], []
        with httpx.stream("POST", f"{url}/v1/chat/completions", json=body, headers=headers, timeout=60) as resp:
            assert resp.status_code == 200
            for line in resp.iter_lines():
                if line.startswith("data: {"):
                    chunk = orjson.loads(line[6:])
                    if chunk["choices"]:
                        text.append(chunk["choices"][0]["delta"].get("content") or "")
                        ids += chunk["choices"][0]["token_ids"]
                        info = chunk.get("tokentrail", {})
        msgs = httpx.get(f"{url}/chats/{info['chat_id']}", headers=headers).json()["messages"]
        (stored,) = [m for m in msgs if m["id"] == info["message_id"]]
        assert "".join(text) == stored["content"] and len(ids) > 0


def test_a_killed_process_is_started_again(two_processes: tuple[str, Any]) -> None:
    url, server = two_processes
    children = _children(server.pid)
    assert len(children) == 2
    victim = children[0]
    os.kill(victim, signal.SIGKILL)
    wait_for(lambda: victim not in _children(server.pid) and len(_children(server.pid)) == 2, 60, "a new process")
    wait_for(lambda: len(_servers(url, 20)) == 2, 90, "two processes answering again")


def _children(pid: int) -> list[int]:
    """The server processes under ``pid`` (multiprocessing's spawned children, not its resource tracker)."""
    out = subprocess.run(["pgrep", "-P", str(pid)], capture_output=True, check=False).stdout
    found = []
    for child in map(int, out.split()):
        try:
            cmdline = Path(f"/proc/{child}/cmdline").read_bytes()
        except OSError:
            continue
        if b"spawn_main" in cmdline:
            found.append(child)
    return found


def test_more_than_one_process_without_redis_is_refused(tmp_path: Path) -> None:
    out = subprocess.run(
        [sys.executable, "-m", "tokentrail", "serve", "--processes", "2", "--data-dir", str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=60,
        env={k: v for k, v in os.environ.items() if k != "TOKENTRAIL_REDIS_URL"},
    )
    assert out.returncode == 2 and "needs Redis" in out.stderr, out.stderr


def test_processes_that_cannot_start_end_the_server(redis_url: str, tmp_path: Path) -> None:
    """A port another program holds: every process exits at once; the parent gives up instead of looping."""
    import socket

    taken = socket.socket()
    taken.bind(("127.0.0.1", 0))
    taken.listen()
    port = taken.getsockname()[1]
    env = {**os.environ, "TOKENTRAIL_REDIS_URL": redis_url, "TOKENTRAIL_AUTH_SECRET": SECRET}
    try:
        out = subprocess.run(
            [sys.executable, "-m", "tokentrail", "serve", "--processes", "2", "--port", str(port), "--data-dir",
             str(tmp_path)],
            capture_output=True, text=True, timeout=120, env=env,
        )  # fmt: skip
    finally:
        taken.close()
    assert out.returncode != 0 and "exited 3 times" in out.stderr, out.stderr[-3000:]


def test_metrics_of_the_processes_are_merged_sums_and_shared_state_once() -> None:
    """What any process of a ``serve --processes N`` answers on /metrics: each series added over the
    processes, but shared state (``tokentrail_cluster_*``) taken once and ``_created`` the earliest."""
    from prometheus_client.parser import text_string_to_metric_families

    from server.metrics import Metrics
    from server.metrics_group import merged

    a, b = Metrics(), Metrics()
    a.errors.labels("chat_not_found").inc(2)
    b.errors.labels("chat_not_found").inc(3)
    b.errors.labels('odd "code"\n').inc()
    a.ttft.labels("m").observe(0.02)
    b.ttft.labels("m").observe(3.0)
    a.sse_readers.set(4)
    b.sse_readers.set(1)
    a.cluster_workers.labels("m").set(2)
    b.cluster_workers.labels("m").set(2)
    text = merged([generate_latest(a.registry), generate_latest(b.registry)])
    samples = {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text.decode())
        for s in family.samples
    }
    assert samples[("tokentrail_errors_total", (("code", "chat_not_found"),))] == 5
    assert samples[("tokentrail_errors_total", (("code", 'odd "code"\n'),))] == 1
    assert samples[("tokentrail_ttft_seconds_count", (("model", "m"),))] == 2
    assert samples[("tokentrail_ttft_seconds_sum", (("model", "m"),))] == pytest.approx(3.02)
    assert samples[("tokentrail_ttft_seconds_bucket", (("le", "0.025"), ("model", "m")))] == 1
    assert samples[("tokentrail_ttft_seconds_bucket", (("le", "+Inf"), ("model", "m")))] == 2
    assert samples[("tokentrail_sse_readers", ())] == 5
    assert samples[("tokentrail_cluster_workers", (("model", "m"),))] == 2
    created = [v for (name, _), v in samples.items() if name == "tokentrail_errors_created"]
    assert created and all(v > 0 for v in created)


def test_metrics_of_either_process_count_the_requests_of_both(two_processes: tuple[str, Any]) -> None:
    from prometheus_client.parser import text_string_to_metric_families

    url, _ = two_processes
    wait_for(lambda: len(_servers(url, 20)) == 2, 60, "both processes answering")

    def scrape() -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
        text = httpx.get(f"{url}/metrics", timeout=10).text  # a connection of its own: either process
        return {
            (s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(text)
            for s in family.samples
        }

    missing = ("tokentrail_errors_total", (("code", "chat_not_found"),))
    before = scrape().get(missing, 0.0)
    headers = login(url, "procs-metrics")
    for _ in range(10):  # new connections: both processes answer some
        assert httpx.get(f"{url}/chats/no-such-chat", headers=headers).status_code == 404
    for _ in range(4):  # whichever process takes the scrape answers for both
        after = scrape()
        assert after.get(missing, 0.0) - before == 10
        assert after[("tokentrail_workers_connected", (("model", MODEL),))] == 1  # held by one of them
        assert after[("tokentrail_cluster_workers", (("model", MODEL),))] == 1
