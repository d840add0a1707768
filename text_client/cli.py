"""``tokentrail chat``: the REPL (text_client/repl.py) over HTTP + SSE."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer
from rich.console import Console

from text_client.client import ApiError, ChatClient
from text_client.repl import Repl, run


def _history_file() -> Path:
    return Path.home() / ".local" / "share" / "tokentrail" / "chat_history"


def chat(
    server_url: Annotated[str, typer.Option(envvar="TOKENTRAIL_SERVER_URL")] = "http://127.0.0.1:8000",
    username: Annotated[str | None, typer.Option(help="Debug login as this user.")] = None,
    api_key: Annotated[str | None, typer.Option(envvar="TOKENTRAIL_API_KEY", help="A user API key.")] = None,
    model: Annotated[str | None, typer.Option(help="Model name; default: the first one offered.")] = None,
    max_new_tokens: Annotated[int, typer.Option(min=1)] = 256,
    temperature: Annotated[float, typer.Option(min=0.0)] = 0.8,
    history: Annotated[bool, typer.Option(help="Keep line history in ~/.local/share/tokentrail.")] = True,
) -> None:
    """Chat with a model. Each line you type is a message; /help lists the commands; Ctrl-C stops
    a reply; Ctrl-D quits."""
    client = ChatClient(server_url)
    try:
        if api_key:
            client.use_api_key(api_key)
        else:
            client.login_debug(username or "repl")
        models = [m["name"] for m in client.models()]
    except ApiError as exc:
        client.close()
        raise typer.BadParameter(f"{server_url}: {exc}") from exc
    try:
        if not models:
            raise typer.BadParameter("no worker is connected to the server yet; start one with `tokentrail worker`")
        name = model or models[0]
        if name not in models:
            raise typer.BadParameter(f"model {name!r} is not offered; offered: {', '.join(models)}")
        repl = Repl(
            client, name, Console(highlight=False), {"max_new_tokens": max_new_tokens, "temperature": temperature}
        )
        repl.new_chat()
        run(repl, _history_file() if history else None)
    finally:
        client.close()
