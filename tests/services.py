"""Redis and PostgreSQL for the tests: an explicit URL, the local service, or a private instance.

``redis_service()`` and ``postgres_service()`` are context managers yielding a URL and cleaning
up on exit; they raise ``ServiceUnavailable`` (turned into a skip by conftest) when the service
can be neither reached nor started.

- Redis: ``TOKENTRAIL_TEST_REDIS_URL``; else 127.0.0.1:6379 with a database of its own (locked
  by a key so that concurrent test sessions never share or flush each other's); else a private
  ``redis-server`` on a free port.
- PostgreSQL: ``TOKENTRAIL_TEST_POSTGRES_URL`` (used as is); else a fresh ``tt_test_<hex>``
  database on 127.0.0.1:5432, or on a private cluster (``initdb`` + ``pg_ctl``) when nothing
  listens there; the database is dropped on exit. URLs are ``postgresql+asyncpg://``.
- ``RestartablePostgres``: a private cluster that a test or benchmark SIGKILLs (every process of it,
  as when its container dies) and starts again, on the same port: it comes back through crash recovery.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import glob
import os
import shlex
import shutil
import signal
import socket
import subprocess
import tempfile
import time
import uuid
from collections.abc import Coroutine, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any, TypeVar

import redis

from tokentrail.launcher import free_port, spawn

T = TypeVar("T")

REDIS_DBS = (13, 14, 15, 12, 11, 10)  # tried in order; the first unlocked one is ours
REDIS_LOCK_KEY = "tt:test-session-lock"
REDIS_LOCK_TTL_S = 6 * 3600


class ServiceUnavailable(Exception):
    """The service is neither reachable nor startable here; the message says why."""


def _run_async(coro: Coroutine[Any, Any, T]) -> T:
    # In a thread of its own, so that this works whether or not an event loop is running.
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        return pool.submit(asyncio.run, coro).result()


# --- Redis --------------------------------------------------------------------------------


def _redis_answers(url: str) -> bool:
    try:
        with redis.Redis.from_url(url, socket_connect_timeout=1, socket_timeout=2) as client:
            return bool(client.ping())
    except (redis.RedisError, OSError):
        return False


def _process_gone(holder: str) -> bool:
    """Whether a lock value ``host:pid:token`` names a dead process on this host."""
    host, _, rest = holder.partition(":")
    pid = rest.partition(":")[0]
    if host != socket.gethostname() or not pid.isdigit():
        return False
    try:
        os.kill(int(pid), 0)
    except ProcessLookupError:
        return True
    except PermissionError:
        return False
    return False


# Take over a lock only if it still holds the value we judged stale.
_STEAL_LOCK = "if redis.call('GET', KEYS[1]) == ARGV[1] then return redis.call('SET', KEYS[1], ARGV[2]) end"


@contextmanager
def _local_redis_db() -> Iterator[str | None]:
    """A locked, flushed database on the local Redis; None if all candidates are taken.

    The lock names this process, so that the lock of a killed session is taken over at once."""
    token = f"{socket.gethostname()}:{os.getpid()}:{uuid.uuid4().hex}"
    for db in REDIS_DBS:
        url = f"redis://127.0.0.1:6379/{db}"
        with redis.Redis.from_url(url, decode_responses=True) as client:
            if not client.set(REDIS_LOCK_KEY, token, nx=True, ex=REDIS_LOCK_TTL_S):
                holder = client.get(REDIS_LOCK_KEY)
                if holder is None or not _process_gone(holder):
                    continue
                if not client.eval(_STEAL_LOCK, 1, REDIS_LOCK_KEY, holder, token):
                    continue
            client.flushdb()
            client.set(REDIS_LOCK_KEY, token, ex=REDIS_LOCK_TTL_S)
        try:
            yield url
        finally:
            with redis.Redis.from_url(url, decode_responses=True) as client:
                if client.get(REDIS_LOCK_KEY) == token:
                    client.flushdb()  # also drops our lock
        return
    yield None


@contextmanager
def _private_redis() -> Iterator[str]:
    binary = shutil.which("redis-server")
    if binary is None:
        raise ServiceUnavailable("Redis is not running on 127.0.0.1:6379 and redis-server is not installed")
    port = free_port()
    workdir = tempfile.mkdtemp(prefix="tt-redis-")
    args = [binary, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no"]
    log = open(Path(workdir) / "redis.log", "wb")  # noqa: SIM115 - closed in finally
    proc = subprocess.Popen([*args, "--dir", workdir], stdout=log, stderr=subprocess.STDOUT)
    url = f"redis://127.0.0.1:{port}/0"
    try:
        deadline = time.monotonic() + 10
        while not _redis_answers(url):
            if proc.poll() is not None or time.monotonic() > deadline:
                raise ServiceUnavailable(f"private redis-server did not start: see {workdir}/redis.log")
            time.sleep(0.05)
        yield url
    finally:
        proc.terminate()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        log.close()
        shutil.rmtree(workdir, ignore_errors=True)


@contextmanager
def redis_service() -> Iterator[str]:
    if url := os.environ.get("TOKENTRAIL_TEST_REDIS_URL"):
        yield url
        return
    if _redis_answers("redis://127.0.0.1:6379/0"):
        with _local_redis_db() as local:
            if local is not None:
                yield local
                return
    with _private_redis() as url:
        yield url


class RestartableRedis:
    """A redis-server of its own (no persistence) that a test can SIGKILL and start again, empty, on
    the same port: what a Redis restart looks like to the server."""

    def __init__(self) -> None:
        binary = shutil.which("redis-server")
        if binary is None:
            raise ServiceUnavailable("redis-server is not installed")
        self.binary = binary
        self.port = free_port()
        self.dir = tempfile.mkdtemp(prefix="tt-sweep-redis-")
        self.proc: subprocess.Popen[bytes] | None = None
        self.url = f"redis://127.0.0.1:{self.port}/0"

    def start(self) -> RestartableRedis:
        args = ["--port", str(self.port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no", "--dir", self.dir]
        self.proc = spawn(args, program=(self.binary,), output=subprocess.DEVNULL, die_with_parent=True)
        deadline = time.monotonic() + 10
        while not _redis_answers(self.url):
            if time.monotonic() > deadline:
                raise ServiceUnavailable("redis-server did not start")
            time.sleep(0.05)
        return self

    def kill(self) -> None:
        assert self.proc is not None
        os.kill(self.proc.pid, signal.SIGKILL)
        self.proc.wait()

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
        shutil.rmtree(self.dir, ignore_errors=True)


# --- PostgreSQL ---------------------------------------------------------------------------


def _sqlalchemy_url(url: str) -> str:
    for scheme in ("postgresql+asyncpg://", "postgresql://", "postgres://"):
        if url.startswith(scheme):
            return "postgresql+asyncpg://" + url[len(scheme) :]
    return url


async def _pg_execute(dsn: str, *statements: str) -> None:
    import asyncpg  # type: ignore[import-untyped]

    conn = await asyncpg.connect(dsn, timeout=5)
    try:
        for statement in statements:
            await conn.execute(statement)
    finally:
        await conn.close()


def _pg_answers(port: int) -> bool:
    try:
        _run_async(_pg_execute(f"postgresql://postgres@127.0.0.1:{port}/postgres", "SELECT 1"))
        return True
    except Exception:
        return False


def _pg_bin() -> Path:
    def version(bindir: str) -> float:
        name = Path(bindir).parent.name
        return float(name) if name.replace(".", "", 1).isdigit() else 0.0

    for bindir in sorted(glob.glob("/usr/lib/postgresql/*/bin"), key=version, reverse=True):
        if Path(bindir, "initdb").exists() and Path(bindir, "pg_ctl").exists():
            return Path(bindir)
    if initdb := shutil.which("initdb"):
        return Path(initdb).resolve().parent
    raise ServiceUnavailable("PostgreSQL is not running on 127.0.0.1:5432 and initdb/pg_ctl are not installed")


def _as_postgres_user(cmd: list[str]) -> list[str]:
    # initdb and postgres refuse to run as root.
    if os.geteuid() != 0:
        return cmd
    if shutil.which("runuser"):
        return ["runuser", "-u", "postgres", "--", *cmd]
    return ["su", "postgres", "-c", shlex.join(cmd)]


@contextmanager
def _private_postgres() -> Iterator[int]:
    bindir = _pg_bin()
    workdir = Path(tempfile.mkdtemp(prefix="tt-pg-"))
    data, port = workdir / "data", free_port()
    if os.geteuid() == 0:
        shutil.chown(workdir, "postgres", "postgres")
    ctl = [str(bindir / "pg_ctl"), "-D", str(data), "-l", str(workdir / "postgres.log")]
    initdb = [str(bindir / "initdb"), "-D", str(data), "-U", "postgres", "-A", "trust", "-E", "UTF8"]
    opts = f"-p {port} -k {workdir} -c listen_addresses=127.0.0.1 -c fsync=off"
    try:
        subprocess.run(_as_postgres_user([*initdb, "--no-sync"]), check=True, capture_output=True)
        subprocess.run(_as_postgres_user([*ctl, "-w", "-o", opts, "start"]), check=True, capture_output=True)
    except subprocess.CalledProcessError as exc:
        shutil.rmtree(workdir, ignore_errors=True)
        detail = (exc.stderr or b"").decode(errors="replace").strip()
        raise ServiceUnavailable(f"private PostgreSQL did not start: {detail}") from exc
    try:
        yield port
    finally:
        subprocess.run(_as_postgres_user([*ctl, "-m", "immediate", "stop"]), capture_output=True)
        shutil.rmtree(workdir, ignore_errors=True)


@contextmanager
def _fresh_database(port: int) -> Iterator[str]:
    name = f"tt_test_{uuid.uuid4().hex[:12]}"
    admin = f"postgresql://postgres@127.0.0.1:{port}/postgres"
    _run_async(_pg_execute(admin, f'CREATE DATABASE "{name}"'))
    try:
        yield f"postgresql+asyncpg://postgres@127.0.0.1:{port}/{name}"
    finally:
        # FORCE ends connections a test may have leaked.
        _run_async(_pg_execute(admin, f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)'))


@contextmanager
def postgres_service() -> Iterator[str]:
    if url := os.environ.get("TOKENTRAIL_TEST_POSTGRES_URL"):
        yield _sqlalchemy_url(url)
        return
    if _pg_answers(5432):
        with _fresh_database(5432) as url:
            yield url
        return
    with _private_postgres() as port, _fresh_database(port) as url:
        yield url


@contextmanager
def pgbouncer_service(postgres_url: str, *, server_connections: int = 16) -> Iterator[str]:
    """A private PgBouncer in transaction pooling mode on a free port, in front of a fresh database of the
    cluster of ``postgres_url``; yields the URL through it. Its ``server_connections`` are shared by every
    client connection, one transaction at a time, as in production (the benchmarks take the default; the
    pooler tests take 2, so that clients share them all the time). ServiceUnavailable where pgbouncer is
    not installed."""
    binary = shutil.which("pgbouncer") or next(iter(glob.glob("/usr/sbin/pgbouncer")), None)
    if binary is None:
        raise ServiceUnavailable("pgbouncer is not installed (apt-get install pgbouncer)")
    from sqlalchemy.engine.url import make_url

    target = make_url(postgres_url)
    host, port = target.host or "127.0.0.1", target.port or 5432
    workdir = Path(tempfile.mkdtemp(prefix="tt-pgbouncer-"))
    listen = free_port()
    (workdir / "users.txt").write_text(f'"{target.username or "postgres"}" ""\n')
    (workdir / "pgbouncer.ini").write_text(
        "[databases]\n"
        f"* = host={host} port={port}\n"
        "[pgbouncer]\n"
        f"listen_addr = 127.0.0.1\nlisten_port = {listen}\nunix_socket_dir =\n"
        f"auth_type = trust\nauth_file = {workdir}/users.txt\n"
        f"pool_mode = transaction\ndefault_pool_size = {server_connections}\nmax_client_conn = 1000\n"
        "ignore_startup_parameters = extra_float_digits,options\n"
        # production advice (docs/production.md): a query waits at most 5 s for a server connection, and a
        # failed login to PostgreSQL is retried after 1 s, not 15
        "query_wait_timeout = 5\nserver_login_retry = 1\n"
        f"logfile = {workdir}/pgbouncer.log\n"
    )
    if os.geteuid() == 0:  # pgbouncer refuses to run as root
        for path in (workdir, *workdir.iterdir()):
            shutil.chown(path, "postgres", "postgres")
    proc = subprocess.Popen(
        _as_postgres_user([binary, str(workdir / "pgbouncer.ini")]),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )
    try:
        deadline = time.monotonic() + 10
        while not _port_open(listen):
            if proc.poll() is not None or time.monotonic() > deadline:
                log = workdir / "pgbouncer.log"
                raise ServiceUnavailable(f"pgbouncer did not start: {log.read_text() if log.exists() else ''}")
            time.sleep(0.05)
        with _fresh_database(port) as url:
            yield make_url(url).set(port=listen).render_as_string(hide_password=False)
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
        shutil.rmtree(workdir, ignore_errors=True)


class RestartablePostgres:
    """A private PostgreSQL cluster that can be SIGKILLed and started again on the same port (crash
    recovery, then the same data): what a database restart looks like to the server. Its postmaster
    leads a process group of its own, so a kill takes every backend with it, as a dying container does.
    ``url`` names a database ``tokentrail`` created at the first start."""

    def __init__(self) -> None:
        self.bindir = _pg_bin()
        self.dir = Path(tempfile.mkdtemp(prefix="tt-pg-restartable-"))
        self.data = self.dir / "data"
        self.port = free_port()
        self.proc: subprocess.Popen[bytes] | None = None
        self.url = f"postgresql+asyncpg://postgres@127.0.0.1:{self.port}/tokentrail"
        self._root = os.geteuid() == 0
        if self._root:
            shutil.chown(self.dir, "postgres", "postgres")
        initdb = [str(self.bindir / "initdb"), "-D", str(self.data), "-U", "postgres", "-A", "trust", "-E", "UTF8"]
        try:
            subprocess.run(_as_postgres_user([*initdb, "--no-sync"]), check=True, capture_output=True)
        except subprocess.CalledProcessError as exc:
            shutil.rmtree(self.dir, ignore_errors=True)
            raise ServiceUnavailable(f"initdb failed: {(exc.stderr or b'').decode(errors='replace')}") from exc
        self._created = False

    def start(self, *, wait: bool = True) -> RestartablePostgres:
        args = [str(self.bindir / "postgres"), "-D", str(self.data), "-p", str(self.port), "-k", str(self.dir),
                "-c", "listen_addresses=127.0.0.1", "-c", "fsync=off", "-c", "max_connections=200"]  # fmt: skip
        log = open(self.dir / "postgres.log", "ab")  # noqa: SIM115 - the child keeps its own descriptor
        with log:
            self.proc = subprocess.Popen(
                args,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
                user="postgres" if self._root else None,
            )
        if wait:
            self.wait_ready()
        return self

    def wait_ready(self, timeout_s: float = 60) -> None:
        deadline = time.monotonic() + timeout_s
        while not _pg_answers(self.port):
            if self.proc is not None and self.proc.poll() is not None:
                raise ServiceUnavailable(f"postgres exited: see {self.dir}/postgres.log")
            if time.monotonic() > deadline:
                raise ServiceUnavailable(f"postgres did not start: see {self.dir}/postgres.log")
            time.sleep(0.05)
        if not self._created:
            admin = f"postgresql://postgres@127.0.0.1:{self.port}/postgres"
            _run_async(_pg_execute(admin, "CREATE DATABASE tokentrail"))
            self._created = True

    def kill(self) -> None:
        """SIGKILL the postmaster and every backend (its process group)."""
        assert self.proc is not None
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.wait()
        # backends die with the group; wait until none holds the port (the next start binds it)
        deadline = time.monotonic() + 10
        while _port_open(self.port) and time.monotonic() < deadline:
            time.sleep(0.05)

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()
        shutil.rmtree(self.dir, ignore_errors=True)


def _port_open(port: int) -> bool:
    with socket.socket() as s:
        s.settimeout(0.2)
        return s.connect_ex(("127.0.0.1", port)) == 0
