"""The worker websocket: keys, protocol versions, API-key users, and recovery of a lost worker."""

from __future__ import annotations

import asyncio
import contextlib
import json
import threading
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import websockets
from typer.testing import CliRunner

from server.settings import ServerSettings
from server.workers.ingest import without_nul
from shared.protocol import FEATURE_UNSEEDED, PROTOCOL_VERSION
from tests.stack import MODEL, ServerThread, WorkerThread, worker_key
from tests.test_e2e_embedded import events, login, turn
from tokentrail.cli import app
from tokentrail.launcher import free_port
from worker.chat_format import ChatFormat
from worker.client import FatalWorkerError, WorkerClient, WorkerOptions, websocket_url
from worker.engines.contract import EngineInfo, GenerationParams, TokenStep
from worker.engines.hf import HFEngine


def hello(version: int = PROTOCOL_VERSION) -> str:
    return json.dumps(
        {
            "type": "hello",
            "protocol_version": version,
            "model_name": "x",
            "engine": "hf",
            "tokenizer_hash": "t",
            "template_hash": "t",
            "compat_hash": "c",
            "capacity": 1,
        }
    )


async def _handshake(url: str, key: str, frame: str) -> tuple[dict[str, Any], int | None]:
    async with websockets.connect(websocket_url(url), additional_headers={"Authorization": f"Bearer {key}"}) as ws:
        with contextlib.suppress(websockets.ConnectionClosed):  # a bad key is refused before the hello
            await ws.send(frame)
        reply = json.loads(await ws.recv())
        with contextlib.suppress(websockets.ConnectionClosed):
            await asyncio.wait_for(ws.recv(), timeout=5)  # the server closes after its error frame
        return reply, ws.close_code


def test_bad_worker_key_is_refused(embedded_stack: str) -> None:
    reply, close = asyncio.run(_handshake(embedded_stack, "tt_w_wrong", hello()))
    assert reply == {"type": "error", "code": "invalid_worker_key", "message": reply["message"]}
    assert close == 4401


def test_protocol_mismatch_is_refused(embedded_stack: str, embedded_settings: ServerSettings) -> None:
    reply, close = asyncio.run(_handshake(embedded_stack, worker_key(embedded_settings), hello(version=999)))
    assert reply["code"] == "protocol_version_mismatch"
    assert close == 4426


def test_worker_client_stops_on_a_refused_key(embedded_stack: str, tiny_model_dir: Path) -> None:
    fmt = ChatFormat.load(str(tiny_model_dir))
    client = WorkerClient(WorkerOptions(embedded_stack, "tt_w_wrong", MODEL), HFEngine(str(tiny_model_dir)), fmt)
    with pytest.raises(FatalWorkerError, match="invalid_worker_key"):
        asyncio.run(client.run_forever())


def test_api_key_user_from_the_cli(embedded_stack: str, embedded_settings: ServerSettings) -> None:
    result = CliRunner().invoke(app, ["admin", "create-user", "keyuser", "--data-dir", str(embedded_settings.data_dir)])
    assert result.exit_code == 0, result.output
    key = result.output.strip()
    assert key.startswith("tt_u_")
    headers = {"Authorization": f"Bearer {key}"}
    assert httpx.get(f"{embedded_stack}/auth/check", headers=headers).json() == "keyuser"
    chat_id = httpx.post(f"{embedded_stack}/chats", json={}, headers=headers).json()["id"]
    _, reply = turn(embedded_stack, headers, chat_id, None, "hello")
    assert events(embedded_stack, f"/chats/{chat_id}/messages/{reply['id']}/events", headers)[-1]["event_type"] == (
        "message"
    )


class SlowEngine:
    """The real hf engine, paced so that a test can lose the worker mid-stream."""

    def __init__(self, inner: HFEngine, delay_s: float) -> None:
        self.inner, self.delay_s = inner, delay_s
        self.info: EngineInfo = inner.info

    async def start(self) -> None:
        await self.inner.start()
        self.info = self.inner.info

    async def generate(
        self, request_id: str, prompt_ids: list[int], params: GenerationParams
    ) -> AsyncIterator[TokenStep]:
        async for step in self.inner.generate(request_id, prompt_ids, params):
            await asyncio.sleep(self.delay_s)
            yield step

    async def abort(self, request_id: str) -> None:
        await self.inner.abort(request_id)

    async def close(self) -> None:
        await self.inner.close()


@pytest.fixture()
def private_server(tmp_path: Path) -> Iterator[tuple[ServerThread, str]]:
    settings = ServerSettings(data_dir=tmp_path, port=free_port())
    server = ServerThread(settings).start()
    yield server, worker_key(settings)
    server.stop()


def test_lost_worker_is_resumed_by_another_in_one_stream(
    private_server: tuple[ServerThread, str], tiny_model_dir: Path
) -> None:
    server, key = private_server
    fmt = ChatFormat.load(str(tiny_model_dir))
    first = WorkerThread(server.url, key, MODEL, fmt, lambda: SlowEngine(HFEngine(str(tiny_model_dir)), 0.05)).start()
    headers = login(server.url, "resume")
    chat_id = httpx.post(f"{server.url}/chats", json={}, headers=headers).json()["id"]
    # ignore_eos: the 60 tokens run to their length (a sampled end token would end the reply early)
    _, reply = turn(server.url, headers, chat_id, None, "go on", max_new_tokens=60, stop_token_ids=[], ignore_eos=True)
    path = f"/chats/{chat_id}/messages/{reply['id']}/events"
    seen: list[dict[str, Any]] = []

    def read() -> None:
        events(server.url, path, headers, sink=seen)

    reader = threading.Thread(target=read)
    reader.start()
    deadline = 200
    while sum(e["event_type"] == "token" for e in seen) < 10 and deadline:
        threading.Event().wait(0.05)
        deadline -= 1
    first.stop()  # the worker goes away mid-stream
    streamed_before = sum(e["event_type"] == "token" for e in seen)
    assert 0 < streamed_before < 60
    second = WorkerThread(server.url, key, MODEL, fmt, lambda: HFEngine(str(tiny_model_dir))).start()
    try:
        reader.join(timeout=60)
        assert not reader.is_alive()
        tokens = [e for e in seen if e["event_type"] == "token"]
        assert seen[-1]["event_type"] == "message", seen[-3:]
        assert [e["index"] for e in tokens] == list(range(len(tokens)))  # one continuous stream
        stored = httpx.get(f"{server.url}{path[: -len('/events')]}?include=tokens", headers=headers).json()
        assert stored["state"] == "complete"
        assert stored["completion_token_ids"] == [e["token_id"] for e in tokens]
        assert len(tokens) == 60 and stored["finish_reason"] == "length"
        # The text readers got is the decode of those ids across the resume, a character the reply
        # stopped inside of included (U+FFFD). (Not compared with the parsed content: random weights
        # emit special tokens, which the parser splits content at.)
        streamed = "".join(e["text"] for e in tokens)
        full = fmt.tokenizer.decode(stored["completion_token_ids"], skip_special_tokens=True)
        full = without_nul(full)  # a generated NUL streams and is stored as U+FFFD (server/workers/ingest.py)
        assert streamed == full
    finally:
        second.stop()


def _record(ids: list[int], texts: list[str]) -> dict[str, Any]:
    ends = [sum(len(t) for t in texts[: i + 1]) for i in range(len(texts))]
    return {
        "prompt_ids": [1, 2, 3],
        "completion_ids": ids,
        "logprobs": [-0.5] * len(ids),
        "text_offsets": ends,
        "completion_text": "".join(texts),
        "content": "".join(texts),
        "finish_reason": "length",
        "engine": "hf",
        "tokenizer_hash": "t",
        "template_hash": "t",
    }


def test_a_batch_of_frames_from_one_engine_step_is_taken_in_order(
    embedded_stack: str, embedded_settings: ServerSettings
) -> None:
    """A worker that the server welcomes with the ``batch`` feature sends the frames of one engine step
    as one JSON array; tokens of several messages are appended at once, then their ends stored."""
    url, key = embedded_stack, worker_key(embedded_settings)
    headers = login(url, "batch-user")

    async def scenario() -> list[str]:
        hdrs = {"Authorization": f"Bearer {key}"}
        async with websockets.connect(websocket_url(url), additional_headers=hdrs) as ws:
            await ws.send(
                hello()
                .replace('"model_name": "x"', '"model_name": "raw-batch"')
                .replace('"capacity": 1', '"capacity": 2')
            )
            welcome = json.loads(await ws.recv())
            assert welcome["type"] == "welcome" and "batch" in welcome["features"]
            await ws.send(json.dumps({"type": "credit", "credits": 2}))
            ids = []
            async with httpx.AsyncClient(base_url=url, headers=headers) as http:
                for k in range(2):
                    chat = (await http.post("/chats", json={})).json()["id"]
                    body = {"parent_id": None, "content": f"q{k}"}
                    prompt = (await http.post(f"/chats/{chat}/prompter_message", json=body)).json()
                    body = {"parent_id": prompt["id"], "model_config_name": "raw-batch"}
                    reply = await http.post(f"/chats/{chat}/assistant_message", json=body)
                    assert reply.status_code == 200, reply.text
                    ids.append((chat, reply.json()["id"]))
            work = {}
            while len(work) < 2:
                frame = json.loads(await asyncio.wait_for(ws.recv(), timeout=10))
                if frame["type"] == "work":
                    work[frame["message_id"]] = frame["attempt"]
            (_, a), (_, b) = ids

            def tokens(mid: str, start: int, token_ids: list[int], texts: list[str]) -> dict[str, Any]:
                return {"type": "tokens", "message_id": mid, "attempt": work[mid], "start": start,
                        "token_ids": token_ids, "logprobs": [-0.5] * len(token_ids), "texts": texts}  # fmt: skip

            step = [
                tokens(a, 0, [5, 6], ["a", "b"]),
                tokens(b, 0, [7], ["c"]),
                {"type": "finished", "message_id": a, "attempt": work[a], "record": _record([5, 6], ["a", "b"])},
            ]
            await ws.send(json.dumps(step))
            await ws.send(json.dumps([tokens(b, 1, [8], ["d"])]))
            await ws.send(
                json.dumps(
                    {"type": "finished", "message_id": b, "attempt": work[b], "record": _record([7, 8], ["c", "d"])}
                )
            )
            out = []
            for chat, mid in ids:
                evs = await asyncio.to_thread(events, url, f"/chats/{chat}/messages/{mid}/events", headers)
                assert evs[-1]["event_type"] == "message", evs[-1]
                out.append(",".join(str(e["token_id"]) for e in evs if e["event_type"] == "token"))
            return out

    assert asyncio.run(scenario()) == ["5,6", "7,8"]


def test_consecutive_steps_of_a_message_queued_together_stream_as_one_batch_before_its_end(
    embedded_stack: str, embedded_settings: ServerSettings
) -> None:
    """Frames that queue while the hub stores earlier ones are stored together: a message's consecutive
    steps (here three in one array, as a backed-up socket delivers them) join into one batch and reach
    readers at once, before the message ends; none is taken for a gap and left to the finished record."""
    url, key = embedded_stack, worker_key(embedded_settings)
    headers = login(url, "joined-user")

    async def scenario() -> list[dict[str, Any]]:
        hdrs = {"Authorization": f"Bearer {key}"}
        async with websockets.connect(websocket_url(url), additional_headers=hdrs) as ws:
            await ws.send(hello().replace('"model_name": "x"', '"model_name": "raw-joined"'))
            assert json.loads(await ws.recv())["type"] == "welcome"
            await ws.send(json.dumps({"type": "credit", "credits": 1}))
            async with httpx.AsyncClient(base_url=url, headers=headers) as http:
                chat = (await http.post("/chats", json={})).json()["id"]
                prompt = await http.post(f"/chats/{chat}/prompter_message", json={"parent_id": None, "content": "q"})
                body = {"parent_id": prompt.json()["id"], "model_config_name": "raw-joined"}
                mid = (await http.post(f"/chats/{chat}/assistant_message", json=body)).json()["id"]
            frame = json.loads(await asyncio.wait_for(ws.recv(), timeout=10))
            while frame["type"] != "work":
                frame = json.loads(await asyncio.wait_for(ws.recv(), timeout=10))
            attempt = frame["attempt"]

            def tokens(start: int, token_ids: list[int], texts: list[str]) -> dict[str, Any]:
                return {"type": "tokens", "message_id": mid, "attempt": attempt, "start": start,
                        "token_ids": token_ids, "logprobs": [-0.5] * len(token_ids), "texts": texts}  # fmt: skip

            seen: list[dict[str, Any]] = []
            reader = asyncio.create_task(
                asyncio.to_thread(events, url, f"/chats/{chat}/messages/{mid}/events", headers, None, seen)
            )
            await ws.send(json.dumps([tokens(0, [5, 6], ["a", "b"]), tokens(2, [7], ["c"]), tokens(3, [8], ["d"])]))
            for _ in range(100):  # the tokens stream before the message ends
                if sum(e["event_type"] == "token" for e in seen) == 4:
                    break
                await asyncio.sleep(0.05)
            streamed_before_end = [e["token_id"] for e in seen if e["event_type"] == "token"]
            assert streamed_before_end == [5, 6, 7, 8], seen
            finished = {"type": "finished", "message_id": mid, "attempt": attempt}
            await ws.send(json.dumps({**finished, "record": _record([5, 6, 7, 8], ["a", "b", "c", "d"])}))
            return await asyncio.wait_for(reader, timeout=30)

    evs = asyncio.run(scenario())
    assert evs[-1]["event_type"] == "message" and evs[-1]["message"]["content"] == "abcd", evs[-1]
    assert [e["token_id"] for e in evs if e["event_type"] == "token"] == [5, 6, 7, 8]


def test_work_that_ended_just_before_a_lost_connection_is_named_to_the_next_server(
    tiny_model_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A finished record sent moments before the server died may never have been stored: the worker
    names that message in its next hello (the server requeues it only if that attempt is still
    current), so it is not left to the reaper's idle timeout. Older work is not named."""
    fmt = ChatFormat.load(str(tiny_model_dir))
    client = WorkerClient(WorkerOptions("http://127.0.0.1:9", "k", MODEL), HFEngine(str(tiny_model_dir)), fmt)
    now = [1000.0]
    monkeypatch.setattr("worker.client.time.monotonic", lambda: now[0])
    client._ended("long-ago", 2)
    now[0] += 30
    client._ended("just-now", 3)
    asyncio.run(client._abort_all())
    assert client.hello().released == [("just-now", 3)]


def test_the_worker_says_it_takes_work_without_a_seed(tiny_model_dir: Path) -> None:
    """``unseeded`` in hello: the server may send ``seed: null`` (the client asked for no seed), which
    an older worker, which does not say it, would refuse."""
    fmt = ChatFormat.load(str(tiny_model_dir))
    client = WorkerClient(WorkerOptions("http://127.0.0.1:9", "k", MODEL), HFEngine(str(tiny_model_dir)), fmt)
    assert FEATURE_UNSEEDED == "unseeded" and FEATURE_UNSEEDED in client.hello().features


def test_ended_work_is_remembered_within_the_window_and_bounded_after(
    tiny_model_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    fmt = ChatFormat.load(str(tiny_model_dir))
    client = WorkerClient(WorkerOptions("http://127.0.0.1:9", "k", MODEL), HFEngine(str(tiny_model_dir)), fmt)
    now = [1000.0]
    monkeypatch.setattr("worker.client.time.monotonic", lambda: now[0])
    for i in range(400):  # all within the window: all kept
        client._ended(f"m{i}", 1)
    assert len(client._recent) == 400
    now[0] += 30
    client._ended("m7", 2)  # ended again: now the newest
    client._ended("late", 1)
    assert len(client._recent) <= 256 and list(client._recent)[-2:] == ["m7", "late"]
    asyncio.run(client._abort_all())
    assert client.hello().released == [("m7", 2), ("late", 1)]


def test_tokens_only_in_the_finished_record_stream_as_the_stored_reasoning_and_content(
    embedded_stack: str, embedded_settings: ServerSettings
) -> None:
    """Tokens the worker never sent as frames (their frames were lost, e.g. with a Redis restart) are
    streamed from the finished record, which keeps no per-token channels: an OpenAI stream still splits
    them as stored (reasoning apart from content), never streaming the reasoning block as content."""
    from server.admin import issue_user_key

    url, key = embedded_stack, worker_key(embedded_settings)
    user_key = issue_user_key(embedded_settings, "tail-user")
    texts = ["<think>", "\nhmm", "\n", "</think>", "\n\nhello"]
    record = {
        **_record([5, 6, 7, 8, 9], texts),
        "content": "hello",
        "reasoning_content": "hmm",
        "finish_reason": "stop",
    }

    async def scenario() -> tuple[str, str]:
        hdrs = {"Authorization": f"Bearer {key}"}
        async with websockets.connect(websocket_url(url), additional_headers=hdrs) as ws:
            await ws.send(hello().replace('"model_name": "x"', '"model_name": "raw-tail"'))
            assert json.loads(await ws.recv())["type"] == "welcome"
            await ws.send(json.dumps({"type": "credit", "credits": 1}))
            body = {"model": "raw-tail", "messages": [{"role": "user", "content": "q"}], "stream": True}
            content, reasoning = [], []
            auth = {"Authorization": f"Bearer {user_key}"}
            async with (
                httpx.AsyncClient(base_url=url, headers=auth) as http,
                http.stream("POST", "/v1/chat/completions", json=body, timeout=30) as resp,
            ):
                assert resp.status_code == 200
                frame = json.loads(await asyncio.wait_for(ws.recv(), timeout=10))
                assert frame["type"] == "work"
                finished = {"type": "finished", "message_id": frame["message_id"], "attempt": frame["attempt"]}
                await ws.send(json.dumps({**finished, "record": record}))  # no tokens frames at all
                async for line in resp.aiter_lines():
                    if line.startswith("data: ") and line != "data: [DONE]":
                        for choice in json.loads(line[6:]).get("choices") or []:
                            delta = choice.get("delta") or {}
                            content.append(delta.get("content") or "")
                            reasoning.append(delta.get("reasoning_content") or "")
            return "".join(content), "".join(reasoning)

    assert asyncio.run(scenario()) == ("hello", "hmm")
