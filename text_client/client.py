"""A synchronous client of the chat API: debug or API-key login, chats, messages, SSE events."""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from typing import Any

import httpx

from text_client.sse import parse_sse


class ApiError(Exception):
    def __init__(self, status: int, code: str | None, detail: object) -> None:
        super().__init__(f"HTTP {status} {code or ''}: {detail}")
        self.status, self.code, self.detail = status, code, detail


class ChatClient:
    def __init__(self, server_url: str, *, timeout: float = 30.0) -> None:
        self.http = httpx.Client(base_url=server_url.rstrip("/"), timeout=timeout, follow_redirects=True)

    def close(self) -> None:
        self.http.close()

    def _check(self, resp: httpx.Response) -> Any:
        if resp.status_code >= 400:
            try:
                body = resp.json()
            except ValueError:
                body = {"detail": resp.text}
            raise ApiError(resp.status_code, body.get("code"), body.get("detail"))
        return resp.json() if resp.content else None

    # ---- auth --------------------------------------------------------------------------------
    def login_debug(self, username: str) -> None:
        pair = self._check(self.http.get("/auth/login/debug", params={"username": username}))
        self.http.headers["Authorization"] = f"Bearer {pair['access_token']['access_token']}"

    def use_api_key(self, key: str) -> None:
        self.http.headers["Authorization"] = f"Bearer {key}"

    # ---- chat API ----------------------------------------------------------------------------
    def models(self) -> list[dict[str, Any]]:
        result: list[dict[str, Any]] = self._check(self.http.get("/configs/model_configs"))
        return result

    def create_chat(self, system_prompt: str | None = None) -> dict[str, Any]:
        body = {"system_prompt": system_prompt} if system_prompt else {}
        result: dict[str, Any] = self._check(self.http.post("/chats", json=body))
        return result

    def chats(self, limit: int = 50) -> list[dict[str, Any]]:
        result: list[dict[str, Any]] = self._check(self.http.get("/chats", params={"limit": limit}))["chats"]
        return result

    def chat(self, chat_id: str) -> dict[str, Any]:
        result: dict[str, Any] = self._check(self.http.get(f"/chats/{chat_id}"))
        return result

    def update_chat(self, chat_id: str, **fields: Any) -> dict[str, Any]:
        result: dict[str, Any] = self._check(self.http.put(f"/chats/{chat_id}", json=fields))
        return result

    def vote(self, chat_id: str, message_id: str, score: int) -> None:
        self._check(self.http.post(f"/chats/{chat_id}/messages/{message_id}/votes", json={"score": score}))

    def prompter_message(self, chat_id: str, parent_id: str | None, content: str) -> dict[str, Any]:
        body = {"parent_id": parent_id, "content": content}
        result: dict[str, Any] = self._check(self.http.post(f"/chats/{chat_id}/prompter_message", json=body))
        return result

    def assistant_message(
        self, chat_id: str, parent_id: str, model: str, sampling: dict[str, Any] | None = None
    ) -> dict[str, Any]:
        body = {"parent_id": parent_id, "model_config_name": model, "sampling_parameters": sampling or {}}
        result: dict[str, Any] = self._check(self.http.post(f"/chats/{chat_id}/assistant_message", json=body))
        return result

    def cancel(self, chat_id: str, message_id: str) -> dict[str, Any]:
        result: dict[str, Any] = self._check(self.http.post(f"/chats/{chat_id}/messages/{message_id}/cancel"))
        return result

    def message(self, chat_id: str, message_id: str, *, tokens: bool = False) -> dict[str, Any]:
        params = {"include": "tokens"} if tokens else None
        result: dict[str, Any] = self._check(self.http.get(f"/chats/{chat_id}/messages/{message_id}", params=params))
        return result

    def events(self, chat_id: str, message_id: str, last_event_id: int | None = None) -> Iterator[dict[str, Any]]:
        """Yield the message's event payloads (dicts with ``event_type``) until it finishes."""
        headers = {"Accept": "text/event-stream"}
        if last_event_id is not None:
            headers["Last-Event-ID"] = str(last_event_id)
        url = f"/chats/{chat_id}/messages/{message_id}/events"
        with self.http.stream("GET", url, headers=headers, timeout=httpx.Timeout(30.0, read=None)) as resp:
            if resp.status_code >= 400:
                resp.read()
                self._check(resp)
            for ev in parse_sse(resp.iter_lines()):
                payload: dict[str, Any] = json.loads(ev.data)
                yield payload
                if payload.get("event_type") in ("message", "error"):
                    return

    def follow(self, chat_id: str, message_id: str, *, retries: int = 30) -> Iterator[dict[str, Any]]:
        """Like ``events``, but a dropped connection (a restarting server, a network blip) is
        resumed with Last-Event-ID, so each token is yielded once; ``reset`` events are passed on."""
        last: int | None = None
        failures = 0
        while True:
            try:
                for event in self.events(chat_id, message_id, last):
                    failures = 0
                    kind = event.get("event_type")
                    if kind == "token":
                        last = max(last if last is not None else -1, int(event["index"]))
                    elif kind == "reset":
                        start = int(event["from_index"])
                        last = start - 1 if start > 0 else None
                    yield event
                    if kind in ("message", "error"):
                        return
            except (httpx.TransportError, httpx.RemoteProtocolError):
                pass
            except ApiError as exc:
                if exc.status < 500:
                    raise
            failures += 1
            if failures > retries:
                raise ApiError(503, "not_ready", "the event stream kept failing")
            time.sleep(min(0.5 * failures, 3.0))
