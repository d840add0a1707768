"""The PostgreSQL fault of ``benchmarks/chaos.py`` and its OpenAI streaming users (issues 23 and 28).

- ``database(args)``: with ``--pg-kills N`` (default 2) a private PostgreSQL that the run SIGKILLs
  (postmaster and every backend, as when its container dies) and starts again; else the local one.
- ``postgres_faults``: N kills at fixed points of the run, each down for the next of ``--pg-down``
  seconds, then started again (crash recovery); when it accepts connections again, ``ServingWatch``
  checks from ``/admin/workers`` (each worker has a key of its own) that every worker stores a reply
  again, and how long after.
- ``OpenAIUser``: ``--openai-share`` of the users chat through ``/v1/chat/completions`` with
  ``stream=true``, each turn echoing the history it streamed. A stream must end with ``[DONE]``
  (after an error chunk at worst); one that breaks is cut (one that breaks while its replica is
  being killed is counted apart: an OpenAI stream cannot resume elsewhere).
- ``verify``: every streamed message against SQL: stored, ended, same token ids and same text.

503 with Retry-After while the database is away is allowed (``User.call`` counts it apart); a 5xx
without it is a failure, as are cut streams, lost/stuck messages, streamed != stored, and a worker
that does not serve again after a restart.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import time
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

import httpx

from benchmarks.progress import say

if TYPE_CHECKING:
    from tests.services import RestartablePostgres


class Chatter(Protocol):
    """What an OpenAI user borrows from one of ``benchmarks/chaos.py``'s users (this module does not
    import that one: it is imported by it)."""

    name: str
    headers: dict[str, str]
    tally: Any  # chaos.Tally

    def url(self) -> str: ...
    async def login(self, client: httpx.AsyncClient) -> None: ...
    async def call(self, client: httpx.AsyncClient, method: str, path: str, **kw: Any) -> httpx.Response | None: ...
    def count_5xx(self, resp: httpx.Response, route: str) -> None: ...
    def after_kill(self, mid: str, now: float) -> None: ...


SERVING_WAIT_S = 30.0  # a worker that stores no reply this long after a restart is not serving again
FAILURES = ("openai_cut_streams", "openai_lost", "openai_stuck", "openai_stream_differs", "workers_not_serving")


def add_arguments(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--pg-kills", type=int, default=2, help="PostgreSQL SIGKILLs and restarts (0: none)")
    ap.add_argument("--pg-down", default="15,5", help="seconds PostgreSQL stays down, per kill (cycled)")
    ap.add_argument("--openai-share", type=float, default=0.5, help="share of users on streamed chat completions")


@contextlib.contextmanager
def database(args: argparse.Namespace) -> Iterator[tuple[str, RestartablePostgres | None]]:
    """The database URL of the run, and the private PostgreSQL to kill (None without the fault)."""
    from tests import services

    if args.pg_kills <= 0:
        with services.postgres_service() as url:
            yield url, None
        return
    pg = services.RestartablePostgres().start()
    try:
        yield pg.url, pg
    finally:
        pg.stop()


# ---- the fault -------------------------------------------------------------------------------------
@dataclass
class Restart:
    killed_at: float  # seconds into the run
    down_s: float
    accepting_after_s: float = 0.0  # from the start command to accepting connections
    serving_after_s: dict[str, float | str | None] = field(default_factory=dict)  # worker key -> s after accepting


async def postgres_faults(
    pg: RestartablePostgres, c: Any, tally: Any, duration: float, args: argparse.Namespace, log: list[str]
) -> list[Restart]:
    """Kill and restart ``pg`` ``--pg-kills`` times during the run (``c``: chaos.Cluster, ``tally``:
    chaos.Tally, whose kill -> next token timing covers these kills too)."""
    downs = [float(x) for x in args.pg_down.split(",")]
    watch = ServingWatch(c)
    start = time.monotonic()
    restarts: list[Restart] = []
    for k in range(args.pg_kills):
        # in the first 60% of the run: after the last restart the load goes on long enough to show
        # that every worker serves again
        at = start + duration * (0.15 + 0.45 * k / max(1, args.pg_kills - 1))
        await asyncio.sleep(max(0.0, at - time.monotonic()))
        before = await watch.snapshot()  # /admin/workers needs the database (its auth)
        streaming = {m for m, t in tally.last_token_at.items() if time.monotonic() - t < 2.0}
        killed = time.monotonic()
        await asyncio.to_thread(pg.kill)
        tally.pending_kills.append((killed, "postgres", streaming))
        restart = Restart(round(killed - start, 1), downs[k % len(downs)])
        restarts.append(restart)
        log.append(f"{killed - start:6.1f}s postgres killed ({len(streaming)} streaming)")
        say(log[-1])
        await asyncio.sleep(restart.down_s)
        began = time.monotonic()
        await asyncio.to_thread(pg.start)  # returns once it accepts connections
        restart.accepting_after_s = round(time.monotonic() - began, 2)
        log.append(f"{time.monotonic() - start:6.1f}s postgres accepting again (recovery {restart.accepting_after_s}s)")
        say(log[-1])
        restart.serving_after_s = await watch.serving_again(before, time.monotonic())
    return restarts


class ServingWatch:
    """Replies stored per worker (``served`` of ``/admin/workers``, summed over a worker key's
    connections, so a reconnect is not mistaken for serving again)."""

    def __init__(self, c: Any) -> None:  # chaos.Cluster
        self.c = c
        self.keys = [f"chaos-{i}" for i in range(len(c.workers))]

    async def _served(self) -> dict[str, dict[str, int]] | None:
        headers = {"Authorization": f"Bearer {self.c.admin_key}"}
        async with httpx.AsyncClient(timeout=5) as client:
            for url in self.c.urls:
                try:
                    resp = await client.get(f"{url}/admin/workers", headers=headers)
                except httpx.HTTPError:
                    continue
                if resp.status_code == 200:
                    out: dict[str, dict[str, int]] = {}
                    for w in resp.json():
                        out.setdefault(w["key_name"], {})[w["worker_id"]] = int(w.get("served", 0))
                    return out
        return None

    async def snapshot(self) -> dict[str, dict[str, int]]:
        return await self._served() or {}

    async def serving_again(self, before: dict[str, dict[str, int]], since: float) -> dict[str, float | str | None]:
        """Per worker key: seconds from ``since`` until one of its connections stored a new reply
        ("killed": the run killed that worker meanwhile; None: it did not serve again)."""
        found: dict[str, float | str | None] = dict.fromkeys(self.keys)
        kills = [w.kills for w in self.c.workers]
        while time.monotonic() - since < SERVING_WAIT_S and any(v is None for v in found.values()):
            now = await self._served() or {}
            for key in self.keys:
                old = before.get(key, {})
                if found[key] is None and any(n > old.get(wid, 0) for wid, n in now.get(key, {}).items()):
                    found[key] = round(time.monotonic() - since, 2)
            await asyncio.sleep(0.5)
        for key, w, k in zip(self.keys, self.c.workers, kills, strict=True):
            if found[key] is None and w.kills != k:
                found[key] = "killed"
        return found


# ---- OpenAI streaming users --------------------------------------------------------------------------
@dataclass
class Streamed:
    chat_id: str
    content: str
    token_ids: list[int]
    reset: bool = False  # a retry rewound the stream: its text is not compared


@dataclass
class OpenAITally:
    streamed: dict[str, Streamed] = field(default_factory=dict)  # message id -> what the stream gave
    done: int = 0
    cut: int = 0  # broke without [DONE]
    cut_by_replica_kill: int = 0  # broke while its replica was killed (expected: no resume on /v1)
    cut_reasons: Counter[str] = field(default_factory=Counter)
    differences: list[dict[str, Any]] = field(default_factory=list)  # the first few streamed != stored
    error_chunks: Counter[str] = field(default_factory=Counter)


class OpenAIUser:
    """Chats through streamed chat completions as ``user`` (its login, replica choice and counters)."""

    def __init__(self, user: Chatter, c: Any, otally: OpenAITally, tokens: int) -> None:
        self.user, self.cluster, self.otally, self.tokens = user, c, otally, tokens
        self.name, self.tally = user.name, user.tally

    async def run(self, client: httpx.AsyncClient, stop: asyncio.Event) -> None:
        await self.user.login(client)
        while not stop.is_set():
            history: list[dict[str, Any]] = []
            for turn in range(3):
                if stop.is_set():
                    break
                history.append({"role": "user", "content": f"{self.name} turn {turn}"})
                content = await self.turn(client, history)
                if content is None:
                    break
                history.append({"role": "assistant", "content": content})

    async def turn(self, client: httpx.AsyncClient, history: list[dict[str, Any]]) -> str | None:
        """One streamed turn: the assembled content, or None if the stream did not end with [DONE]."""
        body = {"model": "tiny", "messages": history, "stream": True, "max_tokens": self.tokens, "ignore_eos": True}
        for _ in range(60):
            url = self.user.url()
            replica = self.cluster.replicas[self.cluster.urls.index(url)]
            kills = replica.kills
            try:
                async with client.stream(
                    "POST", url + "/v1/chat/completions", json=body, headers=self.user.headers, timeout=60
                ) as resp:
                    if resp.status_code >= 500:
                        await resp.aread()
                        self.user.count_5xx(resp, "POST v1")
                        await asyncio.sleep(float(resp.headers.get("Retry-After", "1")))
                        continue
                    if resp.status_code != 200:
                        await resp.aread()
                        self.tally.refused[str(resp.status_code)] += 1
                        await asyncio.sleep(1)
                        return None
                    return await self._read(resp)
            except httpx.ConnectError:  # its replica is down: the request never arrived
                await asyncio.sleep(0.5)
                continue
            except (httpx.HTTPError, json.JSONDecodeError) as exc:
                if replica.kills != kills or replica.proc is None or replica.proc.poll() is not None:
                    self.otally.cut_by_replica_kill += 1
                else:  # when and where, to find it in the servers' logs (their clocks are this one's)
                    self.otally.cut += 1
                    when = time.strftime("%H:%M:%S")
                    self.otally.cut_reasons[f"{repr(exc)[:120]} on {replica.name} at {when}"] += 1
                return None
        return None

    async def _read(self, resp: httpx.Response) -> str | None:
        mid: str | None = None
        got: Streamed | None = None
        error = False
        async for line in resp.aiter_lines():
            if not line.startswith("data: "):
                continue
            data = line[6:]
            if data == "[DONE]":
                self.otally.done += 1
                if got is not None and mid is not None and not error:
                    self.tally.last_token_at.pop(mid, None)
                    return got.content
                return None
            chunk = json.loads(data)
            if "error" in chunk:
                self.otally.error_chunks[str(chunk["error"].get("code"))] += 1
                error = True
                continue
            if mid is None:
                mid = str(chunk["id"]).removeprefix("chatcmpl-")
                info = chunk.get("tokentrail") or {}
                got = self.otally.streamed.setdefault(mid, Streamed(info.get("chat_id", ""), "", []))
            assert got is not None
            if (chunk.get("tokentrail") or {}).get("chat_id"):  # the last chunk names the chat
                got.chat_id = chunk["tokentrail"]["chat_id"]
            if (chunk.get("tokentrail") or {}).get("reset_from") is not None:
                got.reset = True
            for choice in chunk.get("choices", []):
                got.content += choice.get("delta", {}).get("content") or ""
                ids = choice.get("token_ids") or []
                if ids:
                    got.token_ids += ids
                    now = time.monotonic()
                    self.tally.last_token_at[mid] = now
                    self.user.after_kill(mid, now)
        raise httpx.RemoteProtocolError("the stream ended without [DONE]")


# ---- after the run -----------------------------------------------------------------------------------
async def verify(users: list[Chatter], otally: OpenAITally) -> dict[str, Any]:
    """Every streamed OpenAI message against SQL (through the API)."""
    lost = stuck = differs = unknown = 0
    final = {"complete", "aborted_by_worker", "cancelled", "timeout"}
    async with httpx.AsyncClient() as client:
        for mid, got in otally.streamed.items():
            if not got.chat_id:  # cut before its last chunk named the chat (a replica killed)
                unknown += 1
                continue
            msg = None
            for u in users:
                r = await u.call(client, "GET", f"/chats/{got.chat_id}/messages/{mid}", params={"include": "tokens"})
                if r is not None and r.status_code == 200:
                    msg = r.json()
                    break
            if msg is None:
                lost += 1
                continue
            if msg["state"] not in final:
                stuck += 1
                continue
            ids, text = msg.get("completion_token_ids") or [], msg.get("content") or ""
            same = ids == got.token_ids and text == got.content
            if msg["state"] == "complete" and not got.reset and not same:
                differs += 1
                if len(otally.differences) < 5:
                    otally.differences.append(
                        {"message": mid, "tokens_equal": ids == got.token_ids, "streamed": got.content, "stored": text}
                    )
    return {
        "openai_streams_done": otally.done,
        "openai_cut_streams": otally.cut,
        "openai_cut_by_replica_kill": otally.cut_by_replica_kill,
        "openai_cut_reasons": dict(otally.cut_reasons),
        "openai_error_chunks": dict(otally.error_chunks),
        "openai_unchecked": unknown,
        "openai_lost": lost,
        "openai_stuck": stuck,
        "openai_stream_differs": differs,
        "openai_differences": otally.differences,
    }


def serving_summary(restarts: list[Restart]) -> dict[str, Any]:
    return {
        "postgres_restarts": [
            {
                "killed_at_s": r.killed_at,
                "down_s": r.down_s,
                "recovery_s": r.accepting_after_s,
                "worker_serving_again_s": r.serving_after_s,
            }
            for r in restarts
        ],
        "workers_not_serving": sum(v is None for r in restarts for v in r.serving_after_s.values()),
    }
