"""End-to-end chat throughput: concurrent chats through HTTP + SSE against a real server and worker.

    python benchmarks/chat_throughput.py [--chats 16] [--turns 3] [--max-new-tokens 64] [--json]

Starts a server (embedded defaults, or --database-url/--redis-url) and one worker with the tiny
model as child processes, runs ``--chats`` conversations at once (each ``--turns`` turns: prompter
message, assistant message, SSE until the final event), and prints streamed tokens per second,
time to first token and per-request latency percentiles. Numbers depend on the machine; the point
is to see the server and SSE path add little to the engine's own speed.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from text_client.sse import SSEEvent
from tokentrail.launcher import free_port, running_stack


async def sse_events(client: httpx.AsyncClient, url: str) -> Any:
    async with client.stream("GET", url, headers={"Accept": "text/event-stream"}) as resp:
        resp.raise_for_status()
        data: list[str] = []
        async for line in resp.aiter_lines():
            if line.startswith("data:"):
                data.append(line[5:].lstrip(" "))
            elif not line and data:
                yield SSEEvent("\n".join(data))
                data = []


async def one_chat(client: httpx.AsyncClient, turns: int, max_new: int, seed: int, out: dict[str, list[float]]) -> int:
    chat_id = (await client.post("/chats", json={})).json()["id"]
    parent = None
    tokens = 0
    for t in range(turns):
        prompt = (
            await client.post(f"/chats/{chat_id}/prompter_message", json={"parent_id": parent, "content": f"turn {t}"})
        ).json()
        start = time.perf_counter()
        reply = (
            await client.post(
                f"/chats/{chat_id}/assistant_message",
                json={
                    "parent_id": prompt["id"],
                    "model_config_name": "tiny",
                    "sampling_parameters": {
                        "max_new_tokens": max_new,
                        "seed": seed * 100 + t,
                        "stop_token_ids": [],
                    },
                },
            )
        ).json()
        first = None
        async for ev in sse_events(client, f"/chats/{chat_id}/messages/{reply['id']}/events"):
            payload = json.loads(ev.data)
            if payload["event_type"] == "token":
                tokens += 1
                if first is None:
                    first = time.perf_counter() - start
            elif payload["event_type"] in ("message", "error"):
                break
        out["ttft"].append(first or 0.0)
        out["latency"].append(time.perf_counter() - start)
        parent = reply["id"]
    return tokens


async def run(url: str, chats: int, turns: int, max_new: int) -> dict[str, Any]:
    limits = httpx.Limits(max_connections=chats * 2 + 4)
    async with httpx.AsyncClient(base_url=url, timeout=httpx.Timeout(30, read=300), limits=limits) as client:
        pair = (await client.get("/auth/callback/debug", params={"code": "bench"})).json()
        client.headers["Authorization"] = f"Bearer {pair['access_token']['access_token']}"
        out: dict[str, list[float]] = {"ttft": [], "latency": []}
        await one_chat(client, 1, 4, 0, {"ttft": [], "latency": []})  # warm-up
        start = time.perf_counter()
        counts = await asyncio.gather(*(one_chat(client, turns, max_new, i, out) for i in range(chats)))
        wall = time.perf_counter() - start

    def pct(xs: list[float], q: float) -> float:
        return sorted(xs)[min(len(xs) - 1, int(q * len(xs)))]

    return {
        "chats": chats,
        "turns": turns,
        "max_new_tokens": max_new,
        "tokens": sum(counts),
        "wall_s": round(wall, 2),
        "tokens_per_s": round(sum(counts) / wall, 1),
        "ttft_p50_ms": round(1000 * statistics.median(out["ttft"]), 1),
        "ttft_p95_ms": round(1000 * pct(out["ttft"], 0.95), 1),
        "latency_p50_ms": round(1000 * statistics.median(out["latency"]), 1),
        "latency_p95_ms": round(1000 * pct(out["latency"], 0.95), 1),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--chats", type=int, default=16)
    ap.add_argument("--turns", type=int, default=3)
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    with (
        tempfile.TemporaryDirectory() as tmp,
        running_stack(Path(tmp), free_port(), "tiny", quiet=True, max_parallel=args.chats) as url,
    ):
        result = asyncio.run(run(url, args.chats, args.turns, args.max_new_tokens))
    if args.json:
        print(json.dumps(result))
    else:
        for k, v in result.items():
            print(f"{k:>16}: {v}")


if __name__ == "__main__":
    main()
