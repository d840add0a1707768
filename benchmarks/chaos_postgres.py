"""The PostgreSQL fault of ``benchmarks/chaos.py`` and its OpenAI streaming users (issues 23 and 28).

- ``database(args)``: with ``--pg-kills N`` (default 2) a private PostgreSQL that the run SIGKILLs
  (postmaster and every backend, as when its container dies) and starts again; else the local one.
- ``postgres_faults``: N kills at fixed points of the run, each down for the next of ``--pg-down``
  seconds, then started again (crash recovery); when it accepts connections again, ``ServingWatch``
  checks from ``/admin/workers`` (each worker has a key of its own) that every worker stores a reply
  again, and how long after.
- ``OpenAIUser``: ``--openai-share`` of the users chat through ``/v1/chat/completions`` with
  ``stream=true``, each turn echoing the history it streamed (each conversation's first message is
  its own, so each conversation is a chat of its own). A stream must end with ``[DONE]`` (after an
  error chunk at worst); one that breaks is cut (one that breaks while its replica is being killed or
  restarted is counted apart). With idempotency each turn carries an ``Idempotency-Key``, and a cut
  turn is asked again with it on another replica: the answer follows the same message from its first
  token (``openai_resumed_after_cut``); without, a cut turn ends its conversation.
- ``verify``: every streamed message against SQL: stored, ended, same token ids and same text.
- ``audit``: the users' chats in SQL against the ids the clients were given: generations that no
  client was given, and duplicates (siblings of one role under one parent; chats no client knows).

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
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

import httpx

from benchmarks.progress import say

if TYPE_CHECKING:
    from server.db import Pooler
    from tests.services import RestartablePostgres


class Chatter(Protocol):
    """What an OpenAI user borrows from one of ``benchmarks/chaos.py``'s users (this module does not
    import that one: it is imported by it)."""

    name: str
    headers: dict[str, str]
    tally: Any  # chaos.Tally
    idempotent: bool

    def url(self, avoid: str | None = None) -> str: ...
    def new_key(self) -> str | None: ...
    async def login(self, client: httpx.AsyncClient) -> None: ...
    async def call(
        self, client: httpx.AsyncClient, method: str, path: str, key: str | None = None, **kw: Any
    ) -> httpx.Response | None: ...
    def count_5xx(self, resp: httpx.Response, route: str) -> None: ...


SERVING_WAIT_S = 30.0  # a worker that stores no reply this long after a restart is not serving again
FAILURES = ("openai_cut_streams", "openai_lost", "openai_stuck", "openai_stream_differs", "workers_not_serving")
IDEMPOTENCY_FAILURES = ("generations_no_client_received", "duplicate_messages")


def add_arguments(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--pg-kills", type=int, default=2, help="PostgreSQL SIGKILLs and restarts (0: none)")
    ap.add_argument("--pg-down", default="15,5", help="seconds PostgreSQL stays down, per kill (cycled)")
    ap.add_argument(
        "--pooler",
        choices=("none", "pgbouncer"),
        default="none",
        help="pgbouncer: every server process reaches PostgreSQL through a private PgBouncer in transaction "
        "mode (TOKENTRAIL_DB_POOLER=transaction)",
    )
    ap.add_argument("--openai-share", type=float, default=0.5, help="share of users on streamed chat completions")


@contextlib.contextmanager
def database(args: argparse.Namespace) -> Iterator[tuple[str, RestartablePostgres | None]]:
    """The database URL of the run, and the private PostgreSQL to kill (None without the fault); with
    ``--pooler pgbouncer`` the URL is a PgBouncer's in front of it."""
    from tests import services

    with contextlib.ExitStack() as stack:
        pg = None
        if args.pg_kills <= 0:
            url = stack.enter_context(services.postgres_service())
        else:
            pg = services.RestartablePostgres().start()
            stack.callback(pg.stop)
            url = pg.url
        if args.pooler == "pgbouncer":
            url = stack.enter_context(services.pgbouncer_service(url))  # 16 server connections for every replica
        yield url, pg


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
        outage = [killed, float("inf")]
        tally.db_outages.append(outage)
        restart = Restart(round(killed - start, 1), downs[k % len(downs)])
        restarts.append(restart)
        log.append(f"{killed - start:6.1f}s postgres killed ({len(streaming)} streaming)")
        say(log[-1])
        await asyncio.sleep(restart.down_s)
        began = time.monotonic()
        await asyncio.to_thread(pg.start)  # returns once it accepts connections
        restart.accepting_after_s = round(time.monotonic() - began, 2)
        outage[1] = time.monotonic()
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
    tool_calls: bool = False  # the reply made tool calls (parsed from the tiny model's random text)


@dataclass
class OpenAITally:
    streamed: dict[str, Streamed] = field(default_factory=dict)  # message id -> what the stream gave
    done: int = 0
    cut: int = 0  # broke without [DONE]
    cut_by_replica_kill: int = 0  # broke while its replica was killed or restarted
    resumed_after_cut: int = 0  # cut, asked again with its Idempotency-Key and read to [DONE]
    cut_reasons: Counter[str] = field(default_factory=Counter)
    differences: list[dict[str, Any]] = field(default_factory=list)  # the first few streamed != stored
    error_chunks: Counter[str] = field(default_factory=Counter)
    tool_call_turns: int = 0  # replies with tool calls: their conversation ends (no tool runs here)
    retried_after_error: int = 0  # ended with a retryable error chunk (not_ready), asked again with the key


class RetryableChunk(Exception):
    """The stream ended with an error a client retries (a backing service away): with its
    Idempotency-Key, asking again follows the same message."""


class OpenAIUser:
    """Chats through streamed chat completions as ``user`` (its login, replica choice and counters)."""

    def __init__(self, user: Chatter, c: Any, otally: OpenAITally, tokens: int) -> None:
        self.user, self.cluster, self.otally, self.tokens = user, c, otally, tokens
        self.name, self.tally = user.name, user.tally
        self.chats = 0
        self.mid: str | None = None  # the message of the turn's stream, once its first chunk came

    async def run(self, client: httpx.AsyncClient, stop: asyncio.Event) -> None:
        await self.user.login(client)
        while not stop.is_set():
            history: list[dict[str, Any]] = []
            self.chats += 1
            for turn in range(3):
                if stop.is_set():
                    break
                history.append({"role": "user", "content": f"{self.name} chat {self.chats} turn {turn}"})
                content = await self.turn(client, history)
                if content is None:
                    break
                history.append({"role": "assistant", "content": content})

    async def turn(self, client: httpx.AsyncClient, history: list[dict[str, Any]]) -> str | None:
        """One streamed turn: the assembled content, or None if the stream did not end with [DONE] (or
        was rewound: its text is not the stored one, so the conversation cannot go on from it)."""
        body = {"model": "tiny", "messages": history, "stream": True, "max_tokens": self.tokens, "ignore_eos": True}
        key = self.user.new_key()
        headers = {**self.user.headers, "Idempotency-Key": key} if key else self.user.headers
        self.mid = None
        asked = time.monotonic()
        failed: str | None = None
        cuts = 0
        for _ in range(60):
            url = self.user.url(avoid=failed)
            replica = self.cluster.replicas[self.cluster.urls.index(url)]
            kills, stops = replica.kills, replica.stops
            try:
                async with client.stream(
                    "POST", url + "/v1/chat/completions", json=body, headers=headers, timeout=60
                ) as resp:
                    if resp.status_code >= 500:
                        await resp.aread()
                        self.user.count_5xx(resp, "POST v1")
                        failed = url
                        await asyncio.sleep(float(resp.headers.get("Retry-After", "1")))
                        continue
                    if resp.status_code != 200:
                        await resp.aread()
                        self.tally.refused[str(resp.status_code)] += 1
                        await asyncio.sleep(1)
                        return None
                    content = await self._read(resp, asked)
                    self.otally.resumed_after_cut += cuts > 0
                    return content
            except httpx.ConnectError:  # its replica is down: the request never arrived
                failed = url
                await asyncio.sleep(0.5)
                continue
            except RetryableChunk:  # the same request again: the same message, from its first token
                self.otally.retried_after_error += 1
                failed = url
                await asyncio.sleep(1.0)
                continue
            except (httpx.HTTPError, json.JSONDecodeError) as exc:
                gone = replica.kills != kills or replica.stops != stops
                if gone or replica.proc is None or replica.proc.poll() is not None:
                    self.otally.cut_by_replica_kill += 1
                else:  # when and where, to find it in the servers' logs (their clocks are this one's)
                    self.otally.cut += 1
                    when = time.strftime("%H:%M:%S")
                    seen = self.otally.streamed.get(self.mid) if self.mid else None
                    what = f"message {self.mid}, {len(seen.token_ids)} tokens" if seen else "no chunk yet"
                    self.otally.cut_reasons[
                        f"{repr(exc)[:120]} on {replica.name} at {when}"
                        f" ({what}, {time.monotonic() - asked:.1f}s after asking)"
                    ] += 1
                if key is None:
                    break
                cuts += 1  # the same request again, elsewhere: the same message, from its first token
                failed = url
                await asyncio.sleep(0.3)
        if self.mid is not None:
            self.tally.give_up(self.mid)
        return None

    async def _read(self, resp: httpx.Response, asked: float) -> str | None:
        mid: str | None = None
        got: Streamed | None = None
        error = False
        async for line in resp.aiter_lines():
            if not line.startswith("data: "):
                continue
            data = line[6:]
            if data == "[DONE]":
                self.otally.done += 1
                if mid is not None:
                    self.tally.last_token_at.pop(mid, None)
                if got is not None and got.tool_calls:
                    self.otally.tool_call_turns += 1  # echoing only its text would fork the conversation
                    return None
                if got is not None and not error and not got.reset:
                    return got.content
                return None
            chunk = json.loads(data)
            if "error" in chunk:
                code = str(chunk["error"].get("code"))
                self.otally.error_chunks[code] += 1
                if code == "not_ready" and self.user.idempotent:
                    raise RetryableChunk(code)
                error = True
                continue
            info = chunk.get("tokentrail") or {}
            if mid is None:
                mid = self.mid = str(chunk["id"]).removeprefix("chatcmpl-")
                self.tally.received.add(mid)
                self.tally.asked_at.setdefault(mid, asked)
                # a stream asked again (its Idempotency-Key) starts again from the first token
                got = self.otally.streamed[mid] = Streamed(info.get("chat_id", ""), "", [])
            assert got is not None
            if info.get("chat_id"):  # the last chunk names the chat
                got.chat_id = info["chat_id"]
                self.tally.received.add(got.chat_id)
            if info.get("reset_from") is not None:
                got.reset = True
            for choice in chunk.get("choices", []):
                got.content += choice.get("delta", {}).get("content") or ""
                got.tool_calls |= bool(choice.get("delta", {}).get("tool_calls"))
                ids = choice.get("token_ids") or []
                if ids:
                    got.token_ids += ids
                    self.tally.token(mid, time.monotonic())
        raise httpx.RemoteProtocolError("the stream ended without [DONE]")


# ---- after the run -----------------------------------------------------------------------------------
async def verify(users: Sequence[Chatter], otally: OpenAITally) -> dict[str, Any]:
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
        "openai_resumed_after_cut": otally.resumed_after_cut,
        "openai_tool_call_turns": otally.tool_call_turns,
        "openai_retried_after_error": otally.retried_after_error,
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


async def audit(database: str, users: Sequence[str], received: set[str], pooler: Pooler = "none") -> dict[str, Any]:
    """The users' chats in SQL against ``received`` (every chat and message id a client was given)."""
    from sqlalchemy import bindparam, text

    from server.db import create_engine

    engine = create_engine(database, pooler=pooler)
    query = text(
        "SELECT c.id, m.id, m.parent_id, m.role, m.state FROM chats c LEFT JOIN messages m ON m.chat_id = c.id "
        "WHERE c.user_id IN :users"
    ).bindparams(bindparam("users", expanding=True))
    rows: list[Any] = []
    try:
        for attempt in range(30):  # the database may be coming back from its last kill
            try:
                async with engine.connect() as conn:
                    rows = list((await conn.execute(query, {"users": list(users)})).all())
                break
            except Exception:  # any driver error: try again
                if attempt == 29:
                    raise
                await asyncio.sleep(1)
    finally:
        await engine.dispose()
    known: set[str] = set()  # chats some client knows (its id, or one of its messages')
    siblings: Counter[tuple[str, str | None, str]] = Counter()
    states: dict[tuple[str, str | None, str], list[str]] = {}
    orphans: list[str] = []
    chats: set[str] = set()
    for chat, mid, parent, role, state in rows:
        chats.add(chat)
        if chat in received or mid in received:
            known.add(chat)
        if mid is None:
            continue
        siblings[(chat, parent, role)] += 1
        states.setdefault((chat, parent, role), []).append(f"{mid}:{state}")
        if role == "assistant" and state != "manual" and mid not in received:
            orphans.append(mid)
    # A client-written assistant message beside another is a fork (the client's history left the stored
    # one), not a request made twice: reported apart. Generated siblings are duplicates, as are any
    # siblings of another role.
    forks: set[tuple[str, str | None, str]] = set()
    extra: dict[tuple[str, str | None, str], int] = {}
    for k, n in siblings.items():
        written = sum(x.endswith(":manual") for x in states[k]) if k[2] == "assistant" else 0
        if written and n > 1:
            forks.add(k)
        twice = n - 1 if not written else max(n - written - 1, 0)
        if twice > 0:
            extra[k] = twice
    by_role: Counter[str] = Counter()
    for (_, _, role), n in extra.items():
        by_role[role] += n
    unused = sorted(chats - known)
    return {
        "chats_in_sql": len(chats),
        "generations_no_client_received": len(orphans),
        "duplicate_messages": sum(extra.values()) + len(unused),
        "forked_turns": len(forks),
        "duplicates_detail": {
            "extra_siblings_by_role": dict(by_role),
            "chats_no_client_knows": len(unused),
            "examples": [f"chat {c} parent {p} role {r}: {states[(c, p, r)]}" for c, p, r in list(extra)[:5]]
            + [f"chat {c}: unknown to every client" for c in unused[:5]],
            "orphan_generations": orphans[:5],
        },
    }
