"""Parse a generated assistant message (token IDs) into client-facing fields.

The worker keeps the exact token IDs for later prompts; this parser only fills the OpenAI/vLLM-style
``content``, ``reasoning_content`` and ``tool_calls`` fields returned to clients. The dialect is chosen
from the tokenizer's vocabulary (and chat template), never from a model name:

* **reasoning** (Qwen3 / DeepSeek-R1): ``<think>`` ... ``</think>``. A ``</think>`` with no ``<think>``
  before it closes a block the generation prompt opened, so the text before it is reasoning. When the
  chat template's generation prompt itself ends with ``<think>``, the completion is reasoning up to its
  first ``</think>`` (a ``<think>`` inside is reasoning text), all of it if none comes.
* **hermes tool calls** (Qwen2.5 / Qwen3 / Hermes): ``<tool_call>`` ``{"name": ..., "arguments": {...}}``
  ``</tool_call>``, any number of blocks.
* **llama3 tool calls**: ``<|python_tag|>`` then ``{"name": ..., "parameters": {...}}`` objects separated
  by ``;`` up to the end of the completion; and, because Llama 3's JSON tool calling has no marker, a
  completion whose whole visible text is one JSON object with ``"name"`` and ``"parameters"`` (or
  ``"arguments"``) keys.
* none of these markers in the vocabulary: everything is content.

Markers are recognised **only as their token IDs**: the same characters produced as ordinary text tokens
(e.g. a model echoing user text) are plain text and cannot forge structure. Whether a marker is a
special or a normal added token does not matter: spans are decoded without the marker ids, and a marker
id that has no structural role (a stray ``</tool_call>``, a second ``<think>``, a ``<tool_call>`` inside
the reasoning) is rendered as its literal text.

Malformed output never raises: unclosed ``<think>`` makes the rest reasoning; a ``<tool_call>`` block
that is unclosed, is not a JSON object, or lacks ``"name"`` stays in ``content`` as its raw text; each
such case adds a note to ``ParsedOutput.malformed``.

Whitespace policy (exactly):

* ``reasoning_content``: the decoded reasoning text with surrounding whitespace removed (``str.strip``);
  ``None`` when there is no reasoning block, ``""`` for an empty one.
* ``content``: the visible pieces (text outside the reasoning block and outside parsed tool calls, raw
  text of malformed blocks included) concatenated in order, verbatim, then ``str.strip``-ed as a whole.
  So the ``"\\n\\n"`` after ``</think>`` and the newlines around ``<tool_call>`` blocks go, whitespace
  between pieces stays, and a completion without markers yields its decoded text stripped.
* tool-call JSON is parsed from the stripped block text; ``arguments`` given as an object is
  re-serialized with ``json.dumps(..., ensure_ascii=False)``, given as a string it is kept as is.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Sequence
from dataclasses import dataclass, field
from functools import cached_property
from typing import Any

__all__ = ["ChannelTracker", "OutputParser", "ParsedOutput", "block_call"]

THINK_OPEN = "<think>"
THINK_CLOSE = "</think>"
TOOL_CALL_OPEN = "<tool_call>"
TOOL_CALL_CLOSE = "</tool_call>"
PYTHON_TAG = "<|python_tag|>"

_SNIPPET = 80  # characters of offending text quoted in a malformed note


@dataclass
class ParsedOutput:
    content: str
    reasoning_content: str | None = None
    # OpenAI shape: {"id": "call_...", "type": "function", "function": {"name": str, "arguments": str}}
    tool_calls: list[dict[str, Any]] = field(default_factory=list)
    # Human-readable notes about what could not be parsed (that text is kept in content/reasoning).
    malformed: list[str] = field(default_factory=list)


class _Malformed(ValueError):
    """A block looked like a tool call but is not a valid one."""


def _reject_constant(name: str) -> Any:
    # NaN/Infinity are not JSON; json.dumps would pass them on to clients as invalid JSON text.
    raise ValueError(f"{name} is not valid JSON")


_JSON = json.JSONDecoder(parse_constant=_reject_constant)


def _snippet(text: str) -> str:
    text = text.strip()
    return repr(text if len(text) <= _SNIPPET else text[:_SNIPPET] + "...")


def _marker_id(tokenizer: Any, token: str) -> int | None:
    """The id of ``token`` if the vocabulary has it as one token (not the unk token), else None."""
    try:
        token_id = tokenizer.convert_tokens_to_ids(token)
    except (KeyError, ValueError, TypeError):
        return None
    if not isinstance(token_id, int) or token_id < 0:
        return None
    unk = getattr(tokenizer, "unk_token_id", None)
    if unk is not None and token_id == unk:
        return None
    # Some tokenizers map unknown strings to an id without declaring an unk token: check the round trip.
    if tokenizer.convert_ids_to_tokens(token_id) != token:
        return None
    return token_id


def _default_template(tokenizer: Any) -> str | None:
    template = getattr(tokenizer, "chat_template", None)
    if isinstance(template, dict):  # named templates: the default one renders chats
        template = template.get("default") or next(iter(template.values()), None)
    return template if isinstance(template, str) and template else None


def _prompt_opens_think(tokenizer: Any, template: str | None) -> bool:
    """Whether the template's generation prompt ends inside an opened ``<think>`` block."""
    if template is None:
        return False
    try:
        rendered = tokenizer.apply_chat_template(
            [{"role": "user", "content": "ping"}],
            tokenize=False,
            add_generation_prompt=True,
            chat_template=template,
        )
    except Exception:  # any template error (jinja, raise_exception, missing vars): assume not opened
        return False
    return isinstance(rendered, str) and rendered.rstrip().endswith(THINK_OPEN)


def _call_from_object(obj: Any) -> tuple[str, str]:
    """(name, arguments JSON text) of a decoded tool-call object, or _Malformed."""
    if not isinstance(obj, dict):
        raise _Malformed("not a JSON object")
    name = obj.get("name")
    if not isinstance(name, str) or not name:
        raise _Malformed('missing "name"')
    args = obj["arguments"] if "arguments" in obj else obj.get("parameters")
    if args is None:
        return name, "{}"
    if isinstance(args, str):
        return name, args
    if isinstance(args, dict):
        return name, json.dumps(args, ensure_ascii=False)
    raise _Malformed(f'"arguments" of {name!r} is neither an object nor a string')


def block_call(body: str) -> tuple[str, str]:
    """(name, arguments) of the text between ``<tool_call>`` and ``</tool_call>``, or ValueError /
    RecursionError: the one rule for parsing and for streaming (``ChannelTracker``)."""
    return _call_from_object(_JSON.decode(body.strip()))


def _tool_call(index: int, name: str, arguments: str) -> dict[str, Any]:
    # Deterministic: the same generation always gets the same ids (replays, caching, RL exports).
    digest = hashlib.sha256(json.dumps([index, name, arguments], ensure_ascii=False).encode()).hexdigest()
    function = {"name": name, "arguments": arguments}
    return {"id": f"call_{digest[:24]}", "type": "function", "function": function}


class OutputParser:
    """Splits completion token IDs into content, reasoning and tool calls; see the module docstring."""

    def __init__(
        self,
        tokenizer: Any,
        *,
        think: tuple[int, int] | None = None,
        hermes: tuple[int, int] | None = None,
        python_tag: int | None = None,
        prompt_opens_think: bool = False,
    ) -> None:
        """Prefer ``for_tokenizer``; this takes the marker ids ((open, close) pairs) directly."""
        self._tok = tokenizer
        self.think = think
        self.hermes = hermes
        self.python_tag = python_tag
        self.prompt_opens_think = prompt_opens_think and think is not None
        self._markers: dict[int, str] = {}
        for ids, texts in (
            (think, (THINK_OPEN, THINK_CLOSE)),
            (hermes, (TOOL_CALL_OPEN, TOOL_CALL_CLOSE)),
            ((python_tag,) if python_tag is not None else None, (PYTHON_TAG,)),
        ):
            if ids is not None:
                self._markers.update(zip(ids, texts, strict=True))
        specials = {int(i) for i in getattr(tokenizer, "all_special_ids", [])}
        decoder = getattr(tokenizer, "added_tokens_decoder", {}) or {}
        specials.update(int(i) for i, tok in decoder.items() if getattr(tok, "special", False))
        # Stop tokens (eos, <|im_end|>, <|eot_id|>, <|eom_id|>) at the end are dropped; markers are kept.
        self._trailing = frozenset(specials - self._markers.keys())
        self._lone_texts: dict[int, str] = {}  # structural tokens' text decoded alone (streams_alone)

    @classmethod
    def for_tokenizer(cls, tokenizer: Any, chat_template: str | None = None) -> OutputParser:
        """Choose the dialect from the tokenizer's vocabulary and the chat template (default: the
        tokenizer's own); a marker counts only if it is one token in the vocabulary."""

        def pair(open_text: str, close_text: str) -> tuple[int, int] | None:
            open_id, close_id = _marker_id(tokenizer, open_text), _marker_id(tokenizer, close_text)
            return (open_id, close_id) if open_id is not None and close_id is not None else None

        think = pair(THINK_OPEN, THINK_CLOSE)
        template = chat_template if chat_template is not None else _default_template(tokenizer)
        return cls(
            tokenizer,
            think=think,
            hermes=pair(TOOL_CALL_OPEN, TOOL_CALL_CLOSE),
            python_tag=_marker_id(tokenizer, PYTHON_TAG),
            prompt_opens_think=think is not None and _prompt_opens_think(tokenizer, template),
        )

    def opened_by(self, prompt_ids: Sequence[int]) -> bool:
        """Whether this prompt leaves a reasoning block open: a ``<think>`` among its last tokens
        with no ``</think>`` after it (the generation prompt of Qwen3 and DeepSeek-R1; not Qwen3 with
        ``enable_thinking=False``, whose prompt closes an empty block)."""
        if self.think is None:
            return False
        open_id, close_id = self.think
        tail = list(prompt_ids[-8:])
        opened = False
        for token_id in tail:
            if token_id == open_id:
                opened = True
            elif token_id == close_id:
                opened = False
        return opened

    def channels(self, *, prompt_opens_think: bool) -> ChannelTracker:
        return ChannelTracker(self, prompt_opens_think)

    @cached_property
    def markers_literal(self) -> bool:
        """Whether each marker streams as its literal text (not a special token that decoding skips),
        as ``parse`` renders a marker that is text."""
        return all(self._decode([token_id]) == text for token_id, text in self._markers.items())

    def streams_alone(self, token_id: int, text: str) -> bool:
        """Whether ``text``, a structural token's streamed text, is that token's own text. It is not when
        the detokenizer flushed earlier bytes with it (an incomplete UTF-8 sequence before a special
        token becomes U+FFFD on it); hiding such a token would hide that text too."""
        own = self._lone_texts.get(token_id)
        if own is None:
            own = self._lone_texts[token_id] = self._decode([token_id])
        return text == own

    # ---- decoding ----------------------------------------------------------------------------------
    def _decode(self, ids: Sequence[int]) -> str:
        if not ids:
            return ""
        text: str = self._tok.decode(list(ids), skip_special_tokens=True, clean_up_tokenization_spaces=False)
        return text

    def _text(self, ids: Sequence[int]) -> str:
        """Decode a span; marker ids in it become their literal text whether special or not."""
        parts: list[str] = []
        start = 0
        for k, token_id in enumerate(ids):
            marker = self._markers.get(token_id)
            if marker is not None:
                parts += [self._decode(ids[start:k]), marker]
                start = k + 1
        parts.append(self._decode(ids[start:]))
        return "".join(parts)

    # ---- parsing -----------------------------------------------------------------------------------
    def parse(self, completion_ids: Sequence[int], *, prompt_opens_think: bool | None = None) -> ParsedOutput:
        """Parse one completion. ``prompt_opens_think`` overrides what the chat template implied (the
        caller may know its actual prompt ended with ``<think>``); it matters only for a completion with
        no think marker at all (then all of it is unclosed reasoning)."""
        ids = list(completion_ids)
        while ids and ids[-1] in self._trailing:
            ids.pop()
        notes: list[str] = []
        opened = self.prompt_opens_think if prompt_opens_think is None else prompt_opens_think
        # A ``</think>`` before any ``<think>`` closes a block the prompt opened. When the caller knows
        # the prompt did not open one, it is a stray marker (kept as text): streaming can then classify
        # every token as it comes, with no later token turning streamed content into reasoning.
        retroactive = prompt_opens_think is None or opened
        reasoning_ids, visible = self._split_reasoning(ids, opened and self.think is not None, notes, retroactive)
        pieces, calls = self._split_tool_calls(visible, notes)
        content = "".join(pieces).strip()
        if not calls and self.python_tag is not None and content.startswith("{"):
            bare = self._bare_json_call(content, notes)
            if bare is not None:
                calls, content = [bare], ""
        reasoning = None if reasoning_ids is None else self._text(reasoning_ids).strip()
        tool_calls = [_tool_call(i, name, args) for i, (name, args) in enumerate(calls)]
        return ParsedOutput(content, reasoning, tool_calls, notes)

    def _split_reasoning(
        self,
        ids: list[int],
        opened: bool,
        notes: list[str],
        retroactive: bool = True,
    ) -> tuple[list[int] | None, list[int]]:
        """(reasoning ids or None, visible ids). Only the first think block is reasoning."""
        if self.think is None:
            return None, ids
        open_id, close_id = self.think
        first_open = ids.index(open_id) if open_id in ids else None
        first_close = ids.index(close_id) if close_id in ids else None
        if first_close is not None and (first_open is None or first_close < first_open) and retroactive:
            return ids[:first_close], ids[first_close + 1 :]  # the prompt opened the block
        if opened:  # its first </think> closes it; a <think> inside is reasoning text, as it streamed
            if first_close is not None:
                return ids[:first_close], ids[first_close + 1 :]
            notes.append(f"the prompt opened {THINK_OPEN} and the completion never closed it: all reasoning")
            return ids, []
        if first_open is not None:
            try:
                close = ids.index(close_id, first_open + 1)
            except ValueError:
                notes.append(f"unclosed {THINK_OPEN}: the text after it is kept as reasoning")
                return ids[first_open + 1 :], ids[:first_open]
            return ids[first_open + 1 : close], ids[:first_open] + ids[close + 1 :]
        return None, ids

    def _split_tool_calls(self, ids: list[int], notes: list[str]) -> tuple[list[str], list[tuple[str, str]]]:
        """(content pieces in order, [(name, arguments)]). Unparsable blocks stay in the pieces as text."""
        pieces: list[str] = []
        calls: list[tuple[str, str]] = []
        tc_open, tc_close = self.hermes if self.hermes is not None else (None, None)
        text_start = 0  # ids[text_start:k] is plain content not yet decoded
        k = 0
        while k < len(ids):
            token_id = ids[k]
            if tc_open is not None and token_id == tc_open:
                end = k + 1
                while end < len(ids) and ids[end] not in (tc_open, tc_close, self.python_tag):
                    end += 1
                body = self._text(ids[k + 1 : end])
                if end == len(ids) or ids[end] != tc_close:
                    notes.append(f"unclosed {TOOL_CALL_OPEN} {_snippet(body)}: kept as content")
                    k = end  # the raw text (opener included) stays in content
                    continue
                try:
                    calls.append(block_call(body))
                except (ValueError, RecursionError) as exc:  # _Malformed is a ValueError
                    notes.append(f"{TOOL_CALL_OPEN} block {_snippet(body)}: {exc}; kept as content")
                else:
                    pieces.append(self._text(ids[text_start:k]))
                    text_start = end + 1
                k = end + 1
            elif self.python_tag is not None and token_id == self.python_tag:
                body = self._text(ids[k + 1 :])
                try:
                    found = self._python_tag_calls(body)
                except (ValueError, RecursionError) as exc:
                    notes.append(f"{PYTHON_TAG} call {_snippet(body)}: {exc}; kept as content")
                else:
                    pieces.append(self._text(ids[text_start:k]))
                    calls += found
                    text_start = len(ids)
                break  # a python_tag call runs to the end of the completion
            else:
                if token_id in self._markers:  # a marker with no structural role here
                    notes.append(f"stray {self._markers[token_id]} kept as content")
                k += 1
        pieces.append(self._text(ids[text_start:]))
        return pieces, calls

    @staticmethod
    def _python_tag_calls(body: str) -> list[tuple[str, str]]:
        """JSON objects separated by ';' (a trailing ';' is tolerated), all valid or _Malformed/ValueError."""
        calls: list[tuple[str, str]] = []
        pos, end = 0, len(body)

        def skip_ws(p: int) -> int:
            while p < end and body[p].isspace():
                p += 1
            return p

        pos = skip_ws(pos)
        if pos == end:
            raise _Malformed("no JSON after the tag")
        while pos < end:
            obj, pos = _JSON.raw_decode(body, pos)
            calls.append(_call_from_object(obj))
            pos = skip_ws(pos)
            if pos < end:
                if body[pos] != ";":
                    raise _Malformed(f"unexpected text after a call at character {pos}")
                pos = skip_ws(pos + 1)
        return calls

    @staticmethod
    def _bare_json_call(content: str, notes: list[str]) -> tuple[str, str] | None:
        """Llama 3 JSON tool calling: the whole content is one {"name", "parameters"/"arguments"} object."""
        try:
            obj = _JSON.decode(content)
        except (ValueError, RecursionError):
            return None  # ordinary text that starts with "{"
        if not isinstance(obj, dict) or "name" not in obj or not ("parameters" in obj or "arguments" in obj):
            return None  # JSON, but not shaped like a call: plain content
        try:
            return _call_from_object(obj)
        except _Malformed as exc:
            notes.append(f"JSON tool call {_snippet(content)}: {exc}; kept as content")
            return None


class ChannelTracker:
    """Classifies completion tokens one at a time, for streaming: each token is content, reasoning,
    held tool-call text, an unparsed block's close or hidden (``shared.protocol`` CHANNEL_*), following
    ``OutputParser.parse``'s rules with the prompt's ``prompt_opens_think`` given (so a ``</think>`` the
    prompt did not open is literal text in both).

    Parsing is a view (DESIGN D19): a token whose place the parse cannot know yet is held, never shown
    as something it may not be. A ``<tool_call>`` block is held up to its close, then dropped (it parsed:
    the call comes with the finished message) or released as content (CHANNEL_UNPARSED, with the same
    ``block_call`` rule as ``parse``). What only the end decides (an unclosed block, a ``<|python_tag|>``
    tail, a reply that may be one bare JSON call, a marker whose streamed text is not its literal text)
    holds everything from there on; the finished message then carries it."""

    def __init__(self, parser: OutputParser, prompt_opens_think: bool) -> None:
        self._p = parser
        self._state = "reasoning" if prompt_opens_think and parser.think is not None else "content"
        self._think_done = self._state == "reasoning"  # only the first block is reasoning
        self._block: list[int] = []  # the open tool-call block's ids
        self._visible = False  # non-whitespace content seen (a bare JSON call is the whole content)
        self._pending = False  # the last ordinary token streamed "": its bytes may still come

    def feed(self, token_id: int, text: str) -> str:
        """The channel of the next token; ``text`` is what it adds to the streamed text."""
        p = self._p
        state = self._state
        if state == "held":
            return "t"
        marker = p._markers.get(token_id)
        structural = marker is not None or token_id in p._trailing
        if structural and (self._pending or not p.streams_alone(token_id, text)):
            # It carries earlier text, or earlier bytes are still pending and will come out (as U+FFFD)
            # on a token after it, in another channel than the one they belong to: the end decides.
            return self._hold()
        if not structural:
            self._pending = not text
        if state == "reasoning":
            assert p.think is not None
            if token_id == p.think[1]:
                self._state = "content"
                return "x"
            return "r" if marker is None or p.markers_literal else self._hold()
        if state == "tool":
            return self._in_block(token_id)
        if p.think is not None and not self._think_done and token_id == p.think[0]:
            self._think_done = True
            self._state = "reasoning"
            return "x"
        if p.hermes is not None and token_id == p.hermes[0]:
            self._state, self._block = "tool", []
            return "t"
        if token_id == p.python_tag or (marker is not None and not p.markers_literal):
            return self._hold()
        if token_id in p._trailing:
            return "x"
        if not self._visible and text.strip():
            self._visible = True
            if p.python_tag is not None and text.lstrip().startswith("{"):
                return self._hold()  # Llama 3's JSON tool calling: the whole content may be one call
        return "c"

    def _hold(self) -> str:
        self._state = "held"  # to the end: the finished message decides
        return "t"

    def _in_block(self, token_id: int) -> str:
        p = self._p
        assert p.hermes is not None
        if token_id != p.hermes[1]:
            if token_id in p._markers:  # another opener, a think marker: left to the end (rare)
                return self._hold()
            self._block.append(token_id)
            return "t"
        self._state = "content"
        try:
            block_call(p._text(self._block))
        except (ValueError, RecursionError):
            if not p.markers_literal:  # its streamed text lacks the markers: the message carries it
                return self._hold()
            self._visible = True
            return "u"
        return "t"
