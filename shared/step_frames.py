"""The tokens frames of one engine step, decoded by msgspec: the server's hot path (DESIGN D13).

A worker sends each engine step's frames as one JSON array, nearly always tokens frames only. Pydantic's
``TokensFrame`` costs about 2 µs a frame to validate, one frame per running reply per engine step;
msgspec checks the same types and bounds in a quarter of that. ``TokensStep`` has ``TokensFrame``'s
fields, types, bounds and defaults (tests/test_step_merging.py compares them), and
``decode_step`` takes an array only when every frame in it is a valid tokens frame: anything else
(a finished frame, a malformed one) is left to pydantic's models, whose answers and errors stay those
of the protocol.
"""

from __future__ import annotations

from typing import Annotated

import msgspec

from shared.protocol import TokensFrame, TopLogprob, WorkerFrame


class TokensStep(msgspec.Struct, tag_field="type", tag="tokens", forbid_unknown_fields=True):
    """``shared.protocol.TokensFrame``, as msgspec decodes it."""

    message_id: str
    attempt: int
    start: Annotated[int, msgspec.Meta(ge=0)]
    token_ids: list[int]
    logprobs: list[float | None]
    texts: list[str]
    channels: str | None = None
    top_logprobs: list[list[TopLogprob]] | None = None
    prompt_ids: list[int] | None = None
    policy_version: int | None = None


# a step's tokens frame, as either decoder gives it (the hub reads the same fields of both)
Tokens = TokensFrame | TokensStep
StepFrame = WorkerFrame | TokensStep  # a frame of a step as the server received it

_STEP = msgspec.json.Decoder(list[TokensStep])


def decode_step(raw: str | bytes) -> list[TokensStep] | None:
    """The frames of a step message (a JSON array) when all are tokens frames, else None."""
    try:
        return _STEP.decode(raw)
    except (msgspec.ValidationError, msgspec.DecodeError):
        return None
