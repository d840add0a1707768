"""A page of native rollouts as JSON lines by the compiled encoder (``server/export/fastpage_c/``, built by
setup.py when the package is installed): the bytes ``page_rollouts`` + ``page_lines`` give, for a third
of their CPU or less.

The module is optional: without a C compiler at install time (or with ``TOKENTRAIL_EXPORT_PURE_PYTHON=1``)
``encode_page`` is None and the export runs the Python page path. The C code reads the rows as
``server/export/query.py`` lays them out (checked here at import) and asks Python, through the callables
below, for what is not plain data: JSON columns, non-SQLite timestamps, floats and free-form values
(orjson writes them, so the text is orjson's), and the filters that read dates or the version registry.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import orjson

from server.chats.repository import decode_stop_reason
from server.export.page_rollouts import Chat
from server.export.query import (
    DECODED,
    M_DONE,
    M_ID,
    M_POLICY,
    MSG_COLUMNS,
    T_METHOD,
    T_SYNTH,
    TOKEN_COLUMNS,
    Decoders,
    ExportFilters,
    PolicyPaths,
    json_loads,
)
from server.export.rollouts import leaf_passes, recent_enough
from shared.rollout import SCHEMA_NAME, SCHEMA_VERSION

_native: Any = None
if os.environ.get("TOKENTRAIL_EXPORT_PURE_PYTHON", "") in ("", "0"):
    try:
        from server.export import _fastpage as _native  # type: ignore[attr-defined, no-redef]
    except ImportError:  # not built: the Python page path
        _native = None

_LAYOUT = {"M_COUNT": len(MSG_COLUMNS), "T_COUNT": len(TOKEN_COLUMNS)} | {
    "M_ID": M_ID,
    "M_POLICY": M_POLICY,
    "M_DONE": M_DONE,
    "T_SYNTH": T_SYNTH,
    "T_METHOD": T_METHOD,
}
if _native is not None and any(getattr(_native, name) != value for name, value in _LAYOUT.items()):
    raise ImportError("server/export/fastpage_c/ reads another row layout than server/export/query.py")

AVAILABLE = _native is not None
_HEAD = orjson.dumps({"schema": SCHEMA_NAME, "schema_version": SCHEMA_VERSION})[:-1]
_STOP_TEXTS: dict[Any, bytes] = {}  # raw stop reason -> its JSON text (a few distinct values)
_NUMPY = orjson.OPT_SERIALIZE_NUMPY


def _floats(blob: bytes) -> bytes:
    """Float32 logprobs widened to float64, as JSON (what ``page_lines`` prints: null where not finite)."""
    return orjson.dumps(np.frombuffer(blob, "<f4").astype(np.float64), option=_NUMPY)


def _args(chats: Sequence[Chat], filters: ExportFilters, dec: Decoders, paths: PolicyPaths) -> tuple[Any, ...]:
    """The compiled builder's arguments (module.c's ``build``)."""
    by_leaf: Callable[[Any], bool] | None = None
    if filters.model is not None or filters.since is not None or filters.until is not None:
        by_leaf = lambda leaf: leaf_passes(leaf, filters, dec)  # noqa: E731
    by_versions: Callable[[list[int], Any], bool] | None = None
    if filters.min_version is not None or filters.max_staleness is not None:
        by_versions = lambda used, model: recent_enough(used, model or "", filters, paths)  # noqa: E731

    created: Callable[[Any], str | None] | None = None  # None: the driver's datetimes as they are (C: isoformat)
    if dec.datetime is not DECODED.datetime:  # (asyncpg's: datetimes as they are)

        def created(raw: Any) -> str | None:
            value = dec.datetime(raw)
            return value.isoformat() if value else None

    return (
        chats,
        filters.rated_only,
        filters.include_incomplete,
        filters.reward_rule,
        filters.min_score,
        by_leaf,
        by_versions,
        paths.path,
        dec.json,
        orjson.loads if dec.json is json_loads else None,
        created,
        decode_stop_reason,
        orjson.dumps,
        _floats,
        _HEAD,
        orjson.dumps(filters.reward_rule),
        _STOP_TEXTS,
    )


def encode_page(
    chats: Sequence[Chat], filters: ExportFilters, dec: Decoders, paths: PolicyPaths
) -> tuple[bytes, int] | None:
    """The JSON lines of the rollouts of ``chats`` (``page_chats``) and their number, or None where the
    compiled encoder is not available or leaves the page to the Python path (a turn whose logprobs do
    not line up with its completion, a value of a shape it does not take)."""
    if _native is None:
        return None
    result: tuple[bytes, int] | None = _native.encode_page(*_args(chats, filters, dec, paths))
    return result


def arrow_batch(chats: Sequence[Chat], filters: ExportFilters, dec: Decoders, paths: PolicyPaths) -> Any:
    """The record batch ``page_batch`` makes of the rollouts of ``chats``, built by the compiled encoder
    (None: as ``encode_page``)."""
    if _native is None:
        return None
    built = _native.arrow_page(*_args(chats, filters, dec, paths))
    if built is None:
        return None
    from server.export.columnar import native_batch

    columns, rollouts = built
    return native_batch(columns, rollouts, filters.reward_rule)


class SqliteReader:
    """A SQLite connection of the compiled module's (``fastpage_c/sqlite_rows.c``): statements' rows as
    ``sqlite3``'s ``execute(...).fetchall()`` gives them, for less CPU. One thread at a time."""

    def __init__(self, handle: Any) -> None:
        self._handle = handle

    @classmethod
    def open(
        cls, database: str, *, pragmas: Sequence[str] = (), uri: bool = False, **ignored: Any
    ) -> SqliteReader | None:
        """A reader of ``database`` (``sqlite3.connect``'s arguments; those about threads and types do
        not apply), or None where the module was not built or SQLite's library is not found in this
        process (Python's ``sqlite3`` linked it statically): the caller then uses ``sqlite3``."""
        if _native is None or ignored.get("detect_types") or ignored.get("factory"):
            return None
        import _sqlite3

        handle = _native.sqlite_open(_sqlite3.__file__, str(database), bool(uri), list(pragmas))
        return None if handle is None else cls(handle)

    def rows(self, sql: str, params: Sequence[Any]) -> list[tuple[Any, ...]]:
        return _native.sqlite_rows(self._handle, sql, list(params))  # type: ignore[no-any-return]

    def close(self) -> None:
        _native.sqlite_close(self._handle)


_PHYSICAL = {0: "BOOLEAN", 1: "INT32", 2: "INT64", 4: "FLOAT", 5: "DOUBLE", 6: "BYTE_ARRAY"}


def parquet_leaves() -> list[tuple[str, str, int, int]] | None:
    """The leaf columns the compiled Parquet writer writes: (dotted path, physical type, max definition,
    max repetition level), as ``parquet_pages.leaf_columns`` reads them from a file; None: not built."""
    if _native is None:
        return None
    return [(path, _PHYSICAL[kind], d, r) for path, kind, d, r in _native.parquet_leaves()]


def parquet_page(
    chats: Sequence[Chat],
    filters: ExportFilters,
    dec: Decoders,
    paths: PolicyPaths,
    zstd_level: int,
    page_bytes: int = 1 << 20,
) -> tuple[tuple[bytes, tuple[bytes, ...], tuple[int, ...], int], int] | None:
    """The rollouts of ``chats`` as a Parquet row group of ``columnar.ROLLOUT_SCHEMA`` (PLAIN pages of
    about ``page_bytes`` of values, as pyarrow's ``data_page_size``, compressed by zstd at
    ``zstd_level``) written by the compiled encoder, and their number: the column
    chunks' bytes and the ``parquet_pages.RowGroupTemplate`` of their metadata (parts, offsets, rows).
    None: as ``encode_page``, or no libzstd on this machine."""
    if _native is None:
        return None
    extra = (SCHEMA_NAME, SCHEMA_VERSION, filters.reward_rule, zstd_level, page_bytes)
    result: tuple[tuple[bytes, tuple[bytes, ...], tuple[int, ...], int], int] | None = _native.parquet_page(
        _args(chats, filters, dec, paths), extra
    )
    return result


def keep_freed_memory(limit: int) -> bool:
    """Have the C library's allocator serve blocks smaller than ``limit`` bytes from the heap and keep up
    to twice that freed before giving memory back (glibc's ``mallopt``): for a process that allocates
    and frees buffers of megabytes over and over. False where that is not available."""
    return _native is not None and bool(_native.keep_freed_memory(limit))
