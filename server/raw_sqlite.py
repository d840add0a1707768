"""The per-turn statements on SQLite through the ``sqlite3`` module, past SQLAlchemy's execution machinery.

On embedded defaults a chat turn runs about ten statements (admission count, prefix match, inserts, the
fenced start, the finished record) and three commits. Through SQLAlchemy's asyncio layer each one costs
~170 us of Python (greenlet hop, pool checkout, execution context, result wrapping) around a SQLite call of
~5-30 us: a quarter of the embedded server's CPU under agent load (py-spy, issue 22). Here the same Core
statements are compiled once with SQLAlchemy's SQLite dialect (the SQL, parameter order, bind and result
processors: what SQLAlchemy stores and reads is unchanged) and run on a connection of this module's own.

Every call runs to its end without awaiting: a write transaction (``transact``) never spans a suspension, so
no other task's statement can land inside it and no lock is held while the event loop runs other work
(the same rule the inline SQLAlchemy connections follow, ``server/sqlite_inline.py``).
"""

from __future__ import annotations

import sqlite3
from collections import namedtuple
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, cast

from sqlalchemy.engine import Dialect
from sqlalchemy.sql import ClauseElement
from sqlalchemy.sql.base import Executable
from sqlalchemy.sql.compiler import SQLCompiler
from sqlalchemy.sql.dml import Insert
from sqlalchemy.sql.selectable import Select

from server.db import SQLITE_PRAGMAS

_MISSING = object()


@dataclass(frozen=True)
class _Generated:
    """A column default computed per row (``default=utcnow``), as SQLAlchemy computes it before an INSERT."""

    make: Callable[[Any], Any]


@dataclass(frozen=True)
class Step:
    """One statement of a write transaction. ``required``: the transaction is rolled back (and
    ``transact`` returns None) when this statement changes no row (a fenced UPDATE of a stale attempt)."""

    stmt: Executable
    params: dict[str, Any] | Sequence[dict[str, Any]]
    required: bool = False


@dataclass(frozen=True)
class _Prepared:
    sql: str
    names: tuple[str, ...]  # the bound parameters in the SQL's positional order
    defaults: tuple[Any, ...]  # values written into the statement (literals), _MISSING where none
    binds: tuple[Callable[[Any], Any] | None, ...]
    row: Any  # a namedtuple type for a SELECT's rows, else None
    results: tuple[Callable[[Any], Any] | None, ...] | None  # per column; None when no column has one

    def values(self, params: dict[str, Any]) -> tuple[Any, ...]:
        out = []
        for name, default, bind in zip(self.names, self.defaults, self.binds, strict=True):
            value = params.get(name, default)
            if value is _MISSING:
                raise KeyError(f"statement parameter {name!r} not given")
            if isinstance(value, _Generated):
                value = value.make(None)
            out.append(bind(value) if bind is not None else value)
        return tuple(out)


class RawSqlite:
    """A connection of its own to the database file, running prepared Core statements."""

    def __init__(self, path: str, dialect: Dialect) -> None:
        # autocommit mode: reads see the latest commit; writes are explicit BEGIN IMMEDIATE ... COMMIT
        self._conn = sqlite3.connect(path, check_same_thread=False, isolation_level=None)
        for pragma in SQLITE_PRAGMAS:  # the same as SQLAlchemy's connections (busy_timeout included)
            self._conn.execute(f"PRAGMA {pragma}")
        self._dialect = dialect
        self._prepared: dict[tuple[int, tuple[str, ...] | None], tuple[Executable, _Prepared]] = {}

    def close(self) -> None:
        self._conn.close()

    def _prepare(self, stmt: Executable, keys: tuple[str, ...] | None) -> _Prepared:
        # Statements are module-level constants: keyed by identity, the statement kept alive with its entry.
        cache_key = (id(stmt), keys)
        hit = self._prepared.get(cache_key)
        if hit is not None and hit[0] is stmt:
            return hit[1]
        if not isinstance(stmt, ClauseElement):
            raise TypeError(f"not a Core statement: {stmt!r}")
        compiled = cast(
            SQLCompiler, stmt.compile(dialect=self._dialect, column_keys=list(keys) if keys is not None else None)
        )
        if not compiled.positional or compiled.positiontup is None:
            raise ValueError("the SQLite dialect compiles to positional parameters")
        names = tuple(compiled.positiontup)
        constants = compiled.construct_params(_check=False) or {}
        # an INSERT's columns left out of the row take their Python-side defaults, as SQLAlchemy does
        prefetch = {c.key: c.default for c in getattr(compiled, "insert_prefetch", ()) if c.default is not None}
        defaults: list[Any] = []
        for name in names:
            bound = compiled.binds.get(name)
            if name in prefetch:
                d: Any = prefetch[name]
                defaults.append(d.arg if d.is_scalar else _Generated(d.arg))
            elif bound is not None and bound.value is not None and not bound.required and bound.callable is None:
                defaults.append(constants.get(name))
            else:
                defaults.append(_MISSING)
        # the dialect's implementation of each type (SQLite's DATETIME, JSON...), as SQLAlchemy applies it
        binds = tuple(
            compiled.binds[name].type.dialect_impl(self._dialect).bind_processor(self._dialect) for name in names
        )
        row_type: Any = None
        results: tuple[Callable[[Any], Any] | None, ...] | None = None
        if isinstance(stmt, Select):
            columns = list(stmt.selected_columns)
            row_type = _row_type([c.key or f"c{k}" for k, c in enumerate(columns)])
            results = tuple(c.type.dialect_impl(self._dialect).result_processor(self._dialect, None) for c in columns)
            if all(f is None for f in results):
                results = None
        prepared = _Prepared(str(compiled), names, tuple(defaults), binds, row_type, results)
        self._prepared[cache_key] = (stmt, prepared)
        return prepared

    def rows(self, stmt: Executable, params: dict[str, Any]) -> list[Any]:
        """A SELECT's rows (namedtuples, values as SQLAlchemy reads them)."""
        p = self._prepare(stmt, None)
        raw = self._conn.execute(p.sql, p.values(params)).fetchall()
        if p.results is not None:
            raw = [tuple(f(v) if f is not None else v for f, v in zip(p.results, r, strict=True)) for r in raw]
        return [p.row._make(r) for r in raw]

    def transact(self, steps: Sequence[Step]) -> list[int] | None:
        """Run ``steps`` in one transaction and commit; each step's row count, or None (rolled back) when
        a required step changed no row. Errors roll back and are raised (``sqlite3.IntegrityError``...)."""
        conn = self._conn
        conn.execute("BEGIN IMMEDIATE")
        try:
            counts: list[int] = []
            for step in steps:
                # a plain INSERT lists the row's columns; other statements name their parameters
                rows = [step.params] if isinstance(step.params, dict) else list(step.params)
                keys = tuple(rows[0]) if isinstance(step.stmt, Insert) else None
                p = self._prepare(step.stmt, keys)
                if len(rows) == 1:
                    cur = conn.execute(p.sql, p.values(rows[0]))
                else:
                    cur = conn.executemany(p.sql, [p.values(r) for r in rows])
                counts.append(cur.rowcount)
                if step.required and cur.rowcount <= 0:
                    conn.execute("ROLLBACK")
                    return None
        except BaseException:
            if conn.in_transaction:
                conn.execute("ROLLBACK")
            raise
        conn.execute("COMMIT")
        return counts


def _row_type(names: list[str]) -> Any:
    return namedtuple("Row", names, rename=True)
