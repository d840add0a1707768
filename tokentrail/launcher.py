"""``tokentrail up`` and ``tokentrail demo``: a server and a worker as child processes.

Both run the real thing: the server process on embedded defaults (SQLite, in-process queue),
a worker process with the tiny model connected over the websocket, and the demo's chat over
HTTP and SSE. Children are stopped on exit, also on Ctrl-C.
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import typer

from server.settings import ServerSettings


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _worker_key(data_dir: Path) -> str:
    # imported here: the worker's environment (e.g. the vLLM venv) runs this CLI without the server's deps
    from server.admin import issue_worker_key

    return issue_worker_key(ServerSettings(data_dir=data_dir), "launcher")


def _wait_until(
    check: str, url: str, timeout_s: float, proc: subprocess.Popen[bytes], model: str | None = None
) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{check} exited with code {proc.returncode}; see its output above")
        with contextlib.suppress(httpx.HTTPError):
            resp = httpx.get(url, timeout=2)
            if resp.status_code == 200 and (model is None or any(m["name"] == model for m in resp.json())):
                return
        time.sleep(0.2)
    raise RuntimeError(f"{check} not ready after {timeout_s:.0f}s")


def die_with_parent() -> None:
    """preexec_fn of a child process: the kernel sends it SIGTERM when this process dies, even by
    SIGKILL (Linux ``PR_SET_PDEATHSIG``), so no child outlives ``tokentrail up``."""
    if not sys.platform.startswith("linux"):
        return
    import ctypes

    parent = os.getppid()
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    if os.getppid() != parent:  # the parent died before the line above: nothing will signal us
        os.kill(os.getpid(), signal.SIGTERM)


def _stop(proc: subprocess.Popen[bytes], name: str) -> None:
    if proc.poll() is not None:
        return
    proc.send_signal(signal.SIGINT)
    try:
        proc.wait(timeout=15)
    except subprocess.TimeoutExpired:
        typer.echo(f"{name} did not stop in 15s; killing it", err=True)
        proc.kill()
        proc.wait()


@contextlib.contextmanager
def running_stack(data_dir: Path, port: int, model: str, *, quiet: bool, max_parallel: int = 4) -> Iterator[str]:
    """Start server + worker; yield the server URL once the worker's model is offered."""
    from worker.tiny import resolve_model

    url = f"http://127.0.0.1:{port}"
    typer.echo(f"preparing model {model!r} (built once, then cached)...")
    model_path = resolve_model(model)
    key = _worker_key(data_dir)
    out = subprocess.DEVNULL if quiet else None
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    py = [sys.executable, "-m", "tokentrail"]
    server = subprocess.Popen(
        [*py, "serve", "--port", str(port), "--data-dir", str(data_dir), "--log-level", "warning"],
        stdout=out,
        stderr=out,
        env=env,
        preexec_fn=die_with_parent,  # only prctl: safe between fork and exec
    )
    worker: subprocess.Popen[bytes] | None = None
    try:
        _wait_until("server", f"{url}/health", 60, server)
        typer.echo(f"server up at {url} (database in {data_dir})")
        worker = subprocess.Popen(
            [*py, "worker", "--server-url", url, "--api-key", key, "--model", model_path,
             "--served-model-name", model, "--max-parallel", str(max_parallel), "--log-level", "warning"],
            stdout=out,
            stderr=out,
            env=env,
            preexec_fn=die_with_parent,
        )  # fmt: skip
        _wait_until("worker", f"{url}/configs/model_configs", 180, worker, model=model)
        typer.echo(f"worker connected, serving {model!r}")
        yield url
    finally:
        if worker is not None:
            _stop(worker, "worker")
        _stop(server, "server")


def _interrupt(_signum: int, _frame: object) -> None:
    raise KeyboardInterrupt


def up(
    port: int = typer.Option(8000, help="Server port."),
    data_dir: Path | None = typer.Option(
        None, help="Where the SQLite database lives (default: ~/.local/share/tokentrail)."
    ),
    model: str = typer.Option("tiny", help="Model for the worker: 'tiny' or an HF model dir/id."),
) -> None:
    """Start a server and one worker on embedded defaults; Ctrl-C stops both."""
    data_dir = data_dir or ServerSettings().data_dir
    # Stop children on Ctrl-C and on `kill`, also when started in the background (SIGINT ignored).
    signal.signal(signal.SIGINT, signal.default_int_handler)
    signal.signal(signal.SIGTERM, _interrupt)
    with running_stack(data_dir, port, model, quiet=False) as url:
        typer.echo(
            f"\nready. chat in a browser: {url}/  or in a terminal: tokentrail chat --server-url {url}\nCtrl-C stops."
        )
        with contextlib.suppress(KeyboardInterrupt):
            while True:
                time.sleep(3600)


DEMO_TURNS = (
    "Hello! Who are you?",
    "Tell me something about the weather in three short sentences.",
    "Thanks. Can you summarize what we talked about?",
)


def demo(
    max_new_tokens: int = typer.Option(40, help="Tokens per reply."),
    model: str = typer.Option("tiny", help="Model for the worker."),
    data_dir: Path | None = typer.Option(
        None, help="Database folder (default: the embedded default, so `tokentrail export` finds the chat)."
    ),
    show_logs: bool = typer.Option(False, help="Show server and worker logs."),
) -> None:
    """Start a server and a worker, run a 3-turn chat over HTTP + SSE, print it, stop everything."""
    from text_client.client import ChatClient

    data_dir = data_dir or ServerSettings().data_dir
    with running_stack(data_dir, free_port(), model, quiet=not show_logs) as url:
        client = ChatClient(url)
        try:
            client.login_debug("demo")
            chat = client.create_chat()
            typer.echo(f"\nchat {chat['id']}\n")
            parent: str | None = None
            for turn, text in enumerate(DEMO_TURNS, start=1):
                prompt = client.prompter_message(chat["id"], parent, text)
                reply = client.assistant_message(
                    chat["id"], prompt["id"], model,
                    {"max_new_tokens": max_new_tokens, "temperature": 0.8, "seed": turn},
                )  # fmt: skip
                typer.echo(f"[turn {turn}] user> {text}")
                typer.echo(f"[turn {turn}] assistant> ", nl=False)
                streamed = 0
                for event in client.events(chat["id"], reply["id"]):
                    if event["event_type"] == "token":
                        typer.echo(event["text"], nl=False)
                        streamed += 1
                    elif event["event_type"] == "error":
                        raise RuntimeError(f"generation failed: {event['error']}")
                final = client.message(chat["id"], reply["id"], tokens=True)
                typer.echo(
                    f"\n    tokens: prompt={len(final['prompt_token_ids'])} "
                    f"completion={len(final['completion_token_ids'])} streamed={streamed} "
                    f"finish={final['finish_reason']} reused_from_last_turn={final['reused_prefix_len']} "
                    f"synthetic_closer={final['synthetic_token_count']}\n"
                )
                if final["completion_token_ids"] and len(final["completion_token_ids"]) != streamed:
                    raise RuntimeError("streamed and stored token counts differ")
                parent = reply["id"]
        finally:
            client.close()
    typer.echo("demo finished; server and worker stopped. The chat is stored; as training data:")
    typer.echo(f"  tokentrail export --out rollouts.jsonl --chat {chat['id']}")
    typer.echo(f"  tokentrail verify rollouts.jsonl --model {model}")
