"""``tokentrail export --pairs``: filters -> preference pairs -> schema -> file (server/export/pairs.py)."""

from __future__ import annotations

import sys
import time
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from server.admin import open_database
from server.export.pairs import PairStats, iter_pairs
from server.export.query import ExportFilters
from server.export.writers import JsonlWriter, RecordWriter, open_writer
from server.settings import ServerSettings
from shared.pairs import PAIR_SCHEMAS, adapt_pair

# the ExportFilters fields a pair export takes (the others are about rollouts' paths and rewards)
PAIR_FILTERS = ("since", "until", "model", "user", "chat", "min_version", "max_staleness")


def _utc(value: datetime | None) -> datetime | None:
    return value.replace(tzinfo=UTC) if value is not None and value.tzinfo is None else value


async def run_pair_export(
    settings: ServerSettings, out: Path, *, fmt: str, schema: str, progress: bool = True, **filter_args: Any
) -> str:
    if schema not in PAIR_SCHEMAS:
        raise ValueError(f"unknown pair schema {schema!r}; choose from {', '.join(PAIR_SCHEMAS)}")
    if unknown := sorted(set(filter_args) - set(PAIR_FILTERS)):
        raise ValueError(f"not a pair filter: {', '.join(unknown)}")
    filter_args["since"], filter_args["until"] = _utc(filter_args.get("since")), _utc(filter_args.get("until"))
    filters = ExportFilters(**filter_args)
    engine, sessions = await open_database(settings)
    writer: RecordWriter = JsonlWriter(sys.stdout.buffer) if str(out) == "-" else open_writer(out, fmt)
    stats = PairStats()
    start = last = time.monotonic()
    show = progress and str(out) != "-"
    try:
        async for pair in iter_pairs(sessions, filters, stats):
            writer.write(adapt_pair(pair, schema))
            if show and time.monotonic() - last > 5.0:  # pair exports are small: a line now and then
                last = time.monotonic()
                print(f"{stats.pairs} pairs", file=sys.stderr, flush=True)
    finally:
        writer.close()
        await engine.dispose()
    return f"exported {stats.describe()} as {schema} records to {out} in {time.monotonic() - start:.1f}s"
