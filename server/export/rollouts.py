"""Export stored conversations as RL rollouts (native ``tokentrail`` schema; see shared/rollout.py).

Streams in constant memory: chats are read in keyset-paginated batches (a page of chats, their
messages, then the token records of their complete assistant messages), and rollouts are yielded
one by one. One rollout per path that ends in an assistant leaf (an assistant message with no
assistant descendant); branches become separate rollouts that share their prefix. Chats whose
owner opted out of data use are never exported.

Rewards: OA votes (-1, 0, 1) on assistant messages are per-turn rewards; the rollout reward
follows ``reward_rule``: ``last`` (default: the last rated turn), ``mean``/``min`` over rated
turns, or ``leaf`` (the leaf turn's vote). Unrated rollouts have reward None.

Speed (an export is CPU-bound in Python; see benchmarks/export.py): no ORM rows (Core statements,
and on asyncpg the driver's own records); the next batch is read while the current one is turned
into rollouts; JSON columns are fetched as text and parsed only for the turns that are exported,
timestamps converted only where used; token blobs are decoded with numpy once per turn, prefix
checks compare the packed bytes, and a sample's lists are built from its turns' lists. The output
is the same as decoding every column first (what ``chat_rollouts`` takes).
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
import math
import operator
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any, NamedTuple

import numpy as np
import orjson
from sqlalchemy import ARRAY, Select, String, Text, any_, bindparam, case, cast, func, select, type_coerce
from sqlalchemy.engine import Dialect
from sqlalchemy.ext.asyncio import AsyncConnection

from server.chats.repository import decode_stop_reason
from server.db import SessionFactory
from server.models import Chat, Message, MessageTokens
from shared.api import MessageState
from shared.rollout import SCHEMA_NAME, SCHEMA_VERSION, RewardRule, build_samples, sample_record

CHAT_BATCH = 500  # chats per batch (its messages are one IN list: stay below SQLite's 999 parameters)

_INT32 = np.dtype("<i4")
_FLOAT32 = np.dtype("<f4")


@dataclass
class ExportFilters:
    since: datetime | None = None
    until: datetime | None = None
    model: str | None = None
    user: str | None = None
    chat: str | None = None
    rated_only: bool = False
    min_score: float | None = None
    include_incomplete: bool = False
    reward_rule: RewardRule = "last"


_CHAT_COLUMNS: tuple[Any, ...] = (Chat.id, Chat.user_id)


def _chat_query(filters: ExportFilters) -> Select[Any]:
    q = select(*_CHAT_COLUMNS).where(Chat.allow_data_use.is_(True))
    if filters.user is not None:
        q = q.where(Chat.user_id == filters.user)
    if filters.chat is not None:
        q = q.where(Chat.id == filters.chat)
    return q


async def count_chats(sessions: SessionFactory, filters: ExportFilters) -> int:
    async with sessions() as s:
        sub = _chat_query(filters).subquery()
        return int(await s.scalar(select(func.count()).select_from(sub)) or 0)


# The fields the export reads, by position: one row per message (the _M* indices) and, for complete
# assistant messages, one row of their token record (the _T* indices).
_M_ID, _M_PARENT, _M_ROLE, _M_STATE, _M_CONTENT, _M_REASONING, _M_TOOL_CALLS = range(7)
_MANUAL = "manual"
_M_MODEL, _M_WORK, _M_SCORE, _M_VOTED, _M_CREATED, _M_CHAT = range(7, 13)
_MSG_COLUMNS: tuple[Any, ...] = (
    Message.id,
    Message.parent_id,
    Message.role,
    Message.state,
    case((Message.role == "assistant", Message.content)).label("content"),  # prompts are never exported
    Message.reasoning_content,
    cast(Message.tool_calls, Text).label("tool_calls"),  # JSON text: parsed for exported turns only
    Message.model_config_name,
    cast(Message.work_parameters, Text).label("work_parameters"),
    Message.score,
    Message.voted_at.is_not(None).label("voted"),
    type_coerce(Message.created_at, String).label("created_at"),  # as the driver gives it: see _Decoders
    Message.chat_id,
)
_T_ID, _T_PROMPT, _T_COMPLETION, _T_LOGPROBS, _T_FINISH, _T_STOP = range(6)
_T_ENGINE, _T_TOKENIZER, _T_TEMPLATE, _T_REUSED, _T_SYNTH, _T_FORK, _T_METHOD = range(6, 13)
_TOKEN_COLUMNS: tuple[Any, ...] = (
    MessageTokens.message_id,
    MessageTokens.prompt_ids,
    MessageTokens.completion_ids,
    MessageTokens.logprobs,
    MessageTokens.finish_reason,
    MessageTokens.stop_reason,
    MessageTokens.engine,
    MessageTokens.tokenizer_hash,
    MessageTokens.template_hash,
    MessageTokens.reused_prefix_len,
    MessageTokens.synthetic_token_count,
    MessageTokens.fork,
    MessageTokens.prompt_method,
)
_IN_CHUNK = 900  # ids per IN list (SQLite before 3.32 allows 999 parameters)


def _identity(value: Any) -> Any:
    return value


def _json_loads(raw: Any) -> Any:
    """JSON column text -> value, as the driver's ``json.loads`` gives it; orjson (~4x faster) where
    it agrees: it refuses NaN, infinities and lone surrogates, and reads integers beyond 64 bits as
    floats, so a document with a float that large is read again by ``json``."""
    if raw is None or raw == "null":
        return None
    try:
        value = orjson.loads(raw)
    except orjson.JSONDecodeError:
        return json.loads(raw)
    stack = [value]
    while stack:
        v = stack.pop()
        if type(v) is dict:
            stack.extend(v.values())
        elif type(v) is list:
            stack.extend(v)
        elif type(v) is float and not -_WIDE < v < _WIDE:
            return json.loads(raw)
    return value


_WIDE = float(2**63)  # floats this large are integers: maybe a wide integer that orjson read as float


@dataclass(frozen=True)
class _Decoders:
    """How the raw fields of a row become values: JSON text -> objects, created_at -> datetime
    (SQLAlchemy's own result processor for the dialect, e.g. SQLite's text timestamps)."""

    json: Callable[[Any], Any]
    datetime: Callable[[Any], Any]


_DECODED = _Decoders(_identity, _identity)  # rows whose fields are already values


def _decoders(dialect: Dialect) -> _Decoders:
    col_type = Message.__table__.c.created_at.type
    proc = col_type.dialect_impl(dialect).result_processor(dialect, None)
    return _Decoders(_json_loads, proc or _identity)


@dataclass
class _Batch:
    chats: list[Any]  # (id, user_id), in id order
    messages: dict[str, list[Any]]  # chat id -> its message rows, in id order
    tokens: dict[str, Any]  # message id -> token row
    decoders: _Decoders


class _Reader:
    """Reads an export batch by batch: a page of chats, their messages, then the token records of the
    complete assistant messages by primary key (a join can make the planner scan the whole table).

    The statements are built once per export. On PostgreSQL an id list is one array parameter; on
    asyncpg the statements, compiled once, run on the driver connection itself: its records instead
    of SQLAlchemy rows take ~40% less CPU, and no column here needs SQLAlchemy's result processing."""

    def __init__(self, sessions: SessionFactory, filters: ExportFilters) -> None:
        self.sessions = sessions
        self.filters = filters
        self.dialect: Dialect | None = None

    def _prepare(self, dialect: Dialect) -> None:
        self.dialect = dialect
        pg = dialect.name == "postgresql"
        ids = bindparam("ids", type_=ARRAY(String)) if pg else bindparam("ids", expanding=True)

        def member(column: Any) -> Any:
            return column == any_(ids) if pg else column.in_(ids)

        self.chunk = 0 if pg else _IN_CHUNK  # ids per IN list (0: all at once)
        self.statements: dict[str, Any] = {
            "page": _chat_query(self.filters).where(Chat.id > bindparam("after")).order_by(Chat.id).limit(CHAT_BATCH),
            "messages": select(*_MSG_COLUMNS).where(member(Message.chat_id)).order_by(Message.chat_id, Message.id),
            "tokens": select(*_TOKEN_COLUMNS).where(member(MessageTokens.message_id)),
        }
        self.compiled = (
            {name: stmt.compile(dialect=dialect) for name, stmt in self.statements.items()}
            if dialect.driver == "asyncpg"
            else {}
        )
        self.decoders = _decoders(dialect)

    async def _rows(self, conn: AsyncConnection, name: str, **params: Any) -> Sequence[Any]:
        compiled = self.compiled.get(name)
        if compiled is None:
            return (await conn.execute(self.statements[name], params)).all()
        values = compiled.construct_params(params)
        driver: Any = (await conn.get_raw_connection()).driver_connection
        args = [values[key] for key in compiled.positiontup or ()]
        return await driver.fetch(compiled.string, *args)  # type: ignore[no-any-return]

    async def batch(self, after: str) -> _Batch | None:
        """The chats after ``after`` (one page), with their messages and token records; None: no more."""
        async with self.sessions() as s:
            conn = await s.connection()
            if self.dialect is None:
                self._prepare(conn.dialect)
            chats = list(await self._rows(conn, "page", after=after))
            if not chats:
                return None
            msgs = await self._rows(conn, "messages", ids=[c[0] for c in chats])
            # cancelled messages keep the tokens generated until the abort (finish_reason "abort")
            done = (MessageState.complete.value, MessageState.cancelled.value)
            assistant_ids = [m[_M_ID] for m in msgs if m[_M_ROLE] == "assistant" and m[_M_STATE] in done]
            tokens = {}
            chunk = self.chunk or max(1, len(assistant_ids))
            for i in range(0, len(assistant_ids), chunk):
                rows = await self._rows(conn, "tokens", ids=assistant_ids[i : i + chunk])
                tokens.update({r[_T_ID]: r for r in rows})
        by_chat = {cid: list(group) for cid, group in itertools.groupby(msgs, key=operator.itemgetter(_M_CHAT))}
        return _Batch(chats, by_chat, tokens, self.decoders)


async def iter_rollouts(sessions: SessionFactory, filters: ExportFilters) -> AsyncIterator[dict[str, Any]]:
    reader = _Reader(sessions, filters)
    batch = await reader.batch("")
    pending: asyncio.Task[_Batch | None] | None = None
    try:
        while batch is not None:
            # The next batch is read while this one is turned into rollouts: the database (or SQLite's
            # thread) works meanwhile, given a turn of the event loop every few chats.
            if len(batch.chats) == CHAT_BATCH:
                pending = asyncio.ensure_future(reader.batch(batch.chats[-1][0]))
            for i, (chat_id, user_id) in enumerate(batch.chats):
                msgs = batch.messages.pop(chat_id, [])
                for rollout in _chat_rollouts(chat_id, user_id, msgs, batch.tokens, filters, batch.decoders):
                    yield rollout
                if pending is not None and i % 8 == 7 and not pending.done():
                    await asyncio.sleep(0)
            batch = None
            if pending is not None:
                batch, pending = await pending, None
    finally:
        if pending is not None and not pending.done():
            pending.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await pending


def chat_rollouts(
    chat: Any, msgs: Sequence[Any], tokens: dict[str, Any], filters: ExportFilters
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
        )
        for mid, t in tokens.items()
    }
    return _chat_rollouts(chat.id, chat.user_id, rows, token_rows, filters, _DECODED)


def _chat_rollouts(
    chat_id: str,
    user_id: str,
    msgs: Sequence[Any],
    tokens: dict[str, Any],
    filters: ExportFilters,
    dec: _Decoders,
) -> list[dict[str, Any]]:
    by_id = {m[_M_ID]: m for m in msgs}
    below: set[str] = set()  # messages with an assistant descendant
    for m in msgs:
        if m[_M_ROLE] == "assistant" and m[_M_STATE] != _MANUAL:
            parent = m[_M_PARENT]
            while parent in by_id and parent not in below:
                below.add(parent)
                parent = by_id[parent][_M_PARENT]
    out = []
    for m in msgs:
        if m[_M_ROLE] != "assistant" or m[_M_STATE] == _MANUAL or m[_M_ID] in below:
            continue
        rollout = _rollout(chat_id, user_id, _path(by_id, m[_M_ID]), tokens, filters, dec)
        if rollout is not None:
            out.append(rollout)
    return out


def _path(by_id: dict[str, Any], leaf: str) -> list[Any]:
    path = []
    cur: str | None = leaf
    while cur is not None and cur in by_id:
        row = by_id[cur]
        path.append(row)
        cur = row[_M_PARENT]
    path.reverse()
    return path


def _leaf_passes(leaf: Any, filters: ExportFilters, dec: _Decoders) -> bool:
    if filters.model is not None and leaf[_M_MODEL] != filters.model:
        return False
    if filters.since is None and filters.until is None:
        return True
    created = dec.datetime(leaf[_M_CREATED])
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


def _rollout(
    chat_id: str, user_id: str, path: list[Any], tokens: dict[str, Any], filters: ExportFilters, dec: _Decoders
) -> dict[str, Any] | None:
    leaf = path[-1]
    if not _leaf_passes(leaf, filters, dec):
        return None
    # assistant messages a client wrote (OpenAI API histories) are context, not turns
    assistants = [m for m in path if m[_M_ROLE] == "assistant" and m[_M_STATE] != _MANUAL]
    complete = all(m[_M_ID] in tokens for m in assistants)
    if not complete and not filters.include_incomplete:
        return None
    turns: list[dict[str, Any]] = []
    packed: list[_Packed] = []
    first_tokens = None
    leaf_work = None
    prev_prompt = prev_completion = b""
    json_loads, to_datetime = dec.json, dec.datetime
    for m in assistants:
        t = tokens.get(m[_M_ID])
        if t is None:
            continue
        if first_tokens is None:
            first_tokens = t
        prompt_blob = t[_T_PROMPT]
        if type(prompt_blob) is not bytes or len(prompt_blob) % 4:
            prompt_blob = _blob(prompt_blob, "id")
        completion_blob = t[_T_COMPLETION]
        if type(completion_blob) is not bytes or len(completion_blob) % 4:
            completion_blob = _blob(completion_blob, "id")
        lp_blob = t[_T_LOGPROBS]
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
        work = json_loads(m[_M_WORK])
        if m is leaf:
            leaf_work = work
        work = work or {}
        sampling = dict(work.get("sampling_parameters") or {})
        sampling["seed"] = work.get("seed")
        synth = t[_T_SYNTH]
        reused = t[_T_REUSED]
        stop = t[_T_STOP]
        created = to_datetime(m[_M_CREATED])
        turns.append(
            {
                "message_id": m[_M_ID],
                "prompt_delta_ids": delta,
                "completion_ids": completion,
                "logprobs": lps,
                "finish_reason": t[_T_FINISH],
                "stop_reason": None if stop is None else decode_stop_reason(stop),
                "synthetic_closer_ids": prompt[reused : reused + synth].tolist() if synth else [],
                "reused_prefix_len": reused,
                "fork": t[_T_FORK],
                "prompt_method": t[_T_METHOD],
                "prompt_length": len(prompt),
                "sampling": sampling,
                "reward": float(m[_M_SCORE]) if m[_M_VOTED] else None,
                "content": m[_M_CONTENT],
                "reasoning_content": m[_M_REASONING],
                "tool_calls": json_loads(m[_M_TOOL_CALLS]),
                "created_at": created.isoformat() if created else None,
            }
        )
        packed.append(_Packed(prompt_blob, completion_blob, delta, completion, zeroed, ext))
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
        leaf_work = dec.json(leaf[_M_WORK])
    leaf_work = leaf_work or {}
    return {
        "schema": SCHEMA_NAME,
        "schema_version": SCHEMA_VERSION,
        "rollout_id": leaf[_M_ID],
        "chat_id": chat_id,
        "leaf_message_id": leaf[_M_ID],
        "user_id": user_id,
        "model_name": leaf[_M_MODEL] or "",
        "tokenizer_hash": first_tokens[_T_TOKENIZER],
        "template_hash": first_tokens[_T_TEMPLATE],
        "engine": first_tokens[_T_ENGINE],
        "system_prompt": leaf_work.get("system_prompt"),
        "tools": leaf_work.get("tools"),
        "turns": turns,
        "samples": _packed_samples(packed, turns),
        "reward": reward,
        "reward_rule": filters.reward_rule,
        "complete": complete,
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
            spans.append((start, start + len(p.completion_ids)))
        samples.append(sample_record(token_ids, mask, lps, spans, group, turns))
    return samples
