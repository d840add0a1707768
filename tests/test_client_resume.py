"""The REPL's client across a real network drop: a TCP proxy between it and the server closes every
connection mid-stream; ``ChatClient.follow`` reconnects with Last-Event-ID and yields each token
once, equal to what SQL stores."""

from __future__ import annotations

import asyncio
import contextlib
import threading
from collections.abc import Iterator

import pytest

from tests.stack import MODEL
from text_client.client import ChatClient
from tokentrail.launcher import free_port


class DroppingProxy:
    """Forwards 127.0.0.1:<port> to ``target``; ``drop()`` closes every open connection."""

    def __init__(self, target_port: int) -> None:
        self.port, self.target_port = free_port(), target_port
        self.loop = asyncio.new_event_loop()
        self.writers: set[asyncio.StreamWriter] = set()
        self.drops = 0
        ready = threading.Event()
        self.thread = threading.Thread(target=self._run, args=(ready,), daemon=True)
        self.thread.start()
        assert ready.wait(10)

    def _run(self, ready: threading.Event) -> None:
        asyncio.set_event_loop(self.loop)
        server = self.loop.run_until_complete(asyncio.start_server(self._client, "127.0.0.1", self.port))
        ready.set()
        try:
            self.loop.run_forever()
        finally:
            server.close()

    async def _client(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        up_reader, up_writer = await asyncio.open_connection("127.0.0.1", self.target_port)
        self.writers |= {writer, up_writer}

        async def pipe(src: asyncio.StreamReader, dst: asyncio.StreamWriter) -> None:
            with contextlib.suppress(Exception):
                while data := await src.read(65536):
                    dst.write(data)
                    await dst.drain()
            dst.close()

        await asyncio.gather(pipe(reader, up_writer), pipe(up_reader, writer))
        self.writers -= {writer, up_writer}

    def drop(self) -> None:
        """Returns once the connections are closed (the client may still read what it had buffered)."""
        done = threading.Event()

        def close_all() -> None:
            for w in list(self.writers):
                w.transport.abort()  # an RST, as when a link or a load balancer goes away
            self.drops += 1
            done.set()

        self.loop.call_soon_threadsafe(close_all)
        assert done.wait(10)

    def stop(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(timeout=10)


@pytest.fixture
def proxy(embedded_stack: str) -> Iterator[DroppingProxy]:
    p = DroppingProxy(int(embedded_stack.rsplit(":", 1)[1]))
    yield p
    p.stop()


def test_follow_resumes_after_the_connection_is_cut(proxy: DroppingProxy, embedded_stack: str) -> None:
    client = ChatClient(f"http://127.0.0.1:{proxy.port}")
    client.login_debug("resume-client")
    chat = client.create_chat()
    prompt = client.prompter_message(chat["id"], None, "go on")
    reply = client.assistant_message(chat["id"], prompt["id"], MODEL, {"max_new_tokens": 300, "ignore_eos": True})
    opened: list[int | None] = []  # the Last-Event-ID of each connection the client opens
    events = client.events
    client.events = lambda c, m, last=None: (opened.append(last), events(c, m, last))[1]  # type: ignore[method-assign]
    seen: dict[int, int] = {}
    duplicates = 0
    final = None
    for event in client.follow(chat["id"], reply["id"]):
        if event["event_type"] == "token":
            duplicates += event["index"] in seen
            seen[event["index"]] = event["token_id"]
            if len(seen) in (20, 120):
                proxy.drop()
        elif event["event_type"] == "reset":
            seen = {i: t for i, t in seen.items() if i < event["from_index"]}
        else:
            final = event
    assert proxy.drops == 2 and len(opened) >= 2 and opened[0] is None and opened[1] is not None, opened
    assert final is not None and final["event_type"] == "message", final
    assert duplicates == 0 and sorted(seen) == list(range(300))
    stored = client.message(chat["id"], reply["id"], tokens=True)
    assert [seen[i] for i in range(300)] == stored["completion_token_ids"]
    client.close()
