"""OpenAI response bodies, stream chunk pieces and errors built from stored messages and token batches.

Token ids ride on every response the way vLLM's ``return_token_ids`` shapes them: ``prompt_token_ids``
at the top (chat) or per choice (text completions), ``token_ids`` per choice, and in streams the prompt
ids in a choice's first chunk and the token-id delta in every chunk. ``tokentrail`` carries where the
request landed in the chat tree.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import orjson

from server.chats.repository import decode_stop_reason, policy_spans
from server.errors import ApiError
from server.models import Message, MessageTokens
from shared.errors import ErrorCode
from shared.packing import unpack_floats, unpack_ids

# vLLM's stand-in for a -inf logprob (JSON has no infinities; SDKs expect a number)
MIN_LOGPROB = -9999.0


def dumps(body: Any) -> bytes:
    return orjson.dumps(body)


def finite(lp: float | None) -> float:
    return MIN_LOGPROB if lp is None or math.isnan(lp) or math.isinf(lp) else lp


def token_texts(tokens: MessageTokens) -> list[str]:
    ends = unpack_ids(tokens.text_offsets)
    starts = [0, *ends[:-1]]
    return [tokens.completion_text[a:b] for a, b in zip(starts, ends, strict=True)]


def stored_logprobs(tokens: MessageTokens) -> list[float | None]:
    return [None if lp != lp else lp for lp in unpack_floats(tokens.logprobs)]


def _token(token_id: int, text: str, as_ids: bool) -> str:
    return f"token_id:{token_id}" if as_ids else text


def logprob_entries(
    ids: list[int],
    lps: list[float | None],
    texts: list[str],
    tops: Sequence[Sequence[tuple[int, float, str]] | None] | None,
    *,
    top_n: int,
    as_ids: bool,
) -> list[dict[str, Any]]:
    """OpenAI's ``logprobs.content``: one entry per completion token (the sampled token's logprob,
    DESIGN D7), with up to ``top_n`` alternatives when the stream carried them."""
    out = []
    for k, (tid, lp, text) in enumerate(zip(ids, lps, texts, strict=True)):
        alts = (tops[k] if tops is not None and k < len(tops) else None) or []
        out.append(
            {
                "token": _token(tid, text, as_ids),
                "logprob": finite(lp),
                "bytes": list(text.encode()),
                "top_logprobs": [
                    {"token": _token(i, t, as_ids), "logprob": finite(v), "bytes": list(t.encode())}
                    for i, v, t in alts[:top_n]
                ],
            }
        )
    return out


def generate_logprob_entries(
    ids: list[int],
    lps: list[float | None],
    tops: Sequence[Sequence[tuple[int, float, str]] | None] | None,
    *,
    top_n: int,
) -> list[dict[str, Any]]:
    """``/inference/v1/generate``'s ``logprobs.content`` in its default ``output_mode="tokens"``: vLLM's
    integer ``token_id``, ``logprob``, ``rank`` (the sampled token's place among the alternatives, when
    they were computed) and ``top_logprobs`` as a list. Each entry and alternative also carries
    ``token: "token_id:<id>"``, the name vLLM's generate route gave tokens before it had output modes,
    which clients built for it (``renderers``, verifiers' train client) check."""
    out = []
    for k, (tid, lp) in enumerate(zip(ids, lps, strict=True)):
        alts = (tops[k] if tops is not None and k < len(tops) else None) or []
        rank = next((r for r, (i, _, _) in enumerate(alts, 1) if i == tid), None)
        out.append(
            {
                "token_id": tid,
                "token": f"token_id:{tid}",
                "logprob": finite(lp),
                "rank": rank,
                "top_logprobs": [
                    {"token_id": i, "token": f"token_id:{i}", "logprob": finite(v), "rank": r}
                    for r, (i, v, _) in enumerate(alts[:top_n], 1)
                ],
            }
        )
    return out


def finish_reason(msg: Message) -> str | None:
    if msg.tool_calls and msg.finish_reason == "stop":
        return "tool_calls"
    return msg.finish_reason


def assistant_message(msg: Message, *, with_tools: bool = True) -> dict[str, Any]:
    calls = msg.tool_calls if with_tools else None
    body: dict[str, Any] = {"role": "assistant", "content": msg.content if (msg.content or not calls) else None}
    if calls:
        body["tool_calls"] = calls
    if msg.reasoning_content is not None:
        body["reasoning_content"] = msg.reasoning_content
        body["reasoning"] = msg.reasoning_content
    return body


def tokentrail_info(msg: Message, tokens: MessageTokens | None, *, forked: bool) -> dict[str, Any]:
    info: dict[str, Any] = {
        "chat_id": msg.chat_id,
        "message_id": msg.id,
        "reused_prefix_len": tokens.reused_prefix_len if tokens else 0,
        "forked": forked or bool(tokens and tokens.fork),
        "worker_id": msg.worker_id,
    }
    if spans := policy_spans(msg):
        info["policy_versions"] = spans
    if tokens is not None:
        info["prompt_method"] = tokens.prompt_method
        info["synthetic_token_count"] = tokens.synthetic_token_count
        info["cached_tokens"] = tokens.num_cached_tokens
        if tokens.prompt_check is not None:
            info["prompt_check"] = tokens.prompt_check
            info["prompt_matched"] = tokens.prompt_check in ("match", "prefix-match")
    return info


def usage(prompt: int, completion: int, cached: int | None) -> dict[str, Any]:
    return {
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
        "prompt_tokens_details": {"cached_tokens": cached or 0},
    }


def stop_reason(tokens: MessageTokens | None) -> int | str | None:
    return decode_stop_reason(tokens.stop_reason) if tokens is not None else None


def failure(msg: Message) -> ApiError:
    """The error a message that did not complete answers with."""
    try:
        code = ErrorCode(msg.error_code or ErrorCode.engine_error.value)
    except ValueError:
        code = ErrorCode.engine_error
    status = 400 if code in (ErrorCode.context_overflow, ErrorCode.bad_request) else None
    return ApiError(code, msg.error or f"generation ended {msg.state}", status_code=status)
