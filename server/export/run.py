"""``tokentrail export``: filters -> rollouts -> trainer schema -> file, with progress on stderr.

The database is read page by page (``server/export/pages.py``) on the driver's own connections, the
pages encoded on worker processes where there are cores for them (``server/export/parallel.py``) and
written in order (``server/export/writers.py``)."""

from __future__ import annotations

import sys
import time
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from server.admin import open_database
from server.export.pages import page_queries
from server.export.parallel import Job, default_workers, export_pages
from server.export.query import ExportFilters, count_chats
from server.export.writers import page_writer
from server.settings import ServerSettings


def _utc(value: datetime | None) -> datetime | None:
    return value.replace(tzinfo=UTC) if value is not None and value.tzinfo is None else value


class Progress:
    """A one-line progress bar on stderr (a line every few seconds when stderr is not a terminal)."""

    def __init__(self, total: int, enabled: bool) -> None:
        self.total, self.enabled = total, enabled
        self.start = self.last = time.monotonic()
        self.tty = sys.stderr.isatty()

    def update(self, chats: int, rollouts: int, force: bool = False) -> None:
        now = time.monotonic()
        if not self.enabled or (not force and now - self.last < (0.2 if self.tty else 5.0)):
            return
        self.last = now
        frac = chats / self.total if self.total else 1.0
        bar = "#" * int(frac * 30)
        rate = rollouts / max(now - self.start, 1e-9)
        line = f"[{bar:<30}] {chats}/{self.total} chats, {rollouts} rollouts, {rate:,.0f} rollouts/s"
        print("\r" + line if self.tty else line, end="" if self.tty else "\n", file=sys.stderr, flush=True)

    def done(self) -> None:
        if self.enabled and self.tty:
            print(file=sys.stderr)


async def run_export(
    settings: ServerSettings,
    out: Path,
    *,
    fmt: str,
    schema: str,
    progress: bool = True,
    workers: int | None = None,
    **filter_args: Any,
) -> str:
    """``workers``: processes that build the rollouts (None: one per core; 1: this process only)."""
    from shared.rollout_adapters import SCHEMAS

    if schema not in SCHEMAS:
        raise ValueError(f"unknown schema {schema!r}; choose from {', '.join(SCHEMAS)}")
    filter_args["since"], filter_args["until"] = _utc(filter_args.get("since")), _utc(filter_args.get("until"))
    filters = ExportFilters(**filter_args)
    show = progress and str(out) != "-"
    engine, sessions = await open_database(settings)
    try:
        total = await count_chats(sessions, filters) if show else 0
        job_args = (page_queries(engine, filters), filters, None)  # (the version registry: read with the pages)
    finally:
        await engine.dispose()  # the pages are read on connections of their own
    encoder, writer = page_writer(out, fmt, schema)
    rollouts = records = chats = 0
    bar = Progress(total, show)
    try:
        async for page in export_pages(Job(*job_args, encoder), writer, workers or default_workers()):
            chats, rollouts, records = chats + page.chats, rollouts + page.rollouts, records + page.records
            bar.update(chats, rollouts)
        bar.update(bar.total, rollouts, force=True)
        bar.done()
    finally:
        writer.close()
    elapsed = time.monotonic() - bar.start
    return f"exported {rollouts} rollouts ({records} {schema} records) to {out} in {elapsed:.1f}s"
