"""Live weight updates end to end: a real server (HTTP, SQL), real hf workers over the websocket, pushes
through ``POST /admin/models/{model}/weights``, and every stored token teacher-forced with transformers
under the checkpoint of the version it records."""

from __future__ import annotations

import contextlib
import json
import shutil
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import torch

from benchmarks.policy_check import TOLERANCE, Scorer, perturbed_checkpoint
from server.admin import issue_user_key
from server.settings import ServerSettings
from tests.stack import MODEL, ServerThread, WorkerThread, start_reply, wait_for, worker_key
from tokentrail.launcher import free_port
from worker.chat_format import ChatFormat
from worker.engines.hf import HFEngine


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory: pytest.TempPathFactory, tiny_model_dir: Path) -> dict[int, Path]:
    root = tmp_path_factory.mktemp("checkpoints")
    return {0: tiny_model_dir, **{v: perturbed_checkpoint(tiny_model_dir, root / f"v{v}", seed=v) for v in (1, 2, 3)}}


@contextlib.contextmanager
def stack(
    data_dir: Path, model_dir: Path, workers: int = 1
) -> Iterator[tuple[str, ServerSettings, list[WorkerThread]]]:
    settings = ServerSettings(data_dir=data_dir, port=free_port())
    server = ServerThread(settings).start()
    fmt = ChatFormat.load(str(model_dir))
    threads = [
        WorkerThread(server.url, worker_key(settings), MODEL, fmt, lambda: HFEngine(str(model_dir), max_batch_size=8))
        for _ in range(workers)
    ]
    try:
        for w in threads:
            w.start()
        yield server.url, settings, threads
    finally:
        for w in threads:
            w.stop()
        server.stop()


def _message(url: str, headers: dict[str, str], chat: str, mid: str, timeout_s: float = 120) -> dict[str, Any]:
    def done() -> bool:
        r = httpx.get(f"{url}/chats/{chat}/messages/{mid}", headers=headers)
        return r.json()["state"] in ("complete", "aborted_by_worker", "cancelled")

    wait_for(done, timeout_s, f"message {mid}")
    return httpx.get(f"{url}/chats/{chat}/messages/{mid}", params={"include": "tokens"}, headers=headers).json()


def _reply(url: str, headers: dict[str, str], tokens: int) -> tuple[str, str]:
    return start_reply(url, headers, MODEL, tokens)


def _push(url: str, admin: dict[str, str], path: Path, version: int, mode: str = "drain") -> httpx.Response:
    body = {"path": str(path), "version": version, "mode": mode}
    return httpx.post(f"{url}/admin/models/{MODEL}/weights", json=body, headers=admin, timeout=120)


def _first_token(url: str, headers: dict[str, str], chat: str, mid: str) -> None:
    """Wait until the message has streamed a token (it is running in the engine)."""
    with httpx.stream("GET", f"{url}/chats/{chat}/messages/{mid}/events", headers=headers, timeout=60) as resp:
        for line in resp.iter_lines():
            if line.startswith("data:") and json.loads(line[5:]).get("event_type") == "token":
                return


def test_drain_push_then_inflight_push(tmp_path: Path, checkpoints: dict[int, Path]) -> None:
    scorer = Scorer(checkpoints)
    with stack(tmp_path, checkpoints[0]) as (url, settings, _):
        admin = {"Authorization": f"Bearer {issue_user_key(settings, 'trainer', admin=True)}"}
        user = {"Authorization": f"Bearer {issue_user_key(settings, 'player')}"}

        # drain: replies running at the push finish on version 0; one asked meanwhile runs on 1
        running = [_reply(url, user, 120) for _ in range(3)]
        for reply in running:  # each must be in the engine, not queued, when the push begins
            _first_token(url, user, *reply)
        answer: dict[str, Any] = {}
        pusher = threading.Thread(target=lambda: answer.update(r=_push(url, admin, checkpoints[1], 1)))
        pusher.start()
        time.sleep(0.2)
        waiting = _reply(url, user, 8)
        pusher.join(timeout=120)
        resp = answer["r"]
        assert resp.status_code == 200, resp.text
        body = resp.json()
        assert body["model"] == MODEL and body["version"] == 1 and body["mode"] == "drain"
        assert [w["version"] for w in body["workers"]] == [1]
        for chat, mid in running:
            msg = _message(url, user, chat, mid)
            assert msg["policy_versions"] == [[0, 0]]
            assert scorer.max_delta(msg) < TOLERANCE
        msg = _message(url, user, *waiting)
        assert msg["policy_versions"] == [[0, 1]]
        assert scorer.max_delta(msg) < TOLERANCE

        # the version shows everywhere
        configs = httpx.get(f"{url}/configs/model_configs").json()
        assert [m["policy_version"] for m in configs if m["name"] == MODEL] == [1]
        models = httpx.get(f"{url}/v1/models", headers=user).json()["data"]
        assert [m["policy_version"] for m in models if m["id"] == MODEL] == [1]
        workers = httpx.get(f"{url}/admin/workers", headers=admin).json()
        assert [w["policy_version"] for w in workers] == [1]
        history = httpx.get(f"{url}/admin/models/{MODEL}/weights", headers=admin).json()
        assert [(h["version"], h["path"], h["mode"]) for h in history] == [(1, str(checkpoints[1]), "drain")]
        assert "tokentrail_policy_version" in httpx.get(f"{url}/metrics").text

        # inflight: a long reply switches between two steps and goes on under version 2
        chat, mid = _reply(url, user, 200)
        _first_token(url, user, chat, mid)
        resp = _push(url, admin, checkpoints[2], 2, mode="inflight")
        assert resp.status_code == 200, resp.text
        msg = _message(url, user, chat, mid)
        spans = msg["policy_versions"]
        assert [v for _, v in spans] == [1, 2], spans
        assert 0 < spans[1][0] < len(msg["completion_token_ids"])
        assert scorer.max_delta(msg) < TOLERANCE  # no stale KV: each span scores under its own weights


def test_bad_pushes_change_nothing(tmp_path: Path, checkpoints: dict[int, Path], tiny_model_dir: Path) -> None:
    scorer = Scorer(checkpoints)
    with stack(tmp_path, checkpoints[0]) as (url, settings, _):
        admin = {"Authorization": f"Bearer {issue_user_key(settings, 'trainer', admin=True)}"}
        user = {"Authorization": f"Bearer {issue_user_key(settings, 'player')}"}
        assert _push(url, admin, checkpoints[1], 1).status_code == 200

        pickles = tmp_path / "pickles"
        pickles.mkdir()
        shutil.copy(tiny_model_dir / "config.json", pickles / "config.json")
        (pickles / "pytorch_model.bin").write_bytes(b"not to be unpickled")
        other = tmp_path / "other-shape"
        other.mkdir()
        shutil.copy(tiny_model_dir / "config.json", other / "config.json")
        from safetensors.torch import save_file

        save_file({"model.embed_tokens.weight": torch.zeros(3, 3)}, str(other / "model.safetensors"))

        cases = [
            (_push(url, admin, checkpoints[2], 1), 409, "version_not_newer"),
            (_push(url, admin, tmp_path / "missing", 2), 422, "weights_not_found"),
            (_push(url, admin, pickles, 2), 422, "weights_not_safetensors"),
            (_push(url, admin, other, 2), 422, "weights_mismatch"),
            (_push(url, user, checkpoints[2], 2), 403, "forbidden"),
            (
                httpx.post(
                    f"{url}/admin/models/no-such-model/weights",
                    json={"path": str(checkpoints[2]), "version": 2},
                    headers=admin,
                ),
                404,
                "model_not_found",
            ),
            (
                httpx.post(
                    f"{url}/admin/models/{MODEL}/weights",
                    json={"path": str(checkpoints[2]), "version": 0},
                    headers=admin,
                ),
                422,
                "validation_error",
            ),
        ]
        for resp, status, code in cases:
            assert (resp.status_code, resp.json().get("code")) == (status, code), resp.text
        assert "unpickled" not in str(cases[2][0].json())  # the file was named, never read

        # still version 1 everywhere, and its tokens verify under version 1's weights
        workers = httpx.get(f"{url}/admin/workers", headers=admin).json()
        assert [w["policy_version"] for w in workers] == [1]
        history = httpx.get(f"{url}/admin/models/{MODEL}/weights", headers=admin).json()
        assert [h["version"] for h in history] == [1]
        msg = _message(url, user, *_reply(url, user, 16))
        assert msg["policy_versions"] == [[0, 1]]
        assert scorer.max_delta(msg) < TOLERANCE


def test_a_new_worker_loads_the_current_version_before_it_works(tmp_path: Path, checkpoints: dict[int, Path]) -> None:
    scorer = Scorer(checkpoints)
    with stack(tmp_path, checkpoints[0]) as (url, settings, workers):
        admin = {"Authorization": f"Bearer {issue_user_key(settings, 'trainer', admin=True)}"}
        user = {"Authorization": f"Bearer {issue_user_key(settings, 'player')}"}
        assert _push(url, admin, checkpoints[3], 3).status_code == 200
        workers[0].stop()  # a restarted worker starts from its model directory: version 0
        fmt = ChatFormat.load(str(checkpoints[0]))
        fresh = WorkerThread(
            url, worker_key(settings), MODEL, fmt, lambda: HFEngine(str(checkpoints[0]), max_batch_size=8)
        ).start()
        try:
            msg = _message(url, user, *_reply(url, user, 16))
            assert msg["policy_versions"] == [[0, 3]]
            assert scorer.max_delta(msg) < TOLERANCE
            rows = httpx.get(f"{url}/admin/workers", headers=admin).json()
            assert [(w["policy_version"], w["weights_error"]) for w in rows] == [(3, "")]
        finally:
            fresh.stop()


class LoadFailsEngine(HFEngine):
    """Fake at the engine boundary: an hf engine whose weights loads fail after the checks passed (a
    disk that went away, memory that ran out), to see the fleet route around it."""

    async def update_weights(self, path: str, version: int, mode: Any) -> None:
        from worker.engines.contract import EngineError

        raise EngineError("weights_load_failed", "fake: the load failed")


def test_a_worker_that_cannot_load_takes_no_work(tmp_path: Path, checkpoints: dict[int, Path]) -> None:
    scorer = Scorer(checkpoints)
    settings = ServerSettings(data_dir=tmp_path, port=free_port())
    server = ServerThread(settings).start()
    fmt = ChatFormat.load(str(checkpoints[0]))
    good = WorkerThread(
        server.url, worker_key(settings), MODEL, fmt, lambda: HFEngine(str(checkpoints[0]), max_batch_size=8)
    )
    bad = WorkerThread(
        server.url, worker_key(settings), MODEL, fmt, lambda: LoadFailsEngine(str(checkpoints[0]), max_batch_size=8)
    )
    try:
        good.start()
        bad.start()
        url = server.url
        admin = {"Authorization": f"Bearer {issue_user_key(settings, 'trainer', admin=True)}"}
        user = {"Authorization": f"Bearer {issue_user_key(settings, 'player')}"}
        wait_for(lambda: len(httpx.get(f"{url}/admin/workers", headers=admin).json()) == 2, 30, "two workers")
        resp = _push(url, admin, checkpoints[1], 1)
        assert (resp.status_code, resp.json()["code"]) == (502, "weights_load_failed"), resp.text
        assert "fake: the load failed" in resp.json()["detail"]
        rows = {
            w["policy_version"]: w["weights_error"] for w in httpx.get(f"{url}/admin/workers", headers=admin).json()
        }
        assert rows[1] == "" and "fake: the load failed" in rows[0]
        # every reply from now on comes from the worker that serves version 1
        replies = [_reply(url, user, 8) for _ in range(6)]
        for chat, mid in replies:
            msg = _message(url, user, chat, mid)
            assert msg["policy_versions"] == [[0, 1]]
            assert scorer.max_delta(msg) < TOLERANCE
    finally:
        bad.stop()
        good.stop()
        server.stop()
