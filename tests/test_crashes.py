"""Crashes with real processes and SIGKILL, on PostgreSQL and a private Redis.

- A server replica dies: the worker connected to it moves to the other replica and names the work
  it lost (``released``); the reader whose SSE connection broke resumes on the other replica with
  Last-Event-ID. The reply is continued from the streamed tokens, not redone.
- A worker dies mid-stream: its reply is resumed by the other worker.
- An embedded server (SQLite, streams in memory) dies mid-reply: the reply starts over, and its
  resuming reader is reset onto the new attempt.
- A replica dies and stays down while its worker can reach no other: the other replica presumes it
  dead when its presence expires and hands the reply to its own worker (not waiting for the sweep).

Each reader must see one continuous stream (after any ``reset``) equal to what SQL stores.
"""

from __future__ import annotations

import json
import signal
import threading
import time
from collections.abc import Iterator
from contextlib import ExitStack
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests import services
from tests.stack import start_reply, wait_for
from tests.test_e2e_embedded import login
from text_client.sse import parse_sse
from tokentrail.launcher import free_port, spawn

pytestmark = [pytest.mark.redis, pytest.mark.postgres]

MODEL = "crash-model"
SECRET = "crash-test-secret-0123456789abcdef0123"
TOKENS = 1500


@dataclass
class Cluster:
    urls: list[str]
    env: dict[str, str]
    key: str
    tmp: Path
    procs: dict[str, Any] = field(default_factory=dict)

    def worker(self, name: str, urls: list[str], model_dir: Path) -> None:
        args = ["worker", "--server-url", ",".join(urls), "--api-key", self.key, "--model", str(model_dir),
                "--served-model-name", MODEL, "--max-parallel", "1", "--threads", "1"]  # fmt: skip
        self.procs[name] = spawn(args, env={**self.env, "OMP_NUM_THREADS": "1"}, output=self.tmp / f"{name}.log")

    def log(self, name: str) -> str:
        return (self.tmp / f"{name}.log").read_text(errors="replace")


@pytest.fixture
def cluster(tmp_path: Path) -> Iterator[Cluster]:
    with ExitStack() as stack:
        try:
            pg = stack.enter_context(services.postgres_service())
            redis = services.RestartableRedis().start()
        except services.ServiceUnavailable as exc:
            pytest.skip(str(exc))
        stack.callback(redis.stop)
        env = {
            "TOKENTRAIL_DATABASE_URL": pg,
            "TOKENTRAIL_REDIS_URL": redis.url,
            "TOKENTRAIL_AUTH_SECRET": SECRET,
            "TOKENTRAIL_ALLOW_DEBUG_AUTH": "true",
            "TOKENTRAIL_DATA_DIR": str(tmp_path),
        }
        assert spawn(["db", "upgrade"], env=env, output=tmp_path / "upgrade.log").wait(timeout=120) == 0
        made = spawn(["admin", "create-worker-key", "--name", "crash"], env=env, output=tmp_path / "key.log")
        assert made.wait(timeout=60) == 0
        key = (tmp_path / "key.log").read_text().split()[-1]
        ports = [free_port(), free_port()]
        c = Cluster([f"http://127.0.0.1:{p}" for p in ports], env, key, tmp_path)
        for i, port in enumerate(ports):
            args = ["serve", "--port", str(port), "--log-level", "warning"]
            c.procs[f"server-{i}"] = spawn(args, env=env, output=tmp_path / f"server-{i}.log")
        try:
            wait_for(lambda: all(_status(u, "/health") == 200 for u in c.urls), 60, "replicas")
            yield c
        finally:
            for proc in c.procs.values():
                if proc.poll() is None:
                    proc.kill()
                proc.wait()


def _status(url: str, path: str) -> int:
    try:
        return httpx.get(url + path, timeout=2).status_code
    except httpx.HTTPError:
        return 0


def _offered(url: str) -> bool:
    try:
        resp = httpx.get(f"{url}/configs/model_configs", timeout=2)
    except httpx.HTTPError:
        return False
    return resp.status_code == 200 and any(m["name"] == MODEL for m in resp.json())


class Reader(threading.Thread):
    """Reads a message's events to the end, resuming with Last-Event-ID on the next URL whenever
    the connection breaks. ``tokens`` is what the reader holds (index -> id); ``resumes`` counts
    reconnections; ``duplicates`` counts an index seen twice without a reset in between."""

    def __init__(self, urls: list[str], path: str, headers: dict[str, str]) -> None:
        super().__init__(daemon=True)
        self.urls, self.path, self.headers = urls, path, headers
        self.tokens: dict[int, int] = {}
        self.final: dict[str, Any] | None = None
        self.resumes = self.duplicates = self.resets = 0

    def run(self) -> None:
        last, turn = -1, 0
        deadline = time.monotonic() + 180
        while self.final is None and time.monotonic() < deadline:
            url = self.urls[turn % len(self.urls)]
            hdrs = {**self.headers, "Accept": "text/event-stream"}
            if last >= 0:
                hdrs["Last-Event-ID"] = str(last)
            try:
                with httpx.stream("GET", url + self.path, headers=hdrs, timeout=httpx.Timeout(5, read=60)) as resp:
                    if resp.status_code == 200:
                        for ev in parse_sse(resp.iter_lines()):
                            last = self._take(json.loads(ev.data), last)
                            if self.final is not None:
                                return
            except httpx.HTTPError:
                pass
            turn += 1
            self.resumes += 1
            time.sleep(0.2)

    def _take(self, event: dict[str, Any], last: int) -> int:
        kind = event["event_type"]
        if kind == "token":
            index = int(event["index"])
            self.duplicates += index in self.tokens
            self.tokens[index] = int(event["token_id"])
            return max(last, index)
        if kind == "reset":
            self.resets += 1
            start = int(event["from_index"])
            for index in [i for i in self.tokens if i >= start]:
                del self.tokens[index]
            return start - 1
        if kind in ("message", "error"):
            self.final = event
        return last


def _check(url: str, headers: dict[str, str], chat: str, mid: str, reader: Reader) -> int:
    """Checks the reader against SQL; returns the message's attempt (2+ when it was continued)."""
    reader.join(timeout=240)
    assert reader.final is not None and reader.final["event_type"] == "message", reader.final
    assert reader.duplicates == 0
    stored = httpx.get(f"{url}/chats/{chat}/messages/{mid}?include=tokens", headers=headers).json()
    assert stored["state"] == "complete", stored
    assert sorted(reader.tokens) == list(range(TOKENS))  # nothing missed
    assert [reader.tokens[i] for i in range(TOKENS)] == stored["completion_token_ids"]
    return int(stored["attempt"])


def _streaming(reader: Reader) -> bool:
    return len(reader.tokens) >= 20


def test_a_killed_replica_hands_its_worker_and_reader_to_the_other(cluster: Cluster, tiny_model_dir: Path) -> None:
    c = cluster
    c.worker("worker", c.urls, tiny_model_dir)  # connects to server-0 first
    wait_for(lambda: "connected as" in c.log("worker"), 120, "worker connected")
    wait_for(lambda: _offered(c.urls[1]), 30, "model offered")
    headers = login(c.urls[1], "replica-crash")
    chat, mid = start_reply(c.urls[1], headers, MODEL, TOKENS)
    reader = Reader(c.urls, f"/chats/{chat}/messages/{mid}/events", headers)  # reads from server-0 first
    reader.start()
    wait_for(lambda: _streaming(reader), 60, "the reply to stream")
    c.procs["server-0"].send_signal(signal.SIGKILL)
    seen_at_kill = len(reader.tokens)
    assert _check(c.urls[1], headers, chat, mid, reader) >= 2  # interrupted, then continued
    assert seen_at_kill < TOKENS and reader.resumes >= 1
    assert c.log("worker").count("connected as") >= 2  # it moved to server-1


def test_a_killed_worker_has_its_reply_resumed_by_the_other(cluster: Cluster, tiny_model_dir: Path) -> None:
    c = cluster
    for i in range(2):
        c.worker(f"worker-{i}", c.urls[i:] + c.urls[:i], tiny_model_dir)
    for i in range(2):
        wait_for(lambda i=i: "connected as" in c.log(f"worker-{i}"), 120, f"worker-{i} connected")
    headers = login(c.urls[0], "worker-crash")
    replies = [start_reply(c.urls[0], headers, MODEL, TOKENS, text=f"go on {k}") for k in range(2)]
    readers = [Reader(c.urls, f"/chats/{chat}/messages/{mid}/events", headers) for chat, mid in replies]
    for reader in readers:
        reader.start()
    wait_for(lambda: all(_streaming(r) for r in readers), 60, "both replies to stream")  # one per worker
    c.procs["worker-0"].send_signal(signal.SIGKILL)
    assert all(len(r.tokens) < TOKENS for r in readers)
    attempts = [_check(c.urls[0], headers, chat, mid, r) for (chat, mid), r in zip(replies, readers, strict=True)]
    assert sorted(attempts) == [1, 2]  # the killed worker's reply was continued once, the other untouched
    assert all(r.resumes == 0 for r in readers)  # the readers' server never went away


def test_a_dead_replicas_work_moves_to_a_worker_of_another_replica(cluster: Cluster, tiny_model_dir: Path) -> None:
    c = cluster
    for i in range(2):  # each knows one replica only: worker-0 cannot follow its work when server-0 dies
        c.worker(f"worker-{i}", c.urls[i : i + 1], tiny_model_dir)
    for i in range(2):
        wait_for(lambda i=i: "connected as" in c.log(f"worker-{i}"), 120, f"worker-{i} connected")
    wait_for(lambda: _offered(c.urls[1]), 30, "model offered")
    headers = login(c.urls[1], "replica-gone")
    replies = [start_reply(c.urls[1], headers, MODEL, TOKENS, text=f"go on {k}") for k in range(2)]
    readers = [Reader(c.urls[1:], f"/chats/{chat}/messages/{mid}/events", headers) for chat, mid in replies]
    for reader in readers:
        reader.start()
    wait_for(lambda: all(_streaming(r) for r in readers), 60, "both replies to stream")  # one per worker
    c.procs["server-0"].send_signal(signal.SIGKILL)  # and it stays down
    attempts = [_check(c.urls[1], headers, chat, mid, r) for (chat, mid), r in zip(replies, readers, strict=True)]
    assert sorted(attempts) == [1, 2]
    moved = replies[attempts.index(2)][1]
    assert "gone: requeueing " + moved in c.log("server-1")  # the fail-over moved it, not the sweep
    assert all(r.resumes == 0 for r in readers)  # their replica never went away


def test_a_reader_of_an_embedded_server_that_died_is_reset_onto_the_new_attempt(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    """Embedded defaults (SQLite, streams in memory): SIGKILL the server mid-reply and start it again.
    The tokens streamed so far died with it, so the next attempt starts the reply over; the reader,
    resuming with Last-Event-ID, must be told to drop what it holds (a reset) and end up with exactly
    the stored reply."""
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    env = {"TOKENTRAIL_DATA_DIR": str(tmp_path)}
    key_log = tmp_path / "key.log"
    assert spawn(["admin", "create-worker-key", "--name", "w"], env=env, output=key_log).wait(timeout=120) == 0
    key = key_log.read_text().split()[-1]
    serve = ["serve", "--port", str(port), "--log-level", "warning"]
    procs = {"server": spawn(serve, env=env, output=tmp_path / "server.log")}
    try:
        wait_for(lambda: _status(url, "/health") == 200, 60, "server")
        args = ["worker", "--server-url", url, "--api-key", key, "--model", str(tiny_model_dir),
                "--served-model-name", MODEL, "--max-parallel", "1", "--threads", "1"]  # fmt: skip
        procs["worker"] = spawn(args, env={"OMP_NUM_THREADS": "1"}, output=tmp_path / "worker.log")
        wait_for(lambda: _offered(url), 120, "worker")
        headers = login(url, "embedded-crash")
        chat, mid = start_reply(url, headers, MODEL, TOKENS)
        reader = Reader([url], f"/chats/{chat}/messages/{mid}/events", headers)
        reader.start()
        wait_for(lambda: _streaming(reader), 60, "the reply to stream")
        procs["server"].send_signal(signal.SIGKILL)
        procs["server"].wait()
        procs["server"] = spawn(serve, env=env, output=tmp_path / "server.log", append=True)
        assert _check(url, headers, chat, mid, reader) >= 2
        assert reader.resets >= 1
    finally:
        for proc in procs.values():
            if proc.poll() is None:
                proc.kill()
            proc.wait()
