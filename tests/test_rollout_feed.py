"""The rollout feed (``GET /v1/rollouts``): episodes an environment ends with a ``done`` reward stream out as
rollouts, in finishing order, resumable from a cursor, per user or (admin) for all; ``tokentrail.rollouts``
and ``tokentrail export --follow`` consume it, the latter surviving SIGKILL. A real server with a real hf
worker; the official ``openai`` SDK plays the agent; the feed's rollouts are compared with a full export's."""

from __future__ import annotations

import asyncio
import base64
import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import httpx
import orjson
import pytest
from openai import OpenAI

import tokentrail
from server.admin import issue_user_key
from server.db import create_engine, create_session_factory
from server.export.query import ExportFilters
from server.export.stream import export_lines
from tests.stack import MODEL, hf_stack, wait_for
from tokentrail.feed import FeedError


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory, tiny_model_dir: Path) -> Any:
    with hf_stack(tmp_path_factory.mktemp("feed"), tiny_model_dir) as (url, settings):
        yield url, settings, issue_user_key(settings, "feed-admin", admin=True)


def _episode(url: str, key: str, turns: int, reward: float | None, done: bool = True) -> list[str]:
    """An agent episode of ``turns`` turns through the SDK, ended by a reward on its last turn."""
    client = OpenAI(base_url=f"{url}/v1", api_key=key, max_retries=0)
    history: list[dict[str, Any]] = [{"role": "user", "content": f"episode {time.monotonic_ns()}"}]
    ids = []
    for turn in range(turns):
        reply = client.chat.completions.create(model=MODEL, messages=history, max_tokens=5)  # type: ignore[arg-type]
        ids.append((reply.choices[0].model_extra or {})["tokentrail"]["message_id"])
        history += [{"role": "assistant", "content": reply.choices[0].message.content or ""},
                    {"role": "user", "content": f"observation {turn}"}]  # fmt: skip
    if reward is not None:
        body = {"message_id": ids[-1], "reward": reward, "done": done}
        resp = httpx.post(f"{url}/v1/rewards", json=body, headers={"Authorization": f"Bearer {key}"})
        assert resp.status_code == 200, resp.text
    return ids


async def _export(settings: Any) -> dict[str, dict[str, Any]]:
    """A full export (what ``GET /admin/export`` streams), by rollout id."""
    engine = create_engine(settings.effective_database_url)
    try:
        sessions = create_session_factory(engine)
        lines = [text async for text in export_lines(engine, sessions, ExportFilters(), "tokentrail")]
        return {r["rollout_id"]: r for r in map(json.loads, b"".join(lines).splitlines())}
    finally:
        await engine.dispose()


def _same_tokens(fed: dict[str, Any], exported: dict[str, Any]) -> None:
    assert [t["message_id"] for t in fed["turns"]] == [t["message_id"] for t in exported["turns"]]
    for key in ("token_ids", "loss_mask", "logprobs", "policy_versions"):
        assert [s[key] for s in fed["samples"]] == [s[key] for s in exported["samples"]], key


def test_finished_episodes_stream_in_order_per_user_and_resume_from_a_cursor(served: Any) -> None:
    url, settings, admin = served
    alice, bob = issue_user_key(settings, "feed-alice"), issue_user_key(settings, "feed-bob")
    a1 = _episode(url, alice, 2, 0.5)
    b1 = _episode(url, bob, 2, -1.0)
    _episode(url, alice, 2, 0.25, done=False)  # a turn reward: not a finished episode
    a2 = _episode(url, alice, 3, 1.0)

    fed = list(tokentrail.rollouts(url, alice, follow=False))
    assert [r["rollout_id"] for r in fed] == [a1[-1], a2[-1]]
    assert [r["reward"] for r in fed] == [0.5, 1.0]
    assert [len(r["turns"]) for r in fed] == [2, 3] and fed[1]["turns"][-1]["done"] is True
    exported = asyncio.run(_export(settings))
    for r in fed:
        _same_tokens(r, exported[r["rollout_id"]])

    first = tokentrail.rollouts(url, alice, follow=False)
    assert next(first)["rollout_id"] == a1[-1]
    cursor = first.cursor
    first.close()
    assert cursor and cursor.startswith("rf1_")
    assert [r["rollout_id"] for r in tokentrail.rollouts(url, alice, after=cursor, follow=False)] == [a2[-1]]

    everyone = [r["rollout_id"] for r in tokentrail.rollouts(url, admin, follow=False)]
    assert everyone.index(a1[-1]) < everyone.index(b1[-1]) < everyone.index(a2[-1])
    (bobs,) = tokentrail.rollouts(url, bob, follow=False)
    only_bob = [r["rollout_id"] for r in tokentrail.rollouts(url, admin, user=bobs["user_id"], follow=False)]
    assert b1[-1] in only_bob and a1[-1] not in only_bob

    # a trainer schema: one event per rollout, holding that schema's records
    (verl,) = [r for r in tokentrail.rollouts(url, alice, schema="verl", follow=False) if r["rollout_id"] == a2[-1]]
    assert verl["schema"] == "verl" and verl["records"] and all("response_ids" in rec for rec in verl["records"])


def test_a_following_reader_gets_an_episode_as_it_finishes(served: Any) -> None:
    url, settings, _admin = served
    carol = issue_user_key(settings, "feed-carol")
    feed = tokentrail.rollouts(url, carol)  # follow: waits for new episodes
    got: list[dict[str, Any]] = []
    reader = threading.Thread(target=lambda: got.append(next(feed)), daemon=True)
    reader.start()
    ids = _episode(url, carol, 2, 0.75)
    reader.join(timeout=30)
    assert got and got[0]["rollout_id"] == ids[-1] and got[0]["reward"] == 0.75
    feed.close()


def test_bad_feed_requests_are_refused_with_a_code(served: Any) -> None:
    url, settings, _admin = served
    dave = issue_user_key(settings, "feed-dave")
    _episode(url, dave, 1, 0.0)
    feed = tokentrail.rollouts(url, dave, follow=False)
    next(feed)
    cursor = feed.cursor
    feed.close()
    assert cursor is not None
    raw = bytearray(base64.urlsafe_b64decode(cursor[4:] + "=" * (-len(cursor[4:]) % 4)))
    raw[7] ^= 1  # another position, same tag
    tampered = "rf1_" + base64.urlsafe_b64encode(bytes(raw)).decode().rstrip("=")
    headers = {"Authorization": f"Bearer {dave}"}
    for bad in (tampered, "rf1_" + "A" * 27, "12", "rf1_!!"):
        resp = httpx.get(f"{url}/v1/rollouts", params={"after": bad, "follow": "false"}, headers=headers)
        assert resp.status_code == 400 and resp.json()["error"]["code"] == "invalid_cursor", (bad, resp.text)
        resp = httpx.get(f"{url}/v1/rollouts", params={"follow": "false"}, headers={**headers, "Last-Event-ID": bad})
        assert resp.status_code == 400 and resp.json()["error"]["code"] == "invalid_cursor", bad
    resp = httpx.get(f"{url}/v1/rollouts", params={"schema": "nope"}, headers=headers)
    assert resp.status_code == 400 and resp.json()["error"]["code"] == "unknown_schema"
    resp = httpx.get(f"{url}/v1/rollouts", params={"user": "someone-else"}, headers=headers)
    assert resp.status_code == 403 and resp.json()["error"]["code"] == "forbidden"
    assert httpx.get(f"{url}/v1/rollouts").status_code == 401
    with pytest.raises(FeedError) as err:
        next(tokentrail.rollouts(url, dave, after=tampered))
    assert err.value.code == "invalid_cursor"


def _lines(path: Path, *, complete: bool = True) -> list[dict[str, Any]]:
    """The file's records; ``complete=False`` while a writer may be mid-line (or a kill left half a line
    that the restarted writer has not cut yet): the unterminated last line is left out."""
    data = path.read_bytes() if path.exists() else b""
    if not complete:
        data = data[: data.rfind(b"\n") + 1]
    assert data.endswith(b"\n") or not data, "the file ends in half a line"
    return [orjson.loads(line) for line in data.splitlines()]


def test_export_follow_killed_and_restarted_writes_every_episode(served: Any, tmp_path: Path) -> None:
    url, settings, _admin = served
    erin = issue_user_key(settings, "feed-erin")
    out, cursor_file = tmp_path / "feed.jsonl", tmp_path / "feed.cursor"
    cmd = [sys.executable, "-m", "tokentrail", "export", "--follow", "--server-url", url, "--api-key", erin,
           "--out", str(out), "--cursor-file", str(cursor_file), "--quiet"]  # fmt: skip
    expected: list[str] = []
    log = tmp_path / "follow.log"
    for round_ in range(4):
        with open(log, "ab") as fh:
            proc = subprocess.Popen(cmd, stdout=fh, stderr=subprocess.STDOUT)
        try:
            for _ in range(2):
                expected.append(_episode(url, erin, 1 + round_ % 3, float(round_))[-1])
            wait_for(lambda: {r["rollout_id"] for r in _lines(out, complete=False)} >= set(expected), 60,
                     f"round {round_} rollouts in {out}: {log.read_text()[-2000:]}")  # fmt: skip
            if round_ < 3:
                with open(out, "ab") as fh:
                    fh.write(b'{"half a line from a killed wri')  # what a kill mid-write leaves
        finally:
            os.kill(proc.pid, signal.SIGKILL if round_ < 3 else signal.SIGINT)
            proc.wait(timeout=30)
    records = _lines(out)
    ids = [r["rollout_id"] for r in records]
    assert set(ids) == set(expected) and len(set(ids)) == len(expected)
    exported = asyncio.run(_export(settings))
    for r in records:
        _same_tokens(r, exported[r["rollout_id"]])
