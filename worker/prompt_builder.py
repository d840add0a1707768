"""Builds each prompt token-exactly (DESIGN section 5), from the tokenizer and chat template alone.

First turn: the template's full render, message text encoded so it can never forge control
tokens. Later turns: ``A.prompt + A.completion + closer + bridge`` where A is the nearest
assistant ancestor with stored tokens (``WorkFrame.prior``). History is never re-rendered.

What a template looks like is learnt by probing it with sentinel messages, once:
- the turn closer: the special tokens the template writes right after an assistant turn (and
  after an assistant turn that made tool calls, which may differ: llama3's ``<|eom_id|>``);
- the bridge: the template renders a fixed base conversation (system, user, assistant shaped like
  A) followed by the new messages; the text after the base assistant's closer is the bridge, so it
  starts with the template's separator and renders the new messages exactly as the template would.

A history edit — a changed tokenizer, template, system prompt or tool list, or an assistant
message between A and the new turn that has no tokens — forks a new chain with a full render.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

from shared.errors import ErrorCode
from shared.protocol import WorkFrame, WorkMessage
from shared.stitching import stitch, synthetic_closer
from worker.chat_format import ChatFormat, RenderError
from worker.engine import EngineError

PromptMode = Literal["stitch", "naive"]

_BASE_REPLY = "base reply"  # the base assistant turn's text: located by value among the masked texts
_PROBE_CALL = {"id": "call_probe", "type": "function", "function": {"name": "probe_fn", "arguments": {}}}


@dataclass(frozen=True)
class BuiltPrompt:
    prompt_ids: list[int]
    prior_message_id: str | None = None
    reused_prefix_len: int = 0
    synthetic_token_count: int = 0
    bridge_ids: tuple[int, ...] = ()
    fork: bool = False
    fork_reason: str | None = None


@dataclass(frozen=True)
class TemplateShape:
    plain_closer: tuple[int, ...]  # closes an ordinary assistant turn
    tool_closer: tuple[int, ...]  # closes an assistant turn that made tool calls
    closers: frozenset[int]


def _msg(role: str, content: str, **extra: Any) -> WorkMessage:
    return WorkMessage(id=f"probe-{role}", role=role, content=content, **extra)


def probe_template(fmt: ChatFormat) -> TemplateShape:
    specials = set(fmt.tokenizer.all_special_ids)

    def closer_after(assistant: WorkMessage) -> tuple[int, ...]:
        rendered, _ = fmt.render_masked([_msg("user", "u"), assistant], add_generation_prompt=False)
        # the sentinel of the assistant's content is the last one; closers are the special tokens
        # at the end of its turn (after any tool-call text), before the trailing separator
        end = rendered.rfind("\ue001") + 1
        ids = fmt.encode_template_text(rendered[end:])
        while ids and ids[-1] not in specials:
            ids.pop()  # the separator after the closer ("\n" in ChatML)
        run: list[int] = []
        while ids and ids[-1] in specials:
            run.insert(0, ids.pop())
        return tuple(run)

    plain = closer_after(_msg("assistant", "a"))
    try:
        tool = closer_after(_msg("assistant", "a", tool_calls=[_PROBE_CALL])) or plain
    except Exception:  # templates without tool support: tool turns close like plain ones
        tool = plain
    return TemplateShape(plain, tool, frozenset(plain) | frozenset(tool))


class PromptBuilder:
    def __init__(self, fmt: ChatFormat, *, mode: PromptMode = "stitch") -> None:
        self.fmt = fmt
        self.mode = mode
        self.shape = probe_template(fmt)

    def build(self, frame: WorkFrame) -> BuiltPrompt:
        messages, tools = frame.messages, frame.tools
        if self.mode == "naive":
            return BuiltPrompt(self.full_render(messages, tools))
        reason = self._fork_reason(frame)
        if reason is not None:
            has_history = any(m.role == "assistant" for m in messages)
            return BuiltPrompt(self.full_render(messages, tools), fork=has_history, fork_reason=reason)
        prior = frame.prior
        assert prior is not None
        at = next(i for i, m in enumerate(messages) if m.id == prior.message_id)
        turn_closer = self.shape.tool_closer if prior.has_tool_calls else self.shape.plain_closer
        closer = synthetic_closer(
            prior.completion_ids, prior.finish_reason, prior.stop_reason, self.shape.closers, turn_closer
        )
        bridge = self.bridge(messages[: at + 1], messages[at + 1 :], tools)
        stitched = stitch(prior.prompt_ids, prior.completion_ids, closer, bridge)
        return BuiltPrompt(
            stitched.prompt_ids,
            prior_message_id=prior.message_id,
            reused_prefix_len=stitched.reused_prefix_len,
            synthetic_token_count=stitched.synthetic_token_count,
            bridge_ids=tuple(bridge),
        )

    def _fork_reason(self, frame: WorkFrame) -> str | None:
        prior = frame.prior
        if prior is None:
            return "no earlier assistant turn has stored tokens"
        if (prior.tokenizer_hash, prior.template_hash) != (self.fmt.tokenizer_hash, self.fmt.template_hash):
            return "the tokenizer or chat template changed"
        system = next((m.content for m in frame.messages if m.role == "system"), None)
        if system != prior.system_prompt:
            return "the system prompt changed"
        if (frame.tools or None) != (prior.tools or None):
            return "the tool list changed"
        ids = [m.id for m in frame.messages]
        if prior.message_id not in ids:
            return "the stored turn is not on this path"
        new = frame.messages[ids.index(prior.message_id) + 1 :]
        if not new:
            return "no new messages after the stored turn"
        if any(m.role in ("assistant", "system") for m in new):
            return "an assistant message without stored tokens follows the stored turn"
        return None

    def full_render(self, messages: list[WorkMessage], tools: list[dict[str, Any]] | None) -> list[int]:
        try:
            return self.fmt.render(messages, tools=tools, add_generation_prompt=True)
        except RenderError as exc:
            raise EngineError(ErrorCode.bad_request.value, str(exc)) from exc

    def bridge(
        self, history: list[WorkMessage], new: list[WorkMessage], tools: list[dict[str, Any]] | None
    ) -> list[int]:
        """The new messages rendered after a base conversation shaped like ``history``'s end."""
        prior_turn = history[-1]
        base = [m for m in history if m.role == "system"][:1]
        base += [
            _msg("user", "base"),
            _msg("assistant", _BASE_REPLY, tool_calls=prior_turn.tool_calls or None),
        ]
        try:
            rendered, texts = self.fmt.render_masked([*base, *new], add_generation_prompt=True, tools=tools)
        except RenderError as exc:
            raise EngineError(ErrorCode.bad_request.value, f"cannot render the new messages: {exc}") from exc
        marker = f"\ue000tt{texts.index(_BASE_REPLY)}\ue001"
        pos = rendered.index(marker) + len(marker)
        turn_closer = self.shape.tool_closer if prior_turn.tool_calls else self.shape.plain_closer
        closer_text = self.fmt.tokenizer.decode(list(turn_closer), skip_special_tokens=False)
        cut = rendered.find(closer_text, pos) if closer_text else pos
        if cut < 0:
            raise EngineError(ErrorCode.bad_request.value, "the chat template did not close the assistant turn")
        return self.fmt.encode_masked(rendered[cut + len(closer_text) :], texts)
