"""``tokentrail serve --processes N``: N server processes answering on one port.

One process is one core's worth of front end. Each process is a full replica (its own event loop,
database pool and Redis connections); they share the database, the Redis queue, the worker directory
and the token streams exactly as replicas on different machines do, so a worker's websocket and a
client's request may land on any of them. Each binds the port with ``SO_REUSEPORT`` and the kernel
spreads new connections over them (Linux). N > 1 needs Redis: the embedded in-process queue cannot be
shared between processes.

The parent migrates the database once, starts the processes, restarts one that dies (its messages are
taken over by the others meanwhile, as after any replica's death), and on SIGTERM or SIGINT stops them
all gracefully.
"""

from __future__ import annotations

import logging
import multiprocessing
import os
import secrets
import signal
import socket
import sys
import time
from multiprocessing.process import BaseProcess
from types import FrameType

from server import migrate
from server.metrics_group import ProcessGroup
from server.settings import ServerSettings
from shared.logs import configure_logging, uvicorn_log_config

log = logging.getLogger(__name__)

_BACKLOG = 2048  # uvicorn's default
_STOP_GRACE_S = 40.0  # a process's graceful stop (its local drain) before it is killed
_RESTART_PAUSE_S = 1.0  # between a process's death and its restart: a crash loop stays slow
_QUICK_EXIT_S = 10.0
_CRASH_LOOP = 3  # quick exits in a row (e.g. the port is taken) end the whole server


def check(settings: ServerSettings, processes: int) -> None:
    """Raises ValueError when ``processes`` server processes cannot share this configuration."""
    if processes > 1 and settings.redis_url is None:
        raise ValueError(
            "--processes above 1 needs Redis (--redis-url or TOKENTRAIL_REDIS_URL): the processes share the"
            " work queue and token streams through it"
        )
    if processes > 1 and not (hasattr(socket, "SO_REUSEPORT") and sys.platform.startswith("linux")):
        raise ValueError("--processes above 1 needs Linux (SO_REUSEPORT)")


def _listen(host: str, port: int) -> socket.socket:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
    sock.bind((host, port))
    sock.listen(_BACKLOG)
    sock.set_inheritable(True)
    return sock


def _die_with(parent: int) -> None:
    """SIGKILL from the kernel when ``parent`` dies, however it dies (Linux ``PR_SET_PDEATHSIG``): a
    killed replica's processes go with it instead of serving on without their supervisor."""
    import ctypes

    ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)
    if os.getppid() != parent:  # it died before the line above
        os.kill(os.getpid(), signal.SIGKILL)


def _serve_one(settings: ServerSettings, log_level: str, log_format: str, parent: int, group: ProcessGroup) -> None:
    """One server process (the child's entry point)."""
    import uvicorn

    from server.app import create_app

    _die_with(parent)
    configure_logging(log_level, log_format)
    sock = _listen(settings.host, settings.port)
    config = uvicorn.Config(
        create_app(settings, group=group),
        log_level=log_level,
        log_config=uvicorn_log_config(),
        timeout_graceful_shutdown=settings.shutdown_grace_s,
    )
    uvicorn.Server(config).run(sockets=[sock])


def run_processes(settings: ServerSettings, processes: int, log_level: str, log_format: str) -> None:
    """Serve with ``processes`` server processes until SIGTERM or SIGINT."""
    check(settings, processes)
    configure_logging(log_level, log_format)
    if settings.should_migrate_on_start:
        migrate.upgrade(settings.effective_database_url, pooler=settings.db_pooler)
    # every process signs and checks tokens with the same secret, and none migrates again
    shared = settings.model_copy(update={"migrate_on_start": False, "auth_secret": settings.resolved_auth_secret()})
    ctx = multiprocessing.get_context("spawn")
    group = ProcessGroup(secrets.token_hex(6), processes)  # /metrics of any of them answers for all
    stopping = False

    def start(i: int) -> BaseProcess:
        proc = ctx.Process(
            target=_serve_one,
            args=(shared, log_level, log_format, os.getpid(), group),
            name=f"tokentrail-server-{i}",
        )
        proc.start()
        return proc

    def stop(signum: int, _frame: FrameType | None) -> None:
        nonlocal stopping
        stopping = True

    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)
    procs = [start(i) for i in range(processes)]
    started = [time.monotonic()] * processes
    quick_exits = [0] * processes  # exits in a row within _QUICK_EXIT_S of starting: a crash loop
    log.info("serving on %s:%d from %d processes", settings.host, settings.port, processes)
    try:
        while not stopping:
            time.sleep(0.2)
            for i, proc in enumerate(procs):
                if proc.is_alive() or stopping:
                    continue
                quick_exits[i] = quick_exits[i] + 1 if time.monotonic() - started[i] < _QUICK_EXIT_S else 1
                if quick_exits[i] >= _CRASH_LOOP:
                    raise SystemExit(f"server process {i} exited {_CRASH_LOOP} times within seconds of starting")
                log.error("server process %d (pid %s) exited with %s; starting it again", i, proc.pid, proc.exitcode)
                time.sleep(_RESTART_PAUSE_S)
                procs[i], started[i] = start(i), time.monotonic()
    finally:
        for proc in procs:
            if proc.is_alive() and proc.pid is not None:
                proc.terminate()  # SIGTERM: uvicorn's graceful shutdown
        deadline = time.monotonic() + _STOP_GRACE_S
        for proc in procs:
            proc.join(max(0.0, deadline - time.monotonic()))
            if proc.is_alive():
                proc.kill()
                proc.join()
