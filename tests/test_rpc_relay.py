"""Tokenizer calls relayed between server processes through Redis (real Redis, two relays)."""

from __future__ import annotations

import asyncio
import secrets
from typing import Any

import pytest
from redis.asyncio import Redis

from server.workers.relay import RedisRpcRelay, RelayError, RelayTimeout

pytestmark = [pytest.mark.redis]


async def test_relay_answers_errors_and_waits_past_the_socket_timeout(redis_url: str) -> None:
    async def handler(model: str, method: str, params: dict[str, Any]) -> dict[str, Any]:
        if method == "slow":
            await asyncio.sleep(params["s"])
        if method == "fail":
            raise RelayError("bad_request", "no such thing")
        return {"model": model, "echo": params}

    # a short socket timeout: a blocking wait longer than it must be split, not fail
    async with Redis.from_url(redis_url, socket_timeout=2) as one, Redis.from_url(redis_url, socket_timeout=2) as two:
        here, there = RedisRpcRelay(one, secrets.token_hex(4)), RedisRpcRelay(two, secrets.token_hex(4))
        there.start(handler)
        try:
            print("A", flush=True)
            assert await here.request(there.server_id, "m", "echo", {"x": 1}, 10) == {"model": "m", "echo": {"x": 1}}
            print("B", flush=True)
            with pytest.raises(RelayError) as err:
                await here.request(there.server_id, "m", "fail", {}, 10)
            assert err.value.code == "bad_request"
            slow = await here.request(there.server_id, "m", "slow", {"s": 3.5}, 10)
            assert slow["echo"] == {"s": 3.5}
            with pytest.raises(RelayTimeout):
                await here.request(there.server_id, "m", "slow", {"s": 3}, 1)
            with pytest.raises(RelayTimeout):  # nobody serves this process id
                await here.request("gone", "m", "echo", {}, 1)
        finally:
            await there.stop()
            await here.stop()
