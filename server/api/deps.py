"""FastAPI dependencies as ``Annotated`` aliases: app state, DB session, current user, repository, the
client's session hint."""

from __future__ import annotations

import hashlib
import time
from collections.abc import AsyncIterator, Mapping
from typing import Annotated

from fastapi import Depends, Request
from sqlalchemy import select
from sqlalchemy.ext.asyncio import AsyncSession

from server.auth import USER_KEY_PREFIX, hash_key
from server.chats.repository import ChatRepository
from server.errors import ApiError
from server.idempotency import HEADER, IdempotencyKey, fingerprint, parse_key
from server.models import ApiKey, User
from server.state import AppState
from shared.errors import ErrorCode


async def get_state(request: Request) -> AppState:  # async: FastAPI runs plain functions on a thread
    state: AppState = request.app.state.tt
    return state


StateDep = Annotated[AppState, Depends(get_state)]


async def get_session(state: StateDep) -> AsyncIterator[AsyncSession]:
    async with state.sessions() as session:
        yield session


SessionDep = Annotated[AsyncSession, Depends(get_session)]


def bearer_token(request: Request) -> str:
    return bearer_of(request.headers)


def bearer_of(headers: Mapping[str, str]) -> str:
    """The token of an ``Authorization: Bearer`` header (names in lower case, as ASGI gives them)."""
    scheme, _, token = headers.get("authorization", "").partition(" ")
    if scheme.lower() != "bearer" or not token.strip():
        raise ApiError(
            ErrorCode.not_authenticated,
            "missing credentials: send 'Authorization: Bearer <token or API key>'",
            headers={"WWW-Authenticate": "Bearer"},
        )
    return token.strip()


AUTH_CACHE_TTL_S = 5.0  # a revoked key or deleted user is refused within this long
_AUTH_CACHE_MAX = 10_000


async def user_for_token(token: str, state: AppState, session: AsyncSession) -> User:
    """The user a bearer token or API key names. Answers are cached for a few seconds per process:
    a chat turn makes three requests, and each would otherwise look the user up in SQL."""
    now = time.monotonic()
    hit = state.auth_cache.get(token)
    if hit is not None and hit[0] > now:
        return hit[1]
    user = await _lookup_user(token, state, session)
    if len(state.auth_cache) >= _AUTH_CACHE_MAX:
        state.auth_cache.clear()
    # a detached copy: the session that loaded it closes with this request
    state.auth_cache[token] = (
        now + AUTH_CACHE_TTL_S,
        User(
            id=user.id,
            display_name=user.display_name,
            provider=user.provider,
            is_admin=user.is_admin,
            created_at=user.created_at,
        ),
    )
    return user


async def _lookup_user(token: str, state: AppState, session: AsyncSession) -> User:
    if token.startswith(USER_KEY_PREFIX):
        user = await session.scalar(
            select(User)
            .join(ApiKey, ApiKey.user_id == User.id)
            .where(ApiKey.key_hash == hash_key(token), ApiKey.revoked_at.is_(None))
        )
        if user is None:
            raise ApiError(ErrorCode.invalid_credentials, "unknown or revoked API key")
        return user
    user_id = state.signer.verify(token, "access")
    user = await session.get(User, user_id)
    if user is None:
        raise ApiError(ErrorCode.invalid_credentials, "the token's user no longer exists")
    return user


def request_token(request: Request) -> str:
    return token_of(request.headers)


def token_of(headers: Mapping[str, str]) -> str:
    """The bearer token; without an Authorization header, the API key of ``x-api-key`` (Anthropic's SDK
    sends its key so)."""
    key = headers.get("x-api-key", "").strip()
    if key and "authorization" not in headers:
        return key
    return bearer_of(headers)


async def get_current_user(request: Request, state: StateDep, session: SessionDep) -> User:
    return await user_for_token(request_token(request), state, session)


CurrentUser = Annotated[User, Depends(get_current_user)]


async def get_admin(user: CurrentUser) -> User:
    if not user.is_admin:
        raise ApiError(ErrorCode.forbidden, "administrator role required")
    return user


AdminUser = Annotated[User, Depends(get_admin)]


async def get_repository(session: SessionDep, user: CurrentUser) -> ChatRepository:
    return ChatRepository(session, user)


RepoDep = Annotated[ChatRepository, Depends(get_repository)]


# Session hints agents and RL clients send: prime-rl's and verifiers' X-Session-ID, Codex's session_id.
SESSION_HEADERS = ("x-session-id", "session_id", "session-id")
MAX_SESSION_KEY = 128  # the stored column's width: a longer key is stored as its hash


def session_key(value: str | None) -> str | None:
    """A session hint as stored: stripped, empty as none, over ``MAX_SESSION_KEY`` characters hashed."""
    value = (value or "").strip()
    if not value:
        return None
    if len(value) > MAX_SESSION_KEY:
        return "h:" + hashlib.blake2b(value.encode(), digest_size=32).hexdigest()
    return value


async def session_hint(request: Request) -> str | None:
    for name in SESSION_HEADERS:
        if value := session_key(request.headers.get(name)):
            return value
    return None


SessionHint = Annotated[str | None, Depends(session_hint)]


async def idempotency_key(request: Request, user: CurrentUser, state: StateDep) -> IdempotencyKey | None:
    """The request's ``Idempotency-Key`` (``server/idempotency.py``), scoped to its user."""
    raw = request.headers.get(HEADER)
    if raw is None:
        return None
    body = await request.body()  # read once by FastAPI already: cached
    return idempotency_of(raw, user.id, request.method, request.url.path, request.url.query, body, state)


def idempotency_of(
    raw: str, user_id: str, method: str, path: str, query: str, body: bytes, state: AppState
) -> IdempotencyKey:
    """An ``Idempotency-Key`` header's value as the key of this user's request (method, path, body)."""
    target = path + (f"?{query}" if query else "")
    return IdempotencyKey(user_id, parse_key(raw), fingerprint(method, target, body), state.settings.idempotency_ttl_s)


Idempotency = Annotated[IdempotencyKey | None, Depends(idempotency_key)]
