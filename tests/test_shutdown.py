"""Graceful shutdown with real processes and real signals.

- SIGTERM to a worker process: it takes no more work, finishes the message it holds, and exits 0;
  work that arrives afterwards waits in the queue for the next worker.
- ``tokentrail up`` killed with SIGKILL: its server and worker children exit too (PR_SET_PDEATHSIG).
- SIGINT to a server holding a stream that cannot end (its reply's worker was killed): the server stops
  within ``TOKENTRAIL_SHUTDOWN_GRACE_S``, cutting the stream, and the reply stays stored, open.
"""

from __future__ import annotations

import os
import signal
import sqlite3
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest

from server.admin import issue_user_key
from server.settings import ServerSettings
from tests.stack import ServerThread, start_reply, wait_for, worker_key
from tests.test_e2e_embedded import events, login
from tokentrail.launcher import answers, free_port, spawn, wait_ready

MODEL = "drainer"


def _worker(url: str, key: str, model_dir: Path, log: Path) -> subprocess.Popen[bytes]:
    cmd = [sys.executable, "-m", "tokentrail", "worker", "--server-url", url, "--api-key", key, "--model",
           str(model_dir), "--served-model-name", MODEL, "--max-parallel", "2", "--threads", "1"]  # fmt: skip
    with open(log, "wb") as out:
        return subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT)


def _offered(url: str) -> bool:
    resp = httpx.get(f"{url}/configs/model_configs")
    return resp.status_code == 200 and any(m["name"] == MODEL for m in resp.json())


def test_sigterm_drains_a_worker(tmp_path: Path, tiny_model_dir: Path) -> None:
    settings = ServerSettings(data_dir=tmp_path / "data", port=free_port())
    server = ServerThread(settings).start()
    key = worker_key(settings)
    worker = _worker(server.url, key, tiny_model_dir, tmp_path / "worker.log")
    try:
        wait_for(lambda: _offered(server.url), 120, "worker")
        headers = login(server.url, "drain")
        chat, mid = start_reply(server.url, headers, MODEL, 300, text="hello")
        wait_for(
            lambda: (
                httpx.get(f"{server.url}/chats/{chat}/messages/{mid}", headers=headers).json()["state"] == "in_progress"
            ),
            60,
            "generation to start",
        )
        worker.send_signal(signal.SIGTERM)
        final = events(server.url, f"/chats/{chat}/messages/{mid}/events", headers)[-1]
        assert final["event_type"] == "message", final
        msg = httpx.get(f"{server.url}/chats/{chat}/messages/{mid}", headers=headers).json()
        assert msg["state"] == "complete" and msg["completion_token_count"] == 300, msg
        assert worker.wait(timeout=60) == 0, (tmp_path / "worker.log").read_text()[-3000:]
        assert "draining" in (tmp_path / "worker.log").read_text()
        # work asked for after the drain waits for the next worker
        later_chat, later = start_reply(server.url, headers, MODEL, 4, text="hello")
        time.sleep(1)
        state = httpx.get(f"{server.url}/chats/{later_chat}/messages/{later}", headers=headers).json()["state"]
        assert state == "pending"
    finally:
        if worker.poll() is None:
            worker.kill()
            worker.wait()
        server.stop()


def _children(pid: int) -> list[int]:
    out: list[int] = []
    for task in Path(f"/proc/{pid}/task").iterdir():
        out += [int(c) for c in (task / "children").read_text().split()]
    return out


def _alive(pid: int) -> bool:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="PR_SET_PDEATHSIG is Linux only")
def test_children_of_tokentrail_up_die_with_it_on_sigkill(tmp_path: Path, tiny_model_dir: Path) -> None:
    port = free_port()
    env = {**os.environ, "TOKENTRAIL_CACHE_DIR": os.environ.get("TOKENTRAIL_CACHE_DIR", "")}
    env = {k: v for k, v in env.items() if v}
    cmd = [sys.executable, "-m", "tokentrail", "up", "--port", str(port), "--data-dir", str(tmp_path / "data"),
           "--model", str(tiny_model_dir)]  # fmt: skip
    with open(tmp_path / "up.log", "wb") as out:
        up = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env)
    url = f"http://127.0.0.1:{port}"
    children: list[int] = []
    try:
        wait_for(lambda: "ready." in (tmp_path / "up.log").read_text() or up.poll() is not None, 180, "tokentrail up")
        assert up.poll() is None, (tmp_path / "up.log").read_text()[-3000:]
        children = _children(up.pid)
        assert len(children) == 2, children
        assert httpx.get(f"{url}/health").status_code == 200
        up.kill()
        up.wait()
        wait_for(lambda: not any(_alive(c) for c in children), 30, "the children to exit")
        with pytest.raises(httpx.HTTPError):
            httpx.get(f"{url}/health", timeout=2)
    finally:
        if up.poll() is None:
            children = children or _children(up.pid)
            up.kill()
            up.wait()
        for c in children:
            if _alive(c):
                os.kill(c, signal.SIGKILL)


def test_sigint_stops_a_server_whose_stream_cannot_end_within_its_grace(tmp_path: Path, tiny_model_dir: Path) -> None:
    settings = ServerSettings(data_dir=tmp_path / "data", port=free_port())
    env = {"TOKENTRAIL_DATA_DIR": str(settings.data_dir), "TOKENTRAIL_SHUTDOWN_GRACE_S": "2"}
    server = spawn(["serve", "--port", str(settings.port)], output=tmp_path / "server.log", env=env)
    url = f"http://127.0.0.1:{settings.port}"
    worker: subprocess.Popen[bytes] | None = None
    try:
        wait_ready(lambda: answers(url), {"server": server}, "server", 60, logs=tmp_path)
        worker = _worker(url, worker_key(settings), tiny_model_dir, tmp_path / "worker.log")
        wait_for(lambda: _offered(url), 120, "worker")
        headers = {"Authorization": f"Bearer {issue_user_key(settings, 'reader')}"}
        body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2000,
                "ignore_eos": True, "stream": True}  # fmt: skip
        lines: list[str] = []
        ended: list[BaseException | None] = []

        def read() -> None:
            try:
                with httpx.stream("POST", f"{url}/v1/chat/completions", json=body, headers=headers, timeout=60) as r:
                    for line in r.iter_lines():
                        lines.append(line)
                ended.append(None)
            except httpx.HTTPError as exc:
                ended.append(exc)

        reader = threading.Thread(target=read, daemon=True)
        reader.start()
        wait_for(lambda: len(lines) > 4, 60, "tokens to stream")
        worker.kill()  # its reply now waits for a worker (the model's grace period): the stream stays open
        worker.wait()
        time.sleep(0.5)
        began = time.monotonic()
        server.send_signal(signal.SIGINT)
        code = server.wait(timeout=30)
        took = time.monotonic() - began
        assert took < 10, f"the server took {took:.1f}s to stop"
        assert code == 0, (tmp_path / "server.log").read_text()[-3000:]
        reader.join(timeout=10)
        assert ended, "the stream did not end with the server"
        assert "data: [DONE]" not in lines  # cut, not finished
        with sqlite3.connect(settings.data_dir / "tokentrail.db") as db:
            states = [r[0] for r in db.execute("SELECT state FROM messages WHERE role = 'assistant'")]
        assert states == ["in_progress"] or states == ["pending"], states  # kept, to be resumed
    finally:
        for proc in (worker, server):
            if proc is not None and proc.poll() is None:
                proc.kill()
                proc.wait()
