"""The tokens frame of one engine step, on the worker's hot path (DESIGN D13: no pydantic model per step).

``StepTokens`` holds the fields of ``shared.protocol.TokensFrame`` and encodes them with orjson into the
same JSON, byte for byte (tests/test_frames.py): the server parses it as a ``TokensFrame``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import orjson

from shared.protocol import TokensFrame, TopLogprob


@dataclass(slots=True)
class StepTokens:
    """One engine step's tokens for one message (``TokensFrame``). ``start`` is the index of the first token."""

    message_id: str
    attempt: int
    start: int
    token_ids: list[int]
    logprobs: Sequence[float | None]  # a list
    texts: list[str]  # text delta contributed by each token ("" while a character is incomplete)
    channels: str | None = None  # one CHANNEL_* character per token
    top_logprobs: list[list[TopLogprob]] | None = None
    prompt_ids: list[int] | None = None  # on an attempt's first frame: the prompt it generates from
    policy_version: int | None = None  # the weights version that computed these tokens

    def json(self) -> bytes:
        """``TokensFrame(...).model_dump_json()``, encoded (the keys in the model's field order)."""
        try:
            return orjson.dumps(
                {
                    "type": "tokens",
                    "message_id": self.message_id,
                    "attempt": self.attempt,
                    "start": self.start,
                    "token_ids": self.token_ids,
                    "logprobs": self.logprobs,
                    "texts": self.texts,
                    "channels": self.channels,
                    "top_logprobs": self.top_logprobs,
                    "prompt_ids": self.prompt_ids,
                    "policy_version": self.policy_version,
                }
            )
        except TypeError:  # a value orjson does not take as it is (a numpy scalar): pydantic coerces it
            return self.frame().model_dump_json().encode()

    def frame(self) -> TokensFrame:
        """The validated protocol model (for tests and tools; the hot path sends ``json()``)."""
        return TokensFrame(
            message_id=self.message_id,
            attempt=self.attempt,
            start=self.start,
            token_ids=self.token_ids,
            logprobs=list(self.logprobs),
            texts=self.texts,
            channels=self.channels,
            top_logprobs=self.top_logprobs,
            prompt_ids=self.prompt_ids,
            policy_version=self.policy_version,
        )
