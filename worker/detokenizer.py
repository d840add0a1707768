"""Incremental detokenization: the text each new token adds, without re-decoding everything.

Decoding a window of recent tokens and diffing handles tokenizers whose pieces change with
context (byte-level merges, SentencePiece's leading-space rule). A token that ends inside a
multi-byte character contributes "" until the character completes.

A transformers fast tokenizer whose ``decode`` is exactly its Rust tokenizer's (no clean-up pass)
runs the window in Rust (``tokenizers``' ``DecodeStream``: one call per token, the same algorithm);
any other tokenizer decodes the window in Python with ``tokenizer.decode``, twice per token. The
pieces are the same either way (tests/test_detokenizer.py checks them against each other).
"""

from __future__ import annotations

from typing import Any

_REPLACEMENT = "\ufffd"
# transformers >= 5 skips the clean-up pass for BPE models unless this is set on the tokenizer
_FORCE_BPE_CLEANUP = "clean_up_tokenization_spaces_for_bpe_even_though_it_will_corrupt_output"


def transformers_backend(tokenizer: Any, *, fast: tuple[str, ...], base: tuple[str, ...]) -> Any | None:
    """A fast tokenizer's ``tokenizers.Tokenizer``, when the tokenizer's class keeps the methods ``fast``
    of ``PreTrainedTokenizerFast`` and ``base`` of ``PreTrainedTokenizerBase`` as transformers defines
    them (nothing overridden between those methods and the backend), else None."""
    try:
        from tokenizers import Tokenizer
        from transformers import PreTrainedTokenizerFast
        from transformers.tokenization_utils_base import PreTrainedTokenizerBase
    except ImportError:
        return None
    backend = getattr(tokenizer, "_tokenizer", None)
    cls = type(tokenizer)
    if not isinstance(backend, Tokenizer):
        return None
    for owner, names in ((PreTrainedTokenizerFast, fast), (PreTrainedTokenizerBase, base)):
        if any(getattr(cls, name, None) is not getattr(owner, name) for name in names):
            return None
    return backend


def rust_backend(tokenizer: Any) -> Any | None:
    """The ``tokenizers.Tokenizer`` that ``tokenizer.decode`` is exactly, or None when its decode does
    more (a clean-up pass, an overridden decode) or it is not a fast tokenizer."""
    try:
        from tokenizers.decoders import DecodeStream  # noqa: F401  (tokenizers >= 0.21)
    except ImportError:
        return None
    backend = transformers_backend(tokenizer, fast=("_decode",), base=("decode",))
    if backend is None:
        return None
    if getattr(tokenizer, "clean_up_tokenization_spaces", False):
        # transformers >= 5 does not clean up BPE output unless forced; older versions always do
        skipped = (
            hasattr(tokenizer, _FORCE_BPE_CLEANUP)
            and not getattr(tokenizer, _FORCE_BPE_CLEANUP)
            and type(backend.model).__name__ == "BPE"
        )
        if not skipped:
            return None
    return backend


_UNSET: Any = object()


class IncrementalDetokenizer:
    def __init__(self, tokenizer: Any, *, skip_special_tokens: bool = True, rust: Any = _UNSET) -> None:
        """``rust``: ``rust_backend(tokenizer)`` when the caller has it already (None: the Python path)."""
        self._tok = tokenizer
        self._skip = skip_special_tokens
        self._ids: list[int] = []
        self._prefix_offset = 0  # window start: context so the next piece decodes correctly
        self._read_offset = 0  # tokens up to here have been turned into text
        self._pieces: list[str] = []
        self._text: str | None = ""  # "".join(self._pieces) when not None
        self._rust = rust_backend(tokenizer) if rust is _UNSET else rust
        self._stream: Any = None
        if self._rust is not None:
            from tokenizers.decoders import DecodeStream

            self._stream = DecodeStream(skip_special_tokens=skip_special_tokens)

    @property
    def text(self) -> str:
        """All text so far."""
        if self._text is None:
            self._text = "".join(self._pieces)
        return self._text

    @text.setter
    def text(self, value: str) -> None:
        self._pieces = [value]
        self._text = value

    def _decode(self, ids: list[int]) -> str:
        text: str = self._tok.decode(ids, skip_special_tokens=self._skip)
        return text

    def add(self, token_id: int) -> str:
        """Append one token; return the text delta it completes ("" if none yet)."""
        self._ids.append(token_id)
        stream = self._stream
        if stream is not None:
            try:
                piece: str | None = stream.step(self._rust, token_id)
            except Exception:
                # The window's text stopped extending what it gave before (a decoder whose pieces
                # are not prefix-stable): go on in Python from the same window, as that one did.
                self._stream = None
            else:
                if piece is None:
                    return ""
                self._prefix_offset = self._read_offset
                self._read_offset = len(self._ids)
                self._pieces.append(piece)
                self._text = None
                return piece
        prefix = self._decode(self._ids[self._prefix_offset : self._read_offset])
        full = self._decode(self._ids[self._prefix_offset :])
        if len(full) > len(prefix) and not full.endswith(_REPLACEMENT):
            delta = full[len(prefix) :]
            self._prefix_offset = self._read_offset
            self._read_offset = len(self._ids)
            self._pieces.append(delta)
            self._text = None
            return delta
        return ""

    def flush(self) -> str:
        """Text still held back at the end (e.g. an incomplete character), as decoded."""
        full = self._decode(self._ids[self._prefix_offset :])
        prefix = self._decode(self._ids[self._prefix_offset : self._read_offset])
        delta = full[len(prefix) :] if full.startswith(prefix) else ""
        self._read_offset = len(self._ids)
        self._prefix_offset = self._read_offset
        if self._stream is not None:  # its window is ours no longer
            from tokenizers.decoders import DecodeStream

            self._stream = DecodeStream(skip_special_tokens=self._skip)
            self._ids, self._prefix_offset, self._read_offset = [], 0, 0
        if delta:
            self._pieces.append(delta)
            self._text = None
        return delta
