"""Cache-aware routing across workers (issue 26): agent loops through ``/v1/chat/completions`` with
several workers of one model, routing on and off.

    python benchmarks/routing.py [--engine vllm|hf] [--workers 2,4] [--routing on,off] [--concurrency 16]
        [--turns 8] [--tokens 48] [--duration 30] [--capacity K] [--route-wait 0.5] [--block-size 128]
        [--json]

For each worker count, one server process (embedded defaults) and that many worker processes of the
trained tiny chatml model; for each routing mode the server is restarted with ``TOKENTRAIL_ROUTING`` on
or off (the workers reconnect; conversations are new in every mode, so no mode finds the other's cache).
``--concurrency`` clients run closed-loop conversations of ``--turns`` turns (a system prompt, ~20-word
user turns, each turn echoing the history as received, replies of at most ``--tokens`` tokens, natural
stops, temperature 1) for a warm-up and then ``--duration`` seconds. Each worker takes ``--capacity``
messages at once (default: 1.5 x concurrency / workers, rounded up).

Printed per worker count and mode: tokens/s delivered, turns, errors, TTFT p50/p99 by turn; the
prefix-cache hit rate of turns 2..N: cached ÷ prompt tokens (``usage.prompt_tokens_details``), and cached
÷ cacheable tokens, where a turn's cacheable tokens are what the engine that served the conversation's
previous turn had computed of this prompt (that turn's prompt and completion, less the last sampled
token, whose KV is never computed), rounded down to whole KV blocks of ``--block-size`` tokens (vLLM on
CPU caches 128-token blocks; only whole blocks hit); the share of turns served by each worker; and the
server's routing outcomes (``tokentrail_routing_dispatches``: preferred, handed_over, unrouted).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import functools
import json
import math
import re
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import httpx

from benchmarks.models import prepare_model, vllm_python
from benchmarks.pipeline.conversation import MODEL, Dialogue, Workload, closed_loop
from benchmarks.pipeline.measure import Point, Window, ms, pct
from benchmarks.pipeline.stack import MAX_MODEL_LEN, VLLM_ENV
from benchmarks.progress import say
from tokentrail.launcher import answers, free_port, spawn, stop, wait_ready

WARMUP_TURNS = 2  # per client, before the measured window


@dataclass
class Turn:
    index: int  # 1-based
    prompt: int
    completion: int
    cached: int
    cacheable: int | None  # None on a conversation's first turn
    worker: str
    ttft_s: float


@dataclass
class Arm:
    workers: int
    routing: str
    concurrency: int
    turns: list[Turn] = field(default_factory=list)
    tokens: int = 0
    errors: list[str] = field(default_factory=list)
    wall_s: float = 0.0
    outcomes: dict[str, float] = field(default_factory=dict)

    def summary(self, turns_per_conversation: int) -> dict[str, Any]:
        later = [t for t in self.turns if t.index > 1]
        prompt = sum(t.prompt for t in later)
        cached = sum(t.cached for t in later)
        cacheable = sum(t.cacheable or 0 for t in later)
        by_worker = Counter(t.worker for t in self.turns)
        by_turn = [[t.ttft_s for t in self.turns if t.index == k] for k in range(1, turns_per_conversation + 1)]
        return {
            "workers": self.workers,
            "routing": self.routing,
            "concurrency": self.concurrency,
            "tokens_per_s": round(self.tokens / self.wall_s, 1) if self.wall_s else 0.0,
            "turns": len(self.turns),
            "errors": len(self.errors),
            "error_samples": self.errors[:3],
            "hit_rate_of_prompt": round(cached / prompt, 3) if prompt else None,
            "hit_rate_of_cacheable": round(cached / cacheable, 3) if cacheable else None,
            "later_turn_tokens": {"prompt": prompt, "cacheable": cacheable, "cached": cached},
            "ttft_p50_ms": ms(pct([t.ttft_s for t in self.turns], 0.5)),
            "ttft_p99_ms": ms(pct([t.ttft_s for t in self.turns], 0.99)),
            "ttft_p50_ms_by_turn": [ms(pct(xs, 0.5)) for xs in by_turn],
            "ttft_p99_ms_by_turn": [ms(pct(xs, 0.99)) for xs in by_turn],
            "worker_share": sorted((round(n / len(self.turns), 3) for n in by_worker.values()), reverse=True)
            if self.turns
            else [],
            "routing_outcomes": self.outcomes,
        }


class Client:
    """Streamed chat completions; records each turn's usage, serving worker and cacheable prefix."""

    def __init__(self, http: httpx.AsyncClient, arm: Arm, block: int) -> None:
        self.http = http
        self.arm = arm
        self.block = block

    async def turn(self, window: Window, workload: Workload, d: Dialogue) -> None:
        index, _ = d.start_turn()
        body = {
            "model": MODEL,
            "messages": d.messages,
            "stream": True,
            "stream_options": {"include_usage": True},
            "max_tokens": workload.tokens,
            "temperature": 1.0,
        }
        sent = time.perf_counter()
        first: float | None = None
        content: list[str] = []
        usage: dict[str, Any] = {}
        info: dict[str, Any] = {}
        tokens = 0
        async with self.http.stream("POST", "/v1/chat/completions", json=body) as resp:
            if resp.status_code != 200:
                raise RuntimeError(f"HTTP {resp.status_code}: {(await resp.aread())[:300]!r}")
            async for line in resp.aiter_lines():
                if not line.startswith("data:"):
                    continue
                data = line[5:].strip()
                if data == "[DONE]":
                    break
                chunk = json.loads(data)
                if "error" in chunk:
                    raise RuntimeError(f"{chunk['error'].get('code')}: {chunk['error'].get('message')}")
                for choice in chunk.get("choices") or []:
                    n = len(choice.get("token_ids") or [])
                    if n and first is None:
                        first = time.perf_counter()
                    tokens += n
                    content.append((choice.get("delta") or {}).get("content") or "")
                usage = chunk.get("usage") or usage
                info = chunk.get("tokentrail") or info
        prompt, completion = int(usage.get("prompt_tokens", 0)), int(usage.get("completion_tokens", 0))
        cached = int((usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0)
        computed = d.state.get("computed")  # the previous turn's prompt + completion, less its last token
        cacheable = None if computed is None else min(computed, prompt - 1) // self.block * self.block
        d.state["computed"] = prompt + completion - 1
        if window.open:
            self.arm.tokens += tokens
            turn = Turn(
                index, prompt, completion, cached, cacheable, str(info.get("worker_id")), (first or sent) - sent
            )
            self.arm.turns.append(turn)
        d.finish_turn({"role": "assistant", "content": "".join(content)})


@contextlib.contextmanager
def server(data: Path, port: int, routing: str, route_wait: float, logs: Path) -> Iterator[str]:
    env = {
        "TOKENTRAIL_DATA_DIR": str(data),
        "TOKENTRAIL_RATE_LIMIT_PER_MINUTE": "0",
        "TOKENTRAIL_ROUTING": routing,
        "TOKENTRAIL_ROUTE_WAIT_S": str(route_wait),
    }
    proc = spawn(
        ["serve", "--port", str(port), "--log-level", "warning"], env=env, output=logs / "server.log", append=True
    )
    url = f"http://127.0.0.1:{port}"
    try:
        wait_ready(lambda: answers(url), {"server": proc}, "server", 120, logs=logs)
        yield url
    finally:
        stop(proc, "server")


def workers_connected(url: str) -> int:
    with contextlib.suppress(httpx.HTTPError):
        text = httpx.get(f"{url}/metrics", timeout=5).text
        found = re.search(rf'tokentrail_cluster_workers\{{model="{MODEL}"\}} (\S+)', text)
        return int(float(found.group(1))) if found else 0
    return 0


def all_connected(url: str, n: int) -> bool:
    return workers_connected(url) >= n


def outcomes(url: str) -> dict[str, float]:
    out: dict[str, float] = {}
    for line in httpx.get(f"{url}/metrics", timeout=5).text.splitlines():
        if line.startswith("tokentrail_routing_dispatches_total{"):
            found = re.search(r'outcome="([^"]+)"', line)
            if found:
                out[found.group(1)] = float(line.rsplit(" ", 1)[1])
    return out


async def drive(url: str, user_key: str, arm: Arm, workload: Workload, duration: float, block: int) -> None:
    c = arm.concurrency
    limits = httpx.Limits(max_connections=c + 8, max_keepalive_connections=None)
    headers = {"Authorization": f"Bearer {user_key}"}
    async with httpx.AsyncClient(
        base_url=url, timeout=httpx.Timeout(60, read=600), limits=limits, headers=headers
    ) as http:
        client = Client(http, arm, block)
        key = f"routing-{arm.workers}-{arm.routing}"
        warm, forever = Point("warm", "openai", "agent", "natural", c), Window(1e9)
        await closed_loop(warm, forever, c, workload, lambda d, _: client.turn(forever, workload, d), key=f"warm-{key}",
                          max_turns=WARMUP_TURNS * c)  # fmt: skip
        arm.turns.clear()
        arm.tokens = 0
        before = outcomes(url)
        point, window = Point("routing", "openai", "agent", "natural", c), Window(duration)
        await closed_loop(point, window, c, workload, lambda d, _: client.turn(window, workload, d), key=key)
        arm.wall_s = point.wall_s
        arm.errors = point.error_samples + ([] if point.errors <= len(point.error_samples) else ["..."])
        after = outcomes(url)
        arm.outcomes = {k: after.get(k, 0) - before.get(k, 0) for k in sorted(after)}


def run(args: argparse.Namespace) -> list[dict[str, Any]]:
    from server.admin import issue_user_key, issue_worker_key
    from server.settings import ServerSettings

    model_dir = prepare_model("chatml")
    workload = Workload("agent", args.turns, "natural", args.tokens)
    rows: list[dict[str, Any]] = []
    for n in args.workers:
        capacity = args.capacity or math.ceil(1.5 * args.concurrency / n)
        with tempfile.TemporaryDirectory(prefix="tt-routing-") as tmp:
            work = Path(tmp)
            data = work / "data"
            data.mkdir()
            settings = ServerSettings(data_dir=data, migrate_on_start=True)
            key = issue_worker_key(settings, "routing-bench")
            user_key = issue_user_key(settings, "routing-bench")
            port = free_port()
            url = f"http://127.0.0.1:{port}"
            engine_args = ["--engine", args.engine]
            program, env = None, None
            if args.engine == "vllm":
                program, env = (vllm_python(), "-m", "tokentrail"), VLLM_ENV
                engine_args += ["--max-model-len", str(MAX_MODEL_LEN), "--gpu-memory-utilization", "0.1"]
            procs = {}
            try:
                for mode_index, mode in enumerate(args.routing):
                    with server(data, port, mode, args.route_wait, work) as url:
                        if mode_index == 0:
                            say(f"{n} {args.engine} workers (capacity {capacity} each) starting...")
                            for k in range(n):
                                procs[f"worker{k}"] = spawn(
                                    ["worker", "--server-url", url, "--api-key", key, "--model", model_dir,
                                     "--served-model-name", MODEL, "--max-parallel", str(capacity), *engine_args,
                                     "--log-level", "warning"],
                                    program=program, env=env, output=work / f"worker{k}.log",
                                )  # fmt: skip
                        wait_ready(functools.partial(all_connected, url, n), procs, f"{n} workers", 900, logs=work,
                                   progress=True)  # fmt: skip
                        arm = Arm(n, mode, args.concurrency)
                        say(f"{n} workers, routing {mode}: warm-up, then {args.duration:.0f} s...")
                        asyncio.run(drive(url, user_key, arm, workload, args.duration, args.block_size))
                        row = arm.summary(args.turns)
                        rows.append(row)
                        say(
                            f"  {n} workers, routing {mode}: {row['tokens_per_s']} tok/s, {row['turns']} turns, "
                            f"{row['errors']} errors, hit rate (turns 2..{args.turns}) {row['hit_rate_of_cacheable']} "
                            f"of cacheable, {row['hit_rate_of_prompt']} of prompt tokens"
                        )
            finally:
                for name, proc in procs.items():
                    stop(proc, name)
    return rows


def report(rows: list[dict[str, Any]], turns: int) -> None:
    print("\ncache-aware routing: agent loops through /v1/chat/completions, turns 2..N for hit rates")
    head = f"{'workers':>7} {'routing':>7} {'tok/s':>8} {'turns':>6} {'errors':>6} {'hit/cacheable':>13} " \
           f"{'hit/prompt':>10} {'TTFT p50':>9} {'TTFT p99':>9}  worker share"  # fmt: skip
    print(head)
    for r in rows:
        print(
            f"{r['workers']:>7} {r['routing']:>7} {r['tokens_per_s']:>8} {r['turns']:>6} {r['errors']:>6} "
            f"{r['hit_rate_of_cacheable']!s:>13} {r['hit_rate_of_prompt']!s:>10} {r['ttft_p50_ms']!s:>9} "
            f"{r['ttft_p99_ms']!s:>9}  {r['worker_share']}"
        )
    print("\nTTFT p50 / p99 (ms) by turn")
    for r in rows:
        cells = " ".join(f"{a}/{b}" for a, b in zip(r["ttft_p50_ms_by_turn"], r["ttft_p99_ms_by_turn"], strict=True))
        print(f"  {r['workers']} workers, routing {r['routing']}: {cells}")
    print("\nrouting outcomes of the measured window (first attempts dispatched)")
    for r in rows:
        print(f"  {r['workers']} workers, routing {r['routing']}: {r['routing_outcomes']}")
    by = {(r["workers"], r["routing"]): r for r in rows}
    print("\nissue 26's done-when (2 workers)")
    on, off = by.get((2, "on")), by.get((2, "off"))
    if on is not None:
        hit = on["hit_rate_of_cacheable"] or 0.0
        print(
            f"  {'met' if hit >= 0.9 else 'NOT met':>8}  hit rate of cacheable tokens, routing on: {hit} "
            "(target >= 0.9)"
        )
    if on is not None and off is not None:
        ok = on["tokens_per_s"] >= off["tokens_per_s"]
        print(
            f"  {'met' if ok else 'NOT met':>8}  tok/s routing on / off: {on['tokens_per_s']} / {off['tokens_per_s']}"
        )
        print(f"            (routing off: hit rate {off['hit_rate_of_cacheable']} of cacheable tokens)")
    errors = sum(r["errors"] for r in rows)
    print(f"  {'met' if errors == 0 else 'NOT met':>8}  errors in every arm: {errors} (target 0)")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--engine", choices=("vllm", "hf"), default="vllm")
    p.add_argument("--workers", default="2,4", help="worker counts, comma-separated")
    p.add_argument("--routing", default="on,off", help="on, off or both (comma-separated)")
    p.add_argument("--concurrency", type=int, default=16)
    p.add_argument("--turns", type=int, default=8)
    p.add_argument("--tokens", type=int, default=48)
    p.add_argument("--duration", type=float, default=30.0)
    p.add_argument("--capacity", type=int, default=0, help="messages each worker takes at once (0: 1.5 c / workers)")
    p.add_argument("--route-wait", type=float, default=0.5, help="TOKENTRAIL_ROUTE_WAIT_S")
    p.add_argument("--block-size", type=int, default=128, help="the engine's KV block size (vLLM on CPU: 128)")
    p.add_argument("--json", action="store_true")
    args = p.parse_args()
    args.workers = [int(x) for x in args.workers.split(",") if x]
    args.routing = [x.strip() for x in args.routing.split(",") if x.strip()]
    if not args.workers or any(n < 1 for n in args.workers) or not set(args.routing) <= {"on", "off"}:
        p.error("--workers takes positive counts, --routing on and/or off")
    rows = run(args)
    report(rows, args.turns)
    if args.json:
        print(json.dumps(rows, indent=1))
    return 0 if all(r["errors"] == 0 for r in rows) else 1


if __name__ == "__main__":
    raise SystemExit(main())
