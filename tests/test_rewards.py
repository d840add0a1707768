"""Rewards from an environment (``POST /v1/rewards``): stored on the assistant message, shown on reads,
exported as the turn's reward (the rollout's under each rule), and refused with a code for bad input.
A real server with a real hf worker; the official ``openai`` SDK plays the agent."""

from __future__ import annotations

import json
import math
import time
from pathlib import Path
from typing import Any

import httpx
import pytest
from openai import OpenAI

from server.admin import issue_user_key
from server.db import create_engine, create_session_factory
from server.export.query import ExportFilters
from server.export.stream import export_lines
from tests.stack import MODEL, hf_stack, start_reply


async def _export(settings: Any, rule: str = "last") -> list[dict[str, Any]]:
    """A full export (what ``GET /admin/export`` streams)."""
    engine = create_engine(settings.effective_database_url)
    try:
        filters = ExportFilters(reward_rule=rule)  # type: ignore[arg-type]
        lines = [text async for text in export_lines(engine, create_session_factory(engine), filters, "tokentrail")]
        return [json.loads(line) for line in b"".join(lines).splitlines()]
    finally:
        await engine.dispose()


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory, tiny_model_dir: Path) -> Any:
    with hf_stack(tmp_path_factory.mktemp("rewards"), tiny_model_dir) as (url, settings):
        yield url, settings


def test_an_episode_rewarded_through_the_sdk_is_a_rollout_with_that_reward(served: Any) -> None:
    import asyncio

    url, settings = served
    key = issue_user_key(settings, "env")
    client = OpenAI(base_url=f"{url}/v1", api_key=key, max_retries=0)
    history: list[dict[str, Any]] = [{"role": "user", "content": "play"}]
    ids = []
    for turn in range(3):
        reply = client.chat.completions.create(model=MODEL, messages=history, max_tokens=6)  # type: ignore[arg-type]
        info = (reply.choices[0].model_extra or {})["tokentrail"]
        ids.append(info["message_id"])
        history += [{"role": "assistant", "content": reply.choices[0].message.content or ""},
                    {"role": "user", "content": f"move {turn}"}]  # fmt: skip
    chat = info["chat_id"]
    headers = {"Authorization": f"Bearer {key}"}
    turn_reward = httpx.post(f"{url}/v1/rewards", json={"message_id": ids[0], "reward": -0.5}, headers=headers)
    assert turn_reward.status_code == 200, turn_reward.text
    assert turn_reward.json()["done"] is False and turn_reward.json()["chat_id"] == chat
    done = httpx.post(f"{url}/v1/rewards", json={"message_id": ids[2], "reward": 0.75, "done": True}, headers=headers)
    assert done.status_code == 200 and done.json()["done"] is True and done.json()["reward"] == 0.75

    read = httpx.get(f"{url}/chats/{chat}/messages/{ids[2]}", headers=headers).json()
    assert (read["reward"], read["episode_done"]) == (0.75, True)
    assert httpx.get(f"{url}/chats/{chat}/messages/{ids[1]}", headers=headers).json()["reward"] is None

    rollouts = [r for r in asyncio.run(_export(settings)) if r["leaf_message_id"] == ids[2]]
    assert len(rollouts) == 1
    turns = rollouts[0]["turns"]
    assert [(t["message_id"], t["reward"], t["done"]) for t in turns] == [
        (ids[0], -0.5, False), (ids[1], None, False), (ids[2], 0.75, True)
    ]  # fmt: skip
    assert rollouts[0]["reward"] == 0.75
    for rule, expected in (("mean", 0.125), ("min", -0.5), ("leaf", 0.75)):
        (r,) = [r for r in asyncio.run(_export(settings, rule)) if r["leaf_message_id"] == ids[2]]
        assert math.isclose(r["reward"], expected), (rule, r["reward"])

    # posting again replaces the reward; done stays
    again = httpx.post(f"{url}/v1/rewards", json={"message_id": ids[2], "reward": 1.0}, headers=headers)
    assert again.json()["reward"] == 1.0 and again.json()["done"] is True


def test_bad_rewards_are_refused_with_a_code_and_store_nothing(served: Any) -> None:
    url, settings = served
    owner = {"Authorization": f"Bearer {issue_user_key(settings, 'owner')}"}
    other = {"Authorization": f"Bearer {issue_user_key(settings, 'other')}"}
    admin = {"Authorization": f"Bearer {issue_user_key(settings, 'boss', admin=True)}"}
    chat, mid = start_reply(url, owner, MODEL, 4)
    prompt = httpx.get(f"{url}/chats/{chat}/messages/{mid}", headers=owner).json()["parent_id"]
    for _ in range(200):
        if httpx.get(f"{url}/chats/{chat}/messages/{mid}", headers=owner).json()["state"] == "complete":
            break
        time.sleep(0.05)

    def post(body: Any, headers: dict[str, str]) -> tuple[int, str]:
        content = body if isinstance(body, bytes) else None
        resp = httpx.post(
            f"{url}/v1/rewards",
            json=None if content else body,
            content=content,
            headers={**headers, "Content-Type": "application/json"},
        )
        return resp.status_code, resp.json()["error"]["code"] if resp.status_code != 200 else ""

    assert post({"message_id": "no-such-message", "reward": 1}, owner) == (404, "message_not_found")
    assert post({"message_id": mid, "reward": 1}, other) == (404, "message_not_found")
    assert post({"message_id": prompt, "reward": 1}, owner) == (400, "not_assistant_message")
    assert post(b'{"message_id": "%s", "reward": NaN}' % mid.encode(), owner) == (400, "validation_error")
    assert post(b'{"message_id": "%s", "reward": Infinity}' % mid.encode(), owner) == (400, "validation_error")
    assert post({"message_id": mid, "reward": "high"}, owner) == (400, "validation_error")
    assert post({"message_id": mid}, owner) == (400, "validation_error")
    assert post({"message_id": mid, "reward": 1, "score": 2}, owner) == (400, "validation_error")
    read = httpx.get(f"{url}/chats/{chat}/messages/{mid}", headers=owner).json()
    assert (read["reward"], read["episode_done"]) == (None, False)  # nothing stored

    pending = httpx.post(
        f"{url}/chats/{chat}/assistant_message",
        json={"parent_id": prompt, "model_config_name": MODEL,
              "sampling_parameters": {"max_new_tokens": 400, "ignore_eos": True}},
        headers=owner,
    ).json()["id"]  # fmt: skip
    httpx.post(f"{url}/chats/{chat}/messages/{pending}/cancel", headers=owner)
    for _ in range(200):
        if httpx.get(f"{url}/chats/{chat}/messages/{pending}", headers=owner).json()["state"] == "cancelled":
            break
        time.sleep(0.05)
    assert post({"message_id": pending, "reward": 1}, owner) == (409, "message_not_complete")
    assert post({"message_id": mid, "reward": 2.5, "done": True}, admin) == (200, "")  # an admin may
