"""Real servers and workers for end-to-end tests.

``ServerThread`` runs the real app under uvicorn on a free loopback port (real HTTP, SSE and
websockets), optionally with an in-process worker; ``WorkerThread`` runs a real worker client (its own
event loop) against it.
Multi-process tests start ``python -m tokentrail`` children with ``tokentrail.launcher.spawn``.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import uvicorn

from server.app import create_app
from server.settings import ServerSettings
from server.workers.links import LocalWorker
from shared.protocol import PROTOCOL_VERSION, HelloFrame
from tokentrail.launcher import free_port
from worker.chat_format import ChatFormat
from worker.client import WorkerClient, WorkerOptions
from worker.engines.contract import Engine

MODEL = "tiny"


def worker_key(settings: ServerSettings) -> str:
    """A new worker key in the settings' database (migrated first if needed)."""
    from server.admin import issue_worker_key

    return issue_worker_key(settings, "test")


def wait_for(predicate: Callable[[], bool], timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            if predicate():
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.05)
    raise TimeoutError(f"{what} not ready after {timeout_s}s")


class ServerThread:
    """The app under uvicorn in a thread; ``local_worker``: a worker in its process (``tokentrail serve
    --model``), started by the app's lifespan (``start`` returns once it serves)."""

    def __init__(self, settings: ServerSettings, local_worker: LocalWorker | None = None) -> None:
        self.settings = settings
        self.port = settings.port
        self.url = f"http://127.0.0.1:{self.port}"
        app = create_app(settings, local_worker)
        config = uvicorn.Config(app, host="127.0.0.1", port=self.port, log_level="warning")
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(target=self.server.run, daemon=True)

    def start(self) -> ServerThread:
        self.thread.start()
        wait_for(lambda: httpx.get(f"{self.url}/health").status_code == 200, 60, "server")
        return self

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=15)


class WorkerThread:
    """A worker client with its own event loop in a thread; ``engine_factory`` builds its engine."""

    def __init__(
        self,
        server_url: str,
        api_key: str,
        model_name: str,
        fmt: ChatFormat,
        engine_factory: Callable[[], Engine],
        max_parallel: int = 4,
    ) -> None:
        self.options = WorkerOptions(server_url, api_key, model_name, max_parallel=max_parallel)
        self.fmt = fmt
        self.engine_factory = engine_factory
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.client: WorkerClient | None = None
        self._main: asyncio.Task[Any] | None = None
        self.error: BaseException | None = None

    def _run(self) -> None:
        asyncio.set_event_loop(self.loop)

        async def main() -> None:
            engine = self.engine_factory()
            await engine.start()
            self.client = WorkerClient(self.options, engine, self.fmt)
            try:
                await self.client.run_forever()
            finally:
                await engine.close()

        self._main = self.loop.create_task(main())
        try:
            self.loop.run_until_complete(self._main)
        except asyncio.CancelledError:
            pass
        except BaseException as exc:  # surfaced to the test through .error
            self.error = exc
        finally:
            self.loop.close()

    def start(self, server_url: str | None = None, model: str | None = None) -> WorkerThread:
        self.thread.start()
        url = server_url or self.options.server_url
        name = model or self.options.model_name

        def offered() -> bool:
            if self.error:
                raise RuntimeError(f"worker died: {self.error!r}")
            resp = httpx.get(f"{url}/configs/model_configs")  # 503 while Redis restarts
            return resp.status_code == 200 and any(m["name"] == name for m in resp.json())

        wait_for(offered, 60, "worker")
        return self

    def stop(self) -> None:
        if self._main is not None and not self.loop.is_closed():
            self.loop.call_soon_threadsafe(self._main.cancel)
        self.thread.join(timeout=15)


def start_reply(url: str, headers: dict[str, str], model: str, tokens: int, text: str = "go on") -> tuple[str, str]:
    """A new chat with one prompter message and an assistant reply of exactly ``tokens`` tokens
    (ignore_eos) requested; returns (chat id, assistant message id)."""
    chat = httpx.post(f"{url}/chats", json={}, headers=headers).json()["id"]
    prompt = httpx.post(
        f"{url}/chats/{chat}/prompter_message", json={"parent_id": None, "content": text}, headers=headers
    ).json()["id"]
    reply = httpx.post(
        f"{url}/chats/{chat}/assistant_message",
        json={
            "parent_id": prompt,
            "model_config_name": model,
            "sampling_parameters": {"max_new_tokens": tokens, "ignore_eos": True},
        },
        headers=headers,
    )
    assert reply.status_code == 200, reply.text
    return chat, reply.json()["id"]


def fake_hello(model: str, *, engine: str = "none", capacity: int = 1, vocab_size: int | None = None) -> HelloFrame:
    """The hello of a protocol-level test peer (no tokenizer, no engine)."""
    return HelloFrame(
        protocol_version=PROTOCOL_VERSION,
        model_name=model,
        engine=engine,
        tokenizer_hash="t",
        template_hash="t",
        compat_hash="c",
        capacity=capacity,
        vocab_size=vocab_size,
    )


@contextlib.contextmanager
def hf_stack(
    data_dir: Path, model_dir: str | Path, model: str = MODEL, max_batch_size: int = 16, **settings_: Any
) -> Iterator[tuple[str, ServerSettings]]:
    """A server (thread; embedded defaults unless ``settings_`` say otherwise) with one hf worker
    (thread) offering ``model_dir`` as ``model``; yields the server URL and its settings."""
    from worker.engines.hf import HFEngine

    settings = ServerSettings(data_dir=data_dir, port=free_port(), **settings_)
    server = ServerThread(settings).start()
    fmt = ChatFormat.load(str(model_dir))
    engine = lambda: HFEngine(str(model_dir), max_batch_size=max_batch_size)  # noqa: E731
    worker = WorkerThread(server.url, worker_key(settings), model, fmt, engine)
    try:
        worker.start()
        yield server.url, settings
    finally:
        worker.stop()
        server.stop()


@contextlib.contextmanager
def serving(data_dir: Path, model: str, model_dir: str) -> Iterator[str]:
    """``hf_stack``'s URL alone."""
    with hf_stack(data_dir, model_dir, model) as (url, _):
        yield url
