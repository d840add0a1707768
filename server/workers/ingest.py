"""Checks on what a worker sends, before any of it is stored or streamed: token ids inside the
announced vocabulary, logprobs that are log-probabilities, lengths that agree, and text that SQL can
store (a generated NUL becomes U+FFFD). Pure functions: the hub decides what a problem costs."""

from __future__ import annotations

import itertools
import logging
import math
from typing import Any, cast

from server.streams.protocol import TokenBatch, concatenated
from shared.protocol import GenerationRecord
from shared.step_frames import Tokens

log = logging.getLogger(__name__)

_LOGPROB_SLACK = 1e-3  # float error of a log-softmax near probability 1


def token_problem(ids: list[int], logprobs: list[float | None], vocab_size: int | None) -> str | None:
    """What is wrong with token ids (outside the announced vocabulary) or logprobs (not finite, or
    above 0: a log-probability), or None. The common case is checked with builtins over the whole list
    (min, max, sum: no Python step per token); only a list that fails them is walked to name the culprit."""
    limit = vocab_size if vocab_size is not None else 2**31
    if ids and (min(ids) < 0 or max(ids) >= limit):
        bad = next(t for t in ids if not 0 <= t < limit)
        return f"token id {bad} is outside the vocabulary [0, {limit})"
    if not logprobs:
        return None
    values = cast("list[float]", logprobs if None not in logprobs else [lp for lp in logprobs if lp is not None])
    # a sum is not finite when some value is -inf, inf or nan (or, for huge values, when it overflows)
    if not values or (math.isfinite(sum(values)) and max(values) <= _LOGPROB_SLACK):
        return None
    for lp in values:
        if not (math.isfinite(lp) and lp <= _LOGPROB_SLACK):
            return f"logprob {lp} is not a finite log-probability"
    return None


def token_batch(frame: Tokens, streamed: int, vocab_size: int | None) -> TokenBatch | str | None:
    """The stream batch of a tokens frame of current work (``streamed`` tokens so far), or what is
    wrong with the frame; None for an empty frame or one that follows a gap."""
    if not frame.token_ids:
        return None
    n = len(frame.token_ids)
    channels = frame.channels or ""
    top = frame.top_logprobs
    if (
        len(frame.logprobs) != n
        or len(frame.texts) != n
        or (channels and len(channels) != n)
        or (top is not None and len(top) != n)
    ):
        return "a tokens frame with mismatched lengths"
    if frame.start > streamed:
        # an earlier frame was not appended (Redis briefly away): the finished record fills the gap
        log.info("tokens %d.. of %s follow a gap; left to the finished record", frame.start, frame.message_id)
        return None
    problem = token_problem(frame.token_ids, frame.logprobs, vocab_size)
    if problem is None and frame.prompt_ids is not None:
        problem = token_problem(frame.prompt_ids, [], vocab_size)
    if problem is not None:
        return problem
    prompt = frame.prompt_ids if frame.start == 0 else None
    texts = frame.texts
    if "\x00" in "".join(texts):  # one scan of the step's text, not one per token
        texts = [without_nul(t) for t in texts]
    version = frame.policy_version or 0
    return TokenBatch(frame.start, frame.token_ids, frame.logprobs, texts, channels, top, prompt, version)


def record_problem(record: GenerationRecord, streamed: list[int], vocab_size: int | None) -> str | None:
    """What is wrong with a finished record whose message streamed ``streamed``, or None."""
    problem = token_problem(record.completion_ids, record.logprobs, vocab_size) or token_problem(
        record.prompt_ids, [], vocab_size
    )
    if problem is None and record.completion_ids[: len(streamed)] != streamed:
        problem = "the finished record's tokens differ from the tokens it streamed"
    if problem is None and (
        len(record.logprobs) != len(record.completion_ids) or len(record.text_offsets) != len(record.completion_ids)
    ):
        problem = "the finished record's logprobs or text offsets do not match its tokens"
    if problem is None:
        problem = spans_problem(record.policy_versions, len(record.completion_ids))
    return problem


def spans_problem(spans: list[tuple[int, int]], tokens: int) -> str | None:
    """What is wrong with a record's policy version spans (none, from an older worker, is fine)."""
    if not spans:
        return None
    starts = [s for s, _ in spans]
    if starts[0] != 0 or any(b <= a for a, b in itertools.pairwise(starts)) or starts[-1] >= max(tokens, 1):
        return "the finished record's policy_versions spans are not increasing starts within its completion"
    if any(v < 0 for _, v in spans):
        return "the finished record's policy_versions has a negative version"
    return None


def without_nul(text: str) -> str:
    """A generated NUL character becomes U+FFFD (same length, so text offsets hold): PostgreSQL text
    cannot store it, and readers must see what is stored. The token ids stay exact."""
    return text.replace("\x00", "\ufffd") if "\x00" in text else text


def _json_without_nul(value: Any) -> Any:
    if isinstance(value, str):
        return without_nul(value)
    if isinstance(value, list):
        return [_json_without_nul(v) for v in value]
    if isinstance(value, dict):
        return {without_nul(k): _json_without_nul(v) for k, v in value.items()}
    return value


def record_without_nul(record: GenerationRecord) -> GenerationRecord:
    """The record with every generated NUL character as U+FFFD (see ``without_nul``)."""
    texts = ("completion_text", "content", "reasoning_content")
    update: dict[str, Any] = {f: without_nul(v) for f in texts if (v := getattr(record, f)) and "\x00" in v}
    if record.tool_calls:
        cleaned = _json_without_nul(record.tool_calls)
        if cleaned != record.tool_calls:
            update["tool_calls"] = cleaned
    return record.model_copy(update=update) if update else record


def joined_batch(first: TokenBatch, then: TokenBatch) -> TokenBatch | None:
    """``first`` followed by ``then`` as one batch, or None when they do not join (a gap or overlap,
    or one carries channels or top logprobs and the other not)."""
    return concatenated((first, then)) if then.start == first.end else None
