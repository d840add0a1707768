"""The worker's outbox: the frames its message tasks send while the event loop runs one engine step's
consumers go to the server as one message (a list), each sender returns once that message is out, a
cancelled sender leaves the others (and the send) alone, and a failed send fails every sender. A
message's frames are posted (queued without waiting for the send): they join the same message, and after
a failed send the next post raises.

Over the real in-process link of ``tokentrail serve --model`` (``shared.local_link``); the engine is the
tiny model's hf engine, never started (the outbox does not touch it)."""

from __future__ import annotations

import asyncio
import contextlib
from pathlib import Path

from shared.local_link import LinkClosed, ServerEnd, worker_link
from shared.protocol import HeartbeatFrame
from worker.channels import LocalChannel
from worker.chat_format import ChatFormat
from worker.client import WorkerClient, WorkerOptions
from worker.engines.hf import HFEngine


def _client(model_dir: Path) -> tuple[WorkerClient, ServerEnd]:
    server, worker = worker_link()
    options = WorkerOptions(server_url="local", api_key="", model_name="tiny")
    client = WorkerClient(options, HFEngine(str(model_dir), max_batch_size=2), ChatFormat.load(str(model_dir)))
    client._channel = LocalChannel(worker)
    client._batching = True  # as after a welcome that lists FEATURE_BATCH
    return client, server


def test_one_steps_frames_go_as_one_message(tiny_model_dir: Path) -> None:
    async def run() -> None:
        client, server = _client(tiny_model_dir)
        senders = [asyncio.create_task(client._send(HeartbeatFrame())) for _ in range(5)]
        await asyncio.gather(*senders)
        got = await server.receive()
        assert isinstance(got, list) and len(got) == 5
        # the next step's frames are the next message
        await client._send(HeartbeatFrame())
        assert len(await server.receive()) == 1

    asyncio.run(run())


def test_a_cancelled_sender_leaves_the_others_and_the_send(tiny_model_dir: Path) -> None:
    async def run() -> None:
        client, server = _client(tiny_model_dir)
        senders = [asyncio.create_task(client._send(HeartbeatFrame())) for _ in range(3)]
        await asyncio.sleep(0)  # every sender has queued its frame and waits for the send
        senders[1].cancel()
        results = await asyncio.gather(*senders, return_exceptions=True)
        assert results[0] is None and results[2] is None
        assert isinstance(results[1], asyncio.CancelledError)
        assert len(await server.receive()) == 3  # its frame was queued before it was cancelled

    asyncio.run(run())


def test_a_failed_send_fails_every_sender(tiny_model_dir: Path) -> None:
    async def run() -> None:
        client, server = _client(tiny_model_dir)
        server.close(1011, "gone")
        senders = [asyncio.create_task(client._send(HeartbeatFrame())) for _ in range(3)]
        results = await asyncio.gather(*senders, return_exceptions=True)
        assert all(isinstance(r, LinkClosed) for r in results), results
        with contextlib.suppress(LinkClosed):
            await server.receive()

    asyncio.run(run())


def test_posts_join_the_steps_message_without_waiting(tiny_model_dir: Path) -> None:
    async def run() -> None:
        client, server = _client(tiny_model_dir)
        await client._post(HeartbeatFrame())  # returns at once: nothing is sent yet
        await client._post(HeartbeatFrame())
        sender = asyncio.create_task(client._send(HeartbeatFrame()))
        await sender  # the step's message: the two posts and the send
        assert len(await server.receive()) == 3
        await client._post(HeartbeatFrame())
        await client._sent()  # a drain waits for what was posted
        assert len(await server.receive()) == 1

    asyncio.run(run())


def test_a_post_after_a_failed_send_raises(tiny_model_dir: Path) -> None:
    async def run() -> None:
        client, server = _client(tiny_model_dir)
        server.close(1011, "gone")
        await client._post(HeartbeatFrame())  # queued; its send fails
        with contextlib.suppress(LinkClosed):
            await client._sent()
        try:
            await client._post(HeartbeatFrame())
        except ConnectionError:
            return
        raise AssertionError("a post on a failed channel did not raise")

    asyncio.run(run())
