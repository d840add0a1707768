"""The model's tokenizer and chat template: identity hashes, stop tokens, and safe rendering.

Rendering is token-exact and forge-proof: the template is rendered once with each message's
content replaced by a sentinel, the template's own text is tokenized with special tokens
recognised, and each content span is tokenized with special tokens *split* — so a user or tool
writing ``<|im_end|>`` gets plain text tokens, never the control token.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import re
from dataclasses import dataclass
from typing import Any

from transformers import AutoTokenizer

from shared.protocol import WorkMessage

_SENTINEL = "\ue000tt{}\ue001"
_SENTINEL_RE = re.compile("\ue000tt(\\d+)\ue001")


class RenderError(Exception):
    """The conversation cannot be rendered safely with this template."""


def _sha(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()


@dataclass
class ChatFormat:
    tokenizer: Any
    template: str
    tokenizer_hash: str
    template_hash: str
    compat_hash: str
    stop_token_ids: tuple[int, ...]

    @classmethod
    def load(cls, model_path: str) -> ChatFormat:
        tok = AutoTokenizer.from_pretrained(model_path)
        template = tok.chat_template
        if isinstance(template, dict):  # named templates: the default one renders chats
            template = template.get("default") or next(iter(template.values()))
        if not template:
            raise RenderError(f"{model_path} has no chat template; give the worker a model with one")
        backend = getattr(tok, "backend_tokenizer", None)
        tok_text = backend.to_str() if backend is not None else json.dumps(tok.get_vocab(), sort_keys=True)
        specials = json.dumps(sorted(str(t) for t in tok.all_special_tokens))
        tokenizer_hash = _sha(tok_text + specials)
        template_hash = _sha(template)
        stops = set()
        for name in ("eos_token_id",):
            value = getattr(tok, name, None)
            if isinstance(value, int):
                stops.add(value)
        try:
            from transformers import GenerationConfig

            gen = GenerationConfig.from_pretrained(model_path)
            eos = gen.eos_token_id
            stops.update([eos] if isinstance(eos, int) else list(eos or []))
        except (OSError, ValueError):
            pass
        return cls(
            tokenizer=tok,
            template=template,
            tokenizer_hash=tokenizer_hash,
            template_hash=template_hash,
            compat_hash=_sha(tokenizer_hash + template_hash)[:16],
            stop_token_ids=tuple(sorted(stops)),
        )

    # ---- tokenization ------------------------------------------------------------------------
    def encode_template_text(self, text: str) -> list[int]:
        """Template text: special tokens in it are real control tokens."""
        ids: list[int] = self.tokenizer.encode(text, add_special_tokens=False)
        return ids

    def encode_content(self, text: str) -> list[int]:
        """Message text: nothing in it can become a control or added token. Special tokens are split
        by the tokenizer; strings of non-special added tokens (``<tool_call>`` in Qwen) are cut in
        two and encoded piecewise, so they come out as ordinary text tokens."""
        ids: list[int] = []
        for piece, is_marker in self._split_markers(text):
            if not is_marker:
                ids += self.tokenizer(piece, add_special_tokens=False, split_special_tokens=True)["input_ids"]
                continue
            half = len(piece) // 2
            ids += self.encode_content(piece[:half]) + self.encode_content(piece[half:])
        return ids

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

    def render_text(
        self, messages: list[dict[str, Any]], *, add_generation_prompt: bool, tools: list[dict[str, Any]] | None = None
    ) -> str:
        text: str = self.tokenizer.apply_chat_template(
            messages,
            tools=tools or None,
            tokenize=False,
            add_generation_prompt=add_generation_prompt,
            chat_template=self.template,
        )
        return text

    def render_masked(
        self, messages: list[WorkMessage], *, add_generation_prompt: bool, tools: list[dict[str, Any]] | None = None
    ) -> tuple[str, list[str]]:
        """The template's text with every message text replaced by a sentinel, and those texts.

        Raises RenderError when the template rewrites message text (trims or splits it) in a way
        that puts control-token text at risk; such templates are rendered as a whole instead."""
        texts: list[str] = []

        def mask(value: str | None) -> str | None:
            if not value:  # nothing to protect; templates test emptiness (`if content`), so keep it empty
                return value
            texts.append(value)
            return _SENTINEL.format(len(texts) - 1)

        masked = [template_message(m, mask(m.content) or "", mask(m.reasoning_content)) for m in messages]
        rendered = self.render_text(masked, add_generation_prompt=add_generation_prompt, tools=tools)
        real = [template_message(m, m.content, m.reasoning_content) for m in messages]
        reference = self.render_text(real, add_generation_prompt=add_generation_prompt, tools=tools)
        if unmask(rendered, texts) != reference:
            raise RenderError("the chat template rewrites message text; it cannot be isolated")
        return rendered, texts

    def encode_masked(self, rendered: str, texts: list[str]) -> list[int]:
        """Tokenize masked template text: literal parts as template text, sentinels as content."""
        ids: list[int] = []
        pos = 0
        for match in _SENTINEL_RE.finditer(rendered):
            ids += self.encode_template_text(rendered[pos : match.start()])
            ids += self.encode_content(texts[int(match.group(1))])
            pos = match.end()
        return ids + self.encode_template_text(rendered[pos:])

    def render(
        self,
        messages: list[WorkMessage],
        *,
        tools: list[dict[str, Any]] | None = None,
        add_generation_prompt: bool = True,
    ) -> list[int]:
        """Token IDs of the whole conversation rendered by the template, message text encoded safely."""
        try:
            rendered, texts = self.render_masked(messages, add_generation_prompt=add_generation_prompt, tools=tools)
        except RenderError:
            if any(self._has_marker_text(t) for m in messages for t in (m.content, m.reasoning_content or "")):
                raise RenderError(
                    "this chat template rewrites message text, and the text contains control-token "
                    "strings that could not be kept as plain text"
                ) from None
            real = [template_message(m, m.content, m.reasoning_content) for m in messages]
            return self.encode_template_text(
                self.render_text(real, add_generation_prompt=add_generation_prompt, tools=tools)
            )
        return self.encode_masked(rendered, texts)

    def _has_marker_text(self, text: str) -> bool:
        return any(tok in text for tok in self.tokenizer.all_special_tokens) or bool(
            self._marker_re and self._marker_re.search(text)
        )


def unmask(rendered: str, texts: list[str]) -> str:
    return _SENTINEL_RE.sub(lambda m: texts[int(m.group(1))], rendered)


def template_message(m: WorkMessage, content: str, reasoning: str | None) -> dict[str, Any]:
    """A message as chat templates expect it (OpenAI/HF shape; tool-call arguments as objects)."""
    out: dict[str, Any] = {"role": m.role, "content": content}
    if reasoning is not None:
        out["reasoning_content"] = reasoning
    if m.tool_call_id is not None:
        out["tool_call_id"] = m.tool_call_id
    if m.tool_calls:
        calls = []
        for call in m.tool_calls:
            fn = dict(call.get("function", call))
            args = fn.get("arguments")
            if isinstance(args, str):
                with contextlib.suppress(ValueError):
                    fn["arguments"] = json.loads(args)
            calls.append({**call, "type": call.get("type", "function"), "function": fn})
        out["tool_calls"] = calls
    return out
