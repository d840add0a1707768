"""Authentication: OA-style debug login tokens (signed JWTs) and hashed API keys.

User API keys start with ``tt_u_``, worker keys with ``tt_w_``; both are shown once and stored
as SHA-256 (they are long random strings, so a fast hash is enough). Access and refresh tokens
are HS256 JWTs signed with the server's secret, so any replica can check them.
"""

from __future__ import annotations

import hashlib
import secrets
from datetime import UTC, datetime, timedelta

import jwt

from server.errors import ApiError
from shared.errors import ErrorCode

USER_KEY_PREFIX = "tt_u_"
WORKER_KEY_PREFIX = "tt_w_"


def hash_key(key: str) -> str:
    return hashlib.sha256(key.encode()).hexdigest()


def new_user_key() -> str:
    return USER_KEY_PREFIX + secrets.token_urlsafe(32)


def new_worker_key() -> str:
    return WORKER_KEY_PREFIX + secrets.token_urlsafe(32)


class TokenSigner:
    def __init__(self, secret: str, access_minutes: int, refresh_days: int) -> None:
        self._secret = secret
        self._access = timedelta(minutes=access_minutes)
        self._refresh = timedelta(days=refresh_days)

    def _make(self, user_id: str, kind: str, ttl: timedelta) -> str:
        now = datetime.now(UTC)
        claims = {"sub": user_id, "kind": kind, "iat": now, "exp": now + ttl}
        return jwt.encode(claims, self._secret, algorithm="HS256")

    def access_token(self, user_id: str) -> str:
        return self._make(user_id, "access", self._access)

    def refresh_token(self, user_id: str) -> str:
        return self._make(user_id, "refresh", self._refresh)

    def verify(self, token: str, kind: str = "access") -> str:
        """The user id of a valid token of this kind; ApiError(invalid_credentials) otherwise."""
        try:
            claims = jwt.decode(token, self._secret, algorithms=["HS256"])
        except jwt.PyJWTError as exc:
            raise ApiError(ErrorCode.invalid_credentials, f"invalid token: {exc}") from exc
        if claims.get("kind") != kind or not isinstance(claims.get("sub"), str):
            raise ApiError(ErrorCode.invalid_credentials, f"not an {kind} token")
        return str(claims["sub"])
