"""The modes beside the arms: ``--ceiling`` (the pipeline with a benchmark-only synthetic engine),
``--idle-streams`` (server memory per connected SSE reader), ``--prompt-build`` (the next turn's
prompt build after long histories), and the synthetic worker they start."""

from __future__ import annotations

import asyncio
import contextlib
import subprocess
import sys
import tempfile
import time
from collections.abc import AsyncIterator, Iterator, Sequence
from pathlib import Path
from typing import Any

import httpx

from benchmarks.pipeline.clients import drive_tokentrail, sse
from benchmarks.pipeline.conversation import MODEL, Workload
from benchmarks.pipeline.measure import CpuMeter, Point, Role, tree_cpu_s
from benchmarks.pipeline.stack import ENTRY, ROOT, tokentrail_stack


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

    async def close(self) -> None:
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
    from worker.cli import run_on_uvloop
    from worker.client import WorkerClient, WorkerOptions

    fmt = ChatFormat.load(model_dir)
    specials = fmt.special_ids
    ids = [i for i in range(200, 400) if i not in specials]
    engine = SyntheticEngine(ids, rate)
    client = WorkerClient(WorkerOptions(server_url, api_key, MODEL, max_parallel=capacity), engine, fmt)
    run_on_uvloop(client.run_forever())  # as ``tokentrail worker`` runs


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
            async for _ev in sse(client, path):
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


def run_idle(model_dir: str, n: int) -> dict[str, Any]:
    worker_cmd = [sys.executable, str(ENTRY), "--synthetic-worker", "--model-dir", model_dir, "--capacity", "1",
                  "--rate", "1"]  # fmt: skip
    with (
        tempfile.TemporaryDirectory(prefix="tt-idle-") as tmp,
        tokentrail_stack(Path(tmp), model_dir, 1, "hf", worker_cmd=worker_cmd) as stack,
    ):
        return asyncio.run(idle_streams(stack.url, stack.pids["server"], n))


def run_ceiling(
    model_dir: str,
    levels: list[int],
    tokens: int,
    duration: float,
    readers: int,
    apis: list[str] | None = None,
    code: Path | None = None,
    arm: str = "synthetic",
    processes: int | None = None,
) -> list[Point]:
    """Single turns of exactly ``tokens`` tokens from the synthetic engine, through each of ``apis`` (the OA
    flow with ``readers`` SSE readers per message; streamed chat completions, one reader per reply).
    ``code``: another checkout whose server and worker (and its own synthetic worker) run instead.
    ``processes``: ``tokentrail serve --processes N`` on PostgreSQL + Redis (a fresh database each), with N
    synthetic workers, each taking up to the highest concurrency ÷ N; its server CPU is the N processes' and
    their parent's. None: the embedded default (one process, SQLite, in-process queue and streams)."""
    from benchmarks.pipeline.stack import postgres_and_redis

    entry = code / "benchmarks" / "pipeline.py" if code is not None else ENTRY
    n = processes or 1
    worker_cmd = [sys.executable, str(entry), "--synthetic-worker", "--model-dir", model_dir,
                  "--capacity", str(-(-max(levels) // n))]  # fmt: skip
    workload = Workload("single", 1, "fixed", tokens)
    backing: contextlib.AbstractContextManager[dict[str, str]] = (
        postgres_and_redis() if processes is not None else contextlib.nullcontext({})
    )
    with tempfile.TemporaryDirectory(prefix="tt-ceiling-") as tmp, backing as env:
        work = Path(tmp)
        with tokentrail_stack(
            work, model_dir, max(levels), "hf", env, worker_cmd=worker_cmd, code=code, processes=n, workers=n
        ) as stack:
            roles = [Role("server", stack.pids["server"])]
            roles += [Role("worker", pid) for name, pid in stack.pids.items() if name.startswith("worker")]
            meter = CpuMeter(roles, client=True, services=processes is not None)
            return asyncio.run(
                drive_tokentrail(
                    arm, stack.url, stack.user_key, meter, apis or ["oa"], [workload], levels, duration, readers
                )
            )


@contextlib.contextmanager
def checkout(ref: str) -> Iterator[Path]:
    """The tree of commit ``ref`` of this repository in a temporary directory (``git archive``)."""
    with tempfile.TemporaryDirectory(prefix="tt-against-") as tmp:
        archive = subprocess.run(["git", "-C", str(ROOT), "archive", ref], capture_output=True, check=True).stdout
        subprocess.run(["tar", "-x", "-C", tmp], input=archive, check=True)
        yield Path(tmp)
