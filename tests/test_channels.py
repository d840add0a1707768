"""The streaming path of the output parser equals its whole-text path (DESIGN D19): the worker's
``ChannelTracker`` labels each token as it comes, ``shared.channels.ReplyStream`` turns batches of
(text, channel) into deltas, and the deltas plus the final chunk add up to ``OutputParser.parse`` of the
whole completion, character for character, however the tokens are split into engine steps. Tokenizers
are the small real ones of ``test_output_parser`` (markers as non-special and as special tokens)."""

from __future__ import annotations

import itertools

from hypothesis import given, settings
from hypothesis import strategies as st

from shared.channels import Delta, ReplyStream
from tests.test_output_parser import enc, tid, tokenizer
from worker.detokenizer import IncrementalDetokenizer
from worker.generation import StopStrings
from worker.output_parser import OutputParser, ParsedOutput

_VALID = '{"name": "get_weather", "arguments": {"city": "Paris"}}'
_LLAMA = '{"name": "get_weather", "parameters": {"city": "Paris"}}'
_FRAGMENTS = [
    "<think>",
    "</think>",
    "<tool_call>",
    "</tool_call>",
    "<|python_tag|>",
    "<|im_end|>",
    "<|eot_id|>",
    f"\n{_VALID}\n",
    _LLAMA,
    '{"name": "get_weather", "arguments": {"city": Paris}}',  # not JSON
    '{"arguments": {}}',  # no name
    '{"name": "get_weather", "arguments": {"city": "Par',  # cut
    "[1, 2]",
    ";",
    "{",
    "Hello world!",
    " How can I help you today?",
    "Let me check the weather in Paris.",
    "\n",
    "\n\n",
    " ",
    "é 你好",
]
_KINDS = ["qwen", "qwen-special", "llama3", "plain"]


def streamed(
    parser: OutputParser, ids: list[int], cuts: list[int], opened: bool, stops: list[str] | None = None
) -> tuple[str, str, ReplyStream, str]:
    """(content, reasoning) a client assembles when ``ids`` arrive in batches cut at ``cuts``; the
    stream; what was sent before the final chunk."""
    tok = parser._tok
    detok = IncrementalDetokenizer(tok)
    tracker = parser.channels(prompt_opens_think=opened)
    texts = [detok.add(t) for t in ids]
    channels = "".join(tracker.feed(t, x) for t, x in zip(ids, texts, strict=True))
    stream = ReplyStream(stops or [])
    total = Delta()
    bounds = [0, *sorted(set(cuts)), len(ids)]
    for a, b in itertools.pairwise(bounds):
        delta = stream.feed(texts[a:b], channels[a:b])
        total.content += delta.content
        total.reasoning += delta.reasoning
    before_end = total.content
    return total.content, total.reasoning, stream, before_end


def assert_views_equal(parser: OutputParser, ids: list[int], cuts: list[int], opened: bool) -> ParsedOutput:
    whole = parser.parse(ids, prompt_opens_think=opened)
    content, reasoning, stream, _ = streamed(parser, ids, cuts, opened)
    end = stream.finish(whole.content, whole.reasoning_content)
    assert stream.mismatch == [], (whole, content, reasoning)
    assert content + end.content == whole.content
    assert reasoning + end.reasoning == (whole.reasoning_content or "")
    return whole


@settings(max_examples=400, deadline=None)
@given(
    kind=st.sampled_from(_KINDS),
    pieces=st.lists(st.sampled_from(_FRAGMENTS), max_size=12),
    opened=st.booleans(),
    data=st.data(),
)
def test_random_splits_of_the_same_text_stream_the_parsed_message(
    kind: str, pieces: list[str], opened: bool, data: st.DataObject
) -> None:
    parser = OutputParser.for_tokenizer(tokenizer(kind))
    ids = enc(kind, "".join(pieces))
    cuts = data.draw(st.lists(st.integers(0, len(ids)), max_size=len(ids)))
    assert_views_equal(parser, ids, cuts, opened and parser.think is not None)


@settings(max_examples=200, deadline=None)
@given(data=st.data(), kind=st.sampled_from(["qwen", "qwen-special", "llama3"]))
def test_random_ids_stream_the_parsed_message(data: st.DataObject, kind: str) -> None:
    # What a tiny random model emits: any ids, markers drawn often so blocks nest and interleave.
    tok = tokenizer(kind)
    names = ["<think>", "</think>", "<tool_call>", "</tool_call>", "<|python_tag|>", "<|im_end|>", "<|eot_id|>"]
    markers = [tid(kind, m) for m in names if isinstance(tok.convert_tokens_to_ids(m), int)]
    ids = data.draw(st.lists(st.one_of(st.sampled_from(markers), st.integers(0, len(tok) - 1)), max_size=30))
    cuts = data.draw(st.lists(st.integers(0, len(ids)), max_size=len(ids)))
    parser = OutputParser.for_tokenizer(tok)
    assert_views_equal(parser, ids, cuts, data.draw(st.booleans()) and parser.think is not None)


def test_a_malformed_call_is_released_when_it_closes() -> None:
    """Not held to the end: the block and the text after it stream as soon as the close says it did
    not parse; a call that parsed is dropped from the text (it comes as a tool call)."""
    for kind in ("qwen", "qwen-special"):
        parser = OutputParser.for_tokenizer(tokenizer(kind))
        text = 'Hi.\n<tool_call>\n{"name": x}\n</tool_call>\nAfter the block.\n<tool_call>' + _VALID + "</tool_call>"
        ids = enc(kind, text)
        whole = assert_views_equal(parser, ids, [], False)
        _, _, _, before_end = streamed(parser, ids, [], False)
        assert whole.content == text.split("\n<tool_call>" + _VALID)[0] and len(whole.tool_calls) == 1
        if kind == "qwen":
            assert before_end == whole.content
        else:  # special markers stream as "": the finished message carries the block's text
            assert before_end == "Hi."


def test_unclosed_and_cut_blocks_stay_text() -> None:
    parser = OutputParser.for_tokenizer(tokenizer("qwen"))
    texts = ['Sure.\n<tool_call>\n{"name": "get_wea', "Hmm.<think>\nthe user wants", "<think>a</think>b<tool_call>"]
    for text in texts:
        whole = assert_views_equal(parser, enc("qwen", text), [2, 5], False)
        assert whole.tool_calls == []


def test_a_bare_json_call_is_held_until_the_end() -> None:
    parser = OutputParser.for_tokenizer(tokenizer("llama3"))
    ids = enc("llama3", " " + _LLAMA)
    whole = assert_views_equal(parser, ids, [1, 3], False)
    assert whole.content == "" and whole.tool_calls[0]["function"]["name"] == "get_weather"
    assert streamed(parser, ids, [], False)[3] == ""


def test_unknown_channels_hold_the_rest() -> None:
    stream = ReplyStream()
    assert stream.feed(["Hi", " there"], "c?") == Delta(content="Hi")
    assert stream.feed(["!"], "c") == Delta()
    assert stream.finish("Hi there!", None) == Delta(content=" there!") and stream.mismatch == []


def test_text_sent_that_the_message_lacks_is_reported() -> None:
    stream = ReplyStream()
    stream.feed(["Hello", " world"], "cc")
    assert stream.finish("Goodbye", "") == Delta() and stream.mismatch == ["content"]


@settings(max_examples=300, deadline=None)
@given(
    text=st.text(alphabet="ab \n", max_size=30),
    stops=st.lists(st.text(alphabet="ab \n", min_size=1, max_size=3), min_size=1, max_size=3),
    data=st.data(),
)
def test_stop_strings_are_never_streamed(text: str, stops: list[str], data: st.DataObject) -> None:
    """The worker stops at the piece that completes a stop string and cuts the string off the stored
    content; the stream holds back what may begin one, so it never sends what the message lacks."""
    cuts = sorted(set(data.draw(st.lists(st.integers(0, len(text)), max_size=10))))
    pieces = [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)], strict=True)]
    finder = StopStrings(stops)
    stream = ReplyStream(stops)
    sent, hit = "", None
    seen = ""
    for piece in pieces:
        seen += piece
        hit = finder.feed(piece)
        sent += stream.feed([piece], "c").content
        if hit is not None:
            break
    final = ParsedOutput(seen.strip())
    if hit is not None:
        final = StopStrings.cut(final, hit)
    end = stream.finish(final.content, None)
    assert stream.mismatch == [] and sent + end.content == final.content


def test_raw_text_keeps_its_whitespace() -> None:
    stream = ReplyStream(["\n\n"], strip=False)
    sent = stream.feed([" a", "\n", "b\n"], "").content
    assert sent == " a\nb" and stream.finish(" a\nb\n", None) == Delta(content="\n")


def test_a_marker_that_flushes_an_incomplete_character_keeps_it() -> None:
    """A byte token that does not complete a UTF-8 character streams no text; the special token after
    it flushes U+FFFD with its own text. That character is the message's (as ``parse`` decodes it), so
    the marker is not hidden with it (found by the random-ids test: ``[97, <think>, </think>, <think>]``)."""
    for kind in ("qwen", "qwen-special", "llama3"):
        tok = tokenizer(kind)
        byte = next(i for i in range(len(tok)) if tok.decode([i]) == "\ufffd")
        parser = OutputParser.for_tokenizer(tok)
        for names in (["<think>", "</think>", "<think>"], ["<tool_call>", _VALID, "</tool_call>"], ["<|im_end|>"]):
            if not all(n == _VALID or isinstance(tok.convert_tokens_to_ids(n), int) for n in names):
                continue
            ids = [byte, *(t for n in names for t in (enc(kind, n) if n == _VALID else [tid(kind, n)]))]
            for opened in {False, parser.think is not None}:
                whole = assert_views_equal(parser, ids, [], opened)
                assert "\ufffd" in (whole.content or "") + (whole.reasoning_content or ""), (kind, names, whole)


def test_bytes_pending_across_a_skipped_marker_hold_the_stream() -> None:
    """An incomplete UTF-8 sequence before a special ``</think>``: the Rust detokenizer skips the marker
    and flushes the bytes (as U+FFFD) with the next content token, though they belong to the reasoning.
    The stream holds from the marker on; the finished message puts U+FFFD in the reasoning."""
    tok = tokenizer("qwen-special")
    byte = tok.convert_tokens_to_ids("¡")  # a byte-level piece that is not a whole character
    ids = [tid("qwen-special", "<think>"), byte, tid("qwen-special", "</think>"), *enc("qwen-special", "!")]
    parser = OutputParser.for_tokenizer(tok)
    whole = assert_views_equal(parser, ids, [], False)
    assert (whole.reasoning_content, whole.content) == ("\ufffd", "!")
