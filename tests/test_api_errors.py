"""Bad input gets a clear error with a machine-readable code and the right status, and changes nothing."""

from __future__ import annotations

from typing import Any

import httpx
import pytest

from shared.api import MAX_CONTENT_CHARS
from tests.stack import MODEL
from tests.test_e2e_embedded import events, login


@pytest.fixture(scope="module")
def url(embedded_stack: str) -> str:
    return embedded_stack


@pytest.fixture(scope="module")
def alice(url: str) -> dict[str, str]:
    return login(url, "err-alice")


@pytest.fixture(scope="module")
def chat(url: str, alice: dict[str, str]) -> dict[str, Any]:
    """A chat with one finished turn: prompter message and completed assistant reply."""
    chat_id = httpx.post(f"{url}/chats", json={}, headers=alice).json()["id"]
    prompt = httpx.post(
        f"{url}/chats/{chat_id}/prompter_message", json={"parent_id": None, "content": "hi"}, headers=alice
    ).json()
    reply = httpx.post(
        f"{url}/chats/{chat_id}/assistant_message",
        json={
            "parent_id": prompt["id"],
            "model_config_name": MODEL,
            "sampling_parameters": {"max_new_tokens": 4},
        },
        headers=alice,
    ).json()
    assert events(url, f"/chats/{chat_id}/messages/{reply['id']}/events", alice)[-1]["event_type"] == "message"
    return {"id": chat_id, "prompt": prompt["id"], "reply": reply["id"]}


def snapshot(url: str, headers: dict[str, str], chat_id: str) -> list[tuple[str, str, str | None]]:
    tree = httpx.get(f"{url}/chats/{chat_id}", headers=headers).json()
    return sorted((m["id"], m["state"], m["content"]) for m in tree["messages"])


def expect(resp: httpx.Response, status: int, code: str) -> None:
    assert resp.status_code == status, resp.text
    body = resp.json()
    assert body["code"] == code, body
    assert body["detail"]


def test_unknown_chat_and_message_are_404(url: str, alice: dict[str, str], chat: dict[str, Any]) -> None:
    expect(httpx.get(f"{url}/chats/nope", headers=alice), 404, "chat_not_found")
    expect(httpx.get(f"{url}/chats/{chat['id']}/messages/nope", headers=alice), 404, "message_not_found")
    expect(httpx.get(f"{url}/chats/{chat['id']}/messages/nope/events", headers=alice), 404, "message_not_found")
    before = snapshot(url, alice, chat["id"])
    resp = httpx.post(
        f"{url}/chats/{chat['id']}/prompter_message",
        json={"parent_id": "nope", "content": "x"},
        headers=alice,
    )
    expect(resp, 404, "message_not_found")
    assert snapshot(url, alice, chat["id"]) == before


def test_another_users_chat_is_404(url: str, chat: dict[str, Any]) -> None:
    mallory = login(url, "err-mallory")
    expect(httpx.get(f"{url}/chats/{chat['id']}", headers=mallory), 404, "chat_not_found")
    path = f"/chats/{chat['id']}/messages/{chat['reply']}"
    expect(httpx.get(f"{url}{path}", headers=mallory), 404, "chat_not_found")
    expect(httpx.get(f"{url}{path}/events", headers=mallory), 404, "chat_not_found")
    resp = httpx.post(
        f"{url}/chats/{chat['id']}/prompter_message",
        json={"parent_id": chat["reply"], "content": "x"},
        headers=mallory,
    )
    expect(resp, 404, "chat_not_found")
    assert all(c["id"] != chat["id"] for c in httpx.get(f"{url}/chats", headers=mallory).json()["chats"])


def test_missing_or_bad_credentials_are_401(url: str, chat: dict[str, Any]) -> None:
    expect(httpx.get(f"{url}/chats"), 401, "not_authenticated")
    expect(httpx.post(f"{url}/chats", json={}), 401, "not_authenticated")
    expect(httpx.get(f"{url}/chats", headers={"Authorization": "Bearer garbage"}), 401, "invalid_credentials")
    expect(httpx.get(f"{url}/chats", headers={"Authorization": "Bearer tt_u_nope"}), 401, "invalid_credentials")
    expect(httpx.get(f"{url}/chats", headers={"Authorization": "Basic abc"}), 401, "not_authenticated")
    assert httpx.get(f"{url}/chats").headers.get("www-authenticate") == "Bearer"


def test_parent_of_wrong_role_or_unfinished_is_409(url: str, alice: dict[str, str], chat: dict[str, Any]) -> None:
    before = snapshot(url, alice, chat["id"])
    # prompter under prompter
    resp = httpx.post(
        f"{url}/chats/{chat['id']}/prompter_message",
        json={"parent_id": chat["prompt"], "content": "x"},
        headers=alice,
    )
    expect(resp, 409, "parent_wrong_role")
    # assistant under assistant
    resp = httpx.post(
        f"{url}/chats/{chat['id']}/assistant_message",
        json={"parent_id": chat["reply"], "model_config_name": MODEL},
        headers=alice,
    )
    expect(resp, 409, "parent_wrong_role")
    assert snapshot(url, alice, chat["id"]) == before
    # a prompter message under an assistant message that is still generating
    long = httpx.post(
        f"{url}/chats/{chat['id']}/assistant_message",
        json={
            "parent_id": chat["prompt"],
            "model_config_name": MODEL,
            "sampling_parameters": {"max_new_tokens": 1500, "stop_token_ids": []},
        },
        headers=alice,
    ).json()
    resp = httpx.post(
        f"{url}/chats/{chat['id']}/prompter_message",
        json={"parent_id": long["id"], "content": "x"},
        headers=alice,
    )
    expect(resp, 409, "parent_not_complete")
    # cancelled, not waited for: the stack is left idle for the next test
    cancelled = httpx.post(f"{url}/chats/{chat['id']}/messages/{long['id']}/cancel", headers=alice)
    assert cancelled.status_code == 200, cancelled.text
    events(url, f"/chats/{chat['id']}/messages/{long['id']}/events", alice)


def test_content_over_limit_is_413(url: str, alice: dict[str, str], chat: dict[str, Any]) -> None:
    before = snapshot(url, alice, chat["id"])
    resp = httpx.post(
        f"{url}/chats/{chat['id']}/prompter_message",
        json={"parent_id": chat["reply"], "content": "a" * (MAX_CONTENT_CHARS + 1)},
        headers=alice,
    )
    expect(resp, 413, "content_too_long")
    assert snapshot(url, alice, chat["id"]) == before


@pytest.mark.parametrize(
    "sampling",
    [
        {"temperature": -1},
        {"top_p": 0},
        {"top_p": 1.5},
        {"top_k": 0},
        {"max_new_tokens": 0},
        {"max_new_tokens": 10**9},
        {"repetition_penalty": 0},
        {"seed": -1},
        {"no_such_parameter": 1},
        {"stop_token_ids": [-5]},
    ],
)
def test_sampling_out_of_range_is_422(
    url: str, alice: dict[str, str], chat: dict[str, Any], sampling: dict[str, Any]
) -> None:
    before = snapshot(url, alice, chat["id"])
    resp = httpx.post(
        f"{url}/chats/{chat['id']}/assistant_message",
        json={"parent_id": chat["prompt"], "model_config_name": MODEL, "sampling_parameters": sampling},
        headers=alice,
    )
    expect(resp, 422, "validation_error")
    assert snapshot(url, alice, chat["id"]) == before


def test_unknown_model_is_422(url: str, alice: dict[str, str], chat: dict[str, Any]) -> None:
    before = snapshot(url, alice, chat["id"])
    resp = httpx.post(
        f"{url}/chats/{chat['id']}/assistant_message",
        json={"parent_id": chat["prompt"], "model_config_name": "no-such-model"},
        headers=alice,
    )
    expect(resp, 422, "unknown_model")
    assert snapshot(url, alice, chat["id"]) == before


def test_events_of_a_prompter_message_is_400(url: str, alice: dict[str, str], chat: dict[str, Any]) -> None:
    resp = httpx.get(f"{url}/chats/{chat['id']}/messages/{chat['prompt']}/events", headers=alice)
    expect(resp, 400, "not_assistant_message")


def test_malformed_body_is_422(url: str, alice: dict[str, str], chat: dict[str, Any]) -> None:
    resp = httpx.post(
        f"{url}/chats/{chat['id']}/prompter_message",
        content=b"{not json",
        headers={**alice, "Content-Type": "application/json"},
    )
    expect(resp, 422, "validation_error")
    resp = httpx.post(f"{url}/chats/{chat['id']}/assistant_message", json={"parent_id": 5}, headers=alice)
    expect(resp, 422, "validation_error")


def test_chat_list_pagination(url: str) -> None:
    headers = login(url, "err-pager")
    ids = [httpx.post(f"{url}/chats", json={}, headers=headers).json()["id"] for _ in range(5)]
    page1 = httpx.get(f"{url}/chats", params={"limit": 2}, headers=headers).json()
    assert [c["id"] for c in page1["chats"]] == ids[::-1][:2]
    page2 = httpx.get(f"{url}/chats", params={"limit": 2, "after": page1["next"]}, headers=headers).json()
    assert [c["id"] for c in page2["chats"]] == ids[::-1][2:4]
    back = httpx.get(f"{url}/chats", params={"limit": 2, "before": page2["prev"]}, headers=headers).json()
    assert [c["id"] for c in back["chats"]] == ids[::-1][:2]
    expect(httpx.get(f"{url}/chats", params={"after": "%%%"}, headers=headers), 400, "bad_request")
    expect(httpx.get(f"{url}/chats", params={"limit": 0}, headers=headers), 422, "validation_error")
