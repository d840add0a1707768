"""The ``tokentrail chat`` REPL: one path through a chat tree at a time, slash commands for the rest.

Lines are read with prompt_toolkit (editing, history in the data dir) on a terminal, with plain
``input`` otherwise; replies are rendered with rich. Ctrl-C during a reply cancels that reply on the
server; the program goes on.
"""

from __future__ import annotations

import json
import math
import os
import shlex
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.text import Text
from rich.tree import Tree

from text_client.client import ApiError, ChatClient

HELP = """\
Type a message and press Enter. Commands:
  /new [SYSTEM PROMPT]   a new chat (optionally with a system prompt)
  /chats                 your chats;  /switch N|ID  open one
  /tree                  the chat's messages as a tree (* marks the path shown)
  /regen                 a new reply to the last message of yours (a sibling branch)
  /edit TEXT             replace your last message with TEXT (a new branch) and get a reply
  /vote +1|-1|0          rate the last reply
  /stop                  cancel the last reply if it is still running (Ctrl-C does it while streaming)
  /logprobs on|off       colour streamed tokens by probability
  /tokens                the last reply's token ids and logprobs, and its prompt's reuse
  /params [k=v ...]      sampling parameters (temperature, top_p, top_k, max_new_tokens, seed, ignore_eos, ...)
  /model [NAME]          list the models, or choose one
  /system [TEXT]         show or set the chat's system prompt (later turns use it)
  /export FILE           write this chat with every reply's tokens as JSON
  /help, /quit           this help; leave (Ctrl-D too)"""

_PARAM_TYPES: dict[str, Callable[[str], Any]] = {
    "temperature": float,
    "top_p": float,
    "top_k": int,
    "typical_p": float,
    "min_p": float,
    "repetition_penalty": float,
    "max_new_tokens": int,
    "seed": int,
    "top_logprobs": int,
    "ignore_eos": lambda v: v.lower() in ("1", "true", "yes", "on"),
}


class Quit(Exception):
    pass


def _style(logprob: float | None) -> str:
    if logprob is None:
        return ""
    p = math.exp(logprob)
    return "on green4" if p > 0.6 else "on dark_olive_green3" if p > 0.3 else "on orange3" if p > 0.1 else "on red3"


@dataclass
class Repl:
    client: ChatClient
    model: str
    console: Console
    params: dict[str, Any] = field(default_factory=dict)
    logprobs: bool = False
    chat: dict[str, Any] | None = None
    choice: dict[str, str] = field(default_factory=dict)  # parent id ("root") -> chosen child

    # ---- the tree ----------------------------------------------------------------------------
    def _children(self) -> dict[str, list[dict[str, Any]]]:
        kids: dict[str, list[dict[str, Any]]] = {}
        for m in (self.chat or {}).get("messages", []):
            kids.setdefault(m["parent_id"] or "root", []).append(m)
        for sibs in kids.values():
            sibs.sort(key=lambda m: m["id"])
        return kids

    def path(self) -> list[dict[str, Any]]:
        kids, out, key = self._children(), [], "root"
        while key in kids:
            sibs = kids[key]
            chosen = next((m for m in sibs if m["id"] == self.choice.get(key)), sibs[-1])
            out.append(chosen)
            key = chosen["id"]
        return out

    def _reload(self) -> None:
        if self.chat is not None:
            self.chat = self.client.chat(self.chat["id"])

    def _last(self, role: str) -> dict[str, Any] | None:
        return next((m for m in reversed(self.path()) if m["role"] == role), None)

    # ---- turns -------------------------------------------------------------------------------
    def say(self, text: str) -> None:
        if self.chat is None:
            self.new_chat()
        assert self.chat is not None
        path = self.path()
        tail = path[-1] if path else None
        if tail is not None and (tail["role"] != "assistant" or tail["state"] != "complete"):
            self.console.print("[yellow]the last reply did not complete: /regen it, or /edit your message[/]")
            return
        prompt = self.client.prompter_message(self.chat["id"], tail["id"] if tail else None, text)
        self.choice[tail["id"] if tail else "root"] = prompt["id"]
        self.reply(prompt["id"])

    def reply(self, parent_id: str) -> None:
        assert self.chat is not None
        msg = self.client.assistant_message(self.chat["id"], parent_id, self.model, self.params)
        self.choice[parent_id] = msg["id"]
        self.stream(msg["id"])

    def stream(self, message_id: str) -> None:
        assert self.chat is not None
        self.console.print("[bold cyan]assistant>[/] ", end="")
        try:
            for event in self.client.follow(self.chat["id"], message_id):
                kind = event["event_type"]
                if kind == "token":
                    style = _style(event.get("logprob")) if self.logprobs else ""
                    self.console.print(Text(event["text"], style=style), end="", soft_wrap=True)
                elif kind == "pending" and event.get("queue_position"):
                    self.console.print(f"[dim](queued: {event['queue_position']} ahead)[/] ", end="")
                elif kind == "reset":
                    self.console.print("[dim](retrying)[/] ", end="")
                elif kind == "error" and event.get("code") != "cancelled":
                    problem = f"[{event.get('code')}: {event.get('error')}]"
                    self.console.print(Text("\n" + problem, style="red"), end="")
        except KeyboardInterrupt:  # Ctrl-C cancels the reply, not the program
            self._cancel(message_id)
            self.console.print(Text("\n[cancelled]", style="yellow"), end="")
        self.console.print()
        self._reload()

    def _cancel(self, message_id: str) -> bool:
        assert self.chat is not None
        try:
            self.client.cancel(self.chat["id"], message_id)
            return True
        except ApiError as exc:
            if exc.code != "message_finished":
                raise
            return False

    # ---- commands ----------------------------------------------------------------------------
    def command(self, line: str) -> None:
        name, _, rest = line[1:].partition(" ")
        handler = getattr(self, f"cmd_{name.lower()}", None)
        if handler is None:
            self.console.print(f"[red]unknown command /{name}[/]; /help lists them")
            return
        handler(rest.strip())

    def cmd_help(self, _: str) -> None:
        self.console.print(HELP, markup=False, highlight=False)

    def cmd_quit(self, _: str) -> None:
        raise Quit

    cmd_exit = cmd_quit

    def new_chat(self, system: str | None = None) -> None:
        self.chat = self.client.chat(self.client.create_chat(system or None)["id"])
        self.choice = {}
        self.console.print(f"[dim]chat {self.chat['id']} with {self.model}[/]")

    def cmd_new(self, rest: str) -> None:
        self.new_chat(rest or None)

    def cmd_chats(self, _: str) -> None:
        for i, c in enumerate(self.client.chats(), 1):
            mark = "*" if self.chat and c["id"] == self.chat["id"] else " "
            self.console.print(f"{mark}{i:3}  {c['id']}  {c.get('title') or ''}", markup=False)

    def cmd_switch(self, rest: str) -> None:
        chats = self.client.chats()
        target = chats[int(rest) - 1]["id"] if rest.isdigit() and 0 < int(rest) <= len(chats) else rest
        if not target:
            self.console.print("[red]/switch N (from /chats) or a chat id[/]")
            return
        self.chat, self.choice = self.client.chat(target), {}
        self.console.print(f"[dim]chat {target}[/]")
        for m in self.path():
            who = "you" if m["role"] == "prompter" else "assistant"
            self.console.print(f"[bold]{who}:[/] ", end="")
            self.console.print(m.get("content") or f"({m['state']})", markup=False)

    def cmd_tree(self, _: str) -> None:
        if self.chat is None:
            return
        self._reload()
        kids, on_path = self._children(), {m["id"] for m in self.path()}

        def label(m: dict[str, Any]) -> Text:
            who = "you" if m["role"] == "prompter" else "assistant"
            text = (m.get("content") or f"({m['state']})").replace("\n", " ")[:60]
            score = f" [{m['score']:+d}]" if m.get("score") else ""
            mark = "* " if m["id"] in on_path else "  "
            return Text(f"{mark}{m['id'][-6:]} {who}: {text}{score}", style="bold" if m["id"] in on_path else "")

        tree = Tree(f"chat {self.chat['id']}")

        def add(node: Tree, key: str) -> None:
            for m in kids.get(key, []):
                add(node.add(label(m)), m["id"])

        add(tree, "root")
        self.console.print(tree)

    def cmd_regen(self, _: str) -> None:
        last = self._last("prompter")
        if last is None:
            self.console.print("[red]nothing to regenerate yet[/]")
            return
        self.reply(last["id"])

    def cmd_edit(self, rest: str) -> None:
        last = self._last("prompter")
        if last is None or not rest:
            self.console.print("[red]/edit TEXT replaces your last message[/]")
            return
        assert self.chat is not None
        prompt = self.client.prompter_message(self.chat["id"], last["parent_id"], rest)
        self.choice[last["parent_id"] or "root"] = prompt["id"]
        self.reply(prompt["id"])

    def cmd_vote(self, rest: str) -> None:
        last = self._last("assistant")
        if last is None or rest not in ("+1", "1", "-1", "0"):
            self.console.print("[red]/vote +1, -1 or 0 rates the last reply[/]")
            return
        assert self.chat is not None
        self.client.vote(self.chat["id"], last["id"], int(rest))
        self._reload()
        self.console.print(f"[dim]voted {int(rest):+d}[/]")

    def cmd_stop(self, _: str) -> None:
        last = self._last("assistant")
        if last is not None and self._cancel(last["id"]):
            self.console.print(Text("[cancelled]", style="yellow"))
            self._reload()
        else:
            self.console.print("[dim]nothing is running[/]")

    def cmd_logprobs(self, rest: str) -> None:
        self.logprobs = rest.lower() in ("on", "1", "true", "yes")
        self.console.print(f"[dim]logprob colours {'on' if self.logprobs else 'off'}[/]")

    def cmd_tokens(self, _: str) -> None:
        last = self._last("assistant")
        if last is None or self.chat is None:
            self.console.print("[red]no reply yet[/]")
            return
        full = self.client.message(self.chat["id"], last["id"], tokens=True)
        prompt = full.get("prompt_token_ids") or []
        self.console.print(
            f"prompt: {len(prompt)} tokens, {full.get('reused_prefix_len') or 0} reused from the stored chain, "
            f"{full.get('synthetic_token_count') or 0} synthetic; method {full.get('prompt_method')}",
            markup=False,
        )
        ids, lps = full.get("completion_token_ids") or [], full.get("logprobs") or []
        self.console.print(f"completion: {len(ids)} tokens, finish {full.get('finish_reason')}", markup=False)
        for i, (tid, lp) in enumerate(zip(ids, lps, strict=False)):
            self.console.print(f"  {i:4}  {tid:7}  {'n/a' if lp is None else f'{lp:9.4f}'}", markup=False)

    def cmd_params(self, rest: str) -> None:
        for pair in shlex.split(rest):
            key, _, value = pair.partition("=")
            if key not in _PARAM_TYPES or not value:
                self.console.print(f"[red]unknown or empty parameter {key!r}; known: {', '.join(_PARAM_TYPES)}[/]")
                return
            try:
                self.params[key] = _PARAM_TYPES[key](value)
            except ValueError:
                self.console.print(f"[red]{key}={value!r} is not a valid value[/]")
                return
        self.console.print(json.dumps(self.params), markup=False, highlight=False)

    def cmd_model(self, rest: str) -> None:
        names = [m["name"] for m in self.client.models()]
        if rest:
            if rest not in names:
                self.console.print(f"[red]{rest!r} is not offered; offered: {', '.join(names)}[/]")
                return
            self.model = rest
        for n in names:
            self.console.print(f"{'*' if n == self.model else ' '} {n}", markup=False)

    def cmd_system(self, rest: str) -> None:
        if self.chat is None:
            self.new_chat(rest or None)
            return
        if rest:
            self.client.update_chat(self.chat["id"], system_prompt=rest)
            self._reload()
        self.console.print(f"system prompt: {self.chat.get('system_prompt') or '(none)'}", markup=False)

    def cmd_export(self, rest: str) -> None:
        if self.chat is None or not rest:
            self.console.print("[red]/export FILE writes the current chat[/]")
            return
        self._reload()
        chat = dict(self.chat)
        chat["messages"] = [
            self.client.message(chat["id"], m["id"], tokens=m["role"] == "assistant") for m in chat["messages"]
        ]
        Path(rest).expanduser().write_text(json.dumps(chat, indent=2, default=str))
        self.console.print(f"[dim]wrote {len(chat['messages'])} messages to {rest}[/]")


def _reader(history: Path | None) -> Callable[[str], str]:
    """prompt_toolkit on a terminal (line editing, history); plain input otherwise."""
    if os.isatty(0) and os.isatty(1):
        from prompt_toolkit import PromptSession
        from prompt_toolkit.history import FileHistory, InMemoryHistory

        if history is not None:
            history.parent.mkdir(parents=True, exist_ok=True)
        session: PromptSession[str] = PromptSession(
            history=FileHistory(str(history)) if history is not None else InMemoryHistory()
        )
        return lambda prompt: session.prompt(prompt)
    return input


def run(repl: Repl, history: Path | None) -> None:
    read = _reader(history)
    repl.console.print("[dim]/help lists the commands; Ctrl-C stops a reply; Ctrl-D quits[/]")
    while True:
        try:
            line = read("you> ")
        except EOFError:
            repl.console.print()
            return
        except KeyboardInterrupt:  # at the prompt: clear the line, keep going
            continue
        if not line.strip():
            continue
        try:
            if line.startswith("/"):
                repl.command(line.strip())
            else:
                repl.say(line)
        except Quit:
            return
        except ApiError as exc:
            repl.console.print(Text(f"[{exc}]", style="red"))
