"""The hot lane (``server/api/hot_lane.py``) answers the generation routes as the full FastAPI stack does.

Error answers are compared with a server that has the lane off, request for request: the same status,
headers that matter and body. Streams it serves end when the client goes away. The lane's happy paths
are the rest of the suite: the shared embedded stack has it on, so every OpenAI, Responses and Messages
test on that stack goes through it.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from server.admin import issue_user_key
from server.settings import ServerSettings
from tests.stack import MODEL, ServerThread
from tokentrail.launcher import free_port


@pytest.fixture(scope="module")
def lane_off(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, ServerSettings]]:
    settings = ServerSettings(data_dir=tmp_path_factory.mktemp("lane-off"), port=free_port(), hot_lane=False)
    server = ServerThread(settings).start()
    try:
        yield server.url, settings
    finally:
        server.stop()


USER = [{"role": "user", "content": "hi"}]
# (path, body bytes, extra headers); every key but the first two is sent with the user's API key.
CASES: list[tuple[str, bytes, dict[str, str]]] = [
    ("/v1/chat/completions", b'{"model": "m", "messages": ', {}),  # not JSON
    ("/v1/chat/completions", b'{"model": "m"}', {}),  # no messages
    ("/v1/chat/completions", b'{"model": "m", "messages": "hi"}', {}),
    ("/v1/chat/completions", b'{"model": "m", "messages": [], "n": 99}', {}),
    ("/v1/chat/completions", b'{"model": "nope", "messages": [{"role": "user", "content": "hi"}]}', {}),
    ("/v1/chat/completions", b'{"model": "m", "messages": [{"role": "user", "content": "a\\u0000b"}]}', {}),
    ("/v1/chat/completions", b'{"model": "m", "messages": [], "temperature": NaN}', {}),
    ("/v1/chat/completions", b'{"model": "m", "messages": []}', {"Content-Type": "text/plain"}),
    ("/v1/chat/completions", b'{"model": "nope", "messages": []}', {"Idempotency-Key": "x" * 300}),
    ("/v1/chat/completions", b"[1, 2]", {}),
    ("/v1/chat/completions/tokens", b'{"model": "nope", "messages": [{"role": "user", "content": "hi"}]}', {}),
    ("/v1/completions", b'{"model": "nope", "prompt": "hi"}', {}),
    ("/v1/completions", b'{"model": "nope", "prompt": 5}', {}),
    ("/v1/responses", b'{"model": "nope", "input": "hi"}', {}),
    ("/v1/responses", b'{"input": "hi"}', {}),
    ("/v1/messages", b'{"model": "nope", "max_tokens": 5, "messages": [{"role": "user", "content": "hi"}]}', {}),
    ("/v1/messages", b'{"model": "nope", "messages": [{"role": "user", "content": "hi"}]}', {}),
]
_COMPARED_HEADERS = ("content-type", "www-authenticate", "retry-after", "connection")


def _answer(url: str, path: str, body: bytes, headers: dict[str, str]) -> tuple[int, dict[str, str], Any]:
    resp = httpx.post(f"{url}{path}", content=body, headers={"Content-Type": "application/json", **headers})
    kept = {h: resp.headers[h] for h in _COMPARED_HEADERS if h in resp.headers}
    return resp.status_code, kept, resp.json()


@pytest.mark.parametrize(("path", "body", "extra"), CASES)
def test_errors_are_answered_as_without_the_lane(
    embedded_stack: str,
    embedded_settings: ServerSettings,
    lane_off: tuple[str, ServerSettings],
    path: str,
    body: bytes,
    extra: dict[str, str],
) -> None:
    off_url, off_settings = lane_off
    on_key = issue_user_key(embedded_settings, "lane-errors")
    off_key = issue_user_key(off_settings, "lane-errors")
    on = _answer(embedded_stack, path, body, {"Authorization": f"Bearer {on_key}", **extra})
    off = _answer(off_url, path, body, {"Authorization": f"Bearer {off_key}", **extra})
    assert on == off
    assert 400 <= on[0] < 500


@pytest.mark.parametrize(
    "auth",
    [{}, {"Authorization": "Bearer tt-nope"}, {"Authorization": "Basic abc"}, {"x-api-key": "tt-nope"}],
)
def test_auth_errors_are_answered_as_without_the_lane(
    embedded_stack: str, lane_off: tuple[str, ServerSettings], auth: dict[str, str]
) -> None:
    body = b'{"model": "m", "messages": [{"role": "user", "content": "hi"}]}'
    for path in ("/v1/chat/completions", "/v1/messages"):
        on = _answer(embedded_stack, path, body, auth)
        assert on == _answer(lane_off[0], path, body, auth)
        assert on[0] == 401


def test_an_oversized_body_is_refused_as_without_the_lane(
    embedded_stack: str, embedded_settings: ServerSettings, lane_off: tuple[str, ServerSettings]
) -> None:
    big = b'{"model": "m", "messages": [{"role": "user", "content": "%b"}]}' % (b"x" * (9 * 2**20))
    on = _answer(embedded_stack, "/v1/chat/completions", big, {})
    assert on == _answer(lane_off[0], "/v1/chat/completions", big, {})
    assert on[0] == 413


def _readers(url: str) -> float:
    text = httpx.get(f"{url}/metrics").text
    line = next(li for li in text.splitlines() if li.startswith("tokentrail_sse_readers "))
    return float(line.split()[1])


def test_a_stream_ends_when_its_client_goes_away(embedded_stack: str, embedded_settings: ServerSettings) -> None:
    """The reader is let go at once, not when the reply is done (it goes on: it is stored all the same)."""
    key = issue_user_key(embedded_settings, "lane-gone")
    auth = {"Authorization": f"Bearer {key}"}
    body = {"model": MODEL, "messages": USER, "stream": True, "max_tokens": 1500, "ignore_eos": True}
    before = _readers(embedded_stack)
    with httpx.stream("POST", f"{embedded_stack}/v1/chat/completions", json=body, headers=auth) as resp:
        assert resp.status_code == 200
        lines = resp.iter_lines()  # kept: a dropped iterator closes the response
        assert next(lines).startswith("data: {")
        assert _readers(embedded_stack) >= before + 1
    deadline = time.monotonic() + 20
    while _readers(embedded_stack) > before and time.monotonic() < deadline:
        time.sleep(0.02)
    assert _readers(embedded_stack) == before
    (chat,) = httpx.get(f"{embedded_stack}/chats", headers=auth).json()["chats"]
    messages = httpx.get(f"{embedded_stack}/chats/{chat['id']}", headers=auth).json()["messages"]
    assert [m["state"] for m in messages if m["role"] == "assistant"] != ["complete"]


def test_the_lane_answers_what_it_can_and_hands_the_rest_on(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    settings = ServerSettings(data_dir=tmp_path, port=free_port(), hot_lane=True)
    server = ServerThread(settings).start()
    try:
        lane = server.server.config.app.hot_lane
        calls: list[str] = []
        real = lane._call

        async def counted(route: Any, parsed: Any, scope: Any, raw: bytes) -> Any:
            calls.append(scope["path"])
            return await real(route, parsed, scope, raw)

        monkeypatch.setattr(lane, "_call", counted)
        auth = {"Authorization": f"Bearer {issue_user_key(settings, 'lane-unit')}"}
        ok = b'{"model": "nope", "messages": [{"role": "user", "content": "hi"}]}'
        assert _answer(server.url, "/v1/chat/completions", ok, auth)[0] == 404  # model_not_found
        assert calls == ["/v1/chat/completions"]
        for body, extra in ((b'{"model": 1}', {}), (ok, {"Content-Type": "text/plain"})):
            assert _answer(server.url, "/v1/chat/completions", body, {**auth, **extra})[0] == 400
        assert calls == ["/v1/chat/completions"]  # FastAPI answered those, from the replayed body
    finally:
        server.stop()
