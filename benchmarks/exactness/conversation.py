"""What a driven conversation holds: its messages and, per assistant message, what was asked, streamed and
stored; ``--dump`` / ``--load`` as JSON.
"""

from __future__ import annotations

import itertools
from dataclasses import asdict, dataclass, field
from typing import Any

from benchmarks.exactness.script import Script
from shared.protocol import WorkMessage


@dataclass
class Turn:
    """One assistant message: what was asked, what was streamed, what was stored."""

    at: int  # index of this assistant message in Conversation.messages
    new_from: int  # index of the first message after the previous assistant message (or of the first)
    turn: int  # user turn it answers
    round: int  # 0, or the tool round
    sampling: dict[str, Any]
    message_id: str = ""
    error: str | None = None
    streamed_ids: list[int] = field(default_factory=list)
    streamed_logprobs: list[float | None] = field(default_factory=list)
    stored: dict[str, Any] = field(default_factory=dict)  # MessageRead with tokens

    def as_message(self) -> WorkMessage:
        """The stored assistant message as the oracle renders it in later history."""
        return WorkMessage(
            id=self.message_id,
            role="assistant",
            content=self.stored.get("content") or "",
            tool_calls=self.stored.get("tool_calls") or None,
            reasoning_content=self.stored.get("reasoning_content"),
        )

    @property
    def prompt(self) -> list[int]:
        return list(self.stored.get("prompt_token_ids") or [])

    @property
    def completion(self) -> list[int]:
        return list(self.stored.get("completion_token_ids") or [])

    @property
    def logprobs(self) -> list[float | None]:
        return list(self.stored.get("logprobs") or [])


@dataclass
class Conversation:
    arm: str
    script: Script
    messages: list[WorkMessage] = field(default_factory=list)
    turns: list[Turn] = field(default_factory=list)  # completed turns only
    failed: list[Turn] = field(default_factory=list)

    def written_at(self) -> list[int]:
        """Indexes in ``messages`` of the assistant messages the client wrote itself (not generated)."""
        generated = {t.message_id for t in [*self.turns, *self.failed]}
        return [i for i, m in enumerate(self.messages) if m.role == "assistant" and m.id not in generated]

    def after_written(self) -> list[bool]:
        """Per turn after the first: whether a client-written assistant message lies between it and the
        turn before (the pair a text pipeline breaks)."""
        written = self.written_at()
        return [any(prev.at < w < t.at for w in written) for prev, t in itertools.pairwise(self.turns)]


def dump_conversations(convs: dict[str, list[Conversation]]) -> dict[str, Any]:
    """Everything driven, as JSON-ready data (``--dump``), for investigating a failure offline."""
    return {
        arm: [
            {
                "index": c.script.index,
                "system_prompt": c.script.system_prompt,
                "tools": c.script.tools,
                "messages": [m.model_dump(exclude_none=True) for m in c.messages],
                "turns": [asdict(t) for t in [*c.turns, *c.failed]],
            }
            for c in cs
        ]
        for arm, cs in convs.items()
    }


def load_conversations(data: dict[str, Any]) -> dict[str, list[Conversation]]:
    """The conversations of a ``--dump`` file (the inverse of ``dump_conversations``)."""
    out: dict[str, list[Conversation]] = {}
    for arm, convs in data["conversations"].items():
        out[arm] = []
        for c in convs:
            script = Script(data["seed"], c["index"], c["system_prompt"], c["tools"], (), (), data.get("written", 0.0))
            conv = Conversation(arm, script, [WorkMessage.model_validate(m) for m in c["messages"]])
            for t in c["turns"]:
                turn = Turn(**t)
                (conv.failed if turn.error is not None else conv.turns).append(turn)
            out[arm].append(conv)
    return out
