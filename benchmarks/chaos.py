"""Chaos run: users chat through server replicas while workers, replicas and Redis are SIGKILLed.

    python benchmarks/chaos.py [--duration 60] [--users 8] [--replicas 2] [--processes 1] [--workers 2]
                               [--kill-every 10,20] [--tokens 24] [--seed 0] [--json]
                               [--connect all|one] [--schedule LIST] [--rolling N] [--no-idempotency]

Real processes on one machine: PostgreSQL (tests/services.py: the local server or a private one;
a fresh database), a private redis-server without persistence (or, with ``--store sqlite --replicas 1
--pg-kills 0``, embedded defaults: SQLite and an in-process queue, no Redis), ``--replicas`` server processes and
``--workers`` hf workers (the tiny chatml model), each worker connected to all replicas (it moves
to the next one when its replica dies), or with ``--connect one`` worker i to replica i % replicas
only (a dead replica's work then moves by the server's fail-over). Users chat in closed loops through
random replicas over HTTP + SSE; a reader whose connection breaks resumes on another replica with
Last-Event-ID.

Clients are idempotent (``--no-idempotency``: not): every creating POST (``POST /chats``,
``prompter_message``, ``assistant_message``, each OpenAI turn) carries an ``Idempotency-Key`` of its
own, the same on each retry of that POST (on another replica, after a connection error or a 5xx); an
OpenAI stream cut by a replica's death is asked again with its key and read from its first token
(``openai_resumed_after_cut``). Without keys a retry after a request that reached the server creates
the thing twice, and a cut OpenAI stream is given up.

Every ``--kill-every`` seconds (uniform between the two bounds) a random worker or replica is
killed with SIGKILL and started again a moment later, or a random worker's engine is killed (the
worker lives on and restarts it: benchmarks/chaos_engine.py); ``--faults`` picks among these. Redis is
killed and restarted (empty) once, half-way. ``--schedule`` replaces these random kills by a fixed list,
spaced evenly over ``--duration`` (the i-th of k at duration * i / (k + 1)), of ``worker``,
``worker-N``, ``replica``, ``replica-N`` (killed and started again as above), ``redis`` and ``engine``
(a random worker's); Redis then dies only if listed. ``--schedule none``: no kills. With
``--rolling N``, after ``--duration`` (users still chatting) N rolling restarts follow: each replica in
turn is sent SIGTERM, awaited, started again and awaited until it answers /health
(benchmarks/chaos_rolling.py); ``rolling_max_token_gap_s`` is the longest wait of a streaming message
for its next token meanwhile, ``rolling_messages_over_5s`` how many waited longer than 5 s.

A private PostgreSQL is SIGKILLed ``--pg-kills`` times and restarted after ``--pg-down`` seconds, while
``--openai-share`` of the users stream ``/v1/chat/completions`` (benchmarks/chaos_postgres.py).

After the run the chaos stops and every requested message is given ``--settle`` seconds to end. Then,
from the API (SQL behind it) and each reader's log:

- lost: a message the API accepted (200) that is not stored;
- stuck: a message still pending or in progress after the settle time;
- duplicated / missed tokens: a reader saw an index twice (without a reset) or skipped one, or what
  it saw differs from the stored completion;
- 5xx: responses with status >= 500 but a 503 with Retry-After (counted apart: allowed while the
  database or Redis is away); connection errors to a killed replica are not counted;
- kill -> next token: for each kill, the time until each message that was streaming then got its
  next token (p50 / p99); a worker, replica, engine or Redis kill while PostgreSQL is down (a double
  fault) is reported apart (``kill_during_db_outage_to_next_token_s``, with the waits of PostgreSQL's
  kill that the double fault prolonged): a reader it cut resumes with a request that reads the message
  from SQL, so it waits for PostgreSQL;
- engine serving again: for each engine kill, the time until /admin/workers shows one more engine
  restarted (goal: 60 s).

And from SQL, for the users' chats (``chaos_postgres.audit``):

- generations_no_client_received: generated assistant messages whose id no client was ever given (an
  ``assistant_message`` answer or an OpenAI stream's chunk);
- duplicate_messages: messages beside another of the same role under the same parent (each flow posts
  one) plus chats whose id no client was ever given, nor any of their messages' ids.

Exit status 1 if any of lost, stuck, duplicated, missed or 5xx is not 0, an engine took longer, or a
check of chaos_postgres.py fails (cut OpenAI streams, their text or tokens != SQL, a worker not serving
again; with idempotency, generations no client received or duplicate messages), or with ``--rolling``
a message waited more than 5 s for its next token.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import uuid
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import httpx

if TYPE_CHECKING:
    from server.db import Pooler

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks import chaos_postgres
from benchmarks.chaos_engine import WORKER_ENV, EngineWatch, admin_key
from benchmarks.chaos_rolling import GapWatch, rolling_restarts
from benchmarks.models import prepare_model
from benchmarks.progress import say
from tokentrail.launcher import answers, free_port, spawn, stop, wait_ready

MODEL = "tiny"
SECRET = "chaos-benchmark-secret-0123456789abcdef"
FINAL_STATES = {"complete", "aborted_by_worker", "cancelled", "timeout"}


def _pct(xs: list[float], q: float) -> float | None:
    if not xs:
        return None
    s = sorted(xs)
    return round(s[min(len(s) - 1, int(q * len(s)))], 3)


def _gap_stats(gaps: list[float]) -> dict[str, Any]:
    return {
        "n": len(gaps),
        "p50": _pct(gaps, 0.5),
        "p99": _pct(gaps, 0.99),
        "max": round(max(gaps), 3) if gaps else None,
    }


# ---- processes -----------------------------------------------------------------------------------
class Proc:
    """One restartable child process (a replica or a worker), its output appended to ``logs/NAME.log``."""

    def __init__(self, name: str, args: list[str], env: dict[str, str], logs: Path) -> None:
        self.name, self.args, self.env, self.logs = name, args, env, logs
        self.proc: subprocess.Popen[bytes] | None = None
        self.kills = 0
        self.stops = 0  # graceful stops (rolling restarts)

    def start(self) -> subprocess.Popen[bytes]:
        log = self.logs / f"{self.name}.log"
        self.proc = spawn(self.args, output=log, append=True, env=self.env, die_with_parent=True)
        return self.proc

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            os.kill(self.proc.pid, signal.SIGKILL)
            self.proc.wait()
            self.kills += 1

    def terminate(self, timeout: float) -> tuple[float, bool]:
        """SIGTERM (a graceful stop) and wait, SIGKILL after ``timeout`` s; it can be started again.
        The seconds it took, and whether it had to be killed."""
        if self.proc is None or self.proc.poll() is not None:
            return 0.0, False
        self.stops += 1
        began = time.monotonic()
        self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.wait(timeout=timeout)
            return time.monotonic() - began, False
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
            return time.monotonic() - began, True

    def stop(self) -> None:
        if self.proc is not None:
            stop(self.proc, self.name)


@dataclass
class Cluster:
    urls: list[str]
    replicas: list[Proc]
    workers: list[Proc]
    redis: Any
    admin_key: str = ""


@contextlib.contextmanager
def cluster(
    work: Path,
    replicas: int,
    workers: int,
    model_dir: str,
    logs: Path | None = None,
    database: str | None = None,
    connect: str = "all",
    with_redis: bool = True,
    processes: int = 1,
    pooler: Pooler = "none",
) -> Iterator[Cluster]:
    """``connect``: ``all`` (each worker gets every replica's URL, its own first) or ``one`` (worker i
    only replica i % replicas). Without Redis: embedded defaults (one replica, its queue in-process).
    ``processes``: server processes per replica (``serve --processes``; a replica's kill takes them all)."""
    from tests import services

    with contextlib.nullcontext(database) if database else services.postgres_service() as pg:
        redis = services.RestartableRedis().start() if with_redis else None
        env = {
            "TOKENTRAIL_DATABASE_URL": pg,
            **({"TOKENTRAIL_REDIS_URL": redis.url} if redis is not None else {}),
            "TOKENTRAIL_AUTH_SECRET": SECRET,
            "TOKENTRAIL_ALLOW_DEBUG_AUTH": "true",
            "TOKENTRAIL_RATE_LIMIT_PER_MINUTE": "0",
            "TOKENTRAIL_DATA_DIR": str(work),
            "TOKENTRAIL_DB_POOLER": pooler,
        }
        py = [sys.executable, "-m", "tokentrail"]
        run_env = {**os.environ, "PYTHONUNBUFFERED": "1", **env}
        procs: list[Proc] = []
        try:
            up = subprocess.run([*py, "db", "upgrade"], env=run_env, capture_output=True, check=False)
            if up.returncode != 0:
                raise RuntimeError(up.stderr.decode()[-3000:])

            def made(*cmd: str) -> str:
                out = subprocess.run([*py, "admin", *cmd], env=run_env, capture_output=True, check=False)
                if out.returncode != 0:
                    raise RuntimeError(out.stderr.decode()[-3000:])
                return out.stdout.decode().split()[-1]

            keys = [made("create-worker-key", "--name", f"chaos-{i}") for i in range(workers)]  # one each
            ports = [free_port() for _ in range(replicas)]
            urls = [f"http://127.0.0.1:{p}" for p in ports]
            servers = [
                Proc(
                    f"server-{i}",
                    ["serve", "--port", str(p), "--log-level", "warning", "--processes", str(processes)],
                    env,
                    work,
                )
                for i, p in enumerate(ports)
            ]
            wenv = {**env, "OMP_NUM_THREADS": "1", **WORKER_ENV}
            workers_ = []
            for i in range(workers):
                order = urls[i % replicas :] + urls[: i % replicas]  # spread the workers over the replicas
                if connect == "one":
                    order = order[:1]
                args = ["worker", "--server-url", ",".join(order), "--api-key", keys[i], "--model", model_dir,
                        "--served-model-name", MODEL, "--max-parallel", "4", "--threads", "1", "--log-level",
                        "warning", "--drain-timeout", "5"]  # fmt: skip
                workers_.append(Proc(f"worker-{i}", args, wenv, work))
            procs = servers + workers_
            started = {p.name: p.start() for p in servers}
            wait_ready(lambda: all(answers(u) for u in urls), started, "replicas", 60, logs=work)
            started = {p.name: p.start() for p in workers_}
            wait_ready(lambda: _offered(urls[0]) >= workers, started, "workers", 180, logs=work)
            yield Cluster(urls, servers, workers_, redis, admin_key(run_env))
        finally:
            for p in procs:
                p.stop()
            if redis is not None:
                redis.stop()
            if logs is not None:
                logs.mkdir(parents=True, exist_ok=True)
                for f in work.glob("*.log"):
                    shutil.copy(f, logs / f.name)


def _offered(url: str) -> int:
    try:
        models = httpx.get(url + "/configs/model_configs", timeout=2).json()
    except (httpx.HTTPError, ValueError):
        return 0
    return sum(m["workers"] for m in models if m["name"] == MODEL) if isinstance(models, list) else 0


# ---- users ---------------------------------------------------------------------------------------
@dataclass
class Tally:
    requested: dict[str, str] = field(default_factory=dict)  # message id -> chat id
    seen: dict[str, dict[int, int]] = field(default_factory=dict)  # message id -> index -> token id
    duplicated: int = 0
    last_token_at: dict[str, float] = field(default_factory=dict)  # streaming message -> time
    finished: set[str] = field(default_factory=set)
    status_5xx: Counter[str] = field(default_factory=Counter)
    unavailable_503: Counter[str] = field(default_factory=Counter)  # 503 with Retry-After: allowed
    refused: Counter[str] = field(default_factory=Counter)  # 4xx codes (e.g. 503 is counted above)
    kill_gaps: list[tuple[str, str, float, float]] = field(default_factory=list)  # (victim kind, message, gap, at)
    # (killed, accepting again) of each PostgreSQL outage (monotonic; end inf while down)
    db_outages: list[list[float]] = field(default_factory=list)
    broken: set[str] = field(default_factory=set)  # messages whose reader's connection broke
    attempts: dict[str, int] = field(default_factory=dict)  # message -> stored attempts, after the run
    pending_kills: list[tuple[float, str, set[str]]] = field(default_factory=list)  # (at, kind, streaming)
    received: set[str] = field(default_factory=set)  # chat and message ids some client was given
    asked_at: dict[str, float] = field(default_factory=dict)  # message -> when it was asked for
    gaps: GapWatch = field(default_factory=GapWatch)  # token gaps during rolling restarts

    def token(self, mid: str, now: float) -> None:
        """A reader got a token of ``mid``."""
        prev = self.last_token_at.get(mid)
        self.last_token_at[mid] = now
        self.gaps.token(mid, prev, now, self.asked_at.get(mid))
        for at, kind, waiting in self.pending_kills:
            if mid in waiting:
                waiting.discard(mid)
                self.kill_gaps.append((kind, mid, now - at, at))

    def during_db_outage(self, kind: str, at: float) -> bool:
        """A worker, replica, engine or Redis kill while PostgreSQL was down: a double fault. A reader
        cut by it resumes with a request that reads the message from SQL, so it waits for PostgreSQL."""
        return kind != "postgres" and any(start <= at <= end for start, end in self.db_outages)

    def double_fault(self, kind: str, at: float, gap: float) -> bool:
        """Whether a wait for the next token belongs to a double fault: its kill was one, or it is a
        PostgreSQL kill's and a double fault struck before the token came."""
        if self.during_db_outage(kind, at):
            return True
        return kind == "postgres" and any(
            at <= t <= at + gap for t, k, _ in self.pending_kills if self.during_db_outage(k, t)
        )

    def give_up(self, mid: str) -> None:
        """``mid``'s reader stopped reading before its end."""
        last = self.last_token_at.pop(mid, None)
        if last is not None:
            self.gaps.give_up(mid, last)


class User:
    def __init__(
        self, name: str, urls: list[str], tally: Tally, tokens: int, rng: random.Random, idempotent: bool = True
    ) -> None:
        self.name, self.urls, self.tally, self.tokens, self.rng = name, urls, tally, tokens, rng
        self.idempotent = idempotent
        self.headers: dict[str, str] = {}

    def url(self, avoid: str | None = None) -> str:
        """A random replica, another than ``avoid`` (one that just failed) when there is one."""
        return self.rng.choice([u for u in self.urls if u != avoid] or self.urls)

    def new_key(self) -> str | None:
        """An Idempotency-Key for one logical POST (None without idempotency)."""
        return str(uuid.uuid4()) if self.idempotent else None

    async def call(
        self, client: httpx.AsyncClient, method: str, path: str, key: str | None = None, **kw: Any
    ) -> httpx.Response | None:
        """One API call, retried on another replica while the chosen one is down or answers 503; ``key``:
        its Idempotency-Key, sent on every try."""
        headers = {**self.headers, "Idempotency-Key": key} if key else self.headers
        failed: str | None = None
        for _ in range(60):
            url = self.url(avoid=failed)
            try:
                resp = await client.request(method, url + path, headers=headers, timeout=30, **kw)
            except httpx.HTTPError:
                failed = url
                await asyncio.sleep(0.5)
                continue
            if resp.status_code >= 500:
                self.count_5xx(resp, f"{method} {path.split('/')[1]}")
                failed = url
                await asyncio.sleep(float(resp.headers.get("Retry-After", "1")))
                continue
            return resp
        return None

    def count_5xx(self, resp: httpx.Response, route: str) -> None:
        if resp.status_code == 503 and resp.headers.get("Retry-After"):
            self.tally.unavailable_503[route] += 1
        else:
            self.tally.status_5xx[f"{resp.status_code} {route}"] += 1

    async def login(self, client: httpx.AsyncClient) -> None:
        resp = await self.call(client, "GET", f"/auth/login/debug?username={self.name}", follow_redirects=True)
        assert resp is not None and resp.status_code == 200, resp and resp.text
        self.headers = {"Authorization": f"Bearer {resp.json()['access_token']['access_token']}"}

    async def run(self, client: httpx.AsyncClient, stop: asyncio.Event) -> None:
        await self.login(client)
        while not stop.is_set():
            resp = await self.call(client, "POST", "/chats", key=self.new_key(), json={})
            if resp is None or resp.status_code != 200:
                self.refused(resp)
                continue
            chat, parent = resp.json()["id"], None
            self.tally.received.add(chat)
            for turn in range(3):
                if stop.is_set():
                    break
                resp = await self.call(
                    client,
                    "POST",
                    f"/chats/{chat}/prompter_message",
                    key=self.new_key(),
                    json={"parent_id": parent, "content": f"turn {turn}"},
                )
                if resp is None or resp.status_code != 200:
                    self.refused(resp)
                    break
                self.tally.received.add(resp.json()["id"])
                body = {"parent_id": resp.json()["id"], "model_config_name": MODEL,
                        "sampling_parameters": {"max_new_tokens": self.tokens, "ignore_eos": True}}  # fmt: skip
                asked = time.monotonic()
                path = f"/chats/{chat}/assistant_message"
                resp = await self.call(client, "POST", path, key=self.new_key(), json=body)
                if resp is None or resp.status_code != 200:
                    if resp is not None:
                        self.refused(resp)
                        await asyncio.sleep(1)
                    break
                mid = resp.json()["id"]
                self.tally.requested[mid] = chat
                self.tally.received.add(mid)
                self.tally.asked_at[mid] = asked
                final = await self.follow(client, chat, mid, stop)
                if final != "message":
                    break
                parent = mid

    def refused(self, resp: httpx.Response | None) -> None:
        if resp is not None:
            try:
                code = str(resp.json().get("code"))
            except (ValueError, AttributeError):
                code = str(resp.status_code)
            self.tally.refused[code] += 1

    async def follow(self, client: httpx.AsyncClient, chat: str, mid: str, stop: asyncio.Event) -> str | None:
        """Read the message's events to the end, resuming on another replica after a break."""
        seen = self.tally.seen.setdefault(mid, {})
        last = -1
        deadline = time.monotonic() + 300
        failed: str | None = None
        while time.monotonic() < deadline:
            headers = {**self.headers, "Accept": "text/event-stream"}
            if last >= 0:
                headers["Last-Event-ID"] = str(last)
            url = failed = self.url(avoid=failed)  # the next try, if any, goes elsewhere
            try:
                async with client.stream(
                    "GET", f"{url}/chats/{chat}/messages/{mid}/events", headers=headers, timeout=60
                ) as resp:
                    if resp.status_code >= 500:
                        self.count_5xx(resp, "GET events")
                        await asyncio.sleep(1)
                        continue
                    if resp.status_code != 200:
                        await asyncio.sleep(1)
                        continue
                    data = ""
                    async for line in resp.aiter_lines():
                        if line.startswith("data:"):
                            data += line[5:].strip()
                        elif line == "" and data:
                            event = json.loads(data)
                            data = ""
                            kind = event.get("event_type")
                            if kind == "token":
                                i, tok = int(event["index"]), int(event["token_id"])
                                if i in seen:
                                    self.tally.duplicated += 1
                                seen[i] = tok
                                last = max(last, i)
                                self.tally.token(mid, time.monotonic())
                            elif kind == "reset":
                                start = int(event["from_index"])
                                for k in [k for k in seen if k >= start]:
                                    del seen[k]
                                last = start - 1
                            elif kind in ("message", "error"):
                                self.tally.last_token_at.pop(mid, None)
                                self.tally.finished.add(mid)
                                return str(kind)
            except (httpx.HTTPError, json.JSONDecodeError):
                await asyncio.sleep(0.3)
            self.tally.broken.add(mid)
        self.tally.give_up(mid)
        return None


# ---- chaos ---------------------------------------------------------------------------------------
VICTIMS = ("worker", "replica", "redis", "engine")


def parse_schedule(spec: str | None, workers: int, replicas: int) -> list[str] | None:
    """``--schedule``: the victims in order (None: random kills; ``none``: no kills)."""
    if spec is None:
        return None
    if spec.strip() == "none":
        return []
    out = []
    for item in (x.strip() for x in spec.split(",")):
        kind, dash, n = item.partition("-")
        count = {"worker": workers, "replica": replicas}.get(kind, 0)
        if kind not in VICTIMS or (dash and not (n.isdigit() and int(n) < count)):
            raise SystemExit(f"--schedule: {item!r} is none of worker, worker-N, replica, replica-N, redis, engine")
        out.append(item)
    return out


async def strike(
    c: Cluster, tally: Tally, item: str, rng: random.Random, engines: EngineWatch, client: httpx.AsyncClient
) -> str:
    """Kill ``item`` (a ``--schedule`` entry) and start it again; what happened, for the log."""
    streaming = {m for m, t in tally.last_token_at.items() if time.monotonic() - t < 2.0}
    hit = len(streaming)  # the set empties as their next tokens arrive
    at = time.monotonic()
    kind, _, n = item.partition("-")
    if kind == "redis":
        c.redis.kill()
        tally.pending_kills.append((at, "redis", streaming))
        await asyncio.sleep(0.5)
        c.redis.start()
        return f"redis killed and restarted empty ({hit} streaming)"
    if kind == "engine":
        victim = rng.choice([w for w in c.workers if w.proc is not None and w.proc.poll() is None])
        assert victim.proc is not None
        await engines.kill(client, victim.proc.pid)
        tally.pending_kills.append((at, "engine", streaming))
        return f"{victim.name}'s engine killed ({hit} streaming)"
    procs = c.workers if kind == "worker" else c.replicas
    victim = procs[int(n)] if n else rng.choice(procs)
    victim.kill()
    tally.pending_kills.append((at, kind, streaming))
    await asyncio.sleep(1.0 if kind == "worker" else 2.0)
    victim.start()
    return f"{victim.name} killed ({hit} streaming)"


async def chaos(
    c: Cluster,
    tally: Tally,
    duration: float,
    every: tuple[float, float],
    rng: random.Random,
    faults: set[str],
    engines: EngineWatch,
    client: httpx.AsyncClient,
    schedule: list[str] | None = None,
) -> list[str]:
    """Random kills every ``every`` s (Redis once, half-way), or ``schedule``'s, evenly spaced."""
    log: list[str] = []
    start = time.monotonic()
    if schedule is not None:
        for i, item in enumerate(schedule):
            await asyncio.sleep(max(0.0, start + duration * (i + 1) / (len(schedule) + 1) - time.monotonic()))
            at = time.monotonic() - start
            log.append(f"{at:6.1f}s {await strike(c, tally, item, rng, engines, client)}")
            say(log[-1])
        await asyncio.sleep(max(0.0, start + duration - time.monotonic()))
        return log
    redis_at = start + duration / 2
    redis_done = False
    while (now := time.monotonic()) - start < duration:
        await asyncio.sleep(min(rng.uniform(*every), max(0.0, start + duration - now)))
        if time.monotonic() - start >= duration:
            break
        at = time.monotonic()
        if not redis_done and at >= redis_at and c.redis is not None:
            redis_done = True
            item = "redis"
        elif "engine" in faults and (not faults & {"worker", "replica"} or rng.random() < 1 / 3):
            item = "engine"
        else:
            victim = rng.choice(c.workers * ("worker" in faults) + c.replicas * ("replica" in faults))
            item = "worker" if victim in c.workers else "replica"
            item += f"-{(c.workers if item == 'worker' else c.replicas).index(victim)}"
        log.append(f"{at - start:6.1f}s {await strike(c, tally, item, rng, engines, client)}")
        say(log[-1])
    return log


async def run(args: argparse.Namespace) -> dict[str, Any]:
    rng = random.Random(args.seed)
    model_dir = prepare_model("chatml")
    every = tuple(float(x) for x in args.kill_every.split(","))
    schedule = parse_schedule(args.schedule, args.workers, args.replicas)
    idempotent = not args.no_idempotency
    sqlite = args.store == "sqlite"
    pooler: Pooler = "transaction" if args.pooler == "pgbouncer" else "none"
    if sqlite and (args.replicas != 1 or args.pg_kills or args.pooler != "none" or (schedule and "redis" in schedule)):
        raise SystemExit(
            "--store sqlite is embedded defaults: --replicas 1 --pg-kills 0, no --pooler, and no Redis to kill"
        )
    with (
        tempfile.TemporaryDirectory(prefix="tt-chaos-") as tmp,
        contextlib.nullcontext((f"sqlite+aiosqlite:///{tmp}/tokentrail.db", None))
        if sqlite
        else chaos_postgres.database(args) as (database, pg),
        cluster(
            Path(tmp),
            args.replicas,
            args.workers,
            model_dir,
            args.logs,
            database,
            args.connect,
            with_redis=not sqlite,
            processes=args.processes,
            pooler=pooler,
        ) as c,
    ):
        tally = Tally()
        stop = asyncio.Event()
        limits = httpx.Limits(max_connections=4 * args.users)
        async with httpx.AsyncClient(limits=limits) as client:
            users = [
                User(f"chaos-{i}", c.urls, tally, args.tokens, random.Random(rng.random()), idempotent)
                for i in range(args.users)
            ]
            n_ai = round(args.users * args.openai_share)
            otally = chaos_postgres.OpenAITally()
            runners = [chaos_postgres.OpenAIUser(u, c, otally, args.tokens) for u in users[:n_ai]] + users[n_ai:]
            tasks = [asyncio.create_task(u.run(client, stop)) for u in runners]
            plan = f"kills: {','.join(schedule) or 'none'}" if schedule is not None else f"killing every {every}s"
            say(f"{args.users} users ({n_ai} on OpenAI) for {args.duration:.0f}s; {plan}; workers connect to "
                f"{args.connect}; idempotency {'on' if idempotent else 'off'}")  # fmt: skip
            start = time.monotonic()
            engines = EngineWatch(c.urls, c.admin_key)
            faults = set(args.faults.split(","))
            pg_log: list[str] = []
            pg_fault = pg and chaos_postgres.postgres_faults(pg, c, tally, args.duration, args, pg_log)
            pg_task = asyncio.create_task(pg_fault) if pg_fault else None
            log = await chaos(c, tally, args.duration, every, rng, faults, engines, client, schedule)  # type: ignore[arg-type]
            restarts = await pg_task if pg_task else []
            await rolling_restarts(c, tally.gaps, args.rolling, pg_log, start)
            log = sorted(log + pg_log)
            stop.set()
            say(f"chaos over; letting every message end (up to {args.settle:.0f}s)")
            _, running = await asyncio.wait(tasks, timeout=args.settle)
            await engines.settle()
            for t in running:
                t.cancel()
            # every requested message, from the API
            states: Counter[str] = Counter()
            errors: Counter[str] = Counter()
            lost = stuck = missed = mismatched = 0
            stuck_ids: list[str] = []
            for mid, chat in tally.requested.items():
                resp = None
                for u in users:
                    r = await u.call(client, "GET", f"/chats/{chat}/messages/{mid}", params={"include": "tokens"})
                    if r is not None and r.status_code == 200:
                        resp = r
                        break
                if resp is None:
                    lost += 1
                    continue
                msg = resp.json()
                tally.attempts[mid] = int(msg.get("attempt") or 1)
                states[msg["state"]] += 1
                if msg.get("error_code"):
                    errors[msg["error_code"]] += 1
                if msg["state"] not in FINAL_STATES:
                    stuck += 1
                    stuck_ids.append(mid)
                    continue
                seen = tally.seen.get(mid, {})
                if seen and sorted(seen) != list(range(max(seen) + 1)):
                    missed += 1
                stored = msg.get("completion_token_ids") or []
                if mid in tally.finished and msg["state"] == "complete" and [seen[i] for i in sorted(seen)] != stored:
                    mismatched += 1
            openai = await chaos_postgres.verify(users[:n_ai], otally)
            audit = await chaos_postgres.audit(database, [u.name for u in users], tally.received, pooler)
            rolling = tally.gaps.report(tally.last_token_at)
    single = [(k, m, g) for k, m, g, at in tally.kill_gaps if not tally.double_fault(k, at, g)]
    double = [g for k, _, g, at in tally.kill_gaps if tally.double_fault(k, at, g)]
    gaps = [g for _, _, g in single]
    # Interrupted: its reader's connection broke or its generation was handed to another attempt.
    hit = [(k, g) for k, m, g in single if m in tally.broken or tally.attempts.get(m, 1) > 1]
    return {
        "duration_s": args.duration,
        "users": args.users,
        "replicas": args.replicas,
        "workers": args.workers,
        "connect": args.connect,
        "idempotency": idempotent,
        "kills": log,
        "messages_requested": len(tally.requested),
        "states": dict(states),
        "error_codes": dict(errors),
        "lost": lost,
        "stuck": stuck,
        "stuck_ids": stuck_ids[:20],
        "duplicated_tokens": tally.duplicated,
        "missed_tokens": missed,
        "stream_differs_from_stored": mismatched,
        "http_5xx": sum(tally.status_5xx.values()),
        "http_5xx_by_route": dict(tally.status_5xx),
        "http_503_with_retry_after": dict(tally.unavailable_503),
        "refused": dict(tally.refused),
        **engines.report(),
        "kill_to_next_token_s": _gap_stats(gaps),
        "kill_to_next_token_by_victim_s": {
            kind: _gap_stats([g for k, _, g in single if k == kind]) for kind in sorted({k for k, _, _ in single})
        },
        "kills_during_db_outage": sum(tally.during_db_outage(kind, at) for at, kind, _ in tally.pending_kills),
        "kill_during_db_outage_to_next_token_s": _gap_stats(double),
        "interrupted_kill_to_next_token_s": _gap_stats([g for _, g in hit]),
        "interrupted_by_victim_s": {
            kind: _gap_stats([g for k, g in hit if k == kind]) for kind in sorted({k for k, _ in hit})
        },
        **openai,
        **chaos_postgres.serving_summary(restarts),
        **audit,
        **rolling,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--duration", type=float, default=60.0)
    ap.add_argument("--users", type=int, default=8)
    ap.add_argument("--replicas", type=int, default=2)
    ap.add_argument("--processes", type=int, default=1, help="server processes per replica (serve --processes)")
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--kill-every", default="10,20", help="seconds between kills: min,max")
    ap.add_argument("--tokens", type=int, default=48, help="tokens per reply")
    ap.add_argument("--settle", type=float, default=120.0, help="seconds for messages to end after the chaos")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument(
        "--store",
        choices=("postgres", "sqlite"),
        default="postgres",
        help="postgres: PostgreSQL + Redis; sqlite: embedded defaults (SQLite, no Redis; --replicas 1 --pg-kills 0)",
    )
    ap.add_argument(
        "--faults", default="worker,replica,engine", help="what random kills pick from (Redis dies once anyway)"
    )
    ap.add_argument(
        "--connect",
        choices=("all", "one"),
        default="all",
        help="all: each worker gets every replica's URL; one: worker i only replica i %% replicas",
    )
    ap.add_argument(
        "--schedule",
        default=None,
        help="fixed kills instead of random ones, spaced evenly over --duration: comma-separated worker, worker-N, "
        "replica, replica-N, redis, engine (Redis dies only if listed); none: no kills",
    )
    ap.add_argument(
        "--rolling",
        type=int,
        default=0,
        help="rolling restarts after --duration (each replica in turn: SIGTERM, start, /health); reports token gaps",
    )
    ap.add_argument(
        "--no-idempotency",
        action="store_true",
        help="clients send no Idempotency-Key (a retry may create twice; a cut OpenAI stream is given up)",
    )
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--logs", type=Path, default=None, help="copy the servers' and workers' logs here")
    chaos_postgres.add_arguments(ap)
    args = ap.parse_args()
    result = asyncio.run(run(args))
    if args.json:
        print(json.dumps(result, indent=2))
    else:
        for k, v in result.items():
            print(f"{k}: {v}")
    bad: tuple[str, ...] = ("lost", "stuck", "duplicated_tokens", "missed_tokens", "stream_differs_from_stored")
    bad += ("http_5xx",)
    bad += chaos_postgres.FAILURES
    if result["idempotency"]:
        bad += chaos_postgres.IDEMPOTENCY_FAILURES
    if args.rolling:
        bad += ("rolling_messages_over_5s",)
    sys.exit(1 if any(result[k] for k in bad) or not result["engine_serving_again_within_goal"] else 0)


if __name__ == "__main__":
    main()
