"""The model's tokenizer and chat template: identity hashes, stop tokens, and forge-proof rendering.

Forge-proof: nothing a user, a tool or a model wrote can become a control token. Every string that
reaches the template (message text, tool schemas, tool-call arguments) has its control-token strings
(special tokens and non-special added tokens such as Qwen's ``<tool_call>``) replaced by placeholders
before rendering, and each placeholder is encoded as plain text afterwards. Message text is then
encoded by one of two methods, recorded per prompt:

- ``masked``: the template is rendered with each message text replaced by a sentinel; the template's
  own text is tokenized with special tokens recognised and each message text is tokenized on its own,
  with special tokens split. Templates that ``trim``/``strip`` message text are handled by matching
  the real render against the masked one (each text as given, stripped, or stripped on one side).
- ``escaped``: for templates that inspect or rewrite message text in other ways (``split``,
  ``startswith``...), the real text is rendered (placeholders in place) and tokenized as a whole.

Template quirks handled here: templates that loop over ``tools``/``documents`` without checking for
none get empty lists; named templates (``default``, ``tool_use``) are chosen like transformers does;
a template's ``raise_exception`` becomes ``TemplateRejected`` with the template's own message.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import json
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Literal

import jinja2
import orjson
from transformers import AutoTokenizer

from shared.protocol import WorkMessage
from worker.detokenizer import transformers_backend

EncodeMethod = Literal["masked", "escaped"]

# Private-use characters delimit sentinels (message texts) and placeholders (escaped control strings).
SENTINEL = "\ue000tt{}\ue001"  # SENTINEL.format(k): message text k in a masked render (rpc finds it there)
_SENTINEL_RE = re.compile("\ue000tt(\\d+)\ue001")
_PLACEHOLDER = "\ue002{}\ue003"
_PLACEHOLDER_RE = re.compile("\ue002(\\d+)\ue003")
_SPAN_RE = re.compile("\ue000tt(\\d+)\ue001|\ue002(\\d+)\ue003")
_DELIMITERS = "\ue000-\ue005"  # a character class: sentinels, placeholders and probe locators
_MASKED_CACHE_SIZE = 256  # masked renders kept (a few kB each, with their tool schemas)
_TEMPLATE_IDS_CACHE_SIZE = 4096  # token ids of template text pieces kept
_TEMPLATE_PIECE_CHARS = 512  # longer template text is encoded every time
_UNCACHEABLE = re.compile(r"strftime_now|\brandom\b|\bnow\b")  # renders that change without their input


class RenderError(Exception):
    """The conversation cannot be rendered safely with this template."""


class TemplateRejected(RenderError):
    """The chat template itself refused the conversation (its ``raise_exception``)."""


def _sha(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()


@dataclass
class Rendered:
    """Template text in which ``\\ue000tt<i>\\ue001`` stands for ``texts[i]`` (message text, encoded on
    its own) and ``\\ue002<j>\\ue003`` for ``escapes[j]`` (a control string, encoded as plain text)."""

    text: str
    texts: list[str]
    escapes: list[str]
    method: EncodeMethod


@dataclass
class _Escaper:
    """Replaces control strings (and our delimiter characters) in arbitrary JSON-like data."""

    pattern: re.Pattern[str]
    escapes: list[str] = field(default_factory=list)

    def text(self, value: str) -> str:
        def sub(m: re.Match[str]) -> str:
            self.escapes.append(m.group(0))
            return _PLACEHOLDER.format(len(self.escapes) - 1)

        return self.pattern.sub(sub, value)

    def data(self, value: Any) -> Any:
        if isinstance(value, str):
            return self.text(value)
        if isinstance(value, list):
            return [self.data(v) for v in value]
        if isinstance(value, dict):
            return {k: self.data(v) for k, v in value.items()}
        return value


_TRANSFORMS: tuple[Callable[[str], str], ...] = (
    lambda t: t,
    str.strip,
    str.lstrip,
    str.rstrip,
    lambda t: t.strip("\n"),
)


def _align(masked: str, texts: list[str], reference: str) -> list[str] | None:
    """The texts as the template wrote them: each sentinel ``i`` of ``masked`` must stand for
    ``texts[i]`` or a stripped form of it such that the whole equals ``reference``; None otherwise."""
    parts = _SENTINEL_RE.split(masked)  # literal, index, literal, index, ..., literal
    literals, indices = parts[0::2], [int(i) for i in parts[1::2]]
    chosen: list[str] = []

    def match(k: int, pos: int) -> bool:
        if not reference.startswith(literals[k], pos):
            return False
        pos += len(literals[k])
        if k == len(indices):
            return pos == len(reference)
        original = texts[indices[k]]
        for candidate in dict.fromkeys(f(original) for f in _TRANSFORMS):
            if reference.startswith(candidate, pos):
                chosen.append(candidate)
                if match(k + 1, pos + len(candidate)):
                    return True
                chosen.pop()
        return False

    if not match(0, 0):
        return None
    out = list(texts)
    for k, index in enumerate(indices):
        out[index] = chosen[k]
    return out


@dataclass
class ChatFormat:
    tokenizer: Any
    template: str | dict[str, str]
    tokenizer_hash: str
    template_hash: str
    compat_hash: str
    stop_token_ids: tuple[int, ...]
    empty_lists: bool = False  # the template needs tools=[] / documents=[] instead of None
    template_kwargs: dict[str, Any] = field(default_factory=dict)  # extra variables (chat_template_kwargs)

    @classmethod
    def load(cls, model_path: str, *, template_kwargs: dict[str, Any] | None = None) -> ChatFormat:
        tok = AutoTokenizer.from_pretrained(model_path)
        template = tok.chat_template
        if isinstance(template, dict) and len(template) == 1:
            template = next(iter(template.values()))
        if not template:
            raise RenderError(f"{model_path} has no chat template; give the worker a model with one")
        backend = getattr(tok, "backend_tokenizer", None)
        tok_text = backend.to_str() if backend is not None else json.dumps(tok.get_vocab(), sort_keys=True)
        specials = json.dumps(sorted(str(t) for t in tok.all_special_tokens))
        tokenizer_hash = _sha(tok_text + specials)
        template_hash = _sha(template if isinstance(template, str) else json.dumps(template, sort_keys=True))
        stops = set()
        eos = getattr(tok, "eos_token_id", None)
        if isinstance(eos, int):
            stops.add(eos)
        try:
            from transformers import GenerationConfig

            gen = GenerationConfig.from_pretrained(model_path)
            gen_eos = gen.eos_token_id
            stops.update([gen_eos] if isinstance(gen_eos, int) else list(gen_eos or []))
        except (OSError, ValueError):
            pass
        fmt = cls(
            tokenizer=tok,
            template=template,
            tokenizer_hash=tokenizer_hash,
            template_hash=template_hash,
            compat_hash=_sha(tokenizer_hash + template_hash)[:16],
            stop_token_ids=tuple(sorted(stops)),
            template_kwargs=dict(template_kwargs or {}),
        )
        fmt.empty_lists = fmt._needs_empty_lists()
        return fmt

    # ---- tokens -------------------------------------------------------------------------------
    @property
    def special_ids(self) -> frozenset[int]:
        """Every control token id: the named specials and every added token flagged special (real
        Llama 3 tokenizers list only bos/eos as named specials but flag ``<|eot_id|>`` and the rest)."""
        if not hasattr(self, "_special_ids"):
            ids = set(self.tokenizer.all_special_ids)
            decoder = getattr(self.tokenizer, "added_tokens_decoder", {}) or {}
            ids.update(i for i, t in decoder.items() if getattr(t, "special", False))
            self._special_ids = frozenset(ids)
        return self._special_ids

    @property
    def control_strings(self) -> list[str]:
        """Strings that the tokenizer turns into one control or added token, longest first."""
        if not hasattr(self, "_control_strings"):
            added = [str(t) for t in getattr(self.tokenizer, "added_tokens_encoder", {}) if len(str(t)) > 1]
            found = set(added) | {str(t) for t in self.tokenizer.all_special_tokens if len(str(t)) > 1}
            self._control_strings = sorted(found, key=len, reverse=True)
        return self._control_strings

    def _escaper(self) -> _Escaper:
        if not hasattr(self, "_escape_re"):  # compiled once: every prompt build escapes its texts
            alternatives = [*map(re.escape, self.control_strings), f"[{_DELIMITERS}]"]
            self._escape_re = re.compile("|".join(alternatives))
        return _Escaper(self._escape_re)

    def encode_template_text(self, text: str) -> list[int]:
        """Template text: special tokens in it are real control tokens. Kept by text: the template's
        pieces around the messages (a turn's header, the generation prompt) recur in every prompt."""
        if len(text) > _TEMPLATE_PIECE_CHARS:  # a whole escaped render, a long tool list: not a recurring piece
            return list(self.tokenizer.encode(text, add_special_tokens=False))
        cache = self._template_ids
        ids = cache.get(text)
        if ids is None:
            ids = tuple(self.tokenizer.encode(text, add_special_tokens=False))
            if len(cache) >= _TEMPLATE_IDS_CACHE_SIZE:
                cache.clear()  # a new working set (another template shape) refills it
            cache[text] = ids
        return list(ids)

    @functools.cached_property
    def _template_ids(self) -> dict[str, tuple[int, ...]]:
        return {}

    def encode_content(self, text: str) -> list[int]:
        """Message text: nothing in it can become a control or added token. Special tokens are split
        by the tokenizer; strings of non-special added tokens (``<tool_call>`` in Qwen) are cut in
        two and encoded piecewise, so they come out as ordinary text tokens."""
        ids: list[int] = []
        for piece, is_marker in self._split_markers(text):
            if not is_marker:
                ids += self._split_special(piece)
                continue
            half = len(piece) // 2
            ids += self.encode_content(piece[:half]) + self.encode_content(piece[half:])
        return ids

    def _split_special(self, text: str) -> list[int]:
        """``tokenizer(text, add_special_tokens=False, split_special_tokens=True)["input_ids"]``: on a fast
        tokenizer, its Rust backend's encode with the same settings, without the wrapper's batch layers
        (half the time of a prompt's message encoding)."""
        backend = self._rust_encoder
        if backend is None or backend.truncation is not None or backend.padding is not None:
            return list(self.tokenizer(text, add_special_tokens=False, split_special_tokens=True)["input_ids"])
        before = backend.encode_special_tokens
        backend.encode_special_tokens = True
        try:
            return list(backend.encode(text, add_special_tokens=False).ids)
        finally:
            backend.encode_special_tokens = before

    @functools.cached_property
    def _rust_encoder(self) -> Any | None:
        """The ``tokenizers.Tokenizer`` that the tokenizer's ``__call__`` encodes with and nothing more
        (no overridden encoding step), else None."""
        backend = transformers_backend(self.tokenizer, fast=("_encode_plus",), base=("__call__",))
        return backend if hasattr(backend, "encode_special_tokens") else None

    def _split_markers(self, text: str) -> list[tuple[str, bool]]:
        if self._marker_re is None or not self._marker_re.search(text):
            return [(text, False)]
        out: list[tuple[str, bool]] = []
        pos = 0
        for m in self._marker_re.finditer(text):
            if m.start() > pos:
                out.append((text[pos : m.start()], False))
            out.append((m.group(0), True))
            pos = m.end()
        if pos < len(text):
            out.append((text[pos:], False))
        return out

    @property
    def _marker_re(self) -> re.Pattern[str] | None:
        if not hasattr(self, "_marker_re_cache"):
            added = [t for t in getattr(self.tokenizer, "added_tokens_encoder", {}) if len(t) > 1]
            specials = set(self.tokenizer.all_special_tokens)
            markers = sorted((t for t in added if t not in specials), key=len, reverse=True)
            self._marker_re_cache = re.compile("|".join(map(re.escape, markers))) if markers else None
        return self._marker_re_cache

    def next_control(self, text: str, start: int) -> int:
        """Position of the first control-token string in ``text`` at or after ``start`` (else ``start``)."""
        if not hasattr(self, "_control_re"):
            self._control_re = re.compile("|".join(map(re.escape, self.control_strings)) or "$^")
        m = self._control_re.search(text, start)
        return m.start() if m else start

    def encode(self, rendered: Rendered) -> list[int]:
        """Token ids of a ``Rendered``: template text with control tokens recognised, message texts
        (masked) and escaped control strings as plain text."""
        ids: list[int] = []
        pos = 0
        literal: list[str] = []  # escaped mode: literal text runs up to the next placeholder
        for m in _SPAN_RE.finditer(rendered.text):
            literal.append(rendered.text[pos : m.start()])
            pos = m.end()
            if m.group(1) is not None:
                ids += self.encode_template_text("".join(literal))
                literal = []
                text = _PLACEHOLDER_RE.sub(lambda e: rendered.escapes[int(e.group(1))], rendered.texts[int(m.group(1))])
                ids += self.encode_content(text)
            else:
                ids += self.encode_template_text("".join(literal))
                literal = []
                ids += self.encode_content(rendered.escapes[int(m.group(2))])
        literal.append(rendered.text[pos:])
        return ids + self.encode_template_text("".join(literal))

    # ---- rendering ----------------------------------------------------------------------------
    def template_for(self, tools: list[dict[str, Any]] | None) -> str:
        if isinstance(self.template, str):
            return self.template
        if tools and "tool_use" in self.template:
            return self.template["tool_use"]
        return self.template.get("default") or next(iter(self.template.values()))

    def render_text(
        self,
        messages: list[dict[str, Any]],
        *,
        add_generation_prompt: bool,
        tools: list[dict[str, Any]] | None = None,
        empty_lists: bool | None = None,
    ) -> str:
        """The template's text. Where a template fails (not rejects) on the OpenAI shapes of tools
        (``{"type": "function", "function": {...}}``) or tool-call arguments (objects), the other
        common shapes are tried: flat tool schemas (Command-R+), arguments as JSON strings
        (functionary v3.2), and schemas with an empty ``description`` where the tool or a parameter
        has none (Command-R+ reads every parameter's description)."""
        first: RenderError | None = None
        described = _described(tools) if tools else None
        shapes = [
            (f, a, d) for d in (False, True) for f, a in ((False, False), (False, True), (True, False), (True, True))
        ]
        for flat_tools, string_args, fill in shapes:
            if (flat_tools and not tools) or (string_args and not _has_calls(messages)):
                continue
            if fill and (not tools or described == tools):
                continue
            schemas = described if fill else tools
            try:
                return self._render_once(
                    _string_args(messages) if string_args else messages,
                    add_generation_prompt=add_generation_prompt,
                    tools=[t.get("function", t) for t in schemas or []] if flat_tools else schemas,
                    empty_lists=empty_lists,
                )
            except TemplateRejected:
                raise
            except RenderError as exc:
                first = first or exc
        assert first is not None
        raise first

    def _render_once(
        self,
        messages: list[dict[str, Any]],
        *,
        add_generation_prompt: bool,
        tools: list[dict[str, Any]] | None,
        empty_lists: bool | None,
    ) -> str:
        lists = self.empty_lists if empty_lists is None else empty_lists
        kwargs: dict[str, Any] = {**({"documents": []} if lists else {}), **self.template_kwargs}
        try:
            text: str = self.tokenizer.apply_chat_template(
                messages,
                tools=tools or ([] if lists else None),
                tokenize=False,
                add_generation_prompt=add_generation_prompt,
                chat_template=self.template_for(tools),
                **kwargs,
            )
        except jinja2.TemplateError as exc:
            if type(exc) is jinja2.TemplateError:  # raised by the template's raise_exception
                raise TemplateRejected(str(exc)) from exc
            raise RenderError(f"the chat template failed: {type(exc).__name__}: {exc}") from exc
        except (TypeError, ValueError, AttributeError, KeyError, IndexError) as exc:
            raise RenderError(f"the chat template failed: {type(exc).__name__}: {exc}") from exc
        return text

    def _needs_empty_lists(self) -> bool:
        """Templates that loop over ``tools`` or ``documents`` unguarded fail on None: use []."""
        probe = [{"role": "user", "content": "ping"}]
        try:
            self.render_text(probe, add_generation_prompt=True, empty_lists=False)
            return False
        except TemplateRejected:
            return False
        except RenderError:
            try:
                self.render_text(probe, add_generation_prompt=True, empty_lists=True)
                return True
            except RenderError:
                return False

    def render_parts(
        self,
        items: list[WorkMessage | dict[str, Any]],
        *,
        add_generation_prompt: bool,
        tools: list[dict[str, Any]] | None = None,
    ) -> Rendered:
        """Render a conversation forge-proof. ``WorkMessage`` items are conversation messages: their
        text is masked (method ``masked``) or, where the template rewrites text beyond stripping,
        rendered as written with control strings escaped (``escaped``). Plain dict items (probe or
        base messages built by the caller, which cuts them off) are rendered as given."""
        escaper = self._escaper()
        safe_tools = escaper.data(tools) if tools else tools
        real: list[dict[str, Any]] = []
        for m in items:
            if isinstance(m, dict):
                real.append(m)
                continue
            reasoning = None if m.reasoning_content is None else escaper.text(m.reasoning_content)
            calls = escaper.data(m.tool_calls) if m.tool_calls else None
            real.append(template_message(m, escaper.text(m.content), reasoning, calls))
        texts: list[str] = []

        def mask(value: str | None) -> str | None:
            if not value:  # nothing to protect; templates test emptiness (`if content`), so keep it empty
                return value
            texts.append(value)
            return SENTINEL.format(len(texts) - 1)

        masked = [
            m if isinstance(item, dict) else {**m, "content": mask(m["content"]) or "", **_masked_reasoning(m, mask)}
            for item, m in zip(items, real, strict=True)
        ]

        def render(msgs: list[dict[str, Any]]) -> str:
            return self.render_text(msgs, add_generation_prompt=add_generation_prompt, tools=safe_tools)

        text = self._masked_render(masked, add_generation_prompt, safe_tools, render)
        reference = render(real) if texts else text
        aligned = _align(text, texts, reference)
        if aligned is not None:
            return Rendered(text, aligned, escaper.escapes, "masked")
        # The template rewrites message text beyond stripping: keep the text as it wrote it; escaped
        # control strings stay placeholders, so they are still encoded as plain text.
        return Rendered(reference, [], escaper.escapes, "escaped")

    def _masked_render(
        self,
        masked: list[dict[str, Any]],
        add_generation_prompt: bool,
        tools: list[dict[str, Any]] | None,
        render: Callable[[list[dict[str, Any]]], str],
    ) -> str:
        """The masked render, from a cache: its input holds sentinels, not texts, so every later turn
        of a given shape (a user message after an assistant turn, under one system prompt) renders the
        same text, and only the real render (the check of the alignment) varies. Templates that read
        the clock or draw at random are rendered every time."""
        if not self._deterministic:
            return render(masked)
        try:
            key = orjson.dumps([masked, tools, add_generation_prompt])
        except TypeError:  # not plain JSON data (a non-string key): rendered as is
            return render(masked)
        cache = self._masked_cache
        text = cache.pop(key, None)
        if text is None:
            text = render(masked)
            if len(cache) >= _MASKED_CACHE_SIZE:
                del cache[next(iter(cache))]  # the least recently used
        cache[key] = text
        return text

    @functools.cached_property
    def _masked_cache(self) -> dict[bytes, str]:
        return {}

    @functools.cached_property
    def _deterministic(self) -> bool:
        sources = [self.template] if isinstance(self.template, str) else list(self.template.values())
        return not any(_UNCACHEABLE.search(source) for source in sources)

    def render(
        self,
        messages: list[WorkMessage],
        *,
        tools: list[dict[str, Any]] | None = None,
        add_generation_prompt: bool = True,
    ) -> list[int]:
        """Token IDs of the whole conversation rendered by the template, text encoded forge-proof."""
        return self.encode(self.render_parts(list(messages), add_generation_prompt=add_generation_prompt, tools=tools))


def _has_calls(messages: list[dict[str, Any]]) -> bool:
    return any(m.get("tool_calls") for m in messages)


def _described(tools: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Tool schemas with ``description: ""`` added where a function or one of its parameters lacks one."""
    out = []
    for tool in tools:
        fn = tool.get("function", tool)
        if not isinstance(fn, dict):
            out.append(tool)
            continue
        fn = {"description": "", **fn}
        params = fn.get("parameters")
        props = params.get("properties") if isinstance(params, dict) else None
        if isinstance(params, dict) and isinstance(props, dict):
            props = {k: {"description": "", **v} if isinstance(v, dict) else v for k, v in props.items()}
            fn["parameters"] = {**params, "properties": props}
        out.append({**tool, "function": fn} if "function" in tool else fn)
    return out


def _string_args(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Messages with tool-call arguments as JSON strings (as the OpenAI API carries them)."""
    out = []
    for m in messages:
        if m.get("tool_calls"):
            calls = []
            for c in m["tool_calls"]:
                fn = dict(c.get("function", {}))
                if not isinstance(fn.get("arguments"), str):
                    fn["arguments"] = json.dumps(fn.get("arguments", {}), ensure_ascii=False)
                calls.append({**c, "function": fn})
            m = {**m, "tool_calls": calls}
        out.append(m)
    return out


def _masked_reasoning(m: dict[str, Any], mask: Callable[[str | None], str | None]) -> dict[str, Any]:
    if "reasoning_content" not in m:
        return {}
    return {"reasoning_content": mask(m["reasoning_content"])}


def template_message(
    m: WorkMessage,
    content: str,
    reasoning: str | None,
    tool_calls: list[dict[str, Any]] | None = None,
) -> dict[str, Any]:
    """A message as chat templates expect it (OpenAI/HF shape; tool-call arguments as objects)."""
    out: dict[str, Any] = {"role": m.role, "content": content}
    if reasoning is not None:
        out["reasoning_content"] = reasoning
    if m.tool_call_id is not None:
        out["tool_call_id"] = m.tool_call_id
    calls_in = m.tool_calls if tool_calls is None else tool_calls
    if calls_in:
        calls = []
        for call in calls_in:
            fn = dict(call.get("function", call))
            args = fn.get("arguments")
            if isinstance(args, str):
                with contextlib.suppress(ValueError):
                    fn["arguments"] = json.loads(args)
            calls.append({**call, "type": call.get("type", "function"), "function": fn})
        out["tool_calls"] = calls
    return out
