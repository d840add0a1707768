"""The ``tokentrail`` command: composes the subcommands each package owns."""

from __future__ import annotations

import typer

from server.cli import admin_app, db_app, export
from text_client.cli import chat
from tokentrail.quickstart import demo, up
from tokentrail.serve import serve
from worker.cli import model_app, verify, worker

app = typer.Typer(
    help="tokentrail: a chat inference service that keeps every token exactly.",
    no_args_is_help=True,
    pretty_exceptions_enable=False,
)
app.command("serve")(serve)
app.command("worker")(worker)
app.command("chat")(chat)
app.command("up")(up)
app.command("demo")(demo)
app.command("export")(export)
app.command("verify")(verify)
app.add_typer(db_app, name="db")
app.add_typer(admin_app, name="admin")
app.add_typer(model_app, name="model")
