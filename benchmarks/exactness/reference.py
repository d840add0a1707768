"""The independent oracle: the chat template's own render of a conversation as token ids, message text
encoded safely, written apart from ``ChatFormat.render``.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from shared.protocol import WorkMessage
from worker.chat_format import ChatFormat, template_message

_MASK = "\ue000ref{}\ue001"
_MASK_RE = re.compile("\ue000ref(\\d+)\ue001")


@dataclass(frozen=True)
class Reference:
    """A reference render: token ids, and for each masked text the (message index, start, end) of its
    tokens."""

    ids: list[int]
    spans: list[tuple[int, int, int]]

    def text_end(self, message: int) -> int | None:
        """Where the last text of message ``message`` ends in ``ids`` (None: it rendered no text)."""
        ends = [end for m, _, end in self.spans if m == message]
        return max(ends) if ends else None


def reference_render(
    fmt: ChatFormat, messages: Sequence[WorkMessage], tools: list[dict[str, Any]] | None, gen: bool
) -> Reference | None:
    """The template's render of ``messages`` as token ids, message text encoded safely; None if the
    template rewrites message text so that it cannot be isolated.

    Written here independently of ``ChatFormat.render``: the template renders once with every
    non-empty text (content, reasoning) replaced by a sentinel — empty texts stay empty, so templates that
    test them (``if content``) branch as for the real message — and once for real; the two must agree
    once the sentinels are put back. Template text is tokenized with control tokens recognised
    (``encode_template_text``), message text with them split (``encode_content``).
    """
    texts: list[tuple[int, str]] = []

    def mask(index: int, value: str | None) -> str | None:
        if not value:
            return value
        texts.append((index, value))
        return _MASK.format(len(texts) - 1)

    masked = [
        template_message(m, mask(i, m.content) or "", mask(i, m.reasoning_content)) for i, m in enumerate(messages)
    ]
    real = [template_message(m, m.content, m.reasoning_content) for m in messages]
    try:
        rendered = fmt.render_text(masked, add_generation_prompt=gen, tools=tools)
        reference = fmt.render_text(real, add_generation_prompt=gen, tools=tools)
    except Exception:  # a template may raise on what it does not support
        return None
    if _MASK_RE.sub(lambda m: texts[int(m.group(1))][1], rendered) != reference:
        return None
    ids: list[int] = []
    spans: list[tuple[int, int, int]] = []
    pos = 0
    for match in _MASK_RE.finditer(rendered):
        ids += fmt.encode_template_text(rendered[pos : match.start()])
        index, text = texts[int(match.group(1))]
        begin = len(ids)
        ids += fmt.encode_content(text)
        spans.append((index, begin, len(ids)))
        pos = match.end()
    return Reference(ids + fmt.encode_template_text(rendered[pos:]), spans)
