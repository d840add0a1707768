"""A worker that goes silent (no frames, not even heartbeats) for ``worker_timeout_s`` is dropped: the
hub closes its socket with 1011. A worker that keeps sending heartbeats stays, however long it has no
work: the timeout counts from each frame, not from the connection's start.

The workers are real websocket peers written for this test (no engine)."""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import websockets
from websockets.exceptions import ConnectionClosed

from server.settings import ServerSettings
from tests.stack import ServerThread, fake_hello, worker_key
from tokentrail.launcher import free_port

TIMEOUT_S = 1.0


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, str]]:
    settings = ServerSettings(
        data_dir=Path(tmp_path_factory.mktemp("silent")),
        port=free_port(),
        worker_timeout_s=TIMEOUT_S,
        worker_heartbeat_interval_s=0.2,
    )
    srv = ServerThread(settings).start()
    yield srv.url.replace("http://", "ws://") + "/workers/work", worker_key(settings)
    srv.stop()


async def _session(url: str, key: str, *, beat_every_s: float | None, stay_s: float) -> int | None:
    """Connect, say hello, then send heartbeats every ``beat_every_s`` (None: nothing) for ``stay_s``;
    the close code if the server closed the socket by then, else None."""
    headers = {"Authorization": f"Bearer {key}"}
    async with websockets.connect(url, additional_headers=headers) as ws:
        await ws.send(fake_hello("silent", engine="none", capacity=1, vocab_size=10).model_dump_json())
        await ws.recv()  # the welcome
        deadline = time.monotonic() + stay_s
        try:
            while time.monotonic() < deadline:
                if beat_every_s is not None:
                    await ws.send(json.dumps({"type": "heartbeat"}))
                with contextlib.suppress(TimeoutError):  # the server's frames (heartbeats) are dropped
                    await asyncio.wait_for(ws.recv(), timeout=beat_every_s or 0.1)
        except ConnectionClosed as exc:
            return exc.rcvd.code if exc.rcvd is not None else -1
        return None


def test_a_silent_worker_is_dropped(server: tuple[str, str]) -> None:
    url, key = server
    assert asyncio.run(_session(url, key, beat_every_s=None, stay_s=TIMEOUT_S * 5)) == 1011


def test_a_worker_that_sends_heartbeats_stays(server: tuple[str, str]) -> None:
    url, key = server
    assert asyncio.run(_session(url, key, beat_every_s=TIMEOUT_S / 4, stay_s=TIMEOUT_S * 3)) is None
