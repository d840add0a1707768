"""Builds each prompt token-exactly (DESIGN section 5), from the tokenizer and chat template alone.

First turn (and forks): the template's full render, text encoded forge-proof (``worker.chat_format``).
Later turns: ``A.prompt + A.completion + closer + bridge`` where A is the nearest assistant ancestor
with stored tokens (``WorkFrame.prior``). History is never re-rendered.

- closer: what the template writes after an assistant turn, learnt by probing
  (``worker.template_shape``); added as synthetic tokens only where A did not close its turn.
- bridge: the template renders a base conversation (the real system prompt, a user turn, and an
  assistant turn shaped like A, with A's tool-call ids and names) followed by the new messages; the
  bridge is what follows the base assistant's history closer, so it starts with the template's
  separator and renders the new messages exactly as the template would after such a turn.

Closer policy, for templates whose history closer differs from the token the model stops on (gpt-oss
stops on ``<|return|>`` but writes ``<|end|>`` in history):
- ``keep`` (default): the next prompt keeps the sampled tokens; the prompt extends A exactly, and the
  conversation exports as one training sample.
- ``history``: the sampled generation closer is replaced by the template's history closer, as the
  model saw in training; the prompt no longer extends A, so the turn is recorded as a fork and export
  starts a new sample there.

A history edit — a changed tokenizer, template, system prompt or tool list, or a system message after
A — forks a new chain with a full render.

Assistant messages the client wrote (no stored tokens: a tool call it made itself, an edited reply)
after A are new messages like any other: rendered in the bridge, forge-proof, so the prompt keeps A's
stored tokens (method ``stitch-written``). The bridge's ids are checked against the tail of the full
render; a template that renders such a turn differently after real history (it rewrites earlier turns)
gets the full render, recorded as a fork with the reason.

``BuiltPrompt.method`` records how the prompt was built: ``full`` or ``stitch`` (``stitch-history``
under the history policy when the closer was replaced; ``-written`` added when the bridge holds a
client-written assistant turn), then ``/masked`` or ``/escaped`` for how the
new text was encoded (see ``worker.chat_format``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

from shared.errors import ErrorCode
from shared.protocol import WorkFrame, WorkMessage
from shared.stitching import stitch, turn_end
from worker.chat_format import ChatFormat, Rendered, RenderError, TemplateRejected
from worker.engines.contract import EngineError
from worker.template_shape import TemplateShape, payload_end, probe_assistant, probe_template

PromptMode = Literal["stitch", "naive"]
CloserPolicy = Literal["keep", "history"]
CLOSER_POLICIES: tuple[str, ...] = ("keep", "history")


@dataclass(frozen=True)
class BuiltPrompt:
    prompt_ids: list[int]
    prior_message_id: str | None = None
    reused_prefix_len: int = 0
    synthetic_token_count: int = 0
    bridge_ids: tuple[int, ...] = ()
    fork: bool = False
    fork_reason: str | None = None
    method: str = "full/masked"


def template_error(exc: RenderError) -> EngineError:
    if isinstance(exc, TemplateRejected):
        return EngineError(ErrorCode.template_rejected.value, str(exc))
    return EngineError(ErrorCode.bad_request.value, str(exc))


class PromptBuilder:
    def __init__(self, fmt: ChatFormat, *, mode: PromptMode = "stitch", closer_policy: CloserPolicy = "keep") -> None:
        self.fmt = fmt
        self.mode = mode
        self.closer_policy = closer_policy
        self.shape: TemplateShape = probe_template(fmt)

    def build(self, frame: WorkFrame) -> BuiltPrompt:
        messages, tools = frame.messages, frame.tools
        if self.mode == "naive":
            return self._full(messages, tools)
        reason = self._fork_reason(frame)
        if reason is not None:
            has_history = any(m.role == "assistant" for m in messages)
            full = self._full(messages, tools)
            return BuiltPrompt(full.prompt_ids, fork=has_history, fork_reason=reason, method=full.method)
        prior = frame.prior
        assert prior is not None
        at = next(i for i, m in enumerate(messages) if m.id == prior.message_id)
        closers = self.shape.closers(prior.has_tool_calls)
        end = turn_end(
            prior.completion_ids,
            prior.finish_reason,
            prior.stop_reason,
            closers.generation,
            closers.history,
            self.shape.history_ends,
        )
        new = messages[at + 1 :]
        bridge, encoding = self.bridge(messages[: at + 1], new, tools)
        written = any(m.role == "assistant" for m in new)
        if written:
            full = self._full(messages, tools)
            if full.prompt_ids[len(full.prompt_ids) - len(bridge) :] != bridge:
                # the template renders a written turn in a way that depends on the history before it
                return BuiltPrompt(
                    full.prompt_ids,
                    fork=True,
                    fork_reason="the chat template renders the client-written assistant turn differently after "
                    "the stored turns",
                    method=full.method,
                )
        completion = prior.completion_ids
        closer: list[int] = list(end.missing)
        rewritten = end.kind == "generation" and self.closer_policy == "history"
        if rewritten:
            completion = completion[: len(completion) - end.generation_len]
            closer = list(closers.history)
        stitched = stitch(prior.prompt_ids, completion, closer, bridge)
        return BuiltPrompt(
            stitched.prompt_ids,
            prior_message_id=prior.message_id,
            reused_prefix_len=stitched.reused_prefix_len,
            synthetic_token_count=stitched.synthetic_token_count,
            bridge_ids=tuple(bridge),
            fork=rewritten,
            fork_reason="the generation closer was replaced by the template's history closer" if rewritten else None,
            method=f"{'stitch-history' if rewritten else 'stitch'}{'-written' if written else ''}/{encoding}",
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
        if any(m.role == "system" for m in new):
            return "a system message follows the stored turn"
        return None

    def _full(self, messages: list[WorkMessage], tools: list[dict[str, Any]] | None) -> BuiltPrompt:
        try:
            rendered = self.fmt.render_parts(list(messages), add_generation_prompt=True, tools=tools)
        except RenderError as exc:
            raise template_error(exc) from exc
        return BuiltPrompt(self.fmt.encode(rendered), method=f"full/{rendered.method}")

    def full_render(self, messages: list[WorkMessage], tools: list[dict[str, Any]] | None) -> list[int]:
        return self._full(messages, tools).prompt_ids

    def bridge(
        self, history: list[WorkMessage], new: list[WorkMessage], tools: list[dict[str, Any]] | None
    ) -> tuple[list[int], str]:
        """The new messages rendered after a base conversation shaped like ``history``'s end, and
        the encoding method used. Variants of the base turn are tried for templates that refuse some
        (Llama 3.1: one tool call per message); the template's refusal of the new messages themselves
        is ``template_rejected``."""
        prior_turn = history[-1]
        system = [m for m in history if m.role == "system"][:1]
        calls = prior_turn.tool_calls or None
        variants = [calls, calls[:1]] if calls and len(calls) > 1 else [calls]
        closer = self.shape.closers(bool(calls)).history
        closer_text = self.fmt.tokenizer.decode(list(closer), skip_special_tokens=False) if closer else ""
        first_error: RenderError | None = None
        for variant in variants:
            base: list[WorkMessage | dict[str, Any]] = [
                *system,
                {"role": "user", "content": "base question"},
                probe_assistant("B", variant),
            ]
            try:
                rendered = self.fmt.render_parts([*base, *new], add_generation_prompt=True, tools=tools)
            except RenderError as exc:
                first_error = first_error or exc
                continue
            return self._cut(rendered, closer_text), rendered.method
        assert first_error is not None
        raise template_error(first_error) from first_error

    def _cut(self, rendered: Rendered, closer_text: str) -> list[int]:
        end = payload_end(rendered.text, "B")
        if end is None:
            raise EngineError(ErrorCode.bad_request.value, "the chat template did not render the previous turn")
        if closer_text:
            cut = rendered.text.find(closer_text, end)
            if cut < 0:
                raise EngineError(ErrorCode.bad_request.value, "the chat template did not close the previous turn")
            cut += len(closer_text)
        else:  # no closer: the next message starts at the first control token after the turn's text
            cut = self.fmt.next_control(rendered.text, end)
        rendered.text = rendered.text[cut:]
        return self.fmt.encode(rendered)
