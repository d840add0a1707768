"""A worker that lies: token ids outside the vocabulary it announced, non-finite logprobs, a finished
record that differs from what it streamed. Each bad frame ends that attempt only; the message is
retried (here on the same connection, which behaves on the second attempt), readers never see a bad
token, and the stored tokens equal the streamed ones. Other work on the connection is untouched.

The worker is a real websocket peer written for this test (no engine): it answers work frames with
frames the test chooses, by the prompter message's text.
"""

from __future__ import annotations

import asyncio
import json
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import websockets

from server.settings import ServerSettings
from shared.protocol import GenerationRecord, WorkFrame
from tests.stack import ServerThread, fake_hello, start_reply, worker_key
from tests.test_e2e_embedded import events, login
from tokentrail.launcher import free_port

MODEL = "hostile"
VOCAB = 100


def good_record(ids: list[int], lps: list[float | None], texts: list[str]) -> GenerationRecord:
    offsets, end = [], 0
    for t in texts:
        end += len(t)
        offsets.append(end)
    return GenerationRecord(
        prompt_ids=[1, 2, 3],
        completion_ids=ids,
        logprobs=lps,
        text_offsets=offsets,
        completion_text="".join(texts),
        content="".join(texts),
        finish_reason="length",
        engine="hostile",
        tokenizer_hash="t",
        template_hash="t",
    )


class HostileWorker:
    def __init__(self, url: str, key: str) -> None:
        self.url = url.replace("http://", "ws://") + "/workers/work"
        self.key = key
        self.cancels: list[dict[str, Any]] = []
        self.loop = asyncio.new_event_loop()
        self.ready = threading.Event()
        self.thread = threading.Thread(target=self.loop.run_until_complete, args=(self._run(),), daemon=True)
        self.task: asyncio.Task[None] | None = None
        self.tasks: set[asyncio.Task[None]] = set()

    async def _run(self) -> None:
        self.task = asyncio.current_task()
        hello = fake_hello(MODEL, engine="hostile", capacity=8, vocab_size=VOCAB)
        try:
            async with websockets.connect(self.url, additional_headers={"Authorization": f"Bearer {self.key}"}) as ws:
                await ws.send(hello.model_dump_json())
                await ws.recv()
                await ws.send(json.dumps({"type": "credit", "credits": 8}))
                self.ready.set()
                async for raw in ws:
                    frame = json.loads(raw)
                    if frame["type"] == "cancel":
                        self.cancels.append(frame)
                    elif frame["type"] == "work":
                        task = asyncio.create_task(self._work(ws, WorkFrame.model_validate(frame)))
                        self.tasks.add(task)
                        task.add_done_callback(self.tasks.discard)
        except asyncio.CancelledError:
            pass

    async def _work(self, ws: Any, work: WorkFrame) -> None:
        kind = work.messages[-1].content
        mid, attempt = work.message_id, work.attempt
        resumed = work.resume.token_ids if work.resume else []
        ids, lps = list(resumed), list(work.resume.logprobs) if work.resume else []
        texts = list(work.resume.texts) if work.resume else []

        async def tokens(start: int, new_ids: list[int], new_lps: list[Any]) -> None:
            frame = {
                "type": "tokens",
                "message_id": mid,
                "attempt": attempt,
                "start": start,
                "token_ids": new_ids,
                "logprobs": new_lps,
                "texts": [f"<{t}>" for t in new_ids],
            }
            await ws.send(json.dumps(frame))  # NaN goes out as the bare NaN that json writes
            await asyncio.sleep(0.05)

        if kind == "always-fails":  # every attempt fails, retryably: the message must give up
            failed = {"type": "failed", "message_id": mid, "attempt": attempt, "code": "engine_error",
                      "message": "the engine fell over", "retryable": True}  # fmt: skip
            await ws.send(json.dumps(failed))
            await ws.send(json.dumps({"type": "credit", "credits": 1}))
            return
        if kind == "nul":  # a model may generate NUL characters (the 0x00 byte token)
            await tokens(0, [9], [-0.5])  # texts "<9>"; the record's text carries the NUL
            rec = good_record([9], [-0.5], ["<\x00>"])
            await ws.send(
                json.dumps({"type": "finished", "message_id": mid, "attempt": attempt, "record": rec.model_dump()})
            )
            await ws.send(json.dumps({"type": "credit", "credits": 1}))
            return
        if attempt == 1 and kind != "good":
            if kind == "mismatch":
                await tokens(0, [10, 11, 12], [-0.1, -0.2, -0.3])
                lie = good_record([70, 71, 72], [-0.1, -0.2, -0.3], ["<70>", "<71>", "<72>"])
                await ws.send(
                    json.dumps({"type": "finished", "message_id": mid, "attempt": attempt, "record": lie.model_dump()})
                )
            else:
                await tokens(0, [5], [-0.5])
                bad = {
                    "oov": ([10**9], [-0.1]),
                    "negative": ([-7], [-0.1]),
                    "nan": ([6], [float("nan")]),
                    "positive": ([6], [3.0]),
                }
                await tokens(1, *bad[kind])
                await asyncio.sleep(0.5)  # a stale finish after the cancel is dropped, not stored
                rec = good_record([5, 6], [-0.5, -0.1], ["<5>", "<6>"])
                await ws.send(
                    json.dumps({"type": "finished", "message_id": mid, "attempt": attempt, "record": rec.model_dump()})
                )
            await ws.send(json.dumps({"type": "credit", "credits": 1}))
            return
        new = [20 + len(ids), 21 + len(ids)]
        await tokens(len(ids), new, [-0.25, -0.75])
        ids += new
        lps += [-0.25, -0.75]
        texts += [f"<{t}>" for t in new]
        rec = good_record(ids, lps, texts)
        await ws.send(
            json.dumps({"type": "finished", "message_id": mid, "attempt": attempt, "record": rec.model_dump()})
        )
        await ws.send(json.dumps({"type": "credit", "credits": 1}))

    def start(self) -> HostileWorker:
        self.thread.start()
        assert self.ready.wait(30)
        return self

    def stop(self) -> None:
        if self.task is not None:
            self.loop.call_soon_threadsafe(self.task.cancel)
        self.thread.join(timeout=10)


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, HostileWorker]]:
    settings = ServerSettings(data_dir=Path(tmp_path_factory.mktemp("hostile")), port=free_port())
    server = ServerThread(settings).start()
    worker = HostileWorker(server.url, worker_key(settings)).start()
    yield server.url, worker
    worker.stop()
    server.stop()


@pytest.mark.parametrize("kind", ["oov", "negative", "nan", "positive", "mismatch"])
def test_a_bad_frame_ends_only_its_attempt(stack: tuple[str, HostileWorker], kind: str) -> None:
    url, worker = stack
    headers = login(url, f"victim-{kind}")
    replies = {}
    for text in (kind, "good"):  # the good message shares the connection with the bad one
        replies[text] = start_reply(url, headers, MODEL, 8, text=text)
    for text, (chat, mid) in replies.items():
        seen = events(url, f"/chats/{chat}/messages/{mid}/events", headers)
        streamed = [e["token_id"] for e in seen if e["event_type"] == "token"]
        assert seen[-1]["event_type"] == "message", seen[-1]
        stored = httpx.get(f"{url}/chats/{chat}/messages/{mid}", params={"include": "tokens"}, headers=headers).json()
        assert stored["state"] == "complete", stored
        assert stored["completion_token_ids"] == streamed, (text, streamed, stored["completion_token_ids"])
        assert all(0 <= t < VOCAB for t in streamed)
        assert all(lp is not None and lp <= 0 for lp in stored["logprobs"])
        if text == "good":
            assert stored["completion_token_ids"] == [20, 21]
        elif kind == "mismatch":  # what readers saw is kept; the retry continues after it
            assert stored["completion_token_ids"] == [10, 11, 12, 23, 24]
        else:
            assert stored["completion_token_ids"] == [5, 21, 22]
    bad_mid = replies[kind][1]
    assert any(c["message_id"] == bad_mid and c["attempt"] == 1 for c in worker.cancels)


def test_a_message_that_always_fails_gives_up_after_max_attempts(stack: tuple[str, HostileWorker]) -> None:
    url, _ = stack
    headers = login(url, "always-fails")
    chat, mid = start_reply(url, headers, MODEL, 8, text="always-fails")
    final = events(url, f"/chats/{chat}/messages/{mid}/events", headers)[-1]
    assert final["event_type"] == "error" and final["code"] == "too_many_attempts", final
    msg = httpx.get(f"{url}/chats/{chat}/messages/{mid}", headers=headers).json()
    assert msg["state"] == "aborted_by_worker" and msg["error_code"] == "too_many_attempts"
    assert "after 3 failed attempts" in msg["error"]  # max_attempts (3) failures, then no fourth


def test_requeues_that_are_not_the_workers_fault_do_not_count(stack: tuple[str, HostileWorker]) -> None:
    """A worker that comes back after its server died names the work it lost (``released``); that
    requeue is the infrastructure's doing. Five in a row, and the message still completes."""
    url, hostile = stack
    ws_url = url.replace("http://", "ws://") + "/workers/work"
    headers = login(url, "released")
    model = "released-model"

    async def connect(released: list[tuple[str, int]]) -> Any:
        hello = fake_hello(model, capacity=1, vocab_size=VOCAB).model_copy(update={"released": released})
        ws = await websockets.connect(ws_url, additional_headers={"Authorization": f"Bearer {hostile.key}"})
        await ws.send(hello.model_dump_json())
        await ws.recv()  # welcome
        await ws.send(json.dumps({"type": "credit", "credits": 1}))
        return ws

    async def work_frame(ws: Any) -> dict[str, Any]:
        while True:
            frame = json.loads(await ws.recv())
            if frame["type"] == "work":
                return dict(frame)

    async def scenario() -> tuple[str, str]:
        held = [await connect([])]
        chat, mid = await asyncio.to_thread(start_reply, url, headers, model, 4, "good")
        attempt = (await work_frame(held[0]))["attempt"]
        for _ in range(5):  # each connection keeps its socket: as far as this server knows, none failed
            held.append(await connect([(mid, attempt)]))
            attempt = (await work_frame(held[-1]))["attempt"]
        ws = held[-1]
        rec = good_record([7, 8], [-0.5, -0.5], ["<7>", "<8>"])
        tokens = {"type": "tokens", "message_id": mid, "attempt": attempt, "start": 0, "token_ids": [7, 8],
                  "logprobs": [-0.5, -0.5], "texts": ["<7>", "<8>"]}  # fmt: skip
        await ws.send(json.dumps(tokens))
        await ws.send(
            json.dumps({"type": "finished", "message_id": mid, "attempt": attempt, "record": rec.model_dump()})
        )
        final = await asyncio.to_thread(events, url, f"/chats/{chat}/messages/{mid}/events", headers)
        assert final[-1]["event_type"] == "message", final[-1]
        for conn in held:
            await conn.close()
        return chat, mid

    chat, mid = asyncio.run(scenario())
    msg = httpx.get(f"{url}/chats/{chat}/messages/{mid}", headers=headers).json()
    assert msg["state"] == "complete" and msg["attempt"] == 6, msg


def test_generated_nul_characters_are_stored_as_replacement_characters(stack: tuple[str, HostileWorker]) -> None:
    """PostgreSQL text cannot hold U+0000: a generated one is stored (and replayed) as U+FFFD, same
    length so text offsets hold; the token ids are exact."""
    url, _ = stack
    headers = login(url, "nul")
    chat, mid = start_reply(url, headers, MODEL, 8, text="nul")
    final = events(url, f"/chats/{chat}/messages/{mid}/events", headers)[-1]
    assert final["event_type"] == "message", final
    stored = httpx.get(f"{url}/chats/{chat}/messages/{mid}", params={"include": "tokens"}, headers=headers).json()
    assert stored["content"] == "<\ufffd>" and stored["completion_token_ids"] == [9]
