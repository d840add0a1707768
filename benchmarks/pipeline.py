"""What tokentrail's pipeline costs on top of its engine: the same model, prompt, sampling and
concurrency for every arm, closed loop, one run.

    python benchmarks/pipeline.py [--engine hf|vllm] [--concurrency 1,8,32] [--tokens 64] [--duration 20]
                                  [--arms engine,embedded,redis,vllm-serve] [--json] [--plot FILE.png]
    python benchmarks/pipeline.py --ceiling [--concurrency 32] [--readers 4] [--duration 10]
    python benchmarks/pipeline.py --prompt-build
    python benchmarks/pipeline.py --idle-streams 5000

Arms (each a fresh process tree, so CPU time is attributed exactly):

- ``engine``: the engine alone, in a process of its own: ``c`` tasks call ``engine.generate`` in a loop;
- ``embedded``: tokentrail end to end on embedded defaults (SQLite, in-process queue and streams): a
  server process and a worker process; ``c`` clients each post a prompter message and an assistant
  message and read its SSE events until the final one, in a loop;
- ``redis``: the same on PostgreSQL + Redis (a fresh database, dropped afterwards; Redis on its own
  database number, see ``tests/services.py``);
- ``vllm-serve`` (``--engine vllm``): ``vllm serve`` on the same model streaming chat completions.

Every request generates exactly ``--tokens`` tokens (end tokens ignored) at temperature 1. Printed per
arm and concurrency: tokens/s delivered to clients, TTFT p50/p99 (request sent to first token
received), inter-token gap p50/p99, CPU ms per token of the server and the worker process trees (the
engine arm: its process), and the ratios tokentrail / engine alone (and / ``vllm serve``).

``--ceiling`` measures the pipeline without a model: a benchmark-only synthetic engine (in a worker
process started by this script; not part of tokentrail) emits tokens as fast as the pipeline takes
them, ``--readers`` SSE readers follow each message; printed: token events/s the server process fans
out to readers, tokens/s the worker forwards, CPU per event and per token.

``--prompt-build`` times the next turn's prompt build after 1k / 8k / 32k-token histories: stitched
from stored tokens (the worker's way) against a full re-render, and decoding the work frame.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import AsyncIterator, Iterator, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.models import prepare_model, vllm_python
from benchmarks.progress import say
from tokentrail.launcher import answers, free_port, offers, spawn, stop, wait_ready

MODEL = "tiny"
PROMPT = "Tell me a long story about a lighthouse keeper and the storm that changed the town."
CLK_TCK = os.sysconf("SC_CLK_TCK")


# ---- measurements ---------------------------------------------------------------------------------
@dataclass
class Point:
    """One arm at one concurrency: what the clients saw, and the CPU the processes spent."""

    arm: str
    concurrency: int
    wall_s: float = 0.0
    tokens: int = 0
    requests: int = 0
    ttft_s: list[float] = field(default_factory=list)
    gaps_s: list[float] = field(default_factory=list)
    cpu_s: dict[str, float] = field(default_factory=dict)  # process tree -> CPU seconds in the window

    def summary(self) -> dict[str, Any]:
        per_token = {f"{k}_cpu_ms_per_token": _r(1000 * v / self.tokens, 3) for k, v in self.cpu_s.items()}
        return {
            "arm": self.arm,
            "concurrency": self.concurrency,
            "tokens_per_s": _r(self.tokens / self.wall_s if self.wall_s else 0.0, 1),
            "requests": self.requests,
            "ttft_p50_ms": _ms(_pct(self.ttft_s, 0.5)),
            "ttft_p99_ms": _ms(_pct(self.ttft_s, 0.99)),
            "itl_p50_ms": _ms(_pct(self.gaps_s, 0.5)),
            "itl_p99_ms": _ms(_pct(self.gaps_s, 0.99)),
            **(per_token if self.tokens else {}),
        }


def _r(x: float, n: int) -> float:
    return round(x, n)


def _ms(x: float | None) -> float | None:
    return None if x is None else round(1000 * x, 2)


def _pct(xs: Sequence[float], q: float) -> float | None:
    if not xs:
        return None
    s = sorted(xs)
    return s[min(len(s) - 1, int(q * len(s)))]


def tree_cpu_s(pid: int) -> float:
    """CPU seconds (user + system) of a process and all its descendants, from /proc."""
    children: dict[int, list[int]] = {}
    times: dict[int, float] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        p = int(entry)
        children.setdefault(int(fields[1]), []).append(p)
        times[p] = (int(fields[11]) + int(fields[12])) / CLK_TCK
    total, stack = 0.0, [pid]
    while stack:
        p = stack.pop()
        total += times.get(p, 0.0)
        stack += children.get(p, [])
    return total


class Arrivals:
    """Records one request's token arrivals into a point: TTFT, inter-token gaps, tokens."""

    def __init__(self, point: Point, window: Window) -> None:
        self.point = point
        self.window = window
        self.sent = self.last = time.perf_counter()
        self.first = True

    def tokens(self, n: int) -> None:
        now = time.perf_counter()
        if not n or not self.window.open:
            return
        if self.first:
            self.point.ttft_s.append(now - self.sent)
            self.first = False
        else:
            self.point.gaps_s.append(now - self.last)
        self.point.gaps_s += [0.0] * (n - 1)  # tokens that arrived together
        self.last = now
        self.point.tokens += n


def services_cpu_s() -> dict[str, float]:
    """CPU seconds so far of the local PostgreSQL and Redis processes (by command name): they share
    the machine with tokentrail in the PostgreSQL + Redis arm."""
    out = {"postgres": 0.0, "redis": 0.0}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                head, _, rest = f.read().rpartition(")")
        except OSError:
            continue
        name = head.partition("(")[2]
        kind = "postgres" if name.startswith("postgres") else "redis" if name.startswith("redis-server") else None
        if kind is not None:
            fields = rest.split()
            out[kind] += (int(fields[11]) + int(fields[12])) / CLK_TCK
    return out


class Window:
    """The measured window of one point: tokens count only while it is open."""

    def __init__(self, duration_s: float) -> None:
        self.start = time.perf_counter()
        self.end = self.start + duration_s

    @property
    def open(self) -> bool:
        return time.perf_counter() < self.end


# ---- the engine alone -----------------------------------------------------------------------------
async def engine_points(
    engine_name: str, model_dir: str, prompt_ids: list[int], levels: list[int], tokens: int, duration: float
) -> list[Point]:
    from worker.engines.contract import GenerationParams

    engine: Any
    if engine_name == "vllm":
        from worker.engines.vllm import VLLMEngine

        engine = VLLMEngine(model_dir, max_model_len=2048, gpu_memory_utilization=0.2, max_num_seqs=max(levels))
    else:
        from worker.engines.hf import HFEngine

        engine = HFEngine(model_dir, max_batch_size=max(levels))
    await engine.start()
    counter = 0

    async def one(point: Point, window: Window, seed: int) -> None:
        nonlocal counter
        counter += 1
        params = GenerationParams(max_new_tokens=tokens, temperature=1.0, seed=seed, stop_token_ids=())
        arrivals = Arrivals(point, window)
        async for step in engine.generate(f"bench-{counter}", prompt_ids, params):
            arrivals.tokens(len(step.token_ids))
        if window.open:
            point.requests += 1

    points = []
    try:
        await _closed_loop(Point("engine", 1), Window(1e9), 1, one, requests=1)  # warm-up
        for c in levels:
            point = Point("engine", c)
            cpu0 = tree_cpu_s(os.getpid())  # the tree: vLLM runs its engine core in child processes
            await _closed_loop(point, Window(duration), c, one)
            point.cpu_s["engine"] = tree_cpu_s(os.getpid()) - cpu0
            points.append(point)
    finally:
        await engine.close()
    return points


async def _closed_loop(point: Point, window: Window, c: int, one: Any, requests: int | None = None) -> None:
    """``c`` clients, each starting its next request when the last one ends, until the window closes
    (or ``requests`` in all); the point's wall time is the window's."""
    seeds = iter(range(10**9))
    left = [requests]

    async def client() -> None:
        while window.open and (left[0] is None or left[0] > 0):
            if left[0] is not None:
                left[0] -= 1
            await one(point, window, next(seeds))

    await asyncio.gather(*(client() for _ in range(c)))
    point.wall_s = min(time.perf_counter(), window.end) - window.start


# ---- tokentrail over HTTP + SSE -------------------------------------------------------------------
async def _sse(client: httpx.AsyncClient, path: str) -> AsyncIterator[dict[str, Any]]:
    async with client.stream("GET", path, headers={"Accept": "text/event-stream"}) as resp:
        resp.raise_for_status()
        async for line in resp.aiter_lines():
            if line.startswith("data:"):
                yield json.loads(line[5:])


async def tokentrail_points(
    arm: str, url: str, pids: dict[str, int], levels: list[int], tokens: int, duration: float, readers: int = 1
) -> list[Point]:
    limits = httpx.Limits(max_connections=max(levels) * (readers + 2) + 8, max_keepalive_connections=None)
    timeout = httpx.Timeout(60, read=600)
    async with httpx.AsyncClient(base_url=url, timeout=timeout, limits=limits) as client:
        pair = (await client.get("/auth/callback/debug", params={"code": "bench"})).json()
        client.headers["Authorization"] = f"Bearer {pair['access_token']['access_token']}"
        chats: dict[int, str] = {}

        async def one(point: Point, window: Window, seed: int) -> None:
            slot = seed % max(levels)
            if slot not in chats:
                chats[slot] = (await client.post("/chats", json={})).json()["id"]
            chat = chats[slot]
            prompt = (
                await client.post(f"/chats/{chat}/prompter_message", json={"parent_id": None, "content": PROMPT})
            ).json()
            sent = Arrivals(point, window)
            reply = await client.post(
                f"/chats/{chat}/assistant_message",
                json={
                    "parent_id": prompt["id"],
                    "model_config_name": MODEL,
                    "sampling_parameters": {
                        "max_new_tokens": tokens,
                        "temperature": 1.0,
                        "seed": seed,
                        "ignore_eos": True,
                    },
                },
            )
            reply.raise_for_status()
            path = f"/chats/{chat}/messages/{reply.json()['id']}/events"

            async def read(counting: bool) -> None:
                arrivals = Arrivals(point, window)
                arrivals.sent = arrivals.last = sent.sent
                async for ev in _sse(client, path):
                    kind = ev.get("event_type")
                    if kind == "token":
                        arrivals.tokens(1 if counting else 0)
                    elif kind in ("message", "error"):
                        if kind == "error":
                            raise RuntimeError(f"generation failed: {ev}")
                        return

            await asyncio.gather(*(read(k == 0 or readers > 1) for k in range(readers)))
            if window.open:
                point.requests += 1

        points = []
        await _closed_loop(Point(arm, 1), Window(1e9), 1, one, requests=2)  # warm-up
        for c in levels:
            point = Point(arm, c)
            before = {name: tree_cpu_s(pid) for name, pid in pids.items()}
            services = services_cpu_s() if arm == "redis" else {}
            client_cpu = time.process_time()
            await _closed_loop(point, Window(duration), c, one)
            point.cpu_s = {name: tree_cpu_s(pid) - before[name] for name, pid in pids.items()}
            point.cpu_s.update({k: v - services[k] for k, v in services_cpu_s().items() if k in services})
            # the benchmark's own HTTP + SSE clients share the machine (the engine arm has none)
            point.cpu_s["client"] = time.process_time() - client_cpu
            points.append(point)
            say(f"  {arm} c={c}: {point.summary()['tokens_per_s']} tok/s")
        return points


@contextlib.contextmanager
def tokentrail_stack(
    work: Path,
    model_dir: str,
    max_parallel: int,
    engine: str,
    env: dict[str, str] | None = None,
    worker_cmd: list[str] | None = None,
) -> Iterator[tuple[str, dict[str, int]]]:
    """A server process and a worker process; yields (URL, {"server": pid, "worker": pid})."""
    from server.admin import issue_worker_key
    from server.settings import ServerSettings

    data = work / "data"
    data.mkdir(exist_ok=True)
    env = {
        "TOKENTRAIL_DATA_DIR": str(data),
        "TOKENTRAIL_ALLOW_DEBUG_AUTH": "true",
        "TOKENTRAIL_RATE_LIMIT_PER_MINUTE": "0",  # a load generator, not a user to be slowed down
        **(env or {}),
    }
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    try:
        if "TOKENTRAIL_DATABASE_URL" in env:
            up = spawn(["db", "upgrade"], output=work / "upgrade.log")
            if up.wait(timeout=300) != 0:
                raise RuntimeError((work / "upgrade.log").read_text()[-3000:])
        key = issue_worker_key(ServerSettings(migrate_on_start=True), "pipeline")
        port = free_port()
        url = f"http://127.0.0.1:{port}"
        server = spawn(["serve", "--port", str(port), "--log-level", "warning"], output=work / "server.log")
        procs = {"server": server}
        try:
            wait_ready(lambda: answers(url), procs, "server", 180, logs=work)
            if worker_cmd is not None:
                worker = spawn(["--server-url", url, "--api-key", key], program=worker_cmd, output=work / "worker.log")
            else:
                program, extra, args = None, None, []
                if engine == "vllm":
                    program, extra = (vllm_python(), "-m", "tokentrail"), {"VLLM_CPU_KVCACHE_SPACE": "1"}
                    args = ["--max-model-len", "2048", "--gpu-memory-utilization", "0.2"]
                worker = spawn(
                    ["worker", "--server-url", url, "--api-key", key, "--model", model_dir, "--served-model-name",
                     MODEL, "--max-parallel", str(max_parallel), "--engine", engine, "--log-level", "warning", *args],
                    program=program,
                    output=work / "worker.log",
                    env=extra,
                )  # fmt: skip
            procs["worker"] = worker
            wait_ready(lambda: offers(url, [MODEL]), procs, "worker", 600 if engine == "vllm" else 180, logs=work)
            yield url, {name: p.pid for name, p in procs.items()}
        finally:
            for name, p in reversed(procs.items()):
                stop(p, name)
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


# ---- vllm serve -----------------------------------------------------------------------------------
async def vllm_serve_points(url: str, pid: int, levels: list[int], tokens: int, duration: float) -> list[Point]:
    async with httpx.AsyncClient(base_url=url, timeout=httpx.Timeout(60, read=600)) as client:

        async def one(point: Point, window: Window, seed: int) -> None:
            body = {
                "model": MODEL,
                "messages": [{"role": "user", "content": PROMPT}],
                "max_tokens": tokens,
                "temperature": 1.0,
                "seed": seed,
                "ignore_eos": True,
                "stream": True,
                "return_token_ids": True,
            }
            arrivals = Arrivals(point, window)
            async with client.stream("POST", "/v1/chat/completions", json=body) as resp:
                resp.raise_for_status()
                async for line in resp.aiter_lines():
                    if not line.startswith("data:") or line.strip() == "data: [DONE]":
                        continue
                    chunk = json.loads(line[5:])
                    arrivals.tokens(sum(len(c.get("token_ids") or []) for c in chunk.get("choices", [])))
            if window.open:
                point.requests += 1

        points = []
        await _closed_loop(Point("vllm-serve", 1), Window(1e9), 1, one, requests=1)
        for c in levels:
            point = Point("vllm-serve", c)
            cpu0 = tree_cpu_s(pid)
            await _closed_loop(point, Window(duration), c, one)
            point.cpu_s = {"vllm_serve": tree_cpu_s(pid) - cpu0}
            points.append(point)
        return points


@contextlib.contextmanager
def vllm_serve(work: Path, model_dir: str, max_seqs: int) -> Iterator[tuple[str, int]]:
    port = free_port()
    args = ["--model", model_dir, "--served-model-name", MODEL, "--port", str(port), "--max-model-len", "2048",
            "--max-num-seqs", str(max_seqs), "--gpu-memory-utilization", "0.2"]  # fmt: skip
    program = (vllm_python(), "-m", "vllm.entrypoints.openai.api_server")
    proc = spawn(args, program=program, output=work / "vllm-serve.log", env={"VLLM_CPU_KVCACHE_SPACE": "1"})
    url = f"http://127.0.0.1:{port}"
    try:
        wait_ready(lambda: answers(url), {"vllm-serve": proc}, "vllm serve", 600, logs=work)
        yield url, proc.pid
    finally:
        stop(proc, "vllm serve")


# ---- the synthetic engine (benchmark only) --------------------------------------------------------
class SyntheticEngine:
    """Benchmark-only stand-in for a model: emits ordinary token ids as fast as the pipeline takes
    them (one per step), so that what limits the run is tokentrail's own path."""

    def __init__(self, vocab_ids: list[int], rate: float = 0.0, max_context: int = 1 << 20) -> None:
        from worker.engines.contract import EngineInfo

        self.info = EngineInfo(name="synthetic", max_context=max_context)
        self.ids = vocab_ids
        self.pause = 1.0 / rate if rate > 0 else 0.0  # per request; 0: as fast as the pipeline takes them

    async def start(self) -> None:
        return None

    async def stop(self) -> None:
        return None

    async def abort(self, request_id: str) -> None:
        return None

    async def generate(self, request_id: str, prompt_ids: list[int], params: Any) -> AsyncIterator[Any]:
        from worker.engines.contract import TokenStep

        n = params.max_new_tokens
        for i in range(n):
            last = i == n - 1
            yield TokenStep(
                token_ids=[self.ids[i % len(self.ids)]],
                logprobs=[-1.0],
                finish_reason="length" if last else None,
                prompt_token_ids=list(prompt_ids) if i == 0 else None,
            )
            await asyncio.sleep(self.pause)


def run_synthetic_worker(server_url: str, api_key: str, model_dir: str, capacity: int, rate: float = 0.0) -> None:
    from worker.chat_format import ChatFormat
    from worker.client import WorkerClient, WorkerOptions

    fmt = ChatFormat.load(model_dir)
    specials = fmt.special_ids
    ids = [i for i in range(200, 400) if i not in specials]
    engine = SyntheticEngine(ids, rate)
    client = WorkerClient(WorkerOptions(server_url, api_key, MODEL, max_parallel=capacity), engine, fmt)
    asyncio.run(client.run_forever())


# ---- prompt builds --------------------------------------------------------------------------------
_PARAGRAPH = (
    "The keeper climbed the stairs again, counted the steps, trimmed the wick and wrote the hour in the "
    "log. Outside the wind turned east and the boats came in one by one, their lamps low on the water. "
)


def prompt_build_rows(model_dir: str, sizes: Sequence[int], repeats: int = 7) -> list[dict[str, Any]]:
    """Time of the next turn's prompt build after a history of about ``size`` tokens: stitched from the
    stored tokens (what the worker does) against a full re-render, and decoding the work frame."""
    from shared.protocol import PriorChain, WorkFrame, WorkMessage
    from worker.chat_format import ChatFormat
    from worker.prompt_builder import PromptBuilder

    fmt = ChatFormat.load(model_dir)
    builder = PromptBuilder(fmt)
    stop = fmt.stop_token_ids[0]
    rows = []
    for size in sizes:
        messages = [WorkMessage(id="s", role="system", content="You tell long stories.")]
        k = 0
        while True:
            messages.append(WorkMessage(id=f"u{k}", role="user", content=f"Go on ({k})."))
            messages.append(WorkMessage(id=f"a{k}", role="assistant", content=_PARAGRAPH * 3))
            k += 1
            if k % max(1, size // 4000) == 0 and len(builder.full_render(messages, None)) >= size:
                break
        prompt = builder.full_render(messages[:-1], None)
        completion = [*fmt.encode_content(messages[-1].content), stop]
        prior = PriorChain(
            message_id=messages[-1].id,
            prompt_ids=prompt,
            completion_ids=completion,
            finish_reason="stop",
            stop_reason=stop,
            tokenizer_hash=fmt.tokenizer_hash,
            template_hash=fmt.template_hash,
            system_prompt=messages[0].content,
        )
        turn = [*messages, WorkMessage(id="next", role="user", content="And then?")]
        frame = WorkFrame(
            message_id="m", attempt=1, chat_id="c", model_name=MODEL, messages=turn, sampling={}, seed=0, prior=prior
        )
        wire = frame.model_dump_json()

        def timed(fn: Any) -> float:
            samples = []
            for _ in range(repeats):
                t0 = time.perf_counter()
                fn()
                samples.append(time.perf_counter() - t0)
            return sorted(samples)[len(samples) // 2]

        built = builder.build(frame)
        assert built.prior_message_id == "a" + str(k - 1), built.fork_reason
        rows.append(
            {
                "history_tokens": len(prompt) + len(completion),
                "messages": len(turn),
                "stitch_ms": round(1000 * timed(lambda f=frame: builder.build(f)), 2),
                "full_render_ms": round(1000 * timed(lambda t=turn: builder.full_render(t, None)), 2),
                "frame_decode_ms": round(1000 * timed(lambda w=wire: WorkFrame.model_validate_json(w)), 2),
            }
        )
    return rows


# ---- report ---------------------------------------------------------------------------------------
def ratios(points: list[Point]) -> list[dict[str, Any]]:
    by = {(p.arm, p.concurrency): p.summary() for p in points}
    out = []
    for (arm, c), s in by.items():
        if arm in ("engine", "vllm-serve"):
            continue
        row: dict[str, Any] = {"arm": arm, "concurrency": c}
        base = by.get(("engine", c))
        if base and base["tokens_per_s"]:
            row["x_engine"] = round(s["tokens_per_s"] / base["tokens_per_s"], 3)
            if s["ttft_p50_ms"] is not None and base["ttft_p50_ms"] is not None:
                row["added_ttft_p50_ms"] = round(s["ttft_p50_ms"] - base["ttft_p50_ms"], 2)
                row["added_ttft_p99_ms"] = round((s["ttft_p99_ms"] or 0) - (base["ttft_p99_ms"] or 0), 2)
            engine_cpu = base.get("engine_cpu_ms_per_token")
            if engine_cpu is not None and "worker_cpu_ms_per_token" in s:
                row["worker_beyond_engine_cpu_ms_per_token"] = round(s["worker_cpu_ms_per_token"] - engine_cpu, 3)
        serve = by.get(("vllm-serve", c))
        if serve and serve["tokens_per_s"]:
            row["x_vllm_serve"] = round(s["tokens_per_s"] / serve["tokens_per_s"], 3)
        out.append(row)
    return out


def print_table(points: list[Point]) -> None:
    cols = ["arm", "c", "tok/s", "TTFT p50", "TTFT p99", "ITL p50", "ITL p99", "server ms/tok", "worker ms/tok",
            "client ms/tok", "pg+redis ms/tok"]  # fmt: skip
    print(" | ".join(f"{c:>13}" for c in cols))
    for p in points:
        s = p.summary()
        worker = s.get(
            "worker_cpu_ms_per_token", s.get("engine_cpu_ms_per_token", s.get("vllm_serve_cpu_ms_per_token"))
        )
        vals = [s["arm"], s["concurrency"], s["tokens_per_s"], s["ttft_p50_ms"], s["ttft_p99_ms"], s["itl_p50_ms"],
                s["itl_p99_ms"], s.get("server_cpu_ms_per_token", "-"), worker,
                s.get("client_cpu_ms_per_token", "-"),
                _sum(s.get("postgres_cpu_ms_per_token"), s.get("redis_cpu_ms_per_token"))]  # fmt: skip
        print(" | ".join(f"{'-' if v is None else v!s:>13}" for v in vals))
    rows = ratios(points)
    if rows:
        print()
        for r in rows:
            print("  " + ", ".join(f"{k}={v}" for k, v in r.items()))


def _sum(*values: float | None) -> float | str:
    present = [v for v in values if v is not None]
    return round(sum(present), 3) if present else "-"


def plot(points: list[Point], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 4))
    for arm in dict.fromkeys(p.arm for p in points):
        mine = sorted((p for p in points if p.arm == arm), key=lambda p: p.concurrency)
        cs = [p.concurrency for p in mine]
        left.plot(cs, [p.summary()["tokens_per_s"] for p in mine], marker="o", label=arm)
        right.plot(cs, [p.summary()["ttft_p50_ms"] for p in mine], marker="o", label=arm)
    for ax, label in ((left, "tokens/s delivered"), (right, "TTFT p50 (ms)")):
        ax.set_xscale("log", base=2)
        ax.set_xlabel("concurrent requests")
        ax.set_ylabel(label)
        ax.grid(True, alpha=0.3)
    right.set_yscale("log")
    left.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)


# ---- main -----------------------------------------------------------------------------------------
def _prompt_ids(model_dir: str) -> list[int]:
    from shared.protocol import WorkMessage
    from worker.chat_format import ChatFormat

    return ChatFormat.load(model_dir).render([WorkMessage(id="u", role="user", content=PROMPT)])


def _engine_child(args: argparse.Namespace) -> None:
    levels = [int(c) for c in args.concurrency.split(",")]
    prompt = _prompt_ids(args.model_dir)
    points = asyncio.run(engine_points(args.engine, args.model_dir, prompt, levels, args.tokens, args.duration))
    print(json.dumps([asdict(p) for p in points]))


def _engine_arm(args: argparse.Namespace, model_dir: str, work: Path) -> list[Point]:
    python = vllm_python() if args.engine == "vllm" else sys.executable
    cmd = [python, __file__, "--engine-child", "--engine", args.engine, "--model-dir", model_dir,
           "--concurrency", args.concurrency, "--tokens", str(args.tokens),
           "--duration", str(args.duration)]  # fmt: skip
    env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1"}
    with open(work / "engine.log", "wb") as log:
        out = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=log, env=env, check=False)
    if out.returncode != 0:
        raise RuntimeError((work / "engine.log").read_text()[-3000:])
    # vLLM logs to stdout too (its shutdown comes after the figures): take the figures' line
    line = next(x for x in out.stdout.decode().splitlines() if x.startswith("[{"))
    return [Point(**p) for p in json.loads(line)]


@contextlib.contextmanager
def _postgres_and_redis() -> Iterator[dict[str, str]]:
    from tests import services

    with services.postgres_service() as pg, services.redis_service() as rd:
        yield {
            "TOKENTRAIL_DATABASE_URL": pg,
            "TOKENTRAIL_REDIS_URL": rd,
            "TOKENTRAIL_AUTH_SECRET": "pipeline-benchmark-secret-0123456789",
        }


def run(args: argparse.Namespace) -> list[Point]:
    levels = [int(c) for c in args.concurrency.split(",")]
    arms = args.arms.split(",")
    model_dir = args.model_dir or prepare_model("chatml")
    points: list[Point] = []
    with tempfile.TemporaryDirectory(prefix="tt-pipeline-") as tmp:
        work = Path(tmp)
        if "engine" in arms:
            say(f"engine alone ({args.engine})...")
            points += _engine_arm(args, model_dir, work)
        if "embedded" in arms:
            say("tokentrail embedded...")
            sub = work / "embedded"
            sub.mkdir()
            with tokentrail_stack(sub, model_dir, max(levels), args.engine) as (url, pids):
                points += asyncio.run(tokentrail_points("embedded", url, pids, levels, args.tokens, args.duration))
        if "redis" in arms:
            say("tokentrail on PostgreSQL + Redis...")
            sub = work / "redis"
            sub.mkdir()
            with (
                _postgres_and_redis() as env,
                tokentrail_stack(sub, model_dir, max(levels), args.engine, env) as (
                    url,
                    pids,
                ),
            ):
                points += asyncio.run(tokentrail_points("redis", url, pids, levels, args.tokens, args.duration))
        if "vllm-serve" in arms and args.engine == "vllm":
            say("vllm serve...")
            with vllm_serve(work, model_dir, max(levels)) as (url, pid):
                points += asyncio.run(vllm_serve_points(url, pid, levels, args.tokens, args.duration))
    return points


def rss_mb(pid: int) -> float:
    with open(f"/proc/{pid}/status") as f:
        kb = next(int(line.split()[1]) for line in f if line.startswith("VmRSS:"))
    return kb / 1024


async def idle_streams(url: str, server_pid: int, n: int, settle_s: float = 10.0) -> dict[str, Any]:
    """``n`` SSE readers on one message that streams a token a second: the server's memory per
    connected reader, and its CPU while they wait."""
    limits = httpx.Limits(max_connections=n + 8, max_keepalive_connections=None)
    async with httpx.AsyncClient(base_url=url, timeout=httpx.Timeout(60, read=600), limits=limits) as client:
        pair = (await client.get("/auth/callback/debug", params={"code": "idle"})).json()
        client.headers["Authorization"] = f"Bearer {pair['access_token']['access_token']}"
        chat = (await client.post("/chats", json={})).json()["id"]
        prompt = (await client.post(f"/chats/{chat}/prompter_message", json={"parent_id": None, "content": "x"})).json()
        reply = await client.post(
            f"/chats/{chat}/assistant_message",
            json={
                "parent_id": prompt["id"],
                "model_config_name": MODEL,
                "sampling_parameters": {"max_new_tokens": 3000},
            },
        )
        reply.raise_for_status()
        path = f"/chats/{chat}/messages/{reply.json()['id']}/events"
        await asyncio.sleep(1.0)
        before = rss_mb(server_pid)
        seen = [0]
        started = asyncio.Event()

        async def reader() -> None:
            async for _ev in _sse(client, path):
                seen[0] += 1
                if seen[0] >= n:
                    started.set()

        tasks = [asyncio.create_task(reader()) for _ in range(n)]
        t0 = time.perf_counter()
        await asyncio.wait_for(started.wait(), timeout=300)
        connect_s = time.perf_counter() - t0
        await asyncio.sleep(2.0)
        cpu0, events0 = tree_cpu_s(server_pid), seen[0]
        await asyncio.sleep(settle_s)
        cpu, events = tree_cpu_s(server_pid) - cpu0, seen[0] - events0
        after = rss_mb(server_pid)
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
    return {
        "idle_streams": n,
        "connect_s": round(connect_s, 1),
        "server_rss_before_mb": round(before, 1),
        "server_rss_after_mb": round(after, 1),
        "kb_per_stream": round(1024 * (after - before) / n, 1),
        "events_per_s": round(events / settle_s, 1),
        "server_cpu_share": round(cpu / settle_s, 3),
    }


def run_idle(args: argparse.Namespace) -> dict[str, Any]:
    model_dir = args.model_dir or prepare_model("chatml")
    worker_cmd = [sys.executable, __file__, "--synthetic-worker", "--model-dir", model_dir, "--capacity", "1",
                  "--rate", "1"]  # fmt: skip
    with (
        tempfile.TemporaryDirectory(prefix="tt-idle-") as tmp,
        tokentrail_stack(Path(tmp), model_dir, 1, "hf", worker_cmd=worker_cmd) as (url, pids),
    ):
        return asyncio.run(idle_streams(url, pids["server"], args.idle_streams))


def run_ceiling(args: argparse.Namespace) -> list[Point]:
    levels = [int(c) for c in args.concurrency.split(",")]
    model_dir = args.model_dir or prepare_model("chatml")
    worker_cmd = [sys.executable, __file__, "--synthetic-worker", "--model-dir", model_dir,
                  "--capacity", str(max(levels))]  # fmt: skip
    with tempfile.TemporaryDirectory(prefix="tt-ceiling-") as tmp:
        work = Path(tmp)
        with tokentrail_stack(work, model_dir, max(levels), "hf", worker_cmd=worker_cmd) as (url, pids):
            return asyncio.run(
                tokentrail_points("synthetic", url, pids, levels, args.tokens, args.duration, readers=args.readers)
            )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--engine", choices=["hf", "vllm"], default="hf")
    ap.add_argument("--concurrency", default="1,8,32", help="comma-separated concurrency levels")
    ap.add_argument("--tokens", type=int, default=64, help="tokens per reply (end tokens ignored)")
    ap.add_argument("--duration", type=float, default=20.0, help="seconds measured per point")
    ap.add_argument("--arms", default="engine,embedded,redis,vllm-serve")
    ap.add_argument("--model-dir", help="default: the trained tiny chatml model (built once, cached)")
    ap.add_argument("--ceiling", action="store_true", help="the pipeline's own ceiling with a synthetic engine")
    ap.add_argument("--readers", type=int, default=4, help="--ceiling: SSE readers per message")
    ap.add_argument("--prompt-build", action="store_true", help="time prompt builds after 1k / 8k / 32k tokens")
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--plot", type=Path, help="write a PNG of tokens/s and TTFT against concurrency (matplotlib)")
    ap.add_argument("--engine-child", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--synthetic-worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--server-url", help=argparse.SUPPRESS)
    ap.add_argument("--api-key", help=argparse.SUPPRESS)
    ap.add_argument("--capacity", type=int, default=32, help=argparse.SUPPRESS)
    ap.add_argument("--rate", type=float, default=0.0, help=argparse.SUPPRESS)
    ap.add_argument("--idle-streams", type=int, default=0, help="server memory per connected SSE reader (e.g. 5000)")
    args = ap.parse_args()
    if args.engine_child:
        _engine_child(args)
        return
    if args.synthetic_worker:
        run_synthetic_worker(args.server_url, args.api_key, args.model_dir, args.capacity, args.rate)
        return
    if args.idle_streams:
        result = run_idle(args)
        print(json.dumps(result) if args.json else ", ".join(f"{k}={v}" for k, v in result.items()))
        return
    if args.prompt_build:
        rows = prompt_build_rows(args.model_dir or prepare_model("chatml"), (1_000, 8_000, 32_000))
        print(json.dumps(rows) if args.json else "\n".join(", ".join(f"{k}={v}" for k, v in r.items()) for r in rows))
        return
    if args.ceiling:
        args.tokens = args.tokens if args.tokens != 64 else 2048
    points = run_ceiling(args) if args.ceiling else run(args)
    if args.json:
        print(json.dumps({"points": [p.summary() for p in points], "ratios": ratios(points)}))
    else:
        print_table(points)
    if args.plot:
        plot(points, args.plot)


if __name__ == "__main__":
    main()
