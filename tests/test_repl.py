"""``tokentrail chat`` in a real pseudo-terminal (pexpect), against a real server and worker:
streaming, slash commands, branches, Ctrl-C cancelling a reply (not the program), export."""

from __future__ import annotations

import json
import os
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import httpx
import pexpect
import pytest

from tests.stack import serving

MODEL = "repl-model"
PROMPT = "you>\x1b"  # prompt_toolkit draws the prompt, then moves the cursor


@pytest.fixture(scope="module")
def site(tmp_path_factory: pytest.TempPathFactory, trained_model: Callable[[str], Path]) -> Iterator[str]:
    # trained briefly: its tokens have readable probabilities
    with serving(tmp_path_factory.mktemp("repl"), MODEL, str(trained_model("chatml"))) as url:
        yield url


def _spawn(url: str, user: str, tmp: Path) -> pexpect.spawn:
    env = {**os.environ, "PROMPT_TOOLKIT_NO_CPR": "1", "TERM": "xterm", "HOME": str(tmp), "COLUMNS": "160"}
    child = pexpect.spawn(
        sys.executable,
        ["-m", "tokentrail", "chat", "--server-url", url, "--username", user, "--max-new-tokens", "8"],
        env=env,
        encoding="utf-8",
        timeout=60,
        dimensions=(40, 160),
    )
    child.expect(PROMPT)
    return child


def _line(child: pexpect.spawn, text: str) -> str:
    """Type a line, wait for the next prompt, return what was printed in between."""
    child.sendline(text)
    child.expect(PROMPT)
    return str(child.before)


def test_a_session_of_commands(site: str, tmp_path: Path) -> None:
    child = _spawn(site, "repl-user", tmp_path)
    out = _line(child, "hello there")
    assert "assistant>" in out
    assert "/new" in _line(child, "/help")
    out = _line(child, "/params max_new_tokens=6 temperature=0.5")
    assert '"max_new_tokens": 6' in out and '"temperature": 0.5' in out
    assert "unknown or empty parameter" in _line(child, "/params bogus=1")
    assert "assistant>" in _line(child, "/regen")
    tree = _line(child, "/tree")
    assert tree.count("assistant:") == 2  # the reply and its regeneration, siblings
    assert "voted +1" in _line(child, "/vote +1")
    assert "assistant>" in _line(child, "/edit hello again")
    tree = _line(child, "/tree")
    assert tree.count("you:") == 2 and "[+1]" in tree
    tokens = _line(child, "/tokens")
    assert "completion: " in tokens and "prompt: " in tokens
    assert "system prompt: be brief" in _line(child, "/system be brief")
    assert "logprob colours on" in _line(child, "/logprobs on")
    assert "assistant>" in _line(child, "one more")
    export = tmp_path / "chat.json"
    assert "wrote" in _line(child, f"/export {export}")
    data = json.loads(export.read_text())
    replies = [m for m in data["messages"] if m["role"] == "assistant"]
    assert len(replies) == 4 and all(m["completion_token_ids"] for m in replies)
    assert data["system_prompt"] == "be brief"
    chats = _line(child, "/chats")
    assert data["id"] in chats
    _line(child, "/new")
    assert data["id"] in _line(child, "/switch 2") or data["id"] in _line(child, "/switch " + data["id"])
    assert "unknown command" in _line(child, "/nonsense")
    child.sendeof()
    child.expect(pexpect.EOF)
    child.close()
    assert child.exitstatus == 0


def test_ctrl_c_cancels_the_reply_not_the_program(site: str, tmp_path: Path) -> None:
    child = _spawn(site, "repl-stopper", tmp_path)
    _line(child, "/params max_new_tokens=2000 ignore_eos=true")
    for _ in range(5):
        child.sendline("tell me everything")
        child.expect("assistant>")
        time.sleep(0.3)  # into the reply
        child.sendintr()  # Ctrl-C
        # ignore_eos keeps the end token from stopping it, but the trained model may write its turn
        # closer before the Ctrl-C: then the prompt is back first, and the turn is asked again
        if child.expect([r"\[cancelled\]", PROMPT]) == 0:
            break
    else:
        pytest.fail("every reply ended before its Ctrl-C")
    child.expect(PROMPT)
    headers = {"Authorization": f"Bearer {_token(site, 'repl-stopper')}"}
    [chat] = httpx.get(f"{site}/chats", headers=headers).json()["chats"]
    msgs = httpx.get(f"{site}/chats/{chat['id']}", headers=headers).json()["messages"]
    [reply] = [m for m in msgs if m["role"] == "assistant" and m["state"] == "cancelled"]
    assert reply["completion_token_count"] < 2000
    assert "assistant>" in _line(child, "/regen")  # the program goes on
    child.sendline("/quit")
    child.expect(pexpect.EOF)


def _token(url: str, user: str) -> str:
    pair = httpx.get(f"{url}/auth/login/debug", params={"username": user}, follow_redirects=True).json()
    return str(pair["access_token"]["access_token"])
