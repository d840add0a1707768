"""Server subcommands: ``db upgrade``, ``admin ...``, ``export``; and the server's options and runner, which
``tokentrail serve`` (tokentrail/serve.py) combines with a worker's options for ``--model``."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import threading
from collections.abc import Awaitable, Callable, Sequence
from datetime import datetime
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any, TypeVar

import typer
from pydantic import BaseModel, ValidationError

from server.settings import ServerSettings
from shared.logs import configure_logging, uvicorn_log_config

if TYPE_CHECKING:  # the worker's environment (e.g. vLLM's venv) has no SQLAlchemy
    from server.db import SessionFactory
    from server.workers.links import LocalWorker

T = TypeVar("T")

db_app = typer.Typer(help="Database schema.", no_args_is_help=True)
admin_app = typer.Typer(help="Users and keys.", no_args_is_help=True)

DatabaseUrl = Annotated[
    str | None,
    typer.Option(help="SQLAlchemy async URL (default: SQLite file in the data dir). Env: TOKENTRAIL_DATABASE_URL"),
]
DataDir = Annotated[Path | None, typer.Option(help="Where the embedded database lives. Env: TOKENTRAIL_DATA_DIR")]


Host = Annotated[str | None, typer.Option(help="Bind address. Env: TOKENTRAIL_HOST")]
Port = Annotated[int | None, typer.Option(help="Port. Env: TOKENTRAIL_PORT")]
RedisUrl = Annotated[
    str | None,
    typer.Option(help="Redis URL: Redis Streams queue, token fan-out. Env: TOKENTRAIL_REDIS_URL"),
]
AllowDebugAuth = Annotated[
    bool | None,
    typer.Option("--allow-debug-auth/--no-debug-auth", help="Default: on without Redis only."),
]
AuthSecret = Annotated[
    str | None,
    typer.Option(help="Token signing secret (required with Redis). Env: TOKENTRAIL_AUTH_SECRET"),
]
LogLevel = Annotated[str, typer.Option(help="debug, info, warning")]
LogFormat = Annotated[str, typer.Option(help="text, or json: one JSON object per line")]


def _settings(**overrides: object) -> ServerSettings:
    try:
        return ServerSettings(**{k: v for k, v in overrides.items() if v is not None})  # type: ignore[arg-type]
    except ValidationError as exc:  # a bad TOKENTRAIL_* variable: say which, not a traceback
        raise typer.BadParameter("; ".join(_setting_problem(e) for e in exc.errors())) from exc


def _setting_problem(error: Any) -> str:
    where = "TOKENTRAIL_" + "_".join(str(part) for part in error["loc"]).upper() if error["loc"] else "the settings"
    return f"{where}: {error['msg']} (got {error['input']!r})" if error["loc"] else f"{where}: {error['msg']}"


def server_settings(**overrides: object) -> ServerSettings:
    """The server's settings from its command-line options (None: from the environment or the default),
    checked as ``serve`` checks them."""
    settings = _settings(**overrides)
    try:
        settings.resolved_auth_secret()
    except ValueError as exc:
        raise typer.BadParameter(str(exc)) from exc
    return settings


def run_server(
    settings: ServerSettings, log_level: str, log_format: str, local_worker: LocalWorker | None = None
) -> None:
    """Serve the app under uvicorn until stopped (``local_worker``: see ``create_app``)."""
    import uvicorn

    from server.app import create_app

    try:
        configure_logging(log_level, log_format)
    except ValueError as exc:
        raise typer.BadParameter(str(exc)) from exc
    uvicorn.run(
        create_app(settings, local_worker),
        host=settings.host,
        port=settings.port,
        log_level=log_level,
        log_config=uvicorn_log_config(),
        timeout_graceful_shutdown=settings.shutdown_grace_s,
    )


def _run(fn: Callable[[], Awaitable[T]]) -> T:
    return asyncio.run(fn())  # type: ignore[arg-type]


@db_app.command("upgrade")
def db_upgrade(database_url: DatabaseUrl = None, data_dir: DataDir = None) -> None:
    """Apply all migrations."""
    from server import migrate

    settings = _settings(database_url=database_url, data_dir=data_dir)
    migrate.upgrade(settings.effective_database_url, pooler=settings.db_pooler)
    typer.echo(f"database at head: {settings.effective_database_url}")


@admin_app.command("create-user")
def create_user(
    name: str,
    admin: Annotated[bool, typer.Option(help="Give the user the admin role.")] = False,
    database_url: DatabaseUrl = None,
    data_dir: DataDir = None,
) -> None:
    """Create a user and print a new API key for it (shown once; stored hashed)."""
    from server import admin as ops

    settings = _settings(database_url=database_url, data_dir=data_dir)

    async def go() -> str:
        engine, sessions = await ops.open_database(settings)
        try:
            return await ops.create_user(sessions, name, admin=admin)
        finally:
            await engine.dispose()

    typer.echo(_run(go))


@admin_app.command("create-worker-key")
def create_worker_key(
    name: Annotated[str, typer.Option(help="A label for the key.")] = "worker",
    database_url: DatabaseUrl = None,
    data_dir: DataDir = None,
) -> None:
    """Print a new worker key (shown once; stored hashed)."""
    from server import admin as ops

    settings = _settings(database_url=database_url, data_dir=data_dir)

    async def go() -> str:
        engine, sessions = await ops.open_database(settings)
        try:
            return await ops.create_worker_key(sessions, name)
        finally:
            await engine.dispose()

    typer.echo(_run(go))


def _with_db(settings: ServerSettings, job: Callable[[SessionFactory], Awaitable[T]]) -> T:
    from server import admin as ops

    async def go() -> T:
        engine, sessions = await ops.open_database(settings)
        try:
            return await job(sessions)
        finally:
            await engine.dispose()

    return asyncio.run(go())


def _print_json(rows: Sequence[BaseModel]) -> None:
    typer.echo(json.dumps([r.model_dump(mode="json") for r in rows], indent=2))


@admin_app.command("list-users")
def list_users(database_url: DatabaseUrl = None, data_dir: DataDir = None) -> None:
    """Users and their API keys' ids (JSON)."""
    from server import admin as ops

    _print_json(_with_db(_settings(database_url=database_url, data_dir=data_dir), ops.list_users))


@admin_app.command("list-worker-keys")
def list_worker_keys(database_url: DatabaseUrl = None, data_dir: DataDir = None) -> None:
    """Worker keys (JSON); which workers use them: ``tokentrail admin workers``."""
    from server import admin as ops

    _print_json(_with_db(_settings(database_url=database_url, data_dir=data_dir), ops.list_worker_keys))


def _revoke(kind: str, key_id: str, database_url: str | None, data_dir: Path | None) -> None:
    from server import admin as ops

    revoke = ops.revoke_worker_key if kind == "worker key" else ops.revoke_api_key
    settings = _settings(database_url=database_url, data_dir=data_dir)
    key = _with_db(settings, lambda sessions: revoke(sessions, key_id))
    if key is None:
        raise typer.BadParameter(f"no {kind} {key_id}")
    _print_json([key])


@admin_app.command("revoke-worker-key")
def revoke_worker_key(key_id: str, database_url: DatabaseUrl = None, data_dir: DataDir = None) -> None:
    """Revoke a worker key: connected workers using it are dropped at their next heartbeat."""
    _revoke("worker key", key_id, database_url, data_dir)


@admin_app.command("revoke-api-key")
def revoke_api_key(key_id: str, database_url: DatabaseUrl = None, data_dir: DataDir = None) -> None:
    """Revoke a user's API key (ids: ``tokentrail admin list-users``); refused within seconds."""
    _revoke("API key", key_id, database_url, data_dir)


@admin_app.command("workers")
def workers(
    server_url: Annotated[str, typer.Option(help="A server of the cluster. Env: TOKENTRAIL_SERVER_URL")] = (
        "http://127.0.0.1:8000"
    ),
    api_key: Annotated[str, typer.Option(help="An admin user's API key. Env: TOKENTRAIL_API_KEY")] = "",
) -> None:
    """Connected workers (model, compat hash, capacity, in flight, last heartbeat), from a running
    server: the worker directory lives there, not in the database."""
    import os

    import httpx

    url = os.environ.get("TOKENTRAIL_SERVER_URL", server_url).rstrip("/")
    key = api_key or os.environ.get("TOKENTRAIL_API_KEY", "")
    try:
        resp = httpx.get(f"{url}/admin/workers", headers={"Authorization": f"Bearer {key}"}, timeout=10)
    except httpx.HTTPError as exc:
        raise typer.BadParameter(f"cannot reach {url}: {exc}") from exc
    if resp.status_code != 200:
        raise typer.BadParameter(f"{url} answered {resp.status_code}: {resp.text[:300]}")
    rows = resp.json()
    if not rows:
        typer.echo("no workers connected")
    for w in rows:
        typer.echo(
            f"{w['worker_id']}  model={w['model_name']} engine={w['engine']} compat={w['compat_hash'][:12]} "
            f"in_flight={w['inflight']}/{w['capacity']} last_seen={w['last_seen']} key={w['key_name']} "
            f"version={w.get('policy_version', 0)}"
            + (f" weights_error={w['weights_error']!r}" if w.get("weights_error") else "")
        )


@admin_app.command("push-weights")
def push_weights(
    model: Annotated[str, typer.Argument(help="The model name the workers serve")],
    path: Annotated[str, typer.Argument(help="A safetensors checkpoint directory the workers can read")],
    version: Annotated[int, typer.Option(help="The new version: above the model's current one")],
    mode: Annotated[str, typer.Option(help="drain: running replies finish first; inflight: between two steps")] = (
        "drain"
    ),
    server_url: Annotated[str, typer.Option(help="A server of the cluster. Env: TOKENTRAIL_SERVER_URL")] = (
        "http://127.0.0.1:8000"
    ),
    api_key: Annotated[str, typer.Option(help="An admin user's API key. Env: TOKENTRAIL_API_KEY")] = "",
    timeout: Annotated[float, typer.Option(help="Seconds to wait for every worker to serve the version")] = 900.0,
) -> None:
    """Load new weights into every worker of MODEL without restarting them (POST
    /admin/models/MODEL/weights); prints the answer once each serves the version."""
    import os

    import httpx

    if mode not in ("drain", "inflight"):
        raise typer.BadParameter("--mode must be drain or inflight")
    url = os.environ.get("TOKENTRAIL_SERVER_URL", server_url).rstrip("/")
    key = api_key or os.environ.get("TOKENTRAIL_API_KEY", "")
    body = {"path": path, "version": version, "mode": mode}
    try:
        resp = httpx.post(
            f"{url}/admin/models/{model}/weights",
            json=body,
            headers={"Authorization": f"Bearer {key}"},
            timeout=timeout,
        )
    except httpx.HTTPError as exc:
        typer.echo(f"cannot reach {url}: {exc!r}", err=True)
        raise typer.Exit(2) from exc
    if resp.status_code != 200:
        typer.echo(f"{url} answered {resp.status_code}: {resp.text[:2000]}", err=True)
        raise typer.Exit(1)
    typer.echo(resp.text)


def _follow(
    out: Path,
    *,
    fmt: str,
    server_url: list[str] | None,
    api_key: str | None,
    cursor_file: Path | None,
    unsupported: dict[str, object],
    options: dict[str, object],
    quiet: bool,
) -> None:
    """``export --follow``: the rollout feed of a running server, appended to ``out``."""
    import os

    from tokentrail.feed import FeedError, follow_to_file

    if fmt != "jsonl":
        raise typer.BadParameter("--follow writes JSONL (it appends as rollouts arrive)")
    given = [name for name, value in unsupported.items() if value is not None]
    if given:
        raise typer.BadParameter(f"{', '.join(given)} cannot be used with --follow (the feed is in finishing order)")
    urls = server_url or [os.environ.get("TOKENTRAIL_SERVER_URL", "http://127.0.0.1:8000")]
    key = api_key or os.environ.get("TOKENTRAIL_API_KEY", "")
    if not key:
        raise typer.BadParameter("--follow needs --api-key (or TOKENTRAIL_API_KEY)")
    if cursor_file is None and str(out) != "-":
        cursor_file = out.with_name(out.name + ".cursor")
    signal.signal(signal.SIGINT, _interrupted)
    try:
        written = follow_to_file(options, urls, key, out, cursor_file, progress=not quiet)
    except FeedError as exc:
        typer.echo(f"the server refused the feed: {exc}", err=True)
        raise typer.Exit(1) from exc
    if not quiet:
        typer.echo(f"followed {written} rollouts into {out}", err=True)


def _interrupted(signum: int, frame: object) -> None:
    """Ctrl-C while following: stop as usual, and end the process after 5 s if stopping has not (once a
    follower was seen still running 30 s after one; why was not found). The cursor is saved after each
    rollout and a half-written line is cut at the next start, so ending then loses nothing."""
    timer = threading.Timer(5.0, os._exit, (130,))
    timer.daemon = True
    timer.start()
    raise KeyboardInterrupt


def export(
    out: Annotated[Path, typer.Option(help="File to write ('-' for standard output, JSONL only).")],
    fmt: Annotated[str, typer.Option("--format", help="jsonl or parquet.")] = "jsonl",
    schema: Annotated[
        str,
        typer.Option(
            help="tokentrail (native), verl, openrlhf, slime, skyrl, prime-rl, nemo-rl or marin;"
            " with --pairs: tokentrail or trl."
        ),
    ] = "tokentrail",
    since: Annotated[datetime | None, typer.Option(help="Only leaves created at or after this time (UTC).")] = None,
    until: Annotated[datetime | None, typer.Option(help="Only leaves created before this time (UTC).")] = None,
    model: Annotated[str | None, typer.Option(help="Only rollouts whose last turn used this model.")] = None,
    user: Annotated[str | None, typer.Option(help="Only this user's chats.")] = None,
    chat: Annotated[str | None, typer.Option(help="Only this chat.")] = None,
    rated_only: Annotated[bool, typer.Option(help="Only rollouts with at least one reward or vote.")] = False,
    min_score: Annotated[float | None, typer.Option(help="Only rollouts whose reward is at least this.")] = None,
    include_incomplete: Annotated[
        bool, typer.Option(help="Also paths with failed or unfinished assistant turns (those turns are left out).")
    ] = False,
    reward_rule: Annotated[str, typer.Option(help="Rollout reward: last (rated turn), mean, min or leaf.")] = "last",
    min_version: Annotated[
        int | None,
        typer.Option(
            min=0, metavar="N", help="Only rollouts whose every generated token has policy version N or above."
        ),
    ] = None,
    max_staleness: Annotated[
        int | None,
        typer.Option(
            min=0,
            metavar="K",
            help="Only rollouts whose every generated token has a policy version at least the model's newest"
            " registered version minus K (0: the newest only).",
        ),
    ] = None,
    follow: Annotated[
        bool,
        typer.Option(
            help="Stream finished episodes from a running server (GET /v1/rollouts) instead of reading the"
            " database: appends JSONL to --out, saves its position in --cursor-file after each rollout, and"
            " runs until interrupted; restarted, it resumes after the saved position."
        ),
    ] = False,
    server_url: Annotated[
        list[str] | None,
        typer.Option(
            help="With --follow: the server (repeat it for replicas: the feed moves to the next when one fails)."
            " Env: TOKENTRAIL_SERVER_URL"
        ),
    ] = None,
    api_key: Annotated[
        str | None,
        typer.Option(help="With --follow: your API key (an admin's reads every user's). Env: TOKENTRAIL_API_KEY"),
    ] = None,
    cursor_file: Annotated[
        Path | None, typer.Option(help="With --follow: where the feed position is kept (default: OUT.cursor).")
    ] = None,
    database_url: DatabaseUrl = None,
    data_dir: DataDir = None,
    quiet: Annotated[bool, typer.Option(help="No progress output.")] = False,
    workers: Annotated[
        int | None,
        typer.Option(
            min=1,
            help="Processes that build the rollouts: by default TOKENTRAIL_EXPORT_WORKERS, else one per core"
            " (up to 4); 1: this process only.",
        ),
    ] = None,
    pairs: Annotated[
        bool,
        typer.Option(
            "--pairs",
            help="Export preference pairs of sibling drafts instead (OA draft choices, rewards, votes):"
            " --schema tokentrail or trl; filters --model, --user, --chat, --since/--until (the later draft),"
            " --min-version, --max-staleness.",
        ),
    ] = False,
) -> None:
    """Export stored conversations as RL training rollouts (chats that opted out are never exported).

    --follow instead streams each episode as it finishes (a reward posted with done: true), from a
    running server, for as long as it runs: at least once per rollout (a consumer killed between
    writing a rollout and saving its position writes it again on restart; keep the last per
    rollout_id).

    Each turn carries the policy (weights) version of each generated token, each rollout the
    checkpoint directory of each version it uses. --min-version N and --max-staleness K keep the
    rollouts whose every generated token is recent enough: version >= N, and version >= the newest
    version pushed to the turn's model (POST /admin/models/MODEL/weights; 0 if none) minus K, as of
    the export's start. Messages stored before versions were kept count as version 0."""
    from server.export.run import run_export

    if fmt not in ("jsonl", "parquet"):
        raise typer.BadParameter("--format must be jsonl or parquet")
    if reward_rule not in ("last", "mean", "min", "leaf"):
        raise typer.BadParameter("--reward-rule must be last, mean, min or leaf")
    if pairs and follow:  # preference pairs: see _export_pairs
        raise typer.BadParameter("--pairs reads the database: it cannot be used with --follow")
    if follow:
        _follow(
            out,
            fmt=fmt,
            server_url=server_url,
            api_key=api_key,
            cursor_file=cursor_file,
            unsupported={"--since": since, "--until": until, "--chat": chat, "--min-score": min_score},
            options={
                "schema": schema,
                "model": model,
                "user": user,
                "rated_only": rated_only,
                "include_incomplete": include_incomplete,
                "reward_rule": reward_rule,
                "min_version": min_version,
                "max_staleness": max_staleness,
            },
            quiet=quiet,
        )
        return
    if server_url or api_key or cursor_file:
        raise typer.BadParameter("--server-url, --api-key and --cursor-file go with --follow")
    if str(out) == "-" and fmt != "jsonl":
        raise typer.BadParameter("only JSONL can go to standard output")
    settings = _settings(database_url=database_url, data_dir=data_dir)
    # --- preference pairs (server/export/pairs.py) ---
    if pairs or schema == "trl":
        rollout_only = {"--rated-only": rated_only, "--min-score": min_score is not None}
        rollout_only |= {"--include-incomplete": include_incomplete, "--reward-rule": reward_rule != "last"}
        filters: dict[str, Any] = {"since": since, "until": until, "model": model, "user": user, "chat": chat}
        filters |= {"min_version": min_version, "max_staleness": max_staleness}
        _export_pairs(settings, out, fmt, schema, pairs, [k for k, v in rollout_only.items() if v], quiet, filters)
        return
    # --- end preference pairs ---
    try:
        result = _run(
            lambda: run_export(
                settings,
                out,
                fmt=fmt,
                schema=schema,
                since=since,
                until=until,
                model=model,
                user=user,
                chat=chat,
                rated_only=rated_only,
                min_score=min_score,
                include_incomplete=include_incomplete,
                reward_rule=reward_rule,
                min_version=min_version,
                max_staleness=max_staleness,
                progress=not quiet,
                workers=workers,
            )
        )
    except ValueError as exc:
        raise typer.BadParameter(str(exc)) from exc
    if not quiet:
        typer.echo(result, err=True)


def _export_pairs(
    settings: ServerSettings,
    out: Path,
    fmt: str,
    schema: str,
    pairs: bool,
    rollout_only: list[str],
    quiet: bool,
    filters: dict[str, Any],
) -> None:
    """``export --pairs``: the options' checks, then the pair export."""
    from server.export.pairs_run import run_pair_export
    from shared.pairs import PAIR_SCHEMAS

    if not pairs:
        raise typer.BadParameter("--schema trl is a preference-pair schema: add --pairs")
    if schema not in PAIR_SCHEMAS:
        raise typer.BadParameter(f"--schema {schema} is a rollout schema; with --pairs: {' or '.join(PAIR_SCHEMAS)}")
    if rollout_only:
        raise typer.BadParameter(f"{', '.join(rollout_only)}: rollout options, not taken with --pairs")
    try:
        result = _run(lambda: run_pair_export(settings, out, fmt=fmt, schema=schema, progress=not quiet, **filters))
    except ValueError as exc:
        raise typer.BadParameter(str(exc)) from exc
    if not quiet:
        typer.echo(result, err=True)
