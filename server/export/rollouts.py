"""Export stored conversations as RL rollouts (native ``tokentrail`` schema; see shared/rollout.py).

Rollouts are built from rows (``server/export/query.py`` lays them out, ``server/export/reader.py``
reads them batch by batch, in constant memory) and yielded one by one. One rollout per path that
ends in an assistant leaf (an assistant message with no assistant descendant); branches become
separate rollouts that share their prefix. Chats whose owner opted out of data use are never
exported.

Policy versions: each turn carries its message's ``[start, version]`` spans (a message stored before
versions were kept: ``[[0, 0]]``), each sample the version of each generated token, the rollout the
registry's checkpoint directory of each version it uses. ``min_version`` and ``max_staleness`` keep
the rollouts whose every generated token is recent enough (see ``ExportFilters``).

Rewards: a turn's reward is the environment's (``POST /v1/rewards``) when one was posted, else its OA
vote (-1, 0, 1); the rollout reward follows ``reward_rule``: ``last`` (default: the last rewarded
turn), ``mean``/``min`` over rewarded turns, or ``leaf`` (the leaf turn's). Rollouts without any have
reward None.

Speed (an export is CPU-bound in Python; see benchmarks/export.py): JSON columns are fetched as
text and parsed only for the turns that are exported, timestamps converted only where used; token
blobs are decoded with numpy once per turn, prefix checks compare the packed bytes, and a sample's
lists are built from its turns' lists. The output is the same as decoding every column first (what
``chat_rollouts`` takes).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from datetime import UTC
from typing import Any, NamedTuple

import numpy as np

from server.chats.repository import decode_stop_reason
from server.export.query import (
    DECODED,
    M_CONTENT,
    M_CREATED,
    M_DONE,
    M_ID,
    M_MODEL,
    M_PARENT,
    M_POLICY,
    M_REASONING,
    M_REWARD,
    M_ROLE,
    M_SCORE,
    M_STATE,
    M_TOOL_CALLS,
    M_VOTED,
    M_WORK,
    MANUAL,
    NO_PATHS,
    T_COMPLETION,
    T_ENGINE,
    T_FINISH,
    T_FORK,
    T_LOGPROBS,
    T_METHOD,
    T_PROMPT,
    T_REUSED,
    T_STOP,
    T_SYNTH,
    T_TEMPLATE,
    T_TOKENIZER,
    Decoders,
    ExportFilters,
    PolicyPaths,
)
from shared.rollout import (
    NO_VERSION,
    SCHEMA_NAME,
    SCHEMA_VERSION,
    RewardRule,
    build_samples,
    sample_record,
    token_versions,
)

_INT32 = np.dtype("<i4")
_FLOAT32 = np.dtype("<f4")


def chat_rollouts(
    chat: Any, msgs: Sequence[Any], tokens: dict[str, Any], filters: ExportFilters, paths: PolicyPaths = NO_PATHS
) -> list[dict[str, Any]]:
    """The rollouts of one chat from decoded rows: ``msgs`` (message columns, in id order) and
    ``tokens`` (token rows by message id, for complete assistant messages)."""
    rows = [
        (
            m.id,
            m.parent_id,
            m.role,
            m.state,
            m.content,
            m.reasoning_content,
            m.tool_calls,
            m.model_config_name,
            m.work_parameters,
            m.score,
            m.voted_at is not None,
            m.created_at,
            chat.id,
            m.policy_versions,
            m.reward,
            m.episode_done,
        )
        for m in msgs
    ]
    token_rows = {
        mid: (
            t.message_id,
            t.prompt_ids,
            t.completion_ids,
            t.logprobs,
            t.finish_reason,
            t.stop_reason,
            t.engine,
            t.tokenizer_hash,
            t.template_hash,
            t.reused_prefix_len,
            t.synthetic_token_count,
            t.fork,
            t.prompt_method,
        )
        for mid, t in tokens.items()
    }
    return rows_rollouts(chat.id, chat.user_id, rows, token_rows, filters, DECODED, paths)


def rows_rollouts(
    chat_id: str,
    user_id: str,
    msgs: Sequence[Any],
    tokens: dict[str, Any],
    filters: ExportFilters,
    dec: Decoders,
    paths: PolicyPaths = NO_PATHS,
) -> list[dict[str, Any]]:
    by_id = {m[M_ID]: m for m in msgs}
    below: set[str] = set()  # messages with an assistant descendant
    for m in msgs:
        if m[M_ROLE] == "assistant" and m[M_STATE] != MANUAL:
            parent = m[M_PARENT]
            while parent in by_id and parent not in below:
                below.add(parent)
                parent = by_id[parent][M_PARENT]
    out = []
    for m in msgs:
        if m[M_ROLE] != "assistant" or m[M_STATE] == MANUAL or m[M_ID] in below:
            continue
        rollout = path_rollout(chat_id, user_id, leaf_path(by_id, m[M_ID]), tokens, filters, dec, paths)
        if rollout is not None:
            out.append(rollout)
    return out


def leaf_path(by_id: dict[str, Any], leaf: str) -> list[Any]:
    """The rows root -> ``leaf`` (message rows by id)."""
    path = []
    cur: str | None = leaf
    while cur is not None and cur in by_id:
        row = by_id[cur]
        path.append(row)
        cur = row[M_PARENT]
    path.reverse()
    return path


def _leaf_passes(leaf: Any, filters: ExportFilters, dec: Decoders) -> bool:
    if filters.model is not None and leaf[M_MODEL] != filters.model:
        return False
    if filters.since is None and filters.until is None:
        return True
    created = dec.datetime(leaf[M_CREATED])
    if created is not None and created.tzinfo is None:
        created = created.replace(tzinfo=UTC)
    if filters.since is not None and created < filters.since:
        return False
    return not (filters.until is not None and created >= filters.until)


def _reward(turn_rewards: list[float | None], rule: RewardRule) -> float | None:
    rated = [r for r in turn_rewards if r is not None]
    if rule == "leaf":
        return turn_rewards[-1] if turn_rewards else None
    if not rated:
        return None
    if rule == "mean":
        return sum(rated) / len(rated)
    if rule == "min":
        return min(rated)
    return rated[-1]


def _blob(value: Any, kind: str) -> bytes:
    """A packed int32/float32 column (shared/packing.py) as bytes, checked like its unpackers."""
    if not value:
        return b""
    if type(value) is not bytes:
        value = bytes(value)
    if len(value) % 4:
        raise ValueError(f"packed {kind} blob has {len(value)} bytes, not a multiple of 4")
    return value  # type: ignore[no-any-return]


class _Packed(NamedTuple):
    """One exported turn as its sample needs it."""

    prompt: bytes  # packed int32
    completion: bytes
    delta: list[int]  # the turn's prompt_delta_ids
    completion_ids: list[int]
    logprobs: list[float]  # the turn's logprobs with 0.0 for None
    extends_prev: bool  # the prompt extends the previous turn's prompt + completion
    versions: list[int]  # the policy version of each completion token


LEGACY_SPANS = [[0, 0]]  # a message stored before versions were kept: every token from version 0


def _spans(raw: Any) -> list[list[int]]:
    """A message's stored ``[start, version]`` spans (None or empty: stored before versions were kept)."""
    if not raw:
        return [list(span) for span in LEGACY_SPANS]
    return [[int(start), int(version)] for start, version in raw]


def _version_floor(model: str, filters: ExportFilters, paths: PolicyPaths) -> int | None:
    """The lowest version a turn of ``model`` may have under the version filters (None: any)."""
    floors = []
    if filters.min_version is not None:
        floors.append(filters.min_version)
    if filters.max_staleness is not None:
        floors.append(paths.newest(model) - filters.max_staleness)
    return max(floors) if floors else None


def path_rollout(
    chat_id: str,
    user_id: str,
    path: list[Any],
    tokens: dict[str, Any],
    filters: ExportFilters,
    dec: Decoders,
    paths: PolicyPaths = NO_PATHS,
) -> dict[str, Any] | None:
    """The rollout of one path (message rows root -> leaf, ``leaf_path``), or None where the filters
    leave it out or it has no exported turn."""
    leaf = path[-1]
    if not _leaf_passes(leaf, filters, dec):
        return None
    # assistant messages a client wrote (OpenAI API histories) are context, not turns
    assistants = [m for m in path if m[M_ROLE] == "assistant" and m[M_STATE] != MANUAL]
    complete = all(m[M_ID] in tokens for m in assistants)
    if not complete and not filters.include_incomplete:
        return None
    turns: list[dict[str, Any]] = []
    packed: list[_Packed] = []
    first_tokens = None
    leaf_work = None
    prev_prompt = prev_completion = b""
    json_loads, to_datetime = dec.json, dec.datetime
    policy_paths: dict[str, str | None] = {}
    filter_versions = filters.min_version is not None or filters.max_staleness is not None
    for m in assistants:
        t = tokens.get(m[M_ID])
        if t is None:
            continue
        completion_blob = t[T_COMPLETION]
        if type(completion_blob) is not bytes or len(completion_blob) % 4:
            completion_blob = _blob(completion_blob, "id")
        n_completion = len(completion_blob) // 4
        spans = _spans(json_loads(m[M_POLICY]))
        used = [v for start, v in spans if start < n_completion]  # the versions of generated tokens
        model = m[M_MODEL] or ""
        if filter_versions:
            floor = _version_floor(model, filters, paths)
            if floor is not None and any(v < floor for v in used):
                return None
        for v in used:
            if policy_paths.get(str(v)) is None:
                policy_paths[str(v)] = paths.path(model, v) if v else None
        if first_tokens is None:
            first_tokens = t
        prompt_blob = t[T_PROMPT]
        if type(prompt_blob) is not bytes or len(prompt_blob) % 4:
            prompt_blob = _blob(prompt_blob, "id")
        lp_blob = t[T_LOGPROBS]
        if type(lp_blob) is not bytes or len(lp_blob) % 4:
            lp_blob = _blob(lp_blob, "float")
        # extends(prev_prompt + prev_completion, prompt), on the packed bytes
        ext = prompt_blob.startswith(prev_prompt) and prompt_blob.startswith(prev_completion, len(prev_prompt))
        prompt = np.frombuffer(prompt_blob, _INT32)
        prev_len = (len(prev_prompt) + len(prev_completion)) // 4
        delta: list[int] = (prompt[prev_len:] if prev_len and ext else prompt).tolist()
        completion: list[int] = np.frombuffer(completion_blob, _INT32).tolist()
        lps: list[Any] = np.frombuffer(lp_blob, _FLOAT32).tolist()
        zeroed = lps
        if not math.isfinite(sum(lps)):  # a -inf or nan somewhere (or an overflowing sum): check each
            lps = [None if (math.isnan(x) or math.isinf(x)) else x for x in lps]
            zeroed = [0.0 if x is None else x for x in lps]
        work = json_loads(m[M_WORK])
        if m is leaf:
            leaf_work = work
        work = work or {}
        sampling = dict(work.get("sampling_parameters") or {})
        sampling["seed"] = work.get("seed")
        synth = t[T_SYNTH]
        reused = t[T_REUSED]
        stop = t[T_STOP]
        created = to_datetime(m[M_CREATED])
        turns.append(
            {
                "message_id": m[M_ID],
                "prompt_delta_ids": delta,
                "completion_ids": completion,
                "logprobs": lps,
                "finish_reason": t[T_FINISH],
                "stop_reason": None if stop is None else decode_stop_reason(stop),
                "synthetic_closer_ids": prompt[reused : reused + synth].tolist() if synth else [],
                "reused_prefix_len": reused,
                "fork": t[T_FORK],
                "prompt_method": t[T_METHOD],
                "prompt_length": len(prompt),
                "sampling": sampling,
                # the environment's reward (POST /v1/rewards) when posted, else the turn's vote
                "reward": float(m[M_REWARD]) if m[M_REWARD] is not None else float(m[M_SCORE]) if m[M_VOTED] else None,
                "done": bool(m[M_DONE]),
                "policy_versions": spans,
                "content": m[M_CONTENT],
                "reasoning_content": m[M_REASONING],
                "tool_calls": json_loads(m[M_TOOL_CALLS]),
                "created_at": created.isoformat() if created else None,
            }
        )
        versions = token_versions(spans, len(completion))
        packed.append(_Packed(prompt_blob, completion_blob, delta, completion, zeroed, ext, versions))
        prev_prompt, prev_completion = prompt_blob, completion_blob
    if not turns or first_tokens is None:
        return None
    turn_rewards = [t["reward"] for t in turns]
    if filters.rated_only and all(r is None for r in turn_rewards):
        return None
    reward = _reward(turn_rewards, filters.reward_rule)
    if filters.min_score is not None and (reward is None or reward < filters.min_score):
        return None
    if leaf_work is None:
        leaf_work = dec.json(leaf[M_WORK])
    leaf_work = leaf_work or {}
    return {
        "schema": SCHEMA_NAME,
        "schema_version": SCHEMA_VERSION,
        "rollout_id": leaf[M_ID],
        "chat_id": chat_id,
        "leaf_message_id": leaf[M_ID],
        "user_id": user_id,
        "model_name": leaf[M_MODEL] or "",
        "tokenizer_hash": first_tokens[T_TOKENIZER],
        "template_hash": first_tokens[T_TEMPLATE],
        "engine": first_tokens[T_ENGINE],
        "system_prompt": leaf_work.get("system_prompt"),
        "tools": leaf_work.get("tools"),
        "turns": turns,
        "samples": _packed_samples(packed, turns),
        "reward": reward,
        "reward_rule": filters.reward_rule,
        "complete": complete,
        "policy_paths": policy_paths,
    }


def _packed_samples(packed: list[_Packed], turns: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """``build_samples`` from the turns' own lists: a sample's tokens are its first turn's prompt, then
    each turn's completion and the next turn's prompt delta (its prompt extends everything before)."""
    groups: list[list[int]] = []
    for i, p in enumerate(packed):
        if groups and p.extends_prev:
            groups[-1].append(i)
        else:
            groups.append([i])
    samples = []
    for group in groups:
        token_ids: list[int] = []
        mask: list[int] = []
        lps: list[float] = []
        versions: list[int] = []
        spans = []
        for i in group:
            p = packed[i]
            start = len(token_ids) + len(p.delta)
            if start * 4 != len(p.prompt) or len(p.logprobs) != len(p.completion_ids):  # not well-formed
                seqs = [(np.frombuffer(q.prompt, _INT32).tolist(), q.completion_ids) for q in packed]
                return build_samples(seqs, turns)
            token_ids += p.delta
            token_ids += p.completion_ids
            mask += [0] * len(p.delta)
            mask += [1] * len(p.completion_ids)
            lps += [0.0] * len(p.delta)
            lps += p.logprobs
            versions += [NO_VERSION] * len(p.delta)
            versions += p.versions
            spans.append((start, start + len(p.completion_ids)))
        samples.append(sample_record(token_ids, mask, lps, spans, group, turns, versions))
    return samples
