"""``tokentrail up`` and ``tokentrail demo``: a server and a worker as child processes.

Both run the real thing (``tokentrail.launcher.running_stack``): the server process on embedded defaults
(SQLite, in-process queue), a worker process with the tiny model connected over the websocket, and the
demo's chat over HTTP and SSE. Children are stopped on exit, also on Ctrl-C.
"""

from __future__ import annotations

import contextlib
import signal
import time
from pathlib import Path

import typer

from server.settings import ServerSettings
from tokentrail.launcher import free_port, running_stack


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
