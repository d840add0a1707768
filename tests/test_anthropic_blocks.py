"""The Anthropic stream's content blocks (``server.anthropic.streaming._Blocks``) as a client assembles
them: each channel streams as one block, so echoing the blocks back gives the stored message even when
reasoning comes after visible text (a model that writes text, then a ``<think>`` block, then more text).
Pure: no server; the token texts and channels are what a worker sends."""

from __future__ import annotations

import json
from typing import Any

from server.anthropic.streaming import _Blocks
from server.anthropic.translate import _assistant_turn
from shared.channels import ReplyStream
from shared.protocol import CHANNEL_CONTENT as C
from shared.protocol import CHANNEL_HIDDEN as X
from shared.protocol import CHANNEL_REASONING as R


def _assemble(chunks: list[bytes]) -> list[dict[str, Any]]:
    """The content blocks of a stream's events, as the SDK accumulates them; checks their framing."""
    blocks: list[dict[str, Any]] = []
    open_index: int | None = None
    for chunk in chunks:
        name, data = chunk.decode().strip().split("\n")
        body = json.loads(data.removeprefix("data: "))
        kind = name.removeprefix("event: ")
        if kind == "content_block_start":
            assert open_index is None and body["index"] == len(blocks)
            blocks.append(dict(body["content_block"]))
            open_index = body["index"]
        elif kind == "content_block_delta":
            assert body["index"] == open_index
            delta = body["delta"]
            field = "thinking" if delta["type"] == "thinking_delta" else "text"
            blocks[body["index"]][field] += delta[field]
        elif kind == "content_block_stop":
            assert body["index"] == open_index
            open_index = None
    assert open_index is None
    return blocks


def _stream(batches: list[list[tuple[str, str]]], content: str, reasoning: str | None) -> list[dict[str, Any]]:
    reply, blocks = ReplyStream(), _Blocks()
    chunks: list[bytes] = []
    for batch in batches:
        texts = [text for text, _ in batch]
        chunks += blocks.add(reply.feed(texts, "".join(ch for _, ch in batch)))
    chunks += blocks.add(reply.finish(content, reasoning))
    chunks += blocks.end_text()
    assert not reply.mismatch
    return _assemble(chunks)


def test_reasoning_after_text_streams_after_one_text_block() -> None:
    # text, a stray </think> (text), more text, then a think block, then text again
    batches = [
        [("Dave", C), (" said", C), ("\n</think>", C)],
        [("\n\nOn 2", C), ("<think>", X), ("The user", R)],
        [(" asks.", R), ("</think>", X), ("\n\nLike", C), (" this.", C)],
    ]
    content, reasoning = "Dave said\n</think>\n\nOn 2\n\nLike this.", "The user asks."
    blocks = _stream(batches, content, reasoning)
    assert [b["type"] for b in blocks] == ["text", "thinking"]
    echo = _assistant_turn(blocks, "messages[1].content")
    assert echo["content"] == content
    assert echo["reasoning_content"] == reasoning


def test_reasoning_then_text_keeps_the_usual_order() -> None:
    batches = [[("<think>", X), ("Plan", R), (" it.", R)], [("</think>", X), ("\n\nDone", C), (".", C)]]
    blocks = _stream(batches, "Done.", "Plan it.")
    assert [b["type"] for b in blocks] == ["thinking", "text"]
    echo = _assistant_turn(blocks, "messages[1].content")
    assert (echo["content"], echo["reasoning_content"]) == ("Done.", "Plan it.")


def test_text_only_and_reasoning_only() -> None:
    assert [b["type"] for b in _stream([[("Hi", C), (" there", C)]], "Hi there", None)] == ["text"]
    blocks = _stream([[("<think>", X), ("Hmm", R)]], "", "Hmm")
    assert [(b["type"], b.get("thinking")) for b in blocks] == [("thinking", "Hmm")]


def test_reasoning_held_for_a_stop_string_goes_out_before_the_text() -> None:
    # "E" may begin the stop string "END": held until the reasoning ends, then sent in its own block
    reply, blocks = ReplyStream(["END"]), _Blocks()
    chunks = blocks.add(reply.feed(["<think>", "Plan E"], X + R))
    chunks += blocks.add(reply.feed(["</think>", "Go", "."], X + C + C))
    chunks += blocks.add(reply.finish("Go.", "Plan E"))
    chunks += blocks.end_text()
    assert not reply.mismatch
    out = _assemble(chunks)
    assert [(b["type"], b.get("thinking", b.get("text"))) for b in out] == [("thinking", "Plan E"), ("text", "Go.")]
