"""SQLite connections opened at the same moment, as an export's worker processes open theirs: each waits
for the others (``server.db.SQLITE_PRAGMAS`` sets the busy timeout before the pragmas that take a lock)
instead of failing with "database is locked" while one of them opens the write-ahead log. Run many times
over: with the timeout set last, a few percent of these opens failed here."""

from __future__ import annotations

import multiprocessing
import sqlite3
from pathlib import Path
from typing import Any

from server.db import SQLITE_PRAGMAS

ROUNDS, PROCESSES = 30, 6


def _opener(path: str, compiled: bool, barrier: Any, results: Any) -> None:
    """Round after round: wait for the others, open the database and read it, close, wait until all
    have closed (so that the next round's first connection recovers the log again)."""
    from server.export.fastpage import SqliteReader

    for _ in range(ROUNDS):
        try:
            barrier.wait(60)
            if compiled and (reader := SqliteReader.open(path, pragmas=SQLITE_PRAGMAS)) is not None:
                assert reader.rows("SELECT count(*) FROM t", []) == [(1,)]
                reader.close()
            else:
                conn = sqlite3.connect(path, timeout=0)  # (the pragma, not the driver, sets the wait)
                for pragma in SQLITE_PRAGMAS:
                    conn.execute(f"PRAGMA {pragma}")
                assert conn.execute("SELECT count(*) FROM t").fetchall() == [(1,)]
                conn.close()
            results.put("ok")
        except Exception as exc:
            results.put(f"{type(exc).__name__}: {exc}")
        finally:
            barrier.wait(60)


def test_connections_opened_together_wait_for_each_other(tmp_path: Path) -> None:
    path = str(tmp_path / "together.db")
    conn = sqlite3.connect(path)
    conn.execute("PRAGMA journal_mode=WAL")
    conn.execute("CREATE TABLE t (x)")
    conn.execute("INSERT INTO t VALUES (1)")
    conn.commit()
    conn.close()  # (the last connection gone: the next one to open the database recovers its log)
    # spawned, not forked: a fork of the test process (threads of its own) can hang on a lock
    ctx = multiprocessing.get_context("spawn")
    barrier, results = ctx.Barrier(PROCESSES), ctx.Queue()
    procs = [ctx.Process(target=_opener, args=(path, i % 2 == 0, barrier, results)) for i in range(PROCESSES)]
    for proc in procs:
        proc.start()
    outcomes = [results.get(timeout=120) for _ in range(ROUNDS * PROCESSES)]
    for proc in procs:
        proc.join(60)
    assert [proc.exitcode for proc in procs] == [0] * PROCESSES
    failures = [o for o in outcomes if o != "ok"]
    assert not failures, failures
