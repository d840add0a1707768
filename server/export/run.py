"""``tokentrail export``: filters -> rollouts -> trainer schema -> file, with progress on stderr."""

from __future__ import annotations

import sys
import time
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from server.admin import open_database
from server.export.query import ExportFilters, count_chats
from server.export.reader import iter_rollouts
from server.export.writers import JsonlWriter, RecordWriter, open_writer
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
    **filter_args: Any,
) -> str:
    from shared.rollout_adapters import SCHEMAS, adapt

    if schema not in SCHEMAS:
        raise ValueError(f"unknown schema {schema!r}; choose from {', '.join(SCHEMAS)}")
    filter_args["since"], filter_args["until"] = _utc(filter_args.get("since")), _utc(filter_args.get("until"))
    filters = ExportFilters(**filter_args)
    engine, sessions = await open_database(settings)
    writer: RecordWriter = JsonlWriter(sys.stdout.buffer) if str(out) == "-" else open_writer(out, fmt)
    rollouts = records = chats = 0
    last_chat = None
    try:
        bar = Progress(await count_chats(sessions, filters), progress and str(out) != "-")
        async for rollout in iter_rollouts(sessions, filters):
            if rollout["chat_id"] != last_chat:
                chats, last_chat = chats + 1, rollout["chat_id"]
            for record in adapt(rollout, schema):
                writer.write(record)
                records += 1
            rollouts += 1
            bar.update(chats, rollouts)
        bar.update(bar.total, rollouts, force=True)
        bar.done()
    finally:
        writer.close()
        await engine.dispose()
    elapsed = time.monotonic() - bar.start
    return f"exported {rollouts} rollouts ({records} {schema} records) to {out} in {elapsed:.1f}s"
