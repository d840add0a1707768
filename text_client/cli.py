"""``tokentrail chat``: a REPL that streams the assistant's replies over SSE."""

from __future__ import annotations

from typing import Annotated

import typer

from text_client.client import ApiError, ChatClient


def chat(
    server_url: Annotated[str, typer.Option(envvar="TOKENTRAIL_SERVER_URL")] = "http://127.0.0.1:8000",
    username: Annotated[str | None, typer.Option(help="Debug login as this user.")] = None,
    api_key: Annotated[str | None, typer.Option(envvar="TOKENTRAIL_API_KEY", help="A user API key.")] = None,
    model: Annotated[str | None, typer.Option(help="Model name; default: the first one offered.")] = None,
    max_new_tokens: Annotated[int, typer.Option(min=1)] = 256,
    temperature: Annotated[float, typer.Option(min=0.0)] = 0.8,
) -> None:
    """Chat with a model. Each line you type is a message; Ctrl-C stops a reply; Ctrl-D quits."""
    client = ChatClient(server_url)
    try:
        if api_key:
            client.use_api_key(api_key)
        else:
            client.login_debug(username or "repl")
        models = [m["name"] for m in client.models()]
        if not models:
            raise typer.BadParameter("no worker is connected to the server yet; start one with `tokentrail worker`")
        name = model or models[0]
        if name not in models:
            raise typer.BadParameter(f"model {name!r} is not offered; offered: {', '.join(models)}")
        chat_obj = client.create_chat()
        typer.echo(f"chat {chat_obj['id']} with {name}; Ctrl-D quits")
        parent: str | None = None
        while True:
            try:
                line = input("you> ")
            except EOFError:
                typer.echo()
                return
            if not line.strip():
                continue
            try:
                prompt = client.prompter_message(chat_obj["id"], parent, line)
                reply = client.assistant_message(
                    chat_obj["id"],
                    prompt["id"],
                    name,
                    {"max_new_tokens": max_new_tokens, "temperature": temperature},
                )
                typer.echo("assistant> ", nl=False)
                try:
                    for event in client.events(chat_obj["id"], reply["id"]):
                        if event["event_type"] == "token":
                            typer.echo(event["text"], nl=False)
                        elif event["event_type"] == "error" and event.get("code") != "cancelled":
                            typer.echo(f"\n[error: {event['error']}]")
                except KeyboardInterrupt:  # Ctrl-C stops the reply, not the program
                    client.cancel(chat_obj["id"], reply["id"])
                    typer.echo("\n[cancelled]", nl=False)
                typer.echo()
                final = client.message(chat_obj["id"], reply["id"])
                if final["state"] == "complete":
                    parent = reply["id"]
            except ApiError as exc:
                typer.echo(f"[{exc}]", err=True)
    finally:
        client.close()
