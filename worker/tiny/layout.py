"""The special and added tokens of the tiny model's tokenizer, per built-in chat template.

Tests and ``benchmarks/template_zoo`` take these tables from here rather than copying them.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["CHATML", "LLAMA3", "LLAMA3_SPECIALS", "TINY_TEMPLATES", "TokenLayout", "template_layout"]


@dataclass(frozen=True)
class TokenLayout:
    """The special and added tokens of a tokenizer (as its tokenizer_config.json lists them)."""

    specials: tuple[str, ...]  # special tokens, in id order (ids 0..)
    added: tuple[str, ...]  # non-special added tokens (single ids, kept by skip_special_tokens), next ids
    eos: str  # the tokenizer's eos_token and config.eos_token_id
    pad: str
    bos: str | None
    stop: tuple[str, ...]  # generation_config.json eos_token_id (a single id if only one)


CHATML = TokenLayout(
    specials=("<|endoftext|>", "<|im_start|>", "<|im_end|>"),
    added=("<think>", "</think>", "<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>"),
    eos="<|im_end|>",
    pad="<|endoftext|>",
    bos=None,
    stop=("<|im_end|>",),
)
LLAMA3_SPECIALS: tuple[str, ...] = (
    "<|begin_of_text|>",
    "<|end_of_text|>",
    "<|start_header_id|>",
    "<|end_header_id|>",
    "<|eot_id|>",
    "<|eom_id|>",
    "<|python_tag|>",
    "<|finetune_right_pad_id|>",
)
LLAMA3 = TokenLayout(
    specials=LLAMA3_SPECIALS,
    added=(),
    eos="<|end_of_text|>",
    pad="<|finetune_right_pad_id|>",
    bos="<|begin_of_text|>",
    stop=("<|eot_id|>", "<|eom_id|>", "<|end_of_text|>"),
)
# Built-in chat templates (worker/tiny/templates/<name>.jinja) and the tokens each needs.
_TEMPLATE_TOKENS: dict[str, TokenLayout] = {"chatml": CHATML, "llama3": LLAMA3}
TINY_TEMPLATES: tuple[str, ...] = tuple(_TEMPLATE_TOKENS)


def template_layout(template: str) -> TokenLayout:
    """The tokens of a built-in template; ValueError for an unknown one."""
    try:
        return _TEMPLATE_TOKENS[template]
    except KeyError:
        raise ValueError(f"unknown tiny template {template!r}; known: {', '.join(TINY_TEMPLATES)}") from None
