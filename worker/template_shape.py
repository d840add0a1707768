"""What a chat template writes around an assistant turn, learnt by rendering probe conversations.

For each kind of assistant turn (plain, and one that made tool calls):

- ``generation``: the closer the template writes when the assistant turn ends the conversation (a
  training-style render without a generation prompt): what the model is taught to emit, e.g. gpt-oss
  ``<|return|>`` / ``<|call|>``, Command-R7B ``<|END_RESPONSE|><|END_OF_TURN_TOKEN|>``.
- ``history``: the closer it writes when more messages follow, e.g. gpt-oss ``<|end|>``. Usually the
  same tokens.

A closer is the first run of control tokens after the assistant's text (or tool-call arguments),
ending at the first generation stop token in it. A render that ends in eos after the closer (Phi-3.5)
or a separator after it (ChatML's ``\\n``) does not change it: both lie after the run or its stop.
Probe messages carry locators (private-use markers) in place of text, so the turn's end is found by
position, never by searching for text a role name or a user could also contain.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

from worker.chat_format import ChatFormat, RenderError

log = logging.getLogger(__name__)

LOCATOR = "\ue004{}\ue005"
PROBE_CALL_NAME = "probe_fn"


@dataclass(frozen=True)
class Closers:
    generation: tuple[int, ...]
    history: tuple[int, ...]


@dataclass(frozen=True)
class TemplateShape:
    plain: Closers
    tool: Closers

    def closers(self, tool_turn: bool) -> Closers:
        return self.tool if tool_turn else self.plain

    @property
    def history_ends(self) -> frozenset[int]:
        """The last token of each kind's history closer: a turn ending on any of them has ended."""
        return frozenset(c.history[-1] for c in (self.plain, self.tool) if c.history)

    @property
    def closer_ids(self) -> frozenset[int]:
        return frozenset((*self.plain.generation, *self.plain.history, *self.tool.generation, *self.tool.history))


def locator(name: str) -> str:
    return LOCATOR.format(name)


def probe_assistant(name: str, tool_calls: list[dict[str, Any]] | None) -> dict[str, Any]:
    """An assistant message whose end can be found: its text and each call's arguments carry a locator."""
    msg: dict[str, Any] = {"role": "assistant", "content": locator(name)}
    if tool_calls:
        msg["tool_calls"] = [
            {
                "id": c.get("id") or f"call{i}",
                "type": "function",
                "function": {
                    "name": c.get("function", c).get("name") or PROBE_CALL_NAME,
                    "arguments": {"a": locator(name)},
                },
            }
            for i, c in enumerate(tool_calls)
        ]
    return msg


def payload_end(text: str, name: str) -> int | None:
    """End of the last locator of the assistant probe ``name`` in rendered text, or None."""
    marker = locator(name)
    at = text.rfind(marker)
    return None if at < 0 else at + len(marker)


def closer_run(fmt: ChatFormat, ids: list[int]) -> tuple[tuple[int, ...], bool]:
    """The first run of control tokens in ``ids``, ending at the first generation stop token in it,
    and whether it ends on one."""
    specials, stops = fmt.special_ids, set(fmt.stop_token_ids)
    i = 0
    while i < len(ids) and ids[i] not in specials:
        i += 1
    run: list[int] = []
    while i < len(ids) and ids[i] in specials:
        run.append(ids[i])
        if ids[i] in stops:
            return tuple(run), True
        i += 1
    return tuple(run), False


def _after(fmt: ChatFormat, items: list[Any], gen: bool, name: str) -> list[int] | None:
    rendered = fmt.render_parts(items, add_generation_prompt=gen)
    end = payload_end(rendered.text, name)
    if end is None:
        return None
    rendered.text = rendered.text[end:]
    return fmt.encode(rendered)


def _probe(fmt: ChatFormat, tool_calls: list[dict[str, Any]] | None, follow: dict[str, Any]) -> Closers | None:
    """The closers of such a turn, or None where the template does not render the turn's text."""
    user = {"role": "user", "content": "probe question"}
    turn = probe_assistant("A", tool_calls)
    last = _after(fmt, [user, turn], False, "A")
    more = _after(fmt, [user, turn, follow], True, "A")
    if last is None or more is None:
        return None
    generation, stopped = closer_run(fmt, last)
    if not stopped:  # a run without a stop token opens whatever the template writes next
        generation = ()
    run, run_stopped = closer_run(fmt, more)
    if generation and run[: len(generation)] == generation:
        history = generation
    elif generation:  # the template rewrites the closer in history (gpt-oss <|return|> -> <|end|>), token for token
        history = run[: len(generation)]
    else:  # nothing closes the turn at the end; in history only a run that ends on a stop token does
        history = run if run_stopped else ()
        generation = history
    return Closers(generation, history)


def probe_template(fmt: ChatFormat) -> TemplateShape:
    plain: Closers | None = None
    try:
        plain = _probe(fmt, None, {"role": "user", "content": "probe follow-up"})
    except RenderError as exc:
        log.warning("the chat template rejected the plain probe conversation (%s); no closer learnt", exc)
    plain = plain or Closers((), ())
    call = {"id": "call_probe", "type": "function", "function": {"name": PROBE_CALL_NAME, "arguments": {}}}
    try:
        tool = _probe(fmt, [call], {"role": "tool", "tool_call_id": "call_probe", "content": "probe result"})
    except RenderError:  # templates without tool support: tool turns close like plain ones
        tool = None
    return TemplateShape(plain, tool or plain)
