"""The front doors the benchmark drives over HTTP, and the measured runs over them.

- ``oa``: tokentrail's OA chat API, as its web chat uses it: a prompter message, an assistant message,
  then the message's SSE events until the final one. Single-turn conversations reuse one chat per
  client (root messages); an agent conversation is a chat with the system prompt, each turn's prompter
  message under the previous assistant message.
- ``openai``: streamed ``POST /v1/chat/completions`` (tokentrail with a user API key, or ``vllm serve``)
  with ``stream_options.include_usage``, read until ``[DONE]``; tokens are counted by the chunks'
  ``token_ids`` (tokentrail always sends them, vLLM with ``return_token_ids``), prompt and cached
  tokens come from the final usage chunk.

TTFT is from the turn's first request (the OA flow's prompter message) to its first token.
"""

from __future__ import annotations

import asyncio
import itertools
import json
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import httpx

from benchmarks.pipeline.conversation import MODEL, Dialogue, Workload, closed_loop
from benchmarks.pipeline.measure import Arrivals, CpuMeter, Point, Window, summary
from benchmarks.progress import say

Turn = Callable[[Point, Window, Workload, Dialogue, int], Awaitable[None]]
WARMUP_TURNS = 2


class HttpError(RuntimeError):
    pass


async def _raise_for_status(resp: httpx.Response) -> None:
    if resp.status_code >= 400:
        await resp.aread()
        raise HttpError(f"HTTP {resp.status_code} {resp.request.method} {resp.request.url.path}: {resp.text[:200]}")


class OAFlow:
    """tokentrail's OA chat API; ``readers`` SSE readers follow each message (``--ceiling``)."""

    def __init__(self, client: httpx.AsyncClient, readers: int = 1) -> None:
        self.client = client
        self.readers = readers
        self.slot_chats: dict[int, str] = {}
        self.seeds = itertools.count()

    async def _post(self, path: str, body: dict[str, Any]) -> dict[str, Any]:
        resp = await self.client.post(path, json=body)
        await _raise_for_status(resp)
        return dict(resp.json())

    async def turn(self, point: Point, window: Window, workload: Workload, d: Dialogue, slot: int) -> None:
        if workload.kind == "single":
            if slot not in self.slot_chats:
                self.slot_chats[slot] = (await self._post("/chats", {}))["id"]
            chat, parent = self.slot_chats[slot], None
        else:
            if "chat" not in d.state:
                d.state["chat"] = (await self._post("/chats", {"system_prompt": d.system}))["id"]
            chat, parent = d.state["chat"], d.state.get("parent")
        index, text = d.start_turn()
        arrivals = Arrivals(point, window, index)
        prompt = await self._post(f"/chats/{chat}/prompter_message", {"parent_id": parent, "content": text})
        sampling: dict[str, Any] = {"max_new_tokens": workload.tokens, "temperature": 1.0}
        if workload.ignore_eos:
            sampling["ignore_eos"] = True
        if workload.seed_requests:
            sampling["seed"] = next(self.seeds)
        body = {"parent_id": prompt["id"], "model_config_name": MODEL, "sampling_parameters": sampling}
        reply = await self._post(f"/chats/{chat}/assistant_message", body)
        path = f"/chats/{chat}/messages/{reply['id']}/events"
        final: dict[str, Any] = {}

        async def read(k: int) -> None:
            mine = Arrivals(point, window, index)
            mine.sent = mine.last = arrivals.sent
            counting = k == 0 or self.readers > 1  # every reader's events count when fanning out
            async for ev in sse(self.client, path):
                kind = ev.get("event_type")
                if kind == "token":
                    mine.tokens(1 if counting else 0)
                elif kind == "error":
                    raise RuntimeError(f"generation failed: {ev.get('code')}: {ev.get('error') or ev.get('message')}")
                elif kind == "message":
                    if k == 0:
                        final.update(ev.get("message") or {})
                        mine.done()
                    return
            raise RuntimeError("the event stream ended without its final message")

        for result in await _gather(read(k) for k in range(self.readers)):
            if isinstance(result, BaseException):
                raise result
        if window.open:
            point.requests += 1
            point.usage(index, final.get("prompt_token_count"), final.get("num_cached_tokens"))
        d.state["parent"] = reply["id"]
        d.finish_turn({"role": "assistant", "content": final.get("content") or ""})


async def _gather(coros: Any) -> list[Any]:
    return list(await asyncio.gather(*coros, return_exceptions=True))


async def sse(client: httpx.AsyncClient, path: str) -> AsyncIterator[dict[str, Any]]:
    async with client.stream("GET", path, headers={"Accept": "text/event-stream"}) as resp:
        await _raise_for_status(resp)
        async for line in resp.aiter_lines():
            if line.startswith("data:"):
                yield json.loads(line[5:])


class OpenAIChat:
    """Streamed ``/v1/chat/completions``; ``extra`` is added to every body (vLLM: ``return_token_ids``)."""

    def __init__(self, client: httpx.AsyncClient, extra: dict[str, Any] | None = None) -> None:
        self.client = client
        self.extra = extra or {}
        self.seeds = itertools.count()

    def body(self, workload: Workload, messages: list[dict[str, Any]]) -> dict[str, Any]:
        body: dict[str, Any] = {
            "model": MODEL,
            "messages": messages,
            "stream": True,
            "stream_options": {"include_usage": True},
            "max_tokens": workload.tokens,
            "temperature": 1.0,
            **self.extra,
        }
        if workload.ignore_eos:
            body["ignore_eos"] = True
        if workload.seed_requests:
            body["seed"] = next(self.seeds)
        return body

    async def turn(self, point: Point, window: Window, workload: Workload, d: Dialogue, slot: int) -> None:
        index, _ = d.start_turn()
        body = self.body(workload, d.messages)
        arrivals = Arrivals(point, window, index)
        content: list[str] = []
        calls: dict[int, dict[str, Any]] = {}
        usage: dict[str, Any] | None = None
        info: dict[str, Any] | None = None
        done = False
        async with self.client.stream("POST", "/v1/chat/completions", json=body) as resp:
            await _raise_for_status(resp)
            async for line in resp.aiter_lines():
                if not line.startswith("data:"):
                    continue
                data = line[5:].strip()
                if data == "[DONE]":
                    done = True
                    arrivals.done()
                    break
                chunk = json.loads(data)
                if "error" in chunk:
                    err = chunk["error"]
                    raise RuntimeError(f"{err.get('code')}: {err.get('message')}")
                for choice in chunk.get("choices") or []:
                    arrivals.tokens(len(choice.get("token_ids") or []))
                    delta = choice.get("delta") or {}
                    content.append(delta.get("content") or "")
                    for call in delta.get("tool_calls") or []:
                        _merge_call(calls, call)
                usage = chunk.get("usage") or usage
                info = chunk.get("tokentrail") or info
        if not done:
            raise RuntimeError("the stream ended without [DONE]")
        if window.open:
            point.requests += 1
            if usage is not None:
                details = usage.get("prompt_tokens_details") or {}
                point.usage(index, usage.get("prompt_tokens"), details.get("cached_tokens"))
            if info is not None and "prompt_method" in info:  # tokentrail: how it built the prompt
                point.count(window, f"prompt_method:{info.get('prompt_method')}")
                point.count(window, f"forked:{bool(info.get('forked'))}")
        echo: dict[str, Any] = {"role": "assistant", "content": "".join(content)}
        if calls:
            echo["tool_calls"] = [calls[k] for k in sorted(calls)]
        d.finish_turn(echo)


def _merge_call(calls: dict[int, dict[str, Any]], delta: dict[str, Any]) -> None:
    """Tool-call deltas as an OpenAI client accumulates them (by index; arguments concatenated)."""
    call = calls.setdefault(int(delta.get("index", len(calls))), {"type": "function", "function": {}})
    for key in ("id", "type"):
        if delta.get(key):
            call[key] = delta[key]
    fn = delta.get("function") or {}
    if fn.get("name"):
        call["function"]["name"] = fn["name"]
    if fn.get("arguments"):
        call["function"]["arguments"] = call["function"].get("arguments", "") + fn["arguments"]


async def measure(
    arm: str,
    api: str,
    turn: Turn,
    meter: CpuMeter,
    workloads: list[Workload],
    levels: list[int],
    duration: float,
) -> list[Point]:
    """Every workload at every concurrency through one front door of one running arm: a short warm-up,
    then a measured window per level."""
    points = []
    for workload in workloads:

        def bound(point: Point, window: Window, w: Workload = workload) -> Callable[[Dialogue, int], Awaitable[None]]:
            return lambda d, slot: turn(point, window, w, d, slot)

        # warm-up: the highest concurrency, about two turns per client (connections, batch shapes, stitching)
        top = max(levels)
        warm, forever = _point(arm, api, workload, top), Window(1e9)
        turns = WARMUP_TURNS * top
        await closed_loop(warm, forever, top, workload, bound(warm, forever), key=f"warm-{api}", max_turns=turns)
        if warm.errors:
            say(f"  {arm}/{api} warm-up failed: {warm.error_samples[0]}")
        for c in levels:
            point = _point(arm, api, workload, c)
            window = Window(duration)
            meter.label = f"{point.name.replace('/', '-')}-{workload.kind}-{workload.stop}-c{c}"
            await closed_loop(point, window, c, workload, bound(point, window), key=api, meter=meter)
            points.append(point)
            s = summary(point)
            say(
                f"  {point.name} {workload.kind} {workload.stop} c={c}: {s['tokens_per_s']} tok/s, "
                f"{s['requests']} turns, {s['errors']} errors, TTFT p50 {s['ttft_p50_ms']} ms"
            )
    return points


def _point(arm: str, api: str, workload: Workload, c: int) -> Point:
    return Point(arm, api, workload.kind, workload.stop, c, turns=workload.turns_per_conversation)


def _client(url: str, levels: list[int], readers: int = 1) -> httpx.AsyncClient:
    limits = httpx.Limits(max_connections=max(levels) * (readers + 2) + 8, max_keepalive_connections=None)
    return httpx.AsyncClient(base_url=url, timeout=httpx.Timeout(60, read=600), limits=limits)


async def drive_tokentrail(
    arm: str,
    url: str,
    user_key: str,
    meter: CpuMeter,
    apis: list[str],
    workloads: list[Workload],
    levels: list[int],
    duration: float,
    readers: int = 1,
) -> list[Point]:
    """One tokentrail stack through each of ``apis``."""
    points: list[Point] = []
    for api in apis:
        async with _client(url, levels, readers) as client:
            door: OAFlow | OpenAIChat
            if api == "oa":
                pair = (await client.get("/auth/callback/debug", params={"code": "bench"})).json()
                client.headers["Authorization"] = f"Bearer {pair['access_token']['access_token']}"
                door = OAFlow(client, readers)
            else:
                client.headers["Authorization"] = f"Bearer {user_key}"
                door = OpenAIChat(client)
            points += await measure(arm, api, door.turn, meter, workloads, levels, duration)
    return points


async def drive_vllm_serve(
    url: str, meter: CpuMeter, workloads: list[Workload], levels: list[int], duration: float
) -> list[Point]:
    """``vllm serve`` through its OpenAI route, with the same bodies plus ``return_token_ids``."""
    async with _client(url, levels) as client:
        door = OpenAIChat(client, {"return_token_ids": True})
        return await measure("vllm-serve", "openai", door.turn, meter, workloads, levels, duration)
