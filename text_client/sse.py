"""A minimal Server-Sent Events parser over an iterator of lines (per the WHATWG spec)."""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from dataclasses import dataclass


@dataclass
class SSEEvent:
    data: str
    event: str = "message"
    id: str | None = None


def parse_sse(lines: Iterable[str]) -> Iterator[SSEEvent]:
    data: list[str] = []
    event = "message"
    event_id: str | None = None
    for raw in lines:
        line = raw.rstrip("\r\n")
        if not line:
            if data:
                yield SSEEvent("\n".join(data), event, event_id)
            data, event, event_id = [], "message", None
            continue
        if line.startswith(":"):
            continue  # comment (keep-alive ping)
        name, _, value = line.partition(":")
        value = value.removeprefix(" ")
        if name == "data":
            data.append(value)
        elif name == "event":
            event = value
        elif name == "id":
            event_id = value
    if data:
        yield SSEEvent("\n".join(data), event, event_id)
