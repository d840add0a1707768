"""SSE payloads of ``GET /chats/{chat_id}/messages/{message_id}/events`` (DESIGN D8).

Each event is sent as an SSE ``data:`` line holding one of these objects; the ``event_type``
field tells them apart, as in Open-Assistant. Token events also carry ``id:`` = token index.
"""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import BaseModel, Field

from shared.api import MessageRead


class PendingEvent(BaseModel):
    event_type: Literal["pending"] = "pending"
    queue_position: int
    queue_size: int


class TokenEvent(BaseModel):
    event_type: Literal["token"] = "token"
    text: str
    # tokentrail additions
    index: int
    token_id: int
    logprob: float | None = None


class MessageEvent(BaseModel):
    event_type: Literal["message"] = "message"
    message: MessageRead


class ErrorEvent(BaseModel):
    event_type: Literal["error"] = "error"
    error: str
    code: str | None = None
    message: MessageRead | None = None


class ResetEvent(BaseModel):
    """A retry restarted generation: discard tokens from ``from_index`` on."""

    event_type: Literal["reset"] = "reset"
    from_index: int


ResponseEvent = Annotated[
    PendingEvent | TokenEvent | MessageEvent | ErrorEvent | ResetEvent, Field(discriminator="event_type")
]
