"""The metrics of the processes of one ``tokentrail serve --processes N``, merged on every scrape.

The processes share one port, so a scrape reaches whichever takes the connection. That process asks
the others of its group over Redis (a publish on the group's channel; each answers with its own
exposition text on a list of the request's own) and answers with the sum: counters, histograms and
per-process gauges (workers connected, free slots, open SSE streams) add up; ``tokentrail_cluster_*``
and the policy version describe shared state and take the largest; ``*_created`` takes the earliest.
A process that does not answer within ``ANSWER_S`` is left out (and counted, ``what="group"``), so a
scrape never waits on a process that is restarting.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import secrets
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import orjson
from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.utils import floatToGoString

if TYPE_CHECKING:
    from redis.asyncio import Redis

log = logging.getLogger(__name__)

ANSWER_S = 2.0  # how long a scrape waits for the other processes' answers
_MAXED = ("tokentrail_cluster_", "tokentrail_policy_version")  # shared state: the same in every process


@dataclass(frozen=True)
class ProcessGroup:
    """The processes of one ``serve --processes N``: an id of their own, and how many they are."""

    id: str
    size: int


class GroupMetrics:
    """Answers the group's scrapes with this process's metrics, and merges theirs into its own."""

    def __init__(
        self, redis: Redis, group: ProcessGroup, server_id: str, render: Callable[[], Awaitable[bytes]]
    ) -> None:
        self.redis = redis
        self.group = group
        self.server_id = server_id
        self.render = render
        self.channel = f"tokentrail:metrics:{group.id}"
        self._task: asyncio.Task[None] | None = None

    def start(self) -> None:
        self._task = asyncio.create_task(self._answer(), name="group-metrics")

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task

    async def collect(self, own: bytes, on_missing: Callable[[], None]) -> bytes:
        """``own`` merged with the other processes' metrics (those that answered in time)."""
        reply = f"{self.channel}:reply:{secrets.token_hex(8)}"
        texts = [own]
        try:
            listeners = await self.redis.publish(self.channel, orjson.dumps([self.server_id, reply]))
            expected = min(int(listeners) - 1, self.group.size - 1)  # the others (this one listens too)
            loop = asyncio.get_running_loop()
            deadline = loop.time() + ANSWER_S
            while len(texts) <= expected and (left := deadline - loop.time()) > 0:
                got = await self.redis.blpop([reply], timeout=left)
                if got is None:
                    break
                answer = got[1]
                texts.append(answer.encode() if isinstance(answer, str) else answer)
            await self.redis.delete(reply)
        except Exception as exc:  # Redis away: this process's own metrics, as without a group
            log.warning("could not collect the other processes' metrics: %s", exc)
        if len(texts) < self.group.size:
            on_missing()
        return merged(texts) if len(texts) > 1 else own

    async def _answer(self) -> None:
        while True:
            try:
                async with self.redis.pubsub() as pubsub:
                    await pubsub.subscribe(self.channel)
                    async for message in pubsub.listen():
                        if message.get("type") == "message":
                            await self._reply(message["data"])
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # Redis away: listen again once it is back
                log.warning("group metrics: %s; listening again", exc)
                await asyncio.sleep(1.0)

    async def _reply(self, data: bytes) -> None:
        sender, reply = orjson.loads(data)
        if sender == self.server_id:
            return
        text = await self.render()
        async with self.redis.pipeline(transaction=False) as pipe:
            pipe.rpush(reply, text)
            pipe.expire(reply, 30)  # a scrape that gave up never takes it
            await pipe.execute()


SeriesKey = tuple[str, tuple[tuple[str, str], ...]]


def merged(texts: list[bytes]) -> bytes:
    """Prometheus exposition texts of several processes as one: each series' values added, but shared
    state (``_MAXED``) and ``*_created`` timestamps, which take the largest and the earliest."""
    families: dict[str, tuple[str, str]] = {}  # name -> (type, help)
    series: dict[str, dict[SeriesKey, float]] = {}
    for text in texts:
        for family in text_string_to_metric_families(text.decode()):
            families.setdefault(family.name, (family.type, family.documentation))
            values = series.setdefault(family.name, {})
            for sample in family.samples:
                key = (sample.name, tuple(sorted(sample.labels.items())))
                old = values.get(key)
                values[key] = sample.value if old is None else _combined(family.name, sample.name, old, sample.value)
    lines: list[str] = []
    for name, (kind, doc) in families.items():
        lines.append(f"# HELP {name} {doc.replace(chr(92), chr(92) * 2).replace(chr(10), chr(92) + 'n')}")
        lines.append(f"# TYPE {name} {kind}")
        for (sample_name, labels), value in series[name].items():
            inner = ",".join(f'{k}="{_escaped(v)}"' for k, v in labels)
            lines.append(f"{sample_name}{{{inner}}} {_number(value)}" if labels else f"{sample_name} {_number(value)}")
    return ("\n".join(lines) + "\n").encode()


def _number(value: float) -> str:
    text: str = floatToGoString(value)  # type: ignore[no-untyped-call]  # as prometheus_client writes it
    return text


def _combined(family: str, sample: str, a: float, b: float) -> float:
    if sample.endswith("_created"):
        return min(a, b)
    if family.startswith(_MAXED):
        return max(a, b)
    return a + b


def _escaped(value: str) -> str:
    return value.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")
