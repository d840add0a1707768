"""The seeded conversation script: what each conversation sends, the same for both arms.

Everything comes from ``random.Random`` seeded by (seed, conversation, turn, round); see the package
docstring (``The script``).
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass
from typing import Any

from worker.chat_format import ChatFormat
from worker.prompt_builder import PromptBuilder
from worker.tiny.synthetic import tool_schema

MAX_TOOL_ROUNDS = 2  # assistant messages after tool results, per user message
CONTROL_STRINGS = (
    "<|im_end|>",
    "<|im_start|>assistant\n",
    "<|endoftext|>",
    "<|eot_id|>",
    "<|eom_id|>",
    "<|start_header_id|>system<|end_header_id|>",
    "<|python_tag|>",
    '<tool_call>{"name": "get_weather", "arguments": {"city": "Oslo"}}</tool_call>',
    "<think>",
    "</think>",
)

_TOOLS: tuple[tuple[str, str, dict[str, str]], ...] = (
    ("get_weather", "Current weather in a city", {"city": "string", "units": "string"}),
    ("search_web", "Search the web, return the top result", {"query": "string"}),
    ("get_time", "Current local time in a time zone", {"tz": "string"}),
    ("lookup_user", "Look up a user record by id", {"user_id": "integer"}),
    ("read_file", "Read a text file", {"path": "string"}),
)
_CITIES = ("Paris", "London", "Berlin", "Tokyo", "Lagos", "Lima", "Oslo", "Cairo")
_SYSTEM_PROMPTS = (
    "You are a helpful assistant.",
    "You are terse.",
    "Answer in one or two sentences.",
    "You are a careful assistant. Think before you answer.",
)
_TOPICS = ("the river", "a quiet garden", "the old train", "my computer", "the weather", "a music file")
_WRITTEN_REPLIES = (
    "Noted. I will keep that in mind.",
    "Sure, here is my short answer: it depends on the day.",
    "I checked it myself and it looks fine.",
)
_PLAIN_ASKS = (
    "Tell me about {topic}.",
    "What do you think of {topic}?",
    "Write one sentence about {topic}.",
    "The team builds a small model. Why does it change {topic}?",
    "Can you explain {topic} in simple words?",
)


def _tool_ask(rng: random.Random, name: str) -> str:
    if name == "get_weather":
        return rng.choice(("What is the weather in {}?", "Is it warm in {} today?")).format(rng.choice(_CITIES))
    if name == "get_time":
        return f"Please use get time: {rng.choice(('UTC', 'Asia/Tokyo', 'Europe/Paris'))}."
    if name == "lookup_user":
        return f"Please use lookup user: {rng.randint(1, 99999)}."
    if name == "read_file":
        return f"Can you read file for ./data/{rng.choice(('notes', 'report', 'list'))}.txt?"
    return f"Please use search web: {rng.choice(_TOPICS)}."


@dataclass(frozen=True)
class Script:
    """Everything one conversation sends, the same for both arms."""

    seed: int
    index: int
    system_prompt: str | None
    tools: list[dict[str, Any]] | None
    user_texts: tuple[str, ...]
    stop_candidates: tuple[int, ...]
    written_share: float = 0.0  # of user turns after the first where the client writes the assistant message

    @classmethod
    def make(
        cls, seed: int, index: int, turns: int, stop_candidates: tuple[int, ...], written_share: float = 0.0
    ) -> Script:
        rng = random.Random(f"exactness:{seed}:{index}")
        offered = rng.sample(_TOOLS, rng.choice((1, 2, 3))) if rng.random() < 0.5 else []
        system: str | None = None
        if rng.random() < 0.5:
            system = rng.choice(_SYSTEM_PROMPTS)
            if rng.random() < 0.2:
                system += f" Never print {rng.choice(CONTROL_STRINGS)}."
        texts = []
        for _ in range(turns):
            if offered and rng.random() < 0.6:
                text = _tool_ask(rng, rng.choice(offered)[0])
            else:
                text = rng.choice(_PLAIN_ASKS).format(topic=rng.choice(_TOPICS))
            if rng.random() < 0.3:
                literal = rng.choice(CONTROL_STRINGS)
                text = rng.choice((f"{text} Also, why does {literal} show up in my file?", f"{literal}\n{text}"))
            texts.append(text)
        tools = [tool_schema(*t) for t in offered] or None
        return cls(seed, index, system, tools, tuple(texts), stop_candidates, written_share)

    def _rng(self, *key: object) -> random.Random:
        return random.Random(":".join(map(str, ("exactness", self.seed, self.index, *key))))

    def sampling(self, turn: int, round_: int) -> dict[str, Any]:
        rng = self._rng("sampling", turn, round_)
        params: dict[str, Any] = {
            "temperature": rng.choices((0.0, 0.7, 0.8, 1.0), weights=(1, 3, 3, 2))[0],
            "max_new_tokens": rng.randint(3, 8) if rng.random() < 0.2 else 64,
            "seed": rng.randrange(2**31),
        }
        if rng.random() < 0.25:
            params["top_k"] = rng.choice((20, 50))
        if rng.random() < 0.25:
            params["top_p"] = rng.choice((0.8, 0.9, 0.95))
        if rng.random() < 0.2:
            params["repetition_penalty"] = rng.choice((1.1, 1.3))
        if self.stop_candidates and rng.random() < 0.2:
            params["stop_token_ids"] = [rng.choice(self.stop_candidates)]
        return params

    def written(self, turn: int) -> dict[str, Any] | None:
        """The assistant message the client writes itself at user turn ``turn`` (an agent's own tool call,
        a reply it typed), or None: the model answers. A written tool call is followed by its result and
        then the model answers under it; a written reply takes the turn (the next user message follows it).
        Never the first turn: a written turn is measured by the generated turns around it."""
        rng = self._rng("written", turn)
        if turn == 0 or rng.random() >= self.written_share:
            return None
        if self.tools and rng.random() < 0.5:
            tool = rng.choice(self.tools)["function"]
            args = {name: (rng.randint(1, 99) if spec.get("type") == "integer" else rng.choice(_CITIES))
                    for name, spec in tool["parameters"]["properties"].items()}  # fmt: skip
            call = {"id": f"call_w{turn}", "type": "function",
                    "function": {"name": tool["name"], "arguments": json.dumps(args)}}  # fmt: skip
            return {"content": "", "tool_calls": [call], "result": self.tool_result(turn, -1, 0, call)}
        text = rng.choice(_WRITTEN_REPLIES)
        if rng.random() < 0.3:
            text = f"{text} {rng.choice(CONTROL_STRINGS)}"
        return {"content": text, "tool_calls": None, "result": None}

    def tool_result(self, turn: int, round_: int, call_index: int, call: dict[str, Any]) -> str:
        rng = self._rng("tool", turn, round_, call_index)
        name = str(call.get("function", {}).get("name", "tool"))
        roll = rng.random()
        if roll < 0.25:
            return f"{rng.choice(CONTROL_STRINGS)} {name} returned nothing useful."
        if roll < 0.35:
            return f"Error: {name} timed out."
        if name == "get_weather":
            return json.dumps({"temperature": rng.randint(-10, 40), "conditions": rng.choice(("warm", "cold"))})
        return json.dumps({"result": rng.randint(1, 9999), "status": "ok"})


def has_control_text(text: str | None) -> bool:
    return bool(text) and any(s.strip() in (text or "") for s in CONTROL_STRINGS)


def stop_candidates(fmt: ChatFormat) -> list[int]:
    """Stop token ids the script draws from: " the" (if one token) and eos where eos is not a closer."""
    closers = PromptBuilder(fmt).shape.history_ends
    candidates = []
    the = fmt.encode_content(" the")
    if len(the) == 1:
        candidates.append(the[0])
    eos = fmt.tokenizer.eos_token_id
    if isinstance(eos, int) and eos not in closers:
        candidates.append(eos)
    return candidates
