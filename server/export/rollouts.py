"""Export stored conversations as RL rollouts (native ``tokentrail`` schema; see shared/rollout.py).

Rollouts are built from rows (``server/export/query.py`` lays them out; ``server/export/pages.py``
reads them page by page, in constant memory). One rollout per path that
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
text and parsed only for the turns that are exported, timestamps converted only where used; a turn's
token blobs become numpy arrays (views, no Python int or float per token) and prefix checks compare the
packed bytes. ``path_rollout_parts`` stops there: the turns' token fields are arrays and a sample's
per-position fields are left ``TO_FILL`` from its turns' arrays, which each writer does its own way
(JSON text, Arrow columns: server/export/writers.py); ``fill_plain`` fills them with lists, the record
``path_rollout`` gives, the same as decoding every column first (what ``chat_rollouts`` takes).
The export's encoders build whole pages at once instead (``server/export/page_rollouts.py``: the same
records, a column at a time); this one-at-a-time builder serves the feed, the trainer schemas and the
pages that one cannot take.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from datetime import UTC
from typing import Any

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
    """The rollouts of one chat from rows: ``msgs`` (``M_*`` layout, in id order) and ``tokens`` (``T_*``
    layout, by message id, for complete assistant messages)."""
    return [fill_plain(r) for r in rows_rollout_parts(chat_id, user_id, msgs, tokens, filters, dec, paths)]


def rows_rollout_parts(
    chat_id: str,
    user_id: str,
    msgs: Sequence[Any],
    tokens: dict[str, Any],
    filters: ExportFilters,
    dec: Decoders,
    paths: PolicyPaths = NO_PATHS,
) -> list[dict[str, Any]]:
    """``rows_rollouts`` as ``path_rollout_parts`` leaves them: for a writer to finish."""
    by_id = {m[M_ID]: m for m in msgs}
    out = []
    for m in leaves(msgs, by_id):
        rollout = path_rollout_parts(chat_id, user_id, leaf_path(by_id, m[M_ID]), tokens, filters, dec, paths)
        if rollout is not None:
            out.append(rollout)
    return out


def leaves(msgs: Sequence[Any], by_id: dict[str, Any]) -> list[Any]:
    """The chat's leaves, in ``msgs`` order: the assistant messages a worker generated that have no such
    message below them (``by_id``: ``msgs`` by id)."""
    below: set[str] = set()  # messages with an assistant descendant
    for m in msgs:
        if m[M_ROLE] == "assistant" and m[M_STATE] != MANUAL:
            parent = m[M_PARENT]
            while parent in by_id and parent not in below:
                below.add(parent)
                parent = by_id[parent][M_PARENT]
    return [m for m in msgs if m[M_ROLE] == "assistant" and m[M_STATE] != MANUAL and m[M_ID] not in below]


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


def leaf_passes(leaf: Any, filters: ExportFilters, dec: Decoders) -> bool:
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


def rollout_reward(turn_rewards: list[float | None], rule: RewardRule) -> float | None:
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


def packed_blob(value: Any, kind: str) -> bytes:
    """A packed int32/float32 column (shared/packing.py) as bytes, checked like its unpackers."""
    if not value:
        return b""
    if type(value) is not bytes:
        value = bytes(value)
    if len(value) % 4:
        raise ValueError(f"packed {kind} blob has {len(value)} bytes, not a multiple of 4")
    return value  # type: ignore[no-any-return]


LEGACY_SPANS = [[0, 0]]  # a message stored before versions were kept: every token from version 0
_NO_IDS: np.ndarray[Any, Any] = np.zeros(0, _INT32)

# A sample's per-position fields (token_ids, loss_mask, logprobs, policy_versions) before a writer fills
# them from its turns' arrays (``fill_plain``; the writers of server/export/writers.py fill their own).
TO_FILL: list[Any] = []


def stored_spans(raw: Any, dec: Decoders) -> list[list[int]]:
    """A message's stored ``[start, version]`` spans (None or empty: stored before versions were kept)."""
    spans = dec.json(raw)
    if not spans:
        return [[0, 0]]  # LEGACY_SPANS, a list of its own
    return [[int(start), int(version)] for start, version in spans]


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
    rollout = path_rollout_parts(chat_id, user_id, path, tokens, filters, dec, paths)
    return None if rollout is None else fill_plain(rollout)


def path_rollout_parts(
    chat_id: str,
    user_id: str,
    path: list[Any],
    tokens: dict[str, Any],
    filters: ExportFilters,
    dec: Decoders,
    paths: PolicyPaths = NO_PATHS,
) -> dict[str, Any] | None:
    """``path_rollout`` but for the token fields: the turns' are numpy arrays (``prompt_delta_ids``,
    ``completion_ids`` and ``synthetic_closer_ids`` int32, ``logprobs`` float32 with -inf and nan kept),
    and a sample's per-position fields are ``TO_FILL`` where they are its turns' arrays laid end to end
    (every sample unless a turn's logprobs do not match its completion)."""
    leaf = path[-1]
    if not leaf_passes(leaf, filters, dec):
        return None
    # assistant messages a client wrote (OpenAI API histories) are context, not turns
    assistants = [m for m in path if m[M_ROLE] == "assistant" and m[M_STATE] != MANUAL]
    complete = all(m[M_ID] in tokens for m in assistants)
    if not complete and not filters.include_incomplete:
        return None
    turns = _Turns(leaf, filters, dec, paths)
    for m in assistants:
        t = tokens.get(m[M_ID])
        if t is not None and not turns.add(m, t):
            return None
    if not turns.records:
        return None
    turn_rewards = [t["reward"] for t in turns.records]
    if filters.rated_only and all(r is None for r in turn_rewards):
        return None
    reward = rollout_reward(turn_rewards, filters.reward_rule)
    if filters.min_score is not None and (reward is None or reward < filters.min_score):
        return None
    return _rollout_record(chat_id, user_id, turns, reward, complete)


class _Turns:
    """The exported turns of a path, added root to leaf."""

    def __init__(self, leaf: Any, filters: ExportFilters, dec: Decoders, paths: PolicyPaths) -> None:
        self.leaf, self.filters, self.dec, self.paths = leaf, filters, dec, paths
        self.versions_filtered = filters.min_version is not None or filters.max_staleness is not None
        self.records: list[dict[str, Any]] = []
        self.extends: list[bool] = []  # per turn: its prompt extends the previous turn's prompt + completion
        self.prompts: list[bytes] = []
        self.first_tokens: Any = None
        self.leaf_work: Any = None
        self.policy_paths: dict[str, str | None] = {}
        self.prev = (b"", b"")  # the packed prompt and completion of the previous turn

    def add(self, m: Any, t: Any) -> bool:
        """Adds the turn of message row ``m`` with token row ``t``; False: the version filters leave the
        rollout out."""
        spans = stored_spans(m[M_POLICY], self.dec)
        prompt, completion = packed_blob(t[T_PROMPT], "id"), packed_blob(t[T_COMPLETION], "id")
        used = [v for start, v in spans if start < len(completion) >> 2]  # the versions of generated tokens
        model = m[M_MODEL] or ""
        if self.versions_filtered and not recent_enough(used, model, self.filters, self.paths):
            return False
        for v in used:
            key = str(v)
            if self.policy_paths.get(key) is None:
                self.policy_paths[key] = self.paths.path(model, v) if v else None
        if self.first_tokens is None:
            self.first_tokens = t
        work = self.dec.json(m[M_WORK])
        if m is self.leaf:
            self.leaf_work = work
        prev_prompt, prev_completion = self.prev
        ext = prompt.startswith(prev_prompt) and prompt.startswith(prev_completion, len(prev_prompt))
        prev_len = (len(prev_prompt) + len(prev_completion)) >> 2 if ext else 0
        self.records.append(_turn(m, t, prompt, completion, prev_len, work or {}, spans, self.dec))
        self.extends.append(ext)
        self.prompts.append(prompt)
        self.prev = (prompt, completion)
        return True


def recent_enough(used: list[int], model: str, filters: ExportFilters, paths: PolicyPaths) -> bool:
    """Whether the versions ``used`` by a turn of ``model`` pass the version filters."""
    floors = []
    if filters.min_version is not None:
        floors.append(filters.min_version)
    if filters.max_staleness is not None:
        floors.append(paths.newest(model) - filters.max_staleness)
    return all(v >= max(floors) for v in used)


def _rollout_record(chat_id: str, user_id: str, turns: _Turns, reward: float | None, complete: bool) -> dict[str, Any]:
    leaf, first_tokens = turns.leaf, turns.first_tokens
    leaf_work = (turns.leaf_work if turns.leaf_work is not None else turns.dec.json(leaf[M_WORK])) or {}
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
        "turns": turns.records,
        "samples": _samples(turns.records, turns.extends, turns.prompts),
        "reward": reward,
        "reward_rule": turns.filters.reward_rule,
        "complete": complete,
        "policy_paths": turns.policy_paths,
    }


def _turn(
    m: Any, t: Any, prompt_blob: bytes, completion_blob: bytes, prev_len: int, work: Any, spans: Any, dec: Decoders
) -> dict[str, Any]:
    """One exported turn's record; its prompt delta: what follows the previous turn's prompt +
    completion (``prev_len`` tokens, 0: the prompt does not extend them)."""
    prompt = np.frombuffer(prompt_blob, _INT32)
    sampling = dict(work.get("sampling_parameters") or {})
    sampling["seed"] = work.get("seed")
    synth, reused, stop, reward = t[T_SYNTH], t[T_REUSED], t[T_STOP], m[M_REWARD]
    created = dec.datetime(m[M_CREATED])
    return {
        "message_id": m[M_ID],
        "prompt_delta_ids": prompt[prev_len:] if prev_len else prompt,
        "completion_ids": np.frombuffer(completion_blob, _INT32),
        "logprobs": np.frombuffer(packed_blob(t[T_LOGPROBS], "float"), _FLOAT32),
        "finish_reason": t[T_FINISH],
        "stop_reason": None if stop is None else decode_stop_reason(stop),
        "synthetic_closer_ids": prompt[reused : reused + synth] if synth else _NO_IDS,
        "reused_prefix_len": reused,
        "fork": bool(t[T_FORK]),
        "prompt_method": t[T_METHOD],
        "prompt_length": len(prompt),
        "sampling": sampling,
        # the environment's reward (POST /v1/rewards) when posted, else the turn's vote
        "reward": float(reward) if reward is not None else float(m[M_SCORE]) if m[M_VOTED] else None,
        "done": bool(m[M_DONE]),
        "policy_versions": spans,
        "content": m[M_CONTENT],
        "reasoning_content": m[M_REASONING],
        "tool_calls": dec.json(m[M_TOOL_CALLS]),
        "created_at": created.isoformat() if created else None,
    }


def _samples(turns: list[dict[str, Any]], extends: list[bool], prompts: list[bytes]) -> list[dict[str, Any]]:
    """``build_samples`` from the turns' own arrays: a sample's tokens are its first turn's prompt, then
    each turn's completion and the next turn's prompt delta (its prompt extends everything before)."""
    groups: list[list[int]] = []
    for i, ext in enumerate(extends):
        if groups and ext:
            groups[-1].append(i)
        else:
            groups.append([i])
    samples = []
    for group in groups:
        spans = []
        end = 0
        for i in group:
            turn = turns[i]
            start = end + len(turn["prompt_delta_ids"])
            end = start + len(turn["completion_ids"])
            if start != turn["prompt_length"] or len(turn["logprobs"]) != len(turn["completion_ids"]):
                return _built_samples(turns, prompts)  # not well-formed
            spans.append((start, end))
        samples.append(sample_record(TO_FILL, TO_FILL, TO_FILL, spans, group, turns, TO_FILL))
    return samples


def _built_samples(turns: list[dict[str, Any]], prompts: list[bytes]) -> list[dict[str, Any]]:
    """Turns whose arrays do not line up (a logprob missing): ``build_samples`` on lists."""
    seqs = [
        (np.frombuffer(p, _INT32).tolist(), t["completion_ids"].tolist()) for p, t in zip(prompts, turns, strict=True)
    ]
    return build_samples(seqs, [t | {"logprobs": _nullable(t["logprobs"])} for t in turns])


def _nullable(logprobs: np.ndarray[Any, Any]) -> list[float | None]:
    """Logprobs as a list of floats, None for a non-finite one (JSON has no -inf)."""
    return _logprob_lists(logprobs)[0]


def _logprob_lists(logprobs: np.ndarray[Any, Any]) -> tuple[list[Any], list[float]]:
    """A turn's logprobs as a list (None for a non-finite one), and as a sample takes them (0.0)."""
    lps: list[Any] = logprobs.tolist()
    if math.isfinite(sum(lps)):
        return lps, lps
    # a -inf or nan somewhere (or an overflowing sum): check each
    return [x if math.isfinite(x) else None for x in lps], [x if math.isfinite(x) else 0.0 for x in lps]


def fill_plain(rollout: dict[str, Any]) -> dict[str, Any]:
    """A rollout of ``path_rollout_parts`` with lists for its arrays, its samples filled (in place): the
    record ``path_rollout`` gives, Python ints and floats, None for a non-finite turn logprob."""
    turns = rollout["turns"]
    zeroed = []  # per turn, its logprobs with 0.0 for a non-finite one
    for turn in turns:
        turn["prompt_delta_ids"] = turn["prompt_delta_ids"].tolist()
        turn["completion_ids"] = turn["completion_ids"].tolist()
        turn["synthetic_closer_ids"] = turn["synthetic_closer_ids"].tolist()
        turn["logprobs"], lps = _logprob_lists(turn["logprobs"])
        zeroed.append(lps)
    for sample in rollout["samples"]:
        if sample["token_ids"] is TO_FILL:
            _fill_lists(sample, turns, zeroed)
    return rollout


def _fill_lists(sample: dict[str, Any], turns: list[dict[str, Any]], zeroed: list[list[float]]) -> None:
    token_ids: list[int] = []
    mask: list[int] = []
    lps: list[float] = []
    versions: list[int] = []
    for i in sample["turn_indices"]:
        turn = turns[i]
        delta, completion = turn["prompt_delta_ids"], turn["completion_ids"]
        token_ids += delta
        token_ids += completion
        mask += [0] * len(delta)
        mask += [1] * len(completion)
        lps += [0.0] * len(delta)
        lps += zeroed[i]
        versions += [NO_VERSION] * len(delta)
        versions += token_versions(turn["policy_versions"], len(completion))
    sample.update(token_ids=token_ids, loss_mask=mask, logprobs=lps, policy_versions=versions)
