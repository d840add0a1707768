"""The tokens frame of one engine step, on the worker's hot path (DESIGN D13: no pydantic model per step).

``StepTokens`` holds the fields of ``shared.protocol.TokensFrame`` and encodes them with orjson into the
same JSON, byte for byte (tests/test_frames.py): the server parses it as a ``TokensFrame``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TypeVar, cast

import orjson

from shared.protocol import TokensFrame, TopLogprob
from shared.step_frames import TokensStep

F = TypeVar("F")


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

    def joins(self, then: StepTokens) -> bool:
        """Whether ``then`` continues these tokens and can be sent in one frame with them."""
        return (
            then.start == self.start + len(self.token_ids)
            and then.prompt_ids is None
            and (then.channels is None) == (self.channels is None)
            and (then.top_logprobs is None) == (self.top_logprobs is None)
            and then.policy_version == self.policy_version
        )

    def copy(self) -> StepTokens:
        """The frame with lists of its own (to extend)."""
        return StepTokens(
            self.message_id,
            self.attempt,
            self.start,
            list(self.token_ids),
            list(self.logprobs),
            list(self.texts),
            self.channels,
            None if self.top_logprobs is None else list(self.top_logprobs),
            self.prompt_ids,
            self.policy_version,
        )

    def extend(self, then: StepTokens) -> None:
        """Append ``then``'s tokens (``joins``) to this frame's own lists (``copy``)."""
        self.token_ids += then.token_ids
        self.logprobs += then.logprobs  # type: ignore[operator]
        self.texts += then.texts
        if self.channels is not None:
            self.channels += then.channels or ""
        if self.top_logprobs is not None:
            self.top_logprobs += then.top_logprobs or []

    def step(self) -> TokensStep:
        """The frame as the server's step decoder gives it (for an in-process link: no JSON, no pydantic)."""
        lps = self.logprobs
        return TokensStep(
            message_id=self.message_id,
            attempt=self.attempt,
            start=self.start,
            token_ids=self.token_ids,
            logprobs=lps if isinstance(lps, list) else list(lps),
            texts=self.texts,
            channels=self.channels,
            top_logprobs=self.top_logprobs,
            prompt_ids=self.prompt_ids,
            policy_version=self.policy_version,
        )

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


def merged_steps(frames: Sequence[F]) -> list[F]:
    """The frames with each message's consecutive tokens frames joined into one, in order otherwise.

    Frames pile up while a send is under way (a server slower than the engine); joined, the server
    parses, checks and appends one frame per message per send rather than one per engine step. Only
    tokens frames of one attempt with nothing of another kind between them are joined, so every other
    frame keeps its place relative to each message's tokens."""
    out: list[F] = []
    last: dict[tuple[str, int], int] = {}  # (message, attempt) -> index in out of its latest tokens frame
    copies: set[int] = set()  # indexes in out of frames made here (whose lists may be extended)
    for frame in frames:
        if not isinstance(frame, StepTokens):
            out.append(frame)
            last.clear()
            continue
        key = (frame.message_id, frame.attempt)
        k = last.get(key)
        if k is not None:
            prev = cast(StepTokens, out[k])
            if prev.joins(frame):
                if k not in copies:  # never extend lists the pipeline or the engine may hold
                    prev = prev.copy()
                    out[k] = cast(F, prev)
                    copies.add(k)
                prev.extend(frame)
                continue
        last[key] = len(out)
        out.append(frame)
    return out
