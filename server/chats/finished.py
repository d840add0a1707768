"""Replies this process stored a moment ago, as stored, for the readers that follow them to the end.

Every reader of a reply ends by reading the message and its token row from SQL (its final event or
chunk). The hub has both in hand when it stores them, so it keeps them here for a minute: readers on
this process find them without a query; readers elsewhere (another replica), or later, read SQL. The
entries are what SQL holds (built from the same values the hub wrote), so either way gives the same.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from dataclasses import dataclass

from server.models import Message, MessageTokens

_TTL_S = 60.0


@dataclass
class Finished:
    """The message and its token row as stored (``tokens`` is None for a message that failed)."""

    message: Message
    tokens: MessageTokens | None


class RecentlyFinished:
    def __init__(self, max_entries: int = 4096) -> None:
        self.max_entries = max_entries
        self._entries: OrderedDict[str, tuple[float, Finished]] = OrderedDict()

    def put(self, finished: Finished) -> None:
        self._entries[finished.message.id] = (time.monotonic() + _TTL_S, finished)
        self._entries.move_to_end(finished.message.id)
        while len(self._entries) > self.max_entries:
            self._entries.popitem(last=False)

    def get(self, message_id: str) -> Finished | None:
        hit = self._entries.get(message_id)
        if hit is None or hit[0] < time.monotonic():
            return None
        return hit[1]

    def forget(self, message_ids: list[str]) -> None:
        for message_id in message_ids:
            self._entries.pop(message_id, None)
