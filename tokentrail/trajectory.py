"""Client-side trajectories from API responses, for users who keep their own rollouts.

``Trajectory.add(response)`` takes a response of any of tokentrail's three dialects (the SDK's object or
its JSON): a chat completion (``/v1/chat/completions``), a Responses object (``/v1/responses``: the token
fields on its last output item) or an Anthropic message (``/v1/messages``), and records the turn with
the prompt token ids the server actually used, the generated token ids and their logprobs.
``rollout()`` returns a native rollout record (``shared.rollout.Rollout``, the schema ``tokentrail
export`` writes): turns whose prompt extends the
previous turn's prompt + completion merge into one training sample, with a loss mask on generated
tokens only. Nothing here talks to the server or needs its dependencies::

    from tokentrail.trajectory import Trajectory

    traj = Trajectory()
    resp = client.chat.completions.create(model=m, messages=msgs, logprobs=True)
    traj.add(resp)          # after every request of the episode
    record = traj.rollout(reward=1.0).model_dump(by_alias=True)

Without ``logprobs=True`` in the request the logprobs are None (the tokens are still exact).
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

from shared.rollout import Rollout, TurnRecord, build_samples
from shared.stitching import extends

_MIN_LOGPROB = -9999.0  # the API's stand-in for -inf


class ResponseError(ValueError):
    """The response lacks the token fields tokentrail adds (not a tokentrail server?)."""


def _as_dict(response: Any) -> Mapping[str, Any]:
    if isinstance(response, Mapping):
        return response
    dump = getattr(response, "model_dump", None)
    if dump is None:
        raise TypeError("expected a chat completion, a Responses object or an Anthropic message (SDK object or dict)")
    data: Mapping[str, Any] = dump()
    return data


_ANTHROPIC_FINISH = {"end_turn": "stop", "stop_sequence": "stop", "max_tokens": "length", "tool_use": "tool_calls"}


def _as_chat_completion(data: Mapping[str, Any]) -> Mapping[str, Any]:
    """A Responses object or an Anthropic message as the chat completion the same stored turn makes."""
    if data.get("object") == "response":
        output = list(data.get("output") or [])
        fields = output[-1] if output else {}
        text = "".join(
            part.get("text") or ""
            for item in output
            if item.get("type") == "message"
            for part in item.get("content") or []
        )
        reasoning = "".join(
            part.get("text") or ""
            for item in output
            if item.get("type") == "reasoning"
            for part in item.get("summary") or []
        )
        calls = [
            {
                "id": i.get("call_id"),
                "type": "function",
                "function": {"name": i.get("name"), "arguments": i.get("arguments")},
            }
            for i in output
            if i.get("type") == "function_call"
        ]
        incomplete = (data.get("incomplete_details") or {}).get("reason") == "max_output_tokens"
        finish = "length" if incomplete else ("tool_calls" if calls else "stop")
        message = {"content": text or None, "reasoning_content": reasoning or None, "tool_calls": calls or None}
    elif data.get("type") == "message" and "content" in data:
        fields = data
        blocks = list(data.get("content") or [])
        calls = [
            {
                "id": b.get("id"),
                "type": "function",
                "function": {"name": b.get("name"), "arguments": json.dumps(b.get("input"))},
            }
            for b in blocks
            if b.get("type") == "tool_use"
        ]
        message = {
            "content": "".join(b.get("text") or "" for b in blocks if b.get("type") == "text") or None,
            "reasoning_content": "".join(b.get("thinking") or "" for b in blocks if b.get("type") == "thinking")
            or None,
            "tool_calls": calls or None,
        }
        finish = _ANTHROPIC_FINISH.get(str(data.get("stop_reason")), str(data.get("stop_reason") or ""))
    else:
        return data
    ids, lps = fields.get("generation_token_ids"), fields.get("generation_log_probs")
    choice = {
        "token_ids": ids,
        "logprobs": {"content": [{"logprob": lp} for lp in lps]} if lps is not None else None,
        "finish_reason": finish,
        "message": message,
    }
    prompt = fields.get("prompt_token_ids")
    return {
        "prompt_token_ids": prompt,
        "choices": [choice],
        "tokentrail": data.get("tokentrail"),
        "model": data.get("model"),
    }


class Trajectory:
    def __init__(self, *, choice: int = 0) -> None:
        self.choice = choice  # which choice of an n > 1 response continues the episode
        self.turns: list[TurnRecord] = []
        self._seqs: list[tuple[list[int], list[int]]] = []
        self._info: dict[str, Any] = {}
        self.model = ""

    def add(self, response: Any, *, reward: float | None = None) -> TurnRecord:
        data = _as_chat_completion(_as_dict(response))
        prompt = data.get("prompt_token_ids")
        choices = data.get("choices") or []
        if prompt is None or len(choices) <= self.choice or choices[self.choice].get("token_ids") is None:
            raise ResponseError("the response has no prompt_token_ids / token_ids: is it from tokentrail?")
        choice = choices[self.choice]
        completion = list(choice["token_ids"])
        entries = (choice.get("logprobs") or {}).get("content") or []
        lps: list[float | None] = [None if e["logprob"] == _MIN_LOGPROB else e["logprob"] for e in entries]
        if len(lps) != len(completion):
            lps = [None] * len(completion)
        info = dict(choice.get("tokentrail") or data.get("tokentrail") or {})
        prev = self._seqs[-1] if self._seqs else None
        whole = [*prev[0], *prev[1]] if prev else []
        continues = prev is not None and extends(whole, prompt)
        message = choice.get("message") or {}
        turn = TurnRecord(
            message_id=str(info.get("message_id") or data.get("id") or len(self.turns)),
            prompt_delta_ids=list(prompt[len(whole) :]) if continues else list(prompt),
            completion_ids=completion,
            logprobs=lps,
            finish_reason=str(choice.get("finish_reason") or ""),
            stop_reason=choice.get("stop_reason"),
            reused_prefix_len=int(info.get("reused_prefix_len") or 0),
            fork=prev is not None and not continues,
            prompt_method=info.get("prompt_method"),
            prompt_length=len(prompt),
            reward=reward,
            content=message.get("content"),
            reasoning_content=message.get("reasoning_content") or message.get("reasoning"),
            tool_calls=message.get("tool_calls"),
        )
        self.turns.append(turn)
        self._seqs.append((list(prompt), completion))
        self._info = {**self._info, **info}
        self.model = str(data.get("model") or self.model)
        return turn

    def rollout(self, *, reward: float | None = None, user_id: str = "") -> Rollout:
        if not self.turns:
            raise ValueError("no turns yet: add() a response first")
        rows = [{"logprobs": t.logprobs, "sampling": t.sampling} for t in self.turns]
        leaf = self.turns[-1].message_id
        return Rollout(
            rollout_id=leaf,
            chat_id=str(self._info.get("chat_id") or ""),
            leaf_message_id=leaf,
            user_id=user_id,
            model_name=self.model,
            tokenizer_hash="",
            template_hash="",
            engine="",
            turns=self.turns,
            samples=build_samples(self._seqs, rows),
            reward=reward,
        )
