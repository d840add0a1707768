"""What an export reads: its filters, the chats they select, and the row layout of the messages and
token records it reads (fields by position, see ``M_*`` and ``T_*``), with the decoders that turn a
row's raw fields into values (JSON text, the driver's timestamps)."""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from datetime import datetime
from typing import Any

import orjson
from sqlalchemy import ARRAY, Integer, Select, String, Text, any_, bindparam, case, cast, func, select, type_coerce
from sqlalchemy.engine import Dialect

from server.db import SessionFactory
from server.models import Chat, Message, MessageTokens, PolicyVersion
from shared.rollout import RewardRule


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
    # policy versions (docs/weights.md), over every generated token of the rollout's exported turns:
    min_version: int | None = None  # each is at least this version
    max_staleness: int | None = None  # each is at least its model's newest registered version minus this


CHAT_COLUMNS: tuple[Any, ...] = (Chat.id, Chat.user_id)


def chat_query(filters: ExportFilters) -> Select[Any]:
    return select(*CHAT_COLUMNS).where(*chat_conditions(filters))


def chat_conditions(filters: ExportFilters) -> list[Any]:
    """The chats an export reads: those that allow data use, of the filters' user and chat."""
    conditions: list[Any] = [Chat.allow_data_use.is_(True)]
    if filters.user is not None:
        conditions.append(Chat.user_id == filters.user)
    if filters.chat is not None:
        conditions.append(Chat.id == filters.chat)
    return conditions


@dataclass(frozen=True)
class PolicyPaths:
    """The registry of weights versions (SQL ``policy_versions``) as an export reads it, once, at its
    start: each model's pushed versions and their checkpoint directories. Version 0 (the weights the
    workers start with) has no row and no path."""

    paths: dict[str, dict[int, str]]  # model -> version -> checkpoint directory

    def path(self, model: str, version: int) -> str | None:
        return self.paths.get(model, {}).get(version)

    @staticmethod
    def from_rows(rows: Any) -> PolicyPaths:
        """From ``policy_versions`` rows of (model, version, path)."""
        paths: dict[str, dict[int, str]] = {}
        for model, version, path in rows:
            paths.setdefault(str(model), {})[int(version)] = str(path)
        return PolicyPaths(paths)

    def newest(self, model: str) -> int:
        """The model's newest registered version (0: never pushed)."""
        versions = self.paths.get(model)
        return max(versions) if versions else 0


NO_PATHS = PolicyPaths({})
POLICY_QUERY = select(PolicyVersion.model_name, PolicyVersion.version, PolicyVersion.path)


async def read_policy_paths(sessions: SessionFactory) -> PolicyPaths:
    async with sessions() as s:
        return PolicyPaths.from_rows(await s.execute(POLICY_QUERY))


async def count_chats(sessions: SessionFactory, filters: ExportFilters) -> int:
    async with sessions() as s:
        sub = chat_query(filters).subquery()
        return int(await s.scalar(select(func.count()).select_from(sub)) or 0)


# The fields the export reads, by position: one row per message (the _M* indices) and, for complete
# assistant messages, one row of their token record (the _T* indices).
M_ID, M_PARENT, M_ROLE, M_STATE, M_CONTENT, M_REASONING, M_TOOL_CALLS = range(7)
MANUAL = "manual"
M_MODEL, M_WORK, M_SCORE, M_VOTED, M_CREATED, M_CHAT, M_POLICY, M_REWARD, M_DONE = range(7, 16)
MSG_COLUMNS: tuple[Any, ...] = (
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
    type_coerce(Message.created_at, String).label("created_at"),  # as the driver gives it: see Decoders
    Message.chat_id,
    cast(Message.policy_versions, Text).label("policy_versions"),  # JSON text, as tool_calls
    Message.reward,
    Message.episode_done,
)
T_ID, T_PROMPT, T_COMPLETION, T_LOGPROBS, T_FINISH, T_STOP = range(6)
T_ENGINE, T_TOKENIZER, T_TEMPLATE, T_REUSED, T_SYNTH, T_FORK, T_METHOD = range(6, 13)
TOKEN_COLUMNS: tuple[Any, ...] = (
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
IN_CHUNK = 900  # ids per IN list (SQLite before 3.32 allows 999 parameters)


def _identity(value: Any) -> Any:
    return value


def json_loads(raw: Any) -> Any:
    """JSON column text -> value, as the driver's ``json.loads`` gives it; orjson (~3x faster) where
    it agrees: it refuses NaN, infinities and lone surrogates, and reads integers beyond 64 bits as
    floats, so a document with a run of 19 digits or more (maybe such an integer) is read by ``json``."""
    if raw is None or raw == "null":
        return None
    text = raw.encode() if type(raw) is str else bytes(raw)
    if _LONG_NUMBER in text.translate(_DIGITS_AS_NINES):
        return json.loads(raw)
    try:
        return orjson.loads(text)
    except orjson.JSONDecodeError:
        return json.loads(raw)


_DIGITS_AS_NINES = bytes.maketrans(b"012345678", b"999999999")
_LONG_NUMBER = b"9" * 19  # 2**63 has 19 digits: any shorter integer fits in 64 bits


@dataclass(frozen=True)
class Decoders:
    """How the raw fields of a row become values: JSON text -> objects, created_at -> datetime
    (SQLAlchemy's own result processor for the dialect, e.g. SQLite's text timestamps)."""

    json: Callable[[Any], Any]
    datetime: Callable[[Any], Any]


DECODED = Decoders(_identity, _identity)  # rows whose fields are already values


def decoders(dialect: Dialect) -> Decoders:
    col_type = Message.__table__.c.created_at.type
    proc = col_type.dialect_impl(dialect).result_processor(dialect, None)
    return Decoders(json_loads, proc or _identity)


def page_statements(filters: ExportFilters, postgres: bool) -> dict[str, Select[Any]]:
    """What an export reads, a page at a time: ``bound``, the id :skip chats after :after (none: fewer
    chats left), and ``last``, the last id after :after (a page's bounds); ``chats``, the filters' chats
    with ids in (:after, :last] (id, user id, by id); ``messages``, the messages of the chats :ids
    (``MSG_COLUMNS``, by chat then id), which all have ids in (:after, :last]; ``tokens``, the token
    records (``TOKEN_COLUMNS``) of the messages :ids; ``policy``, the registry of weights versions
    (``read_policy_paths``).

    An id list is one parameter: an array on PostgreSQL, JSON text read by ``json_each`` on SQLite (no
    limit on its length). The range makes PostgreSQL walk the (chat_id, id) index: for a list alone it
    may estimate many rows and scan the whole table instead."""
    after = bindparam("after", type_=String)
    last = bindparam("last", type_=String)
    skip = bindparam("skip", type_=Integer)
    ids = bindparam("ids", type_=ARRAY(String) if postgres else String)
    listed = any_(ids) if postgres else select(func.json_each(ids).table_valued("value").c.value)

    def member(column: Any) -> Any:
        return column == listed if postgres else column.in_(listed)

    chats = chat_conditions(filters)
    return {
        "bound": select(Chat.id).where(*chats, Chat.id > after).order_by(Chat.id).offset(skip).limit(1),
        "last": select(func.max(Chat.id)).where(*chats, Chat.id > after),
        "chats": select(*CHAT_COLUMNS).where(*chats, Chat.id > after, Chat.id <= last).order_by(Chat.id),
        "messages": select(*MSG_COLUMNS)
        .where(Message.chat_id > after, Message.chat_id <= last, member(Message.chat_id))
        .order_by(Message.chat_id, Message.id),
        "tokens": select(*TOKEN_COLUMNS).where(member(MessageTokens.message_id)),
        "policy": POLICY_QUERY,
    }
