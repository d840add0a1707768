"""``/auth``: Open-Assistant's debug login flow, token refresh and the credentials check."""

from __future__ import annotations

from typing import Annotated
from urllib.parse import urlencode

from fastapi import APIRouter, Header, Query, Request
from fastapi.responses import RedirectResponse
from sqlalchemy.exc import IntegrityError

from server.api.deps import CurrentUser, SessionDep, StateDep, bearer_token
from server.errors import ApiError
from server.models import User
from shared.api import Token, TokenPair
from shared.errors import ErrorCode

router = APIRouter(prefix="/auth", tags=["auth"])

MAX_USERNAME = 128


@router.get("/check")
async def check(user: CurrentUser) -> str:
    return user.id


@router.get("/providers")
async def providers(state: StateDep) -> list[str]:
    return ["debug"] if state.settings.debug_auth_allowed else []


@router.get("/login/debug")
async def login_debug(
    request: Request, state: StateDep, username: str, state_param: Annotated[str, Query(alias="state")] = "{}"
) -> RedirectResponse:
    """Redirects to the debug callback, as OA does; clients that follow redirects get the tokens."""
    if not state.settings.debug_auth_allowed:
        raise ApiError(ErrorCode.debug_auth_disabled, "debug auth is not allowed on this server")
    query = urlencode({"code": username, "state": state_param})
    return RedirectResponse(f"{request.url_for('callback_debug')}?{query}", status_code=302)


@router.get("/callback/debug", name="callback_debug")
async def callback_debug(code: str, state: StateDep, session: SessionDep) -> TokenPair:
    """Logs in (creating on first use) the user named ``code``, without any check."""
    if not state.settings.debug_auth_allowed:
        raise ApiError(ErrorCode.debug_auth_disabled, "debug auth is not allowed on this server")
    username = code.strip()
    if not username or len(username) > MAX_USERNAME:
        raise ApiError(ErrorCode.bad_request, f"username must be 1 to {MAX_USERNAME} characters")
    user = await session.get(User, username)
    if user is None:
        session.add(User(id=username, display_name=username, provider="debug"))
        try:
            await session.commit()
        except IntegrityError:  # created concurrently by another request: fine
            await session.rollback()
    return TokenPair(
        access_token=Token(access_token=state.signer.access_token(username), token_type="bearer"),
        refresh_token=Token(access_token=state.signer.refresh_token(username), token_type="refresh"),
    )


@router.get("/refresh")
async def refresh(
    request: Request,
    state: StateDep,
    session: SessionDep,
    refresh_header: Annotated[str | None, Header(alias="Refresh")] = None,
) -> Token:
    """A new access token for a refresh token, sent as OA does (``Refresh: <token>``) or as
    ``Authorization: Bearer <token>``."""
    token = refresh_header.strip() if refresh_header and refresh_header.strip() else bearer_token(request)
    if token.lower().startswith("bearer "):
        token = token[7:].strip()
    user_id = state.signer.verify(token, "refresh")
    if await session.get(User, user_id) is None:
        raise ApiError(ErrorCode.invalid_credentials, "the token's user no longer exists")
    return Token(access_token=state.signer.access_token(user_id), token_type="bearer")
