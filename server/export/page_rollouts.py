"""A page's native rollouts built at once, as columns: what an export's encoders take.

``rows_rollout_parts`` builds one rollout at a time, each turn a dict of numpy arrays, and an encoder
then reads them back one by one. Here a page of chats (``page_chats``) becomes a ``PageRollouts``: the
page's distinct turns as columns (a turn shared by branches is built once: the path to a message is
unique, so its record is the same in every rollout that has it) and each rollout as the indices of its
turns. A column's values are made together (created_at from its stored text, stop reasons from a
table, token blobs joined into one array per field for the whole page), so the encoders
(``server/export/jsonl.py``'s ``page_lines``, ``server/export/columnar.py``'s ``page_batch``) format
each field once per page rather than once per turn.

The records are the ones ``path_rollout_parts`` gives, value for value (tests compare the bytes of
both ways on the same pages). A page with a turn whose logprobs do not match its completion (no sample
can be laid out from its arrays) is left to ``rows_rollout_parts``: ``page_rollouts`` returns None.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from server.chats.repository import decode_stop_reason
from server.export.query import (
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
from server.export.rollouts import leaf_passes, leaves, packed_blob, recent_enough, rollout_reward, stored_spans

Chat = tuple[str, str, Sequence[Any], dict[str, Any]]  # (chat id, user id, message rows, token rows by id)

_INT32 = np.dtype("<i4")
_FLOAT32 = np.dtype("<f4")


@dataclass
class PageTurns:
    """The page's distinct exported turns, a list per field (index: the turn's number in the page)."""

    msgs: list[Any] = field(default_factory=list)  # message rows (``M_*``)
    toks: list[Any] = field(default_factory=list)  # token rows (``T_*``)
    prev_lens: list[int] = field(default_factory=list)  # prompt tokens the previous turn covers (0: none)
    spans: list[list[list[int]]] = field(default_factory=list)  # [start, version] spans
    works: list[dict[str, Any]] = field(default_factory=list)  # decoded work parameters ({}: none)
    rewards: list[float | None] = field(default_factory=list)
    extends: list[bool] = field(default_factory=list)  # the prompt extends the previous turn's tokens
    used: list[list[int]] = field(default_factory=list)  # the versions of its generated tokens
    # the page's token blobs joined, as arrays, with each turn's offsets (in items) into them
    prompts: np.ndarray[Any, Any] = field(default_factory=lambda: np.zeros(0, _INT32))
    completions: np.ndarray[Any, Any] = field(default_factory=lambda: np.zeros(0, _INT32))
    logprobs: np.ndarray[Any, Any] = field(default_factory=lambda: np.zeros(0, _FLOAT32))
    prompt_offsets: np.ndarray[Any, Any] = field(default_factory=lambda: np.zeros(1, np.int64))
    completion_offsets: np.ndarray[Any, Any] = field(default_factory=lambda: np.zeros(1, np.int64))

    def __len__(self) -> int:
        return len(self.msgs)

    def delta(self, k: int) -> np.ndarray[Any, Any]:
        """Turn ``k``'s prompt delta: its prompt past the previous turn's prompt and completion."""
        return self.prompts[self.prompt_offsets[k] + self.prev_lens[k] : self.prompt_offsets[k + 1]]

    def completion(self, k: int) -> np.ndarray[Any, Any]:
        return self.completions[self.completion_offsets[k] : self.completion_offsets[k + 1]]

    def turn_logprobs(self, k: int) -> np.ndarray[Any, Any]:
        return self.logprobs[self.completion_offsets[k] : self.completion_offsets[k + 1]]

    def closer(self, k: int) -> np.ndarray[Any, Any]:
        """Turn ``k``'s synthetic closer ids (the template's end of turn the engine never sampled)."""
        t = self.toks[k]
        prompt = self.prompts[self.prompt_offsets[k] : self.prompt_offsets[k + 1]]
        return prompt[t[T_REUSED] : t[T_REUSED] + t[T_SYNTH]] if t[T_SYNTH] else prompt[:0]


@dataclass
class PageRollouts:
    """A page's rollouts: per rollout its chat, leaf, turns (indices into ``turns``) and what is derived
    from them; the turns' fields in ``turns``."""

    turns: PageTurns = field(default_factory=PageTurns)
    chat_ids: list[str] = field(default_factory=list)
    user_ids: list[str] = field(default_factory=list)
    leaves: list[Any] = field(default_factory=list)  # leaf message rows
    turn_lists: list[list[int]] = field(default_factory=list)  # root to leaf
    groups: list[list[list[int]]] = field(default_factory=list)  # samples: positions in the turn list
    rewards: list[float | None] = field(default_factory=list)
    completes: list[bool] = field(default_factory=list)
    policy_paths: list[dict[str, str | None]] = field(default_factory=list)
    leaf_works: list[dict[str, Any]] = field(default_factory=list)

    def __len__(self) -> int:
        return len(self.leaves)

    def head(self, r: int) -> Any:
        """The token row of rollout ``r``'s first turn (its tokenizer, template and engine)."""
        return self.turns.toks[self.turn_lists[r][0]]


class _Malformed(Exception):
    """A turn whose logprobs and completion differ in length: its samples need ``build_samples``."""


def page_rollouts(
    chats: Sequence[Chat], filters: ExportFilters, dec: Decoders, paths: PolicyPaths
) -> PageRollouts | None:
    """The rollouts of ``chats`` (in order: chat by chat, leaves in message id order), or None where a
    turn's logprobs do not line up with its completion (build that page with ``rows_rollout_parts``)."""
    builder = _Builder(filters, dec, paths)
    try:
        for chat in chats:
            builder.chat(*chat)
    except _Malformed:
        return None
    return builder.finish()


class _Builder:
    def __init__(self, filters: ExportFilters, dec: Decoders, paths: PolicyPaths) -> None:
        self.filters, self.dec, self.paths = filters, dec, paths
        self.out = PageRollouts()
        self.index: dict[str, int | None] = {}  # message id -> its turn's number (None: filtered out)
        self.prompt_blobs: list[bytes] = []
        self.completion_blobs: list[bytes] = []
        self.logprob_blobs: list[bytes] = []
        self.versions_filtered = filters.min_version is not None or filters.max_staleness is not None

    def chat(self, chat_id: str, user_id: str, msgs: Sequence[Any], tokens: dict[str, Any]) -> None:
        by_id = {m[M_ID]: m for m in msgs}
        for leaf in leaves(msgs, by_id):
            self.rollout(chat_id, user_id, by_id, leaf, tokens)

    def rollout(self, chat_id: str, user_id: str, by_id: dict[str, Any], leaf: Any, tokens: dict[str, Any]) -> None:
        filters = self.filters
        if not leaf_passes(leaf, filters, self.dec):
            return
        path = []  # the assistant messages a worker generated, root to leaf
        cur: str | None = leaf[M_ID]
        while cur is not None and cur in by_id:
            row = by_id[cur]
            if row[M_ROLE] == "assistant" and row[M_STATE] != MANUAL:
                path.append(row)
            cur = row[M_PARENT]
        path.reverse()
        complete = True
        for m in path:
            if m[M_ID] not in tokens:
                complete = False
                break
        if not complete and not filters.include_incomplete:
            return
        turns: list[int] = []
        prev: int | None = None
        for m in path:
            t = tokens.get(m[M_ID])
            if t is None:
                continue
            k = self.index[m[M_ID]] if m[M_ID] in self.index else self.turn(m, t, prev)
            if k is None:
                return
            turns.append(k)
            prev = k
        if not turns:
            return
        page = self.out.turns
        turn_rewards = [page.rewards[k] for k in turns]
        if filters.rated_only and all(r is None for r in turn_rewards):
            return
        reward = rollout_reward(turn_rewards, filters.reward_rule)
        if filters.min_score is not None and (reward is None or reward < filters.min_score):
            return
        out = self.out
        out.chat_ids.append(chat_id)
        out.user_ids.append(user_id)
        out.leaves.append(leaf)
        out.turn_lists.append(turns)
        groups: list[list[int]] = []
        for i, k in enumerate(turns):
            if groups and page.extends[k]:
                groups[-1].append(i)
            else:
                groups.append([i])
        out.groups.append(groups)
        out.rewards.append(reward)
        out.completes.append(complete)
        policy_paths: dict[str, str | None] = {}
        for k in turns:
            model = page.msgs[k][M_MODEL] or ""
            for v in page.used[k]:
                key = str(v)
                if policy_paths.get(key) is None:
                    policy_paths[key] = self.paths.path(model, v) if v else None
        out.policy_paths.append(policy_paths)
        last = turns[-1]
        out.leaf_works.append(page.works[last] if page.msgs[last] is leaf else (self.dec.json(leaf[M_WORK]) or {}))

    def turn(self, m: Any, t: Any, prev: int | None) -> int | None:
        """Adds the turn of message row ``m`` with token row ``t`` after the page's turn ``prev`` (None:
        the first of its path); None where the version filters leave it (and its rollouts) out."""
        spans = stored_spans(m[M_POLICY], self.dec)
        prompt, completion = packed_blob(t[T_PROMPT], "id"), packed_blob(t[T_COMPLETION], "id")
        logprobs = t[T_LOGPROBS] or b""
        n = len(completion) >> 2
        if len(logprobs) != len(completion):  # (or not a whole number of floats: rows_rollout_parts raises)
            raise _Malformed
        used = [v for start, v in spans if start < n]
        if self.versions_filtered and not recent_enough(used, m[M_MODEL] or "", self.filters, self.paths):
            self.index[m[M_ID]] = None
            return None
        page = self.out.turns
        if prev is None:
            ext, prev_len = True, 0
        else:
            pp, pc = self.prompt_blobs[prev], self.completion_blobs[prev]
            ext = prompt.startswith(pp) and prompt.startswith(pc, len(pp))
            prev_len = (len(pp) + len(pc)) >> 2 if ext else 0
        reward = m[M_REWARD]
        k = len(page.msgs)
        self.index[m[M_ID]] = k
        page.msgs.append(m)
        page.toks.append(t)
        page.prev_lens.append(prev_len)
        page.spans.append(spans)
        page.works.append(self.dec.json(m[M_WORK]) or {})
        page.rewards.append(float(reward) if reward is not None else float(m[M_SCORE]) if m[M_VOTED] else None)
        page.extends.append(ext)
        page.used.append(used)
        self.prompt_blobs.append(prompt)
        self.completion_blobs.append(completion)
        self.logprob_blobs.append(logprobs)
        return k

    def finish(self) -> PageRollouts:
        page = self.out.turns
        page.prompts = np.frombuffer(b"".join(self.prompt_blobs), _INT32)
        page.completions = np.frombuffer(b"".join(self.completion_blobs), _INT32)
        page.logprobs = np.frombuffer(b"".join(self.logprob_blobs), _FLOAT32)
        page.prompt_offsets = _offsets(self.prompt_blobs)
        page.completion_offsets = _offsets(self.completion_blobs)
        return self.out


def _offsets(blobs: list[bytes]) -> np.ndarray[Any, Any]:
    offsets = np.zeros(len(blobs) + 1, np.int64)
    np.cumsum([len(b) >> 2 for b in blobs], out=offsets[1:])
    return offsets


# --- the turns' scalar fields, a column at a time --------------------------------------------------------


def created_texts(turns: PageTurns, dec: Decoders) -> list[str | None]:
    """Each turn's ``created_at`` as ``datetime.isoformat`` writes it. SQLite stores SQLAlchemy's text
    ``YYYY-MM-DD HH:MM:SS.ffffff``, which is its ISO form but for the separator (and for the
    microseconds where they are 0: isoformat leaves them out); other values are parsed."""
    out: list[str | None] = []
    for m in turns.msgs:
        raw = m[M_CREATED]
        if type(raw) is str and len(raw) == 26 and raw[10] == " " and raw[19] == "." and not raw.endswith("000000"):
            out.append(f"{raw[:10]}T{raw[11:]}")
            continue
        created = dec.datetime(raw)
        out.append(created.isoformat() if created else None)
    return out


_STOP_REASONS: dict[str, int | str | None] = {}


def stop_reasons(turns: PageTurns) -> list[int | str | None]:
    """Each turn's stop reason, decoded (a few distinct values: decoded once per process)."""
    out: list[int | str | None] = []
    for t in turns.toks:
        raw = t[T_STOP]
        if raw is None:
            out.append(None)
            continue
        value = _STOP_REASONS.get(raw)
        if value is None:
            value = decode_stop_reason(raw)
            if len(_STOP_REASONS) < 4096:
                _STOP_REASONS[raw] = value
        out.append(value)
    return out


def samplings(turns: PageTurns) -> list[dict[str, Any]]:
    """Each turn's sampling parameters with its seed (the record's ``sampling``)."""
    out = []
    for work in turns.works:
        sampling = dict(work.get("sampling_parameters") or {})
        sampling["seed"] = work.get("seed")
        out.append(sampling)
    return out


def scalar_columns(turns: PageTurns, dec: Decoders) -> dict[str, list[Any]]:
    """The turns' fields other than their token arrays, by record field name."""
    msgs, toks = turns.msgs, turns.toks
    return {
        "message_id": [m[M_ID] for m in msgs],
        "finish_reason": [t[T_FINISH] for t in toks],
        "stop_reason": stop_reasons(turns),
        "reused_prefix_len": [t[T_REUSED] for t in toks],
        "fork": [bool(t[T_FORK]) for t in toks],
        "prompt_method": [t[T_METHOD] for t in toks],
        "prompt_length": [int(n) for n in np.diff(turns.prompt_offsets)],
        "sampling": samplings(turns),
        "reward": turns.rewards,
        "done": [bool(m[M_DONE]) for m in msgs],
        "policy_versions": turns.spans,
        "content": [m[M_CONTENT] for m in msgs],
        "reasoning_content": [m[M_REASONING] for m in msgs],
        "tool_calls": [dec.json(m[M_TOOL_CALLS]) for m in msgs],
        "created_at": created_texts(turns, dec),
    }


def rollout_heads(page: PageRollouts) -> dict[str, list[Any]]:
    """The rollouts' fields before their turns (``_rollout_record``'s order), by field name."""
    heads = [page.head(r) for r in range(len(page))]
    return {
        "rollout_id": [leaf[M_ID] for leaf in page.leaves],
        "chat_id": page.chat_ids,
        "leaf_message_id": [leaf[M_ID] for leaf in page.leaves],
        "user_id": page.user_ids,
        "model_name": [leaf[M_MODEL] or "" for leaf in page.leaves],
        "tokenizer_hash": [t[T_TOKENIZER] for t in heads],
        "template_hash": [t[T_TEMPLATE] for t in heads],
        "engine": [t[T_ENGINE] for t in heads],
        "system_prompt": [w.get("system_prompt") for w in page.leaf_works],
        "tools": [w.get("tools") for w in page.leaf_works],
    }
