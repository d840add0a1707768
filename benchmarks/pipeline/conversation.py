"""The workloads: what a conversation sends, turn by turn, and the closed loop that runs ``c`` of them.

- ``single``: one turn per conversation, the same user prompt every time (``PROMPT``).
- ``agent``: a closed-loop conversation of ``turns`` turns. Turn 1 is a system prompt and a user message;
  every later turn sends the whole history back as the client received it (the assistant message as
  an OpenAI client echoes it: role, the concatenated streamed content, tool calls if any) plus a new
  ~20-word user message. The words come from a generator seeded by the run seed and the conversation's
  key, so prompts differ per conversation and per run but are the same for every arm of one run.

Stops: ``fixed`` = exactly ``tokens`` tokens (the model's end tokens ignored); ``natural`` = at most
``tokens``, the model's end token honoured.
"""

from __future__ import annotations

import asyncio
import random
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

from benchmarks.pipeline.measure import CpuMeter, Point, Window

MODEL = "tiny"
PROMPT = "Tell me a long story about a lighthouse keeper and the storm that changed the town."
SYSTEM = "You are a helpful assistant. Answer the user's questions briefly and stay on topic."
USER_WORDS = 20
ERROR_PAUSE_S = 0.05  # after a failed turn, so that a broken arm does not spin

_VOCABULARY = (
    "the keeper lighthouse storm town harbour boat lamp wind rain night morning sea wave rock island "
    "bell village market bread fisher net rope anchor sail mast deck captain child mother father friend "
    "letter road hill forest river bridge stone house door window fire kettle tea cup table chair book "
    "map clock bird gull fox dog cat horse garden apple winter summer spring autumn snow ice cloud sun "
    "moon star light shadow voice song story secret promise journey question answer reason memory dream "
    "plan why how what where when who tell explain describe remember imagine compare list show find keep "
    "small large old new quiet loud bright dark cold warm slow quick early late long short first last "
    "and but so because while after before under over near far inside outside between through"
)
_WORDS = _VOCABULARY.split()


@dataclass(frozen=True)
class Workload:
    kind: str  # single | agent
    turns: int  # turns per conversation (agent)
    stop: str  # fixed | natural
    tokens: int  # exactly (fixed) or at most (natural)
    seed_requests: bool = False  # send a sampling seed with every request
    run_seed: int = 0  # the user messages' generator

    @property
    def turns_per_conversation(self) -> int:
        return 1 if self.kind == "single" else self.turns

    @property
    def ignore_eos(self) -> bool:
        return self.stop == "fixed"


@dataclass
class Dialogue:
    """One conversation as its client keeps it: OpenAI messages, plus whatever a front door needs
    (``state``: the OA flow's chat and last message)."""

    workload: Workload
    key: str
    turn: int = 0  # turns completed
    messages: list[dict[str, Any]] = field(default_factory=list)
    state: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self._rng = random.Random(f"{self.workload.run_seed}:{self.key}")

    @property
    def done(self) -> bool:
        return self.turn >= self.workload.turns_per_conversation

    @property
    def system(self) -> str | None:
        return SYSTEM if self.workload.kind == "agent" else None

    def user_text(self) -> str:
        if self.workload.kind == "single":
            return PROMPT
        words = [self._rng.choice(_WORDS) for _ in range(USER_WORDS)]
        return " ".join(words).capitalize() + "?"

    def start_turn(self) -> tuple[int, str]:
        """Appends the next user message (and the system prompt on turn 1); returns (turn index from 1,
        the user text)."""
        if not self.messages and self.system is not None:
            self.messages.append({"role": "system", "content": self.system})
        text = self.user_text()
        self.messages.append({"role": "user", "content": text})
        return self.turn + 1, text

    def finish_turn(self, assistant: dict[str, Any]) -> None:
        self.messages.append(assistant)
        self.turn += 1


async def closed_loop(
    point: Point,
    window: Window,
    c: int,
    workload: Workload,
    turn: Callable[[Dialogue, int], Awaitable[None]],
    *,
    key: str = "",
    max_turns: int | None = None,
    meter: CpuMeter | None = None,
) -> None:
    """``c`` clients, each running conversations one after another and each turn when the last one
    ended, until the window closes (or ``max_turns`` turns in all). ``turn(dialogue, slot)`` runs one
    turn (records its arrivals, counts it, calls ``finish_turn``); a turn that raises counts as an
    error and its client starts a new conversation. The point's wall time is the window's, and so is
    its CPU (``meter``, read when the window closes: the turns still running then finish unmeasured)."""
    left = [max_turns]

    def more() -> bool:
        return window.open and (left[0] is None or left[0] > 0)

    async def client(slot: int) -> None:
        n = 0
        while more():
            # unique per front door, workload, stop, level, client and conversation: no conversation of a
            # run repeats another one's messages on the same stack (its prefix index, the engine's cache)
            dialogue = Dialogue(workload, f"{key}:{workload.kind}:{workload.stop}:{point.concurrency}:{slot}:{n}")
            n += 1
            while not dialogue.done and more():
                if left[0] is not None:
                    left[0] -= 1
                try:
                    await turn(dialogue, slot)
                except (asyncio.CancelledError, KeyboardInterrupt):
                    raise
                except Exception as exc:
                    point.fail(window, exc)
                    await asyncio.sleep(ERROR_PAUSE_S)
                    break

    async def read_meter(m: CpuMeter) -> None:
        await asyncio.sleep(max(0.0, window.end - time.perf_counter()))
        point.cpu_s = m.stop()
        point.server = m.last_server

    reading = None
    if meter is not None:
        meter.start(window.end - time.perf_counter())
        reading = asyncio.create_task(read_meter(meter))
    await asyncio.gather(*(client(k) for k in range(c)))
    point.wall_s = min(time.perf_counter(), window.end) - window.start
    if reading is not None:
        await reading
