"""SQLite statements run in the event loop's thread (no aiosqlite worker thread).

aiosqlite hands every statement to a thread of its own and back: two thread switches per statement,
and on a busy machine the event loop's thread loses the GIL to that thread at each hand-off. A SQLite
statement of this service takes tens of microseconds, far less than those hops, so the connection
runs it at once in the caller's thread instead. SQLAlchemy's aiosqlite dialect is used unchanged:
``InlineConnection`` is an aiosqlite connection whose work queue runs each job immediately.
"""

from __future__ import annotations

import asyncio
import sqlite3
from collections.abc import Callable, Generator
from typing import Any

import aiosqlite


class _RunNow:
    """Stands in for aiosqlite's queue to its worker thread: runs each job when it is put."""

    def put_nowait(self, item: tuple[asyncio.Future[Any] | None, Callable[[], Any]]) -> None:
        future, function = item
        try:
            result = function()
        except BaseException as exc:
            if future is not None and not future.done():
                future.set_exception(exc)
            return
        if future is not None and not future.done():
            future.set_result(result)


class InlineConnection(aiosqlite.Connection):
    def __init__(self, connector: Callable[[], sqlite3.Connection]) -> None:
        super().__init__(connector, iter_chunk_size=64)
        self._tx = _RunNow()  # type: ignore[assignment]

    async def _execute(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        if not self._running or not self._connection:
            raise ValueError("Connection closed")
        return fn(*args, **kwargs)

    def __await__(self) -> Generator[Any, None, InlineConnection]:
        return self._connect().__await__()  # no worker thread to start

    async def _connect(self) -> InlineConnection:
        if self._connection is None:
            self._connection = self._connector()
        return self


def inline_connector(path: str, timeout_s: float) -> Callable[[], InlineConnection]:
    """An ``async_creator`` for SQLAlchemy: a new inline connection to the database file ``path``."""

    def create() -> InlineConnection:
        return InlineConnection(lambda: sqlite3.connect(path, timeout=timeout_s, check_same_thread=False))

    return create
