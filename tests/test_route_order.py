"""The app matches routes in order, and each of FastAPI's included routers it passes over costs 15-30 us
(``server/app.py``): the hot routes must come before the rarely called ones."""

from __future__ import annotations

from pathlib import Path

import pytest
from starlette.routing import Match, Route

from server.app import create_app
from server.settings import ServerSettings


@pytest.mark.parametrize(
    ("method", "path", "passed_over"),
    [
        ("POST", "/v1/chat/completions", 0),  # RL and agent clients: every turn
        ("POST", "/v1/completions", 1),
        ("GET", "/chats/c1/messages/m1/events", 4),  # OA's stream, after the four OpenAI-style routers
    ],
)
def test_hot_routes_are_matched_before_the_rare_ones(tmp_path: Path, method: str, path: str, passed_over: int) -> None:
    app = create_app(ServerSettings(data_dir=tmp_path))
    scope = {"type": "http", "method": method, "path": path, "root_path": "", "headers": [], "query_string": b""}
    routers_before = 0
    for route in app.router.routes:
        match, _ = route.matches(scope)
        if match == Match.FULL:
            break
        if not isinstance(route, Route):  # the docs' plain routes are a regex each; routers cost more
            routers_before += 1
    else:
        pytest.fail(f"no route matches {method} {path}")
    assert routers_before == passed_over
