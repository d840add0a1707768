"""Export preference pairs (``tokentrail.pair``, shared/pairs.py) from stored sibling drafts.

Sources, per chat (chats whose owner opted out of data use are never read):

- ``message_eval``: OA's choice between drafts (``message_evals``): the chosen message over each of its
  ``inferior_message_ids``.
- ``reward`` / ``vote``: assistant messages with the same parent (regenerations, OA drafts), compared
  two by two. When both have an environment reward (``POST /v1/rewards``) the higher reward wins
  (source ``reward``); else, when both were voted, the higher vote (``vote``); a tie, or a pair without
  a common kind of score, makes no pair. The environment's reward takes precedence as in the rollouts'
  turn reward, but a reward is never compared with a vote: they are on different scales.

A pair is built from the two drafts' token records. It is skipped, and counted by reason
(``SKIP_REASONS``), when a side has no token record, when the sides come from different models or
tokenizers, or when their prompts differ (token ids or template hash: e.g. the chat's system prompt
changed between the drafts): a DPO pair needs one prompt, and picking either side's would train the
other on a context it was not sampled from.

Filters: ``model`` (the pair's model), ``user``/``chat`` (the chat's), ``since``/``until`` (the later of
the two drafts' creation times), ``min_version``/``max_staleness`` (every generated token of both sides,
as for rollouts). Reads a page of chats at a time: their assistant messages and evals, then the
token records and parsed columns of the messages that make candidate pairs only.
"""

from __future__ import annotations

import itertools
import math
from collections import Counter
from collections.abc import AsyncIterator, Iterable, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any, NamedTuple

from sqlalchemy import select
from sqlalchemy.ext.asyncio import AsyncSession

from server.chats.repository import decode_stop_reason
from server.db import SessionFactory
from server.export.query import ExportFilters, PolicyPaths, chat_query, read_policy_paths
from server.models import Chat, Message, MessageEval, MessageTokens
from shared.api import MessageState
from shared.packing import unpack_floats, unpack_ids
from shared.pairs import PAIR_SCHEMA_NAME, PAIR_SCHEMA_VERSION

CHAT_BATCH = 500
IN_CHUNK = 900  # ids per IN list (SQLite before 3.32 allows 999 parameters)
SKIP_REASONS = {
    "no_tokens": "a side has no token record (client-written, failed or unfinished)",
    "different_model": "the sides come from different models or tokenizers",
    "different_prompt": "the sides' prompts differ (token ids or template)",
    "duplicate": "the same preference stated again",
}
# token records are read for these states, as for rollouts (a cancelled draft keeps its tokens)
_DONE = (MessageState.complete.value, MessageState.cancelled.value)


@dataclass
class PairStats:
    pairs: int = 0
    skipped: Counter[str] = field(default_factory=Counter)

    def describe(self) -> str:
        """``pairs`` and the skips by reason, for the export's last line."""
        skips = ", ".join(f"{n} {reason}" for reason, n in sorted(self.skipped.items()))
        return f"{self.pairs} pairs" + (f" (skipped: {skips})" if skips else "")


class Draft(NamedTuple):
    """An assistant message as pairing needs it (the light columns, read for every message)."""

    id: str
    chat_id: str
    parent_id: str | None
    state: str
    model: str | None
    score: int
    voted: bool
    reward: float | None
    created_at: datetime

    @property
    def turn_reward(self) -> float | None:
        """As rollouts give a turn's reward: the environment's, else the vote."""
        return self.reward if self.reward is not None else float(self.score) if self.voted else None


class Candidate(NamedTuple):
    source: str
    chosen: str
    rejected: str
    chosen_reward: float | None
    rejected_reward: float | None


_DRAFT: tuple[Any, ...] = (Message.id, Message.chat_id, Message.parent_id, Message.state, Message.model_config_name)
_DRAFT += (Message.score, Message.voted_at.is_not(None), Message.reward, Message.created_at)
_EVAL: tuple[Any, ...] = (MessageEval.chat_id, MessageEval.message_id, MessageEval.inferior_message_ids)
_PARSED: tuple[Any, ...] = (Message.id, Message.content, Message.reasoning_content, Message.tool_calls)
_PARSED += (Message.work_parameters, Message.policy_versions)
_TOKENS: tuple[Any, ...] = (MessageTokens.message_id, MessageTokens.prompt_ids, MessageTokens.completion_ids)
_TOKENS += (MessageTokens.logprobs, MessageTokens.finish_reason, MessageTokens.stop_reason, MessageTokens.engine)
_TOKENS += (MessageTokens.tokenizer_hash, MessageTokens.template_hash)


def sibling_candidates(drafts: Sequence[Draft]) -> list[Candidate]:
    """Reward and vote pairs among drafts of one parent (module docstring), in id order."""
    groups: dict[str | None, list[Draft]] = {}
    for d in drafts:
        if d.state != MessageState.manual.value:  # client-written replies are context, not drafts
            groups.setdefault(d.parent_id, []).append(d)
    out = []
    for group in groups.values():
        for a, b in itertools.combinations(group, 2):
            if a.reward is not None and b.reward is not None:
                source, x, y = "reward", a.reward, b.reward
            elif a.voted and b.voted:
                source, x, y = "vote", float(a.score), float(b.score)
            else:
                continue
            if x > y:
                out.append(Candidate(source, a.id, b.id, x, y))
            elif y > x:
                out.append(Candidate(source, b.id, a.id, y, x))
    return out


def eval_candidates(evals: Iterable[Any], drafts: dict[str, Draft]) -> list[Candidate]:
    """The chosen message over each inferior one, in the evals' order."""
    out = []
    for _chat, chosen, inferior in evals:
        for rejected in inferior or []:
            c, r = drafts.get(chosen), drafts.get(rejected)
            out.append(
                Candidate(
                    "message_eval",
                    chosen,
                    str(rejected),
                    c.turn_reward if c else None,
                    r.turn_reward if r else None,
                )
            )
    return out


@dataclass
class _Batch:
    chats: list[Any]  # (id, user_id), in id order
    candidates: dict[str, list[Candidate]]  # by chat id
    drafts: dict[str, Draft]  # by message id
    parsed: dict[str, Any]  # message id -> _PARSED row (candidates' messages only)
    tokens: dict[str, Any]  # message id -> _TOKENS row


async def _rows(session: AsyncSession, stmt: Any, column: Any, ids: Sequence[str]) -> list[Any]:
    rows: list[Any] = []
    for i in range(0, len(ids), IN_CHUNK):
        rows += (await session.execute(stmt.where(column.in_(ids[i : i + IN_CHUNK])))).all()
    return rows


async def _read_batch(sessions: SessionFactory, filters: ExportFilters, after: str) -> _Batch | None:
    async with sessions() as s:
        page = chat_query(filters).where(Chat.id > after).order_by(Chat.id).limit(CHAT_BATCH)
        chats = list((await s.execute(page)).all())
        if not chats:
            return None
        chat_ids = [c[0] for c in chats]
        assistant = select(*_DRAFT).where(Message.role == "assistant").order_by(Message.chat_id, Message.id)
        drafts = [Draft(*row) for row in await _rows(s, assistant, Message.chat_id, chat_ids)]
        evals_q = select(*_EVAL).order_by(MessageEval.chat_id, MessageEval.created_at, MessageEval.id)
        evals = await _rows(s, evals_q, MessageEval.chat_id, chat_ids)
        by_id = {d.id: d for d in drafts}
        candidates: dict[str, list[Candidate]] = {}
        for chat_id, group in itertools.groupby(evals, key=lambda e: e[0]):
            candidates[chat_id] = eval_candidates(group, by_id)
        for chat_id, chat_drafts in itertools.groupby(drafts, key=lambda d: d.chat_id):
            candidates.setdefault(chat_id, []).extend(sibling_candidates(list(chat_drafts)))
        wanted = sorted({i for cs in candidates.values() for c in cs for i in (c.chosen, c.rejected) if i in by_id})
        parsed = {r[0]: r for r in await _rows(s, select(*_PARSED), Message.id, wanted)}
        done = [i for i in wanted if by_id[i].state in _DONE]
        tokens = {r[0]: r for r in await _rows(s, select(*_TOKENS), MessageTokens.message_id, done)}
    return _Batch(chats, candidates, by_id, parsed, tokens)


def _utc(value: datetime) -> datetime:
    return value.replace(tzinfo=UTC) if value.tzinfo is None else value


def _spans(raw: Any) -> list[list[int]]:
    """A message's ``[start, version]`` spans; none stored (before versions were kept): version 0."""
    return [[int(start), int(version)] for start, version in raw] if raw else [[0, 0]]


def _version_floor(model: str, filters: ExportFilters, paths: PolicyPaths) -> int | None:
    floors = [] if filters.min_version is None else [filters.min_version]
    if filters.max_staleness is not None:
        floors.append(paths.newest(model) - filters.max_staleness)
    return max(floors) if floors else None


def _side(draft: Draft, parsed: Any, tok: Any, reward: float | None) -> dict[str, Any]:
    _, content, reasoning, tool_calls, work, policy = parsed
    work = work or {}
    sampling = dict(work.get("sampling_parameters") or {})
    sampling["seed"] = work.get("seed")
    lps = unpack_floats(tok[3])
    return {
        "message_id": draft.id,
        "completion_ids": unpack_ids(tok[2]),
        "logprobs": [x if math.isfinite(x) else None for x in lps],
        "finish_reason": tok[4],
        "stop_reason": decode_stop_reason(tok[5]),
        "engine": tok[6],
        "sampling": sampling,
        "reward": reward,
        "policy_versions": _spans(policy),
        "content": content,
        "reasoning_content": reasoning,
        "tool_calls": tool_calls,
        "created_at": draft.created_at.isoformat(),
    }


def build_pair(
    c: Candidate, chat: Any, batch: _Batch, filters: ExportFilters, paths: PolicyPaths
) -> dict[str, Any] | str | None:
    """The pair record of a candidate; a skip reason (``SKIP_REASONS``); or None where filtered out."""
    drafts = [batch.drafts.get(c.chosen), batch.drafts.get(c.rejected)]
    present = [d for d in drafts if d is not None]
    if filters.model is not None and all(d.model != filters.model for d in present):
        return None
    if present and (filters.since is not None or filters.until is not None):
        newest = max(_utc(d.created_at) for d in present)
        if filters.since is not None and newest < filters.since:
            return None
        if filters.until is not None and newest >= filters.until:
            return None
    dc, dr = drafts
    tc, tr = batch.tokens.get(c.chosen), batch.tokens.get(c.rejected)
    if dc is None or dr is None or tc is None or tr is None:
        return "no_tokens"
    if dc.model != dr.model or tc[7] != tr[7]:
        return "different_model"
    if tc[8] != tr[8] or bytes(tc[1]) != bytes(tr[1]):
        return "different_prompt"
    sides = [
        _side(dc, batch.parsed[dc.id], tc, c.chosen_reward),
        _side(dr, batch.parsed[dr.id], tr, c.rejected_reward),
    ]
    model = dc.model or ""
    used = {v for s in sides for start, v in s["policy_versions"] if start < len(s["completion_ids"])}
    floor = _version_floor(model, filters, paths)
    if floor is not None and any(v < floor for v in used):
        return None
    return {
        "schema": PAIR_SCHEMA_NAME,
        "schema_version": PAIR_SCHEMA_VERSION,
        "pair_id": f"{c.source}:{c.chosen}:{c.rejected}",
        "source": c.source,
        "chat_id": chat[0],
        "user_id": chat[1],
        "parent_message_id": dc.parent_id,
        "model_name": model,
        "tokenizer_hash": tc[7],
        "template_hash": tc[8],
        "prompt_ids": unpack_ids(tc[1]),
        "chosen": sides[0],
        "rejected": sides[1],
        "policy_paths": {str(v): paths.path(model, v) if v else None for v in sorted(used)},
    }


async def iter_pairs(
    sessions: SessionFactory, filters: ExportFilters, stats: PairStats | None = None
) -> AsyncIterator[dict[str, Any]]:
    """Native pair records, chat by chat (in id order); skips are counted into ``stats``."""
    stats = stats if stats is not None else PairStats()
    paths = await read_policy_paths(sessions)  # the registry as of the export's start
    after = ""
    while (batch := await _read_batch(sessions, filters, after)) is not None:
        for chat in batch.chats:
            seen: set[str] = set()
            for c in batch.candidates.get(chat[0], []):
                built = build_pair(c, chat, batch, filters, paths)
                if isinstance(built, str):
                    stats.skipped[built] += 1
                elif built is not None and built["pair_id"] in seen:
                    stats.skipped["duplicate"] += 1
                elif built is not None:
                    seen.add(built["pair_id"])
                    stats.pairs += 1
                    yield built
        after = batch.chats[-1][0]
