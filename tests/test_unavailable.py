"""``server.outages``: which errors mean "a backing service is unavailable" (503, retried) and which
are bugs (500). The driver errors are the real classes, built as the drivers raise them; the
PostgreSQL ones a server really sends are in tests/test_database_outage.py."""

from __future__ import annotations

import asyncpg  # type: ignore[import-untyped]
import pytest
import redis.exceptions
from sqlalchemy.exc import DBAPIError, IntegrityError, ProgrammingError
from sqlalchemy.exc import TimeoutError as PoolTimeout

from server.errors import ApiError
from server.outages import is_database_unavailable, is_unavailable
from shared.errors import ErrorCode


def _wrapped(orig: Exception, *, invalidated: bool = False) -> DBAPIError:
    """As SQLAlchemy raises a driver error: wrapped, the driver's error as ``orig`` and cause."""
    try:
        raise DBAPIError("SELECT 1", None, orig, connection_invalidated=invalidated) from orig
    except DBAPIError as exc:
        return exc


@pytest.mark.parametrize(
    "exc",
    [
        ConnectionRefusedError(111, "Connect call failed"),
        ConnectionResetError(104, "reset by peer"),
        TimeoutError("connect timed out"),
        asyncpg.exceptions.CannotConnectNowError("the database system is starting up"),
        asyncpg.exceptions.AdminShutdownError("terminating connection due to administrator command"),
        asyncpg.exceptions.TooManyConnectionsError("sorry, too many clients already"),
        asyncpg.exceptions.ConnectionDoesNotExistError("connection was closed in the middle of operation"),
        _wrapped(asyncpg.exceptions.CannotConnectNowError("the database system is not yet accepting connections")),
        _wrapped(Exception("connection is closed"), invalidated=True),
        PoolTimeout("QueuePool limit of size 10 overflow 20 reached"),
    ],
    ids=lambda e: type(e).__name__,
)
def test_database_faults_are_unavailable(exc: Exception) -> None:
    assert is_database_unavailable(exc) and is_unavailable(exc)


@pytest.mark.parametrize(
    "exc",
    [
        ValueError("a bug"),
        FileNotFoundError("no such file"),
        ProgrammingError("SELECT nonsense", None, Exception("syntax error")),
        IntegrityError("INSERT", None, Exception("duplicate key")),
        _wrapped(asyncpg.exceptions.UniqueViolationError("duplicate key value")),
        _wrapped(asyncpg.exceptions.QueryCanceledError("canceling statement due to statement timeout")),
    ],
    ids=lambda e: type(e).__name__,
)
def test_bugs_and_bad_queries_are_not(exc: Exception) -> None:
    assert not is_unavailable(exc)


def test_a_bug_raised_while_handling_an_outage_is_a_bug() -> None:
    try:
        try:
            raise ConnectionRefusedError(111, "refused")
        except ConnectionRefusedError:
            raise KeyError("a bug in the handler") from None
    except KeyError as exc:
        assert not is_unavailable(exc)


def test_redis_faults_are_unavailable() -> None:
    assert is_unavailable(redis.exceptions.ConnectionError("Error 111 connecting"))
    assert is_unavailable(redis.exceptions.BusyLoadingError("Redis is loading the dataset in memory"))
    assert not is_unavailable(redis.exceptions.ResponseError("WRONGTYPE"))


@pytest.mark.parametrize("code", [ErrorCode.rate_limited, ErrorCode.queue_full, ErrorCode.not_ready])
def test_every_429_and_503_says_when_to_retry(code: ErrorCode) -> None:
    assert int(ApiError(code, "later").headers["Retry-After"]) >= 1  # type: ignore[index]
    assert ApiError(code, "later", headers={"Retry-After": "7"}).headers == {"Retry-After": "7"}
    assert ApiError(ErrorCode.bad_request, "no").headers is None
