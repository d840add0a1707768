"""The registry of weights versions (SQL ``policy_versions``): what was pushed to each model, where it
lies, when. A model's current version is its highest row, 0 without one. Each server process caches
the current versions; a push updates its own cache at once and other processes' through the push's
relay call, and every process reads SQL again every few seconds and whenever a worker connects."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from datetime import datetime

from sqlalchemy import func, select
from sqlalchemy.exc import IntegrityError

from server.db import SessionFactory
from server.models import PolicyVersion, utcnow
from server.outages import is_database_unavailable

log = logging.getLogger(__name__)


class VersionTaken(Exception):
    """Another push recorded this version (or a newer one) first."""


@dataclass(frozen=True)
class VersionInfo:
    model: str
    version: int
    path: str
    mode: str
    pushed_at: datetime
    pushed_by: str | None


class PolicyRegistry:
    def __init__(self, sessions: SessionFactory) -> None:
        self.sessions = sessions
        self._current: dict[str, int] = {}  # model -> current version, as last read or pushed here

    def current(self, model: str) -> int:
        """The model's current version as this process knows it (0: never pushed)."""
        return self._current.get(model, 0)

    def currents(self) -> dict[str, int]:
        return dict(self._current)

    def advance(self, model: str, version: int) -> None:
        """Raise the cached current version (a push seen here); never lowers it."""
        if version > self._current.get(model, 0):
            self._current[model] = version

    async def fresh(self) -> dict[str, int]:
        """Every model's current version as SQL has it now (another process may have recorded a push a
        moment ago); the cached versions while the database is unavailable."""
        try:
            return await self.refresh()
        except Exception as exc:
            if not is_database_unavailable(exc):
                raise
            return self.currents()

    async def refresh(self, model: str | None = None) -> dict[str, int]:
        """Read the current versions from SQL (one model's, or all), raising the cache to them."""
        stmt = select(PolicyVersion.model_name, func.max(PolicyVersion.version)).group_by(PolicyVersion.model_name)
        if model is not None:
            stmt = stmt.where(PolicyVersion.model_name == model)
        async with self.sessions() as s:
            rows = (await s.execute(stmt)).all()
        for name, version in rows:
            self.advance(str(name), int(version))
        return self.currents()

    async def latest(self, model: str) -> VersionInfo | None:
        """The model's current version's row (None: it serves the weights its workers started with)."""
        async with self.sessions() as s:
            row = await s.scalar(
                select(PolicyVersion)
                .where(PolicyVersion.model_name == model)
                .order_by(PolicyVersion.version.desc())
                .limit(1)
            )
        if row is None:
            return None
        self.advance(model, row.version)
        return _info(row)

    async def history(self, model: str | None = None) -> list[VersionInfo]:
        """Every version pushed (to one model, or to all), oldest first."""
        stmt = select(PolicyVersion).order_by(PolicyVersion.model_name, PolicyVersion.version)
        if model is not None:
            stmt = stmt.where(PolicyVersion.model_name == model)
        async with self.sessions() as s:
            return [_info(row) for row in await s.scalars(stmt)]

    async def record(self, model: str, version: int, path: str, mode: str, pushed_by: str | None) -> VersionInfo:
        """Store a new current version; ``VersionTaken`` if it is not above every stored one."""
        async with self.sessions() as s, s.begin():
            newest = await s.scalar(select(func.max(PolicyVersion.version)).where(PolicyVersion.model_name == model))
            if newest is not None and version <= newest:
                raise VersionTaken(f"{model} is at version {newest}")
            row = PolicyVersion(
                model_name=model, version=version, path=path, mode=mode, pushed_at=utcnow(), pushed_by=pushed_by
            )
            s.add(row)
            try:
                await s.flush()
            except IntegrityError as exc:  # a concurrent push of the same version won
                raise VersionTaken(f"{model} version {version} was pushed meanwhile") from exc
            info = _info(row)
        self.advance(model, version)
        return info


def _info(row: PolicyVersion) -> VersionInfo:
    return VersionInfo(row.model_name, row.version, row.path, row.mode, row.pushed_at, row.pushed_by)
