"""Open-Assistant's website, as its inference client calls the server (website/src/lib/
oasst_inference_client.ts and the browser): CORS from its origin, the ``Refresh`` header, empty and
null bodies, drafts and their evaluation, reports, hide all, delete. Real HTTP + SSE, a real worker."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from server.settings import ServerSettings
from tests.stack import ServerThread, WorkerThread, worker_key
from tests.test_e2e_embedded import events
from tokentrail.launcher import free_port
from worker.chat_format import ChatFormat
from worker.engines.hf import HFEngine

MODEL = "oa-site"
ORIGIN = "http://localhost:3000"


@pytest.fixture(scope="module")
def site(tmp_path_factory: pytest.TempPathFactory, tiny_model_dir: Path) -> Iterator[str]:
    settings = ServerSettings(data_dir=tmp_path_factory.mktemp("oa-site"), port=free_port(), cors_origins=ORIGIN)
    server = ServerThread(settings).start()
    fmt = ChatFormat.load(str(tiny_model_dir))
    worker = WorkerThread(server.url, worker_key(settings), MODEL, fmt, lambda: HFEngine(str(tiny_model_dir)))
    worker.start()
    yield server.url
    worker.stop()
    server.stop()


def _login(url: str, name: str) -> tuple[dict[str, str], str]:
    pair = httpx.get(f"{url}/auth/login/debug", params={"username": name}, follow_redirects=True).json()
    return {"Authorization": f"Bearer {pair['access_token']['access_token']}"}, pair["refresh_token"]["access_token"]


# OA's website sends every field of its form; unset ones are null.
OA_SAMPLING = {
    "top_k": None,
    "top_p": None,
    "typical_p": None,
    "temperature": None,
    "repetition_penalty": None,
    "max_new_tokens": None,
}


def _assistant(url: str, headers: dict[str, str], chat: str, parent: str, **sampling: Any) -> dict[str, Any]:
    body = {
        "parent_id": parent,
        "model_config_name": MODEL,
        "sampling_parameters": {**OA_SAMPLING, **sampling},
        "system_prompt": None,
        "user_profile": None,
        "user_response_instructions": None,
        "plugins": [],
        "used_plugin": None,
    }
    resp = httpx.post(f"{url}/chats/{chat}/assistant_message", json=body, headers=headers)
    assert resp.status_code == 200, resp.text
    return dict(resp.json())


def test_cors_preflight_and_simple_requests_from_the_configured_origin(site: str) -> None:
    preflight = {
        "Origin": ORIGIN,
        "Access-Control-Request-Method": "POST",
        "Access-Control-Request-Headers": "authorization,content-type,refresh",
    }
    ok = httpx.options(f"{site}/chats", headers=preflight)
    assert ok.status_code == 200, ok.text
    assert ok.headers["access-control-allow-origin"] == ORIGIN
    assert "POST" in ok.headers["access-control-allow-methods"]
    assert "authorization" in ok.headers["access-control-allow-headers"].lower()
    other = httpx.options(f"{site}/chats", headers={**preflight, "Origin": "http://evil.example"})
    assert other.status_code == 400 and "access-control-allow-origin" not in other.headers
    simple = httpx.get(f"{site}/configs/model_configs", headers={"Origin": ORIGIN})
    assert simple.headers["access-control-allow-origin"] == ORIGIN
    plain = httpx.options(f"{site}/chats")  # not a preflight: the route's methods, as before
    assert plain.status_code == 204 and "POST" in plain.headers["allow"]


def test_refresh_with_oas_refresh_header(site: str) -> None:
    headers, refresh = _login(site, "oa-refresh")
    for sent in ({"Refresh": refresh}, {"Authorization": f"Bearer {refresh}"}):
        resp = httpx.get(f"{site}/auth/refresh", headers=sent)
        assert resp.status_code == 200, resp.text
        token = resp.json()["access_token"]
        assert httpx.get(f"{site}/auth/check", headers={"Authorization": f"Bearer {token}"}).text == '"oa-refresh"'
    bad = httpx.get(f"{site}/auth/refresh", headers={"Refresh": "not-a-token"})
    assert bad.status_code == 401 and bad.json()["code"] == "invalid_credentials"
    access = httpx.get(f"{site}/auth/refresh", headers={"Refresh": headers["Authorization"][7:]})
    assert access.status_code == 401  # an access token is not a refresh token


def test_the_websites_chat_sequence(site: str) -> None:
    headers, _ = _login(site, "oa-site-user")
    assert httpx.get(f"{site}/configs/builtin_plugins", headers=headers).json() == []
    created = httpx.post(f"{site}/chats", content=b"", headers={**headers, "Content-Type": "application/json"})
    assert created.status_code == 200, created.text
    chat = created.json()["id"]
    prompt = httpx.post(
        f"{site}/chats/{chat}/prompter_message", json={"parent_id": None, "content": "hello"}, headers=headers
    ).json()["id"]

    # a draft, then a regenerated one; null sampling fields mean the defaults
    drafts = []
    for _ in range(2):
        reply = _assistant(site, headers, chat, prompt, max_new_tokens=8)
        final = events(site, f"/chats/{chat}/messages/{reply['id']}/events", headers)[-1]
        assert final["event_type"] == "message", final
        drafts.append(reply["id"])
    default = _assistant(site, headers, chat, prompt)  # max_new_tokens null: the default, not a 422
    assert default["work_parameters"]["sampling_parameters"]["max_new_tokens"] == 1024
    httpx.post(f"{site}/chats/{chat}/messages/{default['id']}/cancel", headers=headers)

    # the user prefers the second draft
    evals = f"{site}/chats/{chat}/messages/{drafts[1]}/message_evals"
    assert httpx.post(evals, json={"inferior_message_ids": [drafts[0]]}, headers=headers).status_code == 200
    itself = httpx.post(evals, json={"inferior_message_ids": [drafts[1]]}, headers=headers)
    assert itself.status_code == 400 and itself.json()["code"] == "bad_request"
    stranger = httpx.post(evals, json={"inferior_message_ids": [prompt]}, headers=headers)
    assert stranger.status_code == 404 and stranger.json()["code"] == "message_not_found"

    vote = httpx.post(f"{site}/chats/{chat}/messages/{drafts[1]}/votes", json={"score": 1}, headers=headers)
    assert vote.status_code == 200
    reports = f"{site}/chats/{chat}/messages/{drafts[0]}/reports"
    assert httpx.post(reports, json={"report_type": "spam", "reason": "ads"}, headers=headers).status_code == 200
    bad = httpx.post(reports, json={"report_type": "boring", "reason": ""}, headers=headers)
    assert bad.status_code == 422

    assert httpx.put(f"{site}/chats/{chat}", json={"title": "greetings"}, headers=headers).status_code == 200
    other = httpx.post(f"{site}/chats", json={}, headers=headers).json()["id"]
    assert httpx.put(f"{site}/chats/hide_all", headers=headers).status_code == 200
    wrong = httpx.get(f"{site}/chats/hide_all", headers=headers)  # a path of its own, not a chat id
    assert wrong.status_code == 405 and wrong.headers["allow"] == "PUT"
    assert httpx.get(f"{site}/chats", headers=headers).json()["chats"] == []
    hidden = httpx.get(f"{site}/chats", params={"include_hidden": "true"}, headers=headers).json()["chats"]
    assert {c["id"] for c in hidden} == {chat, other} and all(c["hidden"] for c in hidden)

    # another user can neither see nor delete it
    stranger_headers, _ = _login(site, "oa-site-stranger")
    assert httpx.delete(f"{site}/chats/{chat}", headers=stranger_headers).status_code == 404
    assert httpx.delete(f"{site}/chats/{chat}", headers=headers).status_code == 200
    gone = httpx.get(f"{site}/chats/{chat}", headers=headers)
    assert gone.status_code == 404 and gone.json()["code"] == "chat_not_found"
    assert httpx.get(f"{site}/chats/{other}", headers=headers).status_code == 200


def test_deleting_a_chat_cancels_its_running_generation(site: str) -> None:
    headers, _ = _login(site, "oa-site-deleter")
    chat = httpx.post(f"{site}/chats", json={}, headers=headers).json()["id"]
    prompt = httpx.post(
        f"{site}/chats/{chat}/prompter_message", json={"parent_id": None, "content": "go"}, headers=headers
    ).json()["id"]
    reply = _assistant(site, headers, chat, prompt, max_new_tokens=1500, ignore_eos=True)
    seen: list[dict[str, Any]] = []
    final: dict[str, Any] = {}
    with httpx.stream(
        "GET", f"{site}/chats/{chat}/messages/{reply['id']}/events", headers={**headers, "Accept": "text/event-stream"}
    ) as resp:
        for line in resp.iter_lines():
            if not line.startswith("data:"):
                continue
            event = json.loads(line[5:])  # by its type: a token's text may itself be "message" or "error"
            if event["event_type"] == "token":
                seen.append(event)
                if len(seen) == 3:
                    assert httpx.delete(f"{site}/chats/{chat}", headers=headers).status_code == 200
            elif event["event_type"] in ("error", "message"):
                final = event
                break
    # the reader ends: its message was cancelled, or is already gone
    assert final["event_type"] == "error" and final["code"] in ("cancelled", "message_not_found"), final
    assert 3 <= len(seen) < 1500
    assert httpx.get(f"{site}/chats/{chat}", headers=headers).status_code == 404
