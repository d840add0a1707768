"""Streams that coalesce: a streamed OpenAI reply carries at least ``stream_interval`` tokens per chunk (a
request's, else the server's), adding up to the stored reply. A real server with a real hf worker. (A reader
that is behind getting what it missed in one batch: tests/test_token_streams.py, on memory and Redis.)"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import httpx
import orjson
import pytest

from server.admin import issue_user_key
from tests.stack import MODEL, hf_stack


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory, tiny_model_dir: Path) -> Any:
    with hf_stack(tmp_path_factory.mktemp("interval"), tiny_model_dir) as (url, settings):
        yield url, {"Authorization": f"Bearer {issue_user_key(settings, 'interval')}"}


def _chunks(url: str, headers: dict[str, str], body: dict[str, Any]) -> list[dict[str, Any]]:
    out = []
    with httpx.stream("POST", f"{url}/v1/chat/completions", json=body, headers=headers, timeout=120) as resp:
        assert resp.status_code == 200, resp.read()
        for line in resp.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                out.append(orjson.loads(line[6:]))
    return out


def _stored(url: str, headers: dict[str, str], chunks: list[dict[str, Any]]) -> dict[str, Any]:
    info = chunks[-1]["tokentrail"]
    chat = httpx.get(f"{url}/chats/{info['chat_id']}", headers=headers).json()
    (msg,) = [m for m in chat["messages"] if m["id"] == info["message_id"]]
    return dict(msg)


def _token_chunks(chunks: list[dict[str, Any]]) -> list[list[int]]:
    """The token ids of each chunk that streams tokens (not the closing one, which holds what the stream missed)."""
    return [c["choices"][0]["token_ids"] for c in chunks if c["choices"] and c["choices"][0]["finish_reason"] is None]


def _check_adds_up(url: str, headers: dict[str, str], chunks: list[dict[str, Any]]) -> None:
    text = "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks if c["choices"])
    assert text == _stored(url, headers, chunks)["content"]


@pytest.mark.parametrize("interval", [4, 7])
def test_a_request_stream_interval_sets_the_fewest_tokens_per_chunk(served: Any, interval: int) -> None:
    url, headers = served
    body = {"model": MODEL, "messages": [{"role": "user", "content": f"count {interval}"}], "stream": True,
            "max_tokens": 30, "ignore_eos": True, "stream_interval": interval}  # fmt: skip
    chunks = _chunks(url, headers, body)
    sizes = [len(ids) for ids in _token_chunks(chunks)]
    assert sum(sizes) + len(chunks[-1]["choices"][0]["token_ids"]) == 30
    assert all(n >= interval for n in sizes[:-1]), sizes  # the last may be short: the stream ended
    _check_adds_up(url, headers, chunks)
    plain = _chunks(url, headers, {**body, "stream_interval": None, "messages": [{"role": "user", "content": "x"}]})
    assert len(_token_chunks(plain)) > len(sizes)  # without it: a chunk per engine step


def test_a_bad_stream_interval_is_refused(served: Any) -> None:
    url, headers = served
    for bad in (0, -1, 5000, "many"):
        body = {"model": MODEL, "messages": [{"role": "user", "content": "x"}], "stream": True, "stream_interval": bad}
        resp = httpx.post(f"{url}/v1/chat/completions", json=body, headers=headers)
        assert resp.status_code == 400 and resp.json()["error"]["param"] == "stream_interval", resp.text
