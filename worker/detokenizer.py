"""Incremental detokenization: the text each new token adds, without re-decoding everything.

Decoding a window of recent tokens and diffing handles tokenizers whose pieces change with
context (byte-level merges, SentencePiece's leading-space rule). A token that ends inside a
multi-byte character contributes "" until the character completes.
"""

from __future__ import annotations

from typing import Any

_REPLACEMENT = "\ufffd"


class IncrementalDetokenizer:
    def __init__(self, tokenizer: Any, *, skip_special_tokens: bool = True) -> None:
        self._tok = tokenizer
        self._skip = skip_special_tokens
        self._ids: list[int] = []
        self._prefix_offset = 0  # window start: context so the next piece decodes correctly
        self._read_offset = 0  # tokens up to here have been turned into text
        self.text = ""

    def _decode(self, ids: list[int]) -> str:
        text: str = self._tok.decode(ids, skip_special_tokens=self._skip)
        return text

    def add(self, token_id: int) -> str:
        """Append one token; return the text delta it completes ("" if none yet)."""
        self._ids.append(token_id)
        prefix = self._decode(self._ids[self._prefix_offset : self._read_offset])
        full = self._decode(self._ids[self._prefix_offset :])
        if len(full) > len(prefix) and not full.endswith(_REPLACEMENT):
            delta = full[len(prefix) :]
            self._prefix_offset = self._read_offset
            self._read_offset = len(self._ids)
            self.text += delta
            return delta
        return ""

    def flush(self) -> str:
        """Text still held back at the end (e.g. an incomplete character), as decoded."""
        full = self._decode(self._ids[self._prefix_offset :])
        prefix = self._decode(self._ids[self._prefix_offset : self._read_offset])
        delta = full[len(prefix) :] if full.startswith(prefix) else ""
        self._read_offset = len(self._ids)
        self._prefix_offset = self._read_offset
        self.text += delta
        return delta
