"""The model's tokenizer and chat template: identity hashes, stop tokens, and safe rendering.

Rendering is token-exact and forge-proof: the template is rendered once with each message's
content replaced by a sentinel, the template's own text is tokenized with special tokens
recognised, and each content span is tokenized with special tokens *split* — so a user or tool
writing ``<|im_end|>`` gets plain text tokens, never the control token.
"""

from __future__ import annotations

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
        """Message content: control-token strings stay plain text."""
        ids: list[int] = self.tokenizer(text, add_special_tokens=False, split_special_tokens=True)[
            "input_ids"
        ]
        return ids

    def render_text(self, messages: list[dict[str, Any]], *, add_generation_prompt: bool) -> str:
        text: str = self.tokenizer.apply_chat_template(
            messages, tokenize=False, add_generation_prompt=add_generation_prompt, chat_template=self.template
        )
        return text

    def render(self, messages: list[WorkMessage], *, add_generation_prompt: bool = True) -> list[int]:
        """Token IDs of the whole conversation rendered by the template, content encoded safely."""
        real = [{"role": m.role, "content": m.content} for m in messages]
        masked = [{"role": m.role, "content": _SENTINEL.format(i)} for i, m in enumerate(messages)]
        reference = self.render_text(real, add_generation_prompt=add_generation_prompt)
        rendered = self.render_text(masked, add_generation_prompt=add_generation_prompt)
        ids: list[int] = []
        pos = 0
        rebuilt = []
        for match in _SENTINEL_RE.finditer(rendered):
            literal = rendered[pos : match.start()]
            content = messages[int(match.group(1))].content
            ids += self.encode_template_text(literal)
            ids += self.encode_content(content)
            rebuilt += [literal, content]
            pos = match.end()
        ids += self.encode_template_text(rendered[pos:])
        rebuilt.append(rendered[pos:])
        if "".join(rebuilt) != reference:
            # The template transforms content (trims it, splits it...): spans can't be isolated.
            if any(self._has_special_text(m.content) for m in messages):
                raise RenderError(
                    "this chat template rewrites message content, and the content contains "
                    "control-token text that could not be kept as plain text"
                )
            return self.encode_template_text(reference)
        return ids

    def _has_special_text(self, text: str) -> bool:
        return any(tok in text for tok in self.tokenizer.all_special_tokens) or any(
            tok in text for tok in getattr(self.tokenizer, "added_tokens_encoder", {})
        )
