"""Shared fixtures for the test suite.

Services (session-scoped, see ``tests/services.py`` for how each is found or started):
- ``redis_url``: a Redis database of this session's own, flushed at start and end.
- ``postgres_url``: a fresh PostgreSQL database (``postgresql+asyncpg://``), dropped at the end.
A test that requests one is skipped, with the reason, where the service is unavailable.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, ExitStack
from pathlib import Path

import pytest

from tests import services


def _enter_or_skip(stack: ExitStack, service: AbstractContextManager[str]) -> str:
    try:
        return stack.enter_context(service)
    except services.ServiceUnavailable as exc:
        pytest.skip(str(exc))


@pytest.fixture(scope="session")
def redis_url() -> Iterator[str]:
    with ExitStack() as stack:
        yield _enter_or_skip(stack, services.redis_service())


@pytest.fixture(scope="session")
def postgres_url() -> Iterator[str]:
    with ExitStack() as stack:
        yield _enter_or_skip(stack, services.postgres_service())


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny chatml model with random weights, built once per test session (seconds, offline).
    Plumbing tests use it; tests that need reasoning, tool calls or closers use ``trained_model``."""
    from worker.tiny import build_tiny_model

    return build_tiny_model(tmp_path_factory.mktemp("tiny-chatml"), train=False)


@pytest.fixture(scope="session")
def trained_model() -> Callable[[str], Path]:
    """``trained_model(template)``: the briefly trained tiny model of that template, from the shared
    cache (``TOKENTRAIL_CACHE_DIR`` or ~/.cache/tokentrail): built once per machine, then reused."""
    from worker.tiny import resolve_model

    return lambda template: Path(resolve_model(f"tiny-{template}"))


@pytest.fixture(scope="session")
def embedded_stack(tmp_path_factory: pytest.TempPathFactory, tiny_model_dir: Path) -> Iterator[str]:
    """A server on embedded defaults (SQLite, in-process queue) in a thread, with one real worker
    (hf engine, tiny model) connected over the websocket. Yields the server URL; the settings
    (for direct database access) are ``embedded_settings``."""
    from server.settings import ServerSettings
    from tests.stack import MODEL, ServerThread, WorkerThread, worker_key
    from tokentrail.launcher import free_port
    from worker.chat_format import ChatFormat
    from worker.engines.hf import HFEngine

    settings = ServerSettings(data_dir=tmp_path_factory.mktemp("data"), port=free_port())
    _SETTINGS["embedded"] = settings
    server = ServerThread(settings).start()
    fmt = ChatFormat.load(str(tiny_model_dir))
    worker = WorkerThread(
        server.url, worker_key(settings), MODEL, fmt, lambda: HFEngine(str(tiny_model_dir), max_batch_size=8)
    ).start()
    yield server.url
    worker.stop()
    server.stop()


_SETTINGS: dict[str, object] = {}


@pytest.fixture(scope="session")
def embedded_settings(embedded_stack: str) -> object:
    return _SETTINGS["embedded"]


@pytest.fixture
def private_redis() -> Iterator[services.RestartableRedis]:
    """A redis-server of the test's own (no persistence) that it may SIGKILL and start again."""
    try:
        proc = services.RestartableRedis().start()
    except services.ServiceUnavailable as exc:
        pytest.skip(str(exc))
    yield proc
    proc.stop()
