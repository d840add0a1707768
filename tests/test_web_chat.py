"""The web chat in a real browser: headless Chromium (Debian's ``chromium``) driven by Playwright,
against a real server and worker. Log in, chat with streaming, regenerate and switch siblings,
edit a message into a branch, vote, stop a running reply, and the token view.

Set ``TOKENTRAIL_SCREENSHOTS=DIR`` to keep screenshots (the README's come from here)."""

from __future__ import annotations

import os
import shutil
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.stack import serving

MODEL = "web-model"
CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
playwright = pytest.importorskip("playwright.sync_api", reason="pip install playwright")
pytestmark = pytest.mark.skipif(CHROMIUM is None, reason="needs Chromium (apt-get install chromium; .ci/run does)")


@pytest.fixture(scope="module")
def site(tmp_path_factory: pytest.TempPathFactory, trained_model: Callable[[str], Path]) -> Iterator[str]:
    # trained briefly: its tokens have readable probabilities
    with serving(tmp_path_factory.mktemp("web"), MODEL, str(trained_model("chatml"))) as url:
        yield url


@pytest.fixture(scope="module")
def browser() -> Iterator[Any]:
    with playwright.sync_playwright() as pw:
        chromium = pw.chromium.launch(executable_path=CHROMIUM, args=["--no-sandbox", "--disable-gpu"])
        yield chromium
        chromium.close()


def _shot(page: Any, name: str) -> None:
    folder = os.environ.get("TOKENTRAIL_SCREENSHOTS")
    if folder:
        Path(folder).mkdir(parents=True, exist_ok=True)
        page.screenshot(path=str(Path(folder) / name))


def _login(page: Any, url: str, name: str) -> None:
    page.goto(url + "/")
    page.fill("#login-user", name)
    page.click("#login-form button[type=submit]")
    page.wait_for_selector("#app:not([hidden])")
    page.wait_for_function("document.querySelector('#model').options.length > 0")


def _send(page: Any, text: str) -> None:
    page.fill("#input", text)
    page.press("#input", "Enter")
    page.wait_for_selector(".msg.assistant[data-state=complete]", timeout=60_000)


def test_chat_branch_vote_and_token_view(site: str, browser: Any) -> None:
    page = browser.new_page(viewport={"width": 1280, "height": 900})
    errors: list[str] = []
    page.on("pageerror", lambda exc: errors.append(str(exc)))
    _login(page, site, "web-user")
    page.click("#settings summary")  # sampling parameters live under Settings
    page.fill("#max_new_tokens", "12")
    page.click("#settings summary")
    _send(page, "hello there")
    assert page.locator(".msg.prompter .text").inner_text() == "hello there"
    first = page.locator(".msg.assistant").get_attribute("data-id")

    # regenerate: a sibling; the switcher moves between them
    page.click(".msg.assistant .regen")
    page.wait_for_function(f"document.querySelector('.msg.assistant').dataset.id !== '{first}'")
    page.wait_for_selector(".msg.assistant[data-state=complete]", timeout=60_000)
    assert page.locator(".msg.assistant .siblings").inner_text().strip().startswith("< 2/2")
    page.click(".msg.assistant .siblings button:first-child")
    assert page.locator(".msg.assistant").get_attribute("data-id") == first

    # vote, as stored
    page.click(".msg.assistant .vote-up")
    page.wait_for_selector(".msg.assistant .vote-up.voted")
    headers = {"Authorization": "Bearer " + page.evaluate("localStorage.getItem('tt_token')")}
    chat_id = page.evaluate("document.querySelector('#chats li.active').dataset.id")
    stored = httpx.get(f"{site}/chats/{chat_id}/messages/{first}", headers=headers).json()
    assert stored["score"] == 1

    # a second turn, then the token view: completion tokens coloured, prompt ids with the reused prefix
    _send(page, "and then?")
    page.wait_for_function("document.querySelectorAll('.msg.assistant[data-state=complete]').length === 2")
    page.check("#show-tokens")
    page.wait_for_selector(".msg.assistant:last-child .completion .tok")
    second = page.locator(".msg.assistant").last.get_attribute("data-id")
    tokens = httpx.get(f"{site}/chats/{chat_id}/messages/{second}?include=tokens", headers=headers).json()
    shown = [int(t) for t in page.locator(".msg.assistant:last-child .completion .tok").evaluate_all(
        "spans => spans.map(s => s.dataset.tokenId)")]  # fmt: skip
    assert shown == tokens["completion_token_ids"]
    assert page.locator(".msg.assistant:last-child .prompt-ids .pid").count() == len(tokens["prompt_token_ids"])
    assert page.locator(".msg.assistant:last-child .prompt-ids .reused").count() == tokens["reused_prefix_len"] > 0
    _shot(page, "web-chat-tokens.png")
    page.uncheck("#show-tokens")

    # edit the first message: a new branch with its own reply
    page.once("dialog", lambda dialog: dialog.accept("hello, edited"))
    page.locator(".msg.prompter").first.locator("button", has_text="Edit").click()
    page.wait_for_function("document.querySelector('.msg.prompter .text').textContent === 'hello, edited'")
    page.wait_for_selector(".msg.assistant[data-state=complete]", timeout=60_000)
    assert page.locator(".msg.prompter .siblings").first.inner_text().strip().startswith("< 2/2")
    _shot(page, "web-chat.png")
    assert not errors, errors
    page.close()


def test_stop_cancels_a_running_reply(site: str, browser: Any) -> None:
    page = browser.new_page()
    _login(page, site, "web-stopper")
    page.click("#settings summary")
    page.fill("#max_new_tokens", "1500")
    page.check("#ignore_eos")
    page.fill("#input", "go on and on")
    page.press("#input", "Enter")
    page.wait_for_function("(document.querySelector('.msg.assistant .text')?.textContent || '').length > 20")
    page.click("#stop")
    page.wait_for_selector(".msg.assistant[data-state=cancelled]", timeout=30_000)
    count = page.locator(".msg.assistant .meta").inner_text()
    assert "abort" in count and "1500 tokens" not in count
    page.close()
