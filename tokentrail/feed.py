"""Clients of the rollout feed (``GET /v1/rollouts``): a Python iterator and ``tokentrail export --follow``.

Both resume from a cursor and reconnect by themselves, to the next server URL when several are given
(replicas of one deployment accept each other's cursors). Delivery is at least once: a consumer that
dies between receiving a rollout and recording its cursor gets that rollout again, so consumers that
must see each rollout once keep its ``rollout_id``.
"""

from __future__ import annotations

import os
import sys
import time
from collections.abc import Generator, Iterator, Sequence
from pathlib import Path
from typing import Any

import httpx
import orjson

from text_client.sse import parse_sse

_RETRY_FIRST_S = 0.2
_RETRY_MAX_S = 5.0
_READ_TIMEOUT_S = 45.0  # the server pings every 15 s: three missed pings and the connection is dead


class FeedError(RuntimeError):
    """The server refused the feed request (bad cursor, schema, key...): retrying cannot help."""

    def __init__(self, status: int, code: str, message: str) -> None:
        super().__init__(f"{status} {code}: {message}")
        self.status, self.code = status, code


class RolloutFeed(Iterator[dict[str, Any]]):
    """Finished rollouts from ``GET /v1/rollouts``, one dict per rollout: the native rollout, or with
    another ``schema`` ``{"rollout_id", "schema", "records"}``. ``cursor`` is the position after the last
    rollout returned: store it with what you did with the rollout, and pass it as ``after`` to resume.

    ``follow=False`` stops once caught up; otherwise it waits for new episodes, reconnecting (to the next
    of ``urls``) whenever a connection fails or a server goes away."""

    def __init__(
        self,
        urls: str | Sequence[str],
        api_key: str,
        after: str | None = None,
        *,
        schema: str = "tokentrail",
        follow: bool = True,
        model: str | None = None,
        user: str | None = None,
        rated_only: bool = False,
        include_incomplete: bool = False,
        reward_rule: str = "last",
        min_version: int | None = None,
        max_staleness: int | None = None,
        connect_timeout_s: float = 10.0,
    ) -> None:
        self.urls = [urls] if isinstance(urls, str) else list(urls)
        if not self.urls:
            raise ValueError("give at least one server URL")
        self.cursor = after or None
        self.follow = follow
        self.reconnects = 0
        params: dict[str, Any] = {
            "schema": schema,
            "model": model,
            "user": user,
            "rated_only": rated_only,
            "include_incomplete": include_incomplete,
            "reward_rule": reward_rule,
            "min_version": min_version,
            "max_staleness": max_staleness,
            "follow": follow,
        }
        self._params = {k: v for k, v in params.items() if v is not None}
        self._client = httpx.Client(
            headers={"Authorization": f"Bearer {api_key}", "Accept": "text/event-stream"},
            timeout=httpx.Timeout(connect_timeout_s, read=_READ_TIMEOUT_S),
        )
        self._events = self._stream()

    def __next__(self) -> dict[str, Any]:
        return next(self._events)

    def close(self) -> None:
        self._events.close()
        self._client.close()

    def __enter__(self) -> RolloutFeed:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _stream(self) -> Generator[dict[str, Any], None, None]:
        delay, turn = _RETRY_FIRST_S, 0
        while True:
            url = self.urls[turn % len(self.urls)].rstrip("/") + "/v1/rollouts"
            headers = {"Last-Event-ID": self.cursor} if self.cursor else {}
            try:
                with self._client.stream("GET", url, params=self._params, headers=headers) as resp:
                    if resp.status_code != 200:
                        self._refuse(resp)
                    delay = _RETRY_FIRST_S  # connected: the next failure starts backing off afresh
                    for event in parse_sse(resp.iter_lines()):
                        if event.event == "rollout":
                            item: dict[str, Any] = orjson.loads(event.data)
                            self.cursor = event.id or self.cursor
                            yield item
                        elif event.event == "cursor" and event.id:
                            self.cursor = event.id
                if not self.follow:
                    return
            except (httpx.TransportError, _Retry):
                pass
            # the connection failed or the server went away: resume at the cursor, on the next URL
            self.reconnects += 1
            turn += 1
            time.sleep(delay)
            delay = min(delay * 2, _RETRY_MAX_S)

    @staticmethod
    def _refuse(resp: httpx.Response) -> None:
        resp.read()
        if resp.status_code >= 500 or resp.status_code == 429:
            raise _Retry  # an unavailable server or database: come back later
        try:
            err = resp.json().get("error") or {}
        except ValueError:
            err = {}
        raise FeedError(resp.status_code, str(err.get("code") or "error"), str(err.get("message") or resp.text[:500]))


class _Retry(Exception):
    """The server is there but cannot serve now (5xx, 429)."""


def _repair_tail(path: Path) -> None:
    """Cut a last line that a killed writer left half-written, so the file stays valid JSON Lines."""
    if not path.exists() or path.stat().st_size == 0:
        return
    with open(path, "rb+") as fh:
        size = fh.seek(0, os.SEEK_END)
        pos, tail = size, b""
        while pos > 0:
            step = min(1 << 16, pos)
            pos -= step
            fh.seek(pos)
            tail = fh.read(step) + tail
            cut = tail.rfind(b"\n")
            if cut >= 0:
                fh.truncate(pos + cut + 1)
                return
        fh.truncate(0)


def _save_cursor(path: Path, cursor: str) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(cursor + "\n")
    os.replace(tmp, path)  # atomic: a kill leaves the old cursor or the new one


def follow_to_file(
    feed_options: dict[str, Any],
    urls: Sequence[str],
    api_key: str,
    out: Path,
    cursor_file: Path | None,
    *,
    progress: bool = True,
) -> int:
    """Append the feed's rollouts to ``out`` as JSON Lines (each rollout's record(s), as ``tokentrail
    export`` writes them), saving the cursor after each rollout; resume from ``cursor_file``. Runs until
    interrupted (or caught up, with ``follow: False``); returns the number of rollouts written."""
    after = None
    if cursor_file is not None and cursor_file.exists():
        after = cursor_file.read_text().strip() or None
    native = feed_options.get("schema", "tokentrail") == "tokentrail"
    to_stdout = str(out) == "-"
    if not to_stdout:
        _repair_tail(out)
    sink = sys.stdout.buffer if to_stdout else open(out, "ab")  # noqa: SIM115
    written, last_report = 0, time.monotonic()
    feed = RolloutFeed(urls, api_key, after, **feed_options)
    try:
        for item in feed:
            records = [item] if native else item["records"]
            sink.write(b"".join(orjson.dumps(r, option=orjson.OPT_APPEND_NEWLINE) for r in records))
            sink.flush()
            if cursor_file is not None and feed.cursor:
                _save_cursor(cursor_file, feed.cursor)
            written += 1
            if progress and time.monotonic() - last_report >= 5.0:
                last_report = time.monotonic()
                print(f"{written} rollouts, {feed.reconnects} reconnects", file=sys.stderr, flush=True)
    except KeyboardInterrupt:
        pass
    finally:
        feed.close()
        if not to_stdout:
            sink.close()
    return written
