"""Rollout export throughput and memory: stored multi-turn conversations -> tokentrail rollouts -> file.

    python benchmarks/export.py [--conversations 10000] [--turns 4] [--backends sqlite,postgres]
                                [--formats jsonl,parquet] [--repeat 3] [--seed 0] [--keep DIR]
                                [--postgres ADMIN_URL] [--workers N] [--profile] [--json]

Per backend it creates a fresh database (a SQLite file in a temp dir; a new PostgreSQL database
``tt_bench_<random>`` on ``--postgres``, dropped at the end), migrates it with ``server.migrate.upgrade``
and bulk-inserts conversations with SQLAlchemy Core executemany (not the HTTP API), then runs ``ANALYZE`` on
PostgreSQL (as its manual advises after a bulk load; autovacuum would within minutes): without
statistics its planner sorts each page's messages instead of walking their index in order. Each chat has a
user, a system prompt (most chats), ``--turns`` turns of prompter message + complete assistant message
+ a ``message_tokens`` row whose prompt extends the previous turn's prompt + completion exactly
(first prompt ~60 tokens, completions 20-120, bridges ~10, a synthetic closer after turns cut by length,
float32 negative logprobs with a rare -inf), regenerations (~10% of chats get a second assistant reply
on the last turn: one more leaf), votes on ~25% of assistant messages and ~2% opted-out chats.

The database is filled in three steps (N/4, N/2, N chats) and after each step every format is exported
through the real path (``server.export.run.run_export``, what ``tokentrail export`` runs: pages of chats
built and encoded on forked worker processes, ``server/export/parallel.py``, written by the writers of
``server/export/writers.py``), ``--repeat`` times, each in a fresh subprocess that reports wall and CPU time
and its peak RSS (``VmHWM``, reset to the current RSS just before the export, so the growth is the
export's own). The workers report their own CPU time (``RUSAGE_CHILDREN``) and peak RSS growth (each resets
its ``VmHWM`` when it starts): "total MB" adds the parent's growth and every worker's, an upper bound of
what the export holds at once. The table gives the fastest run (and the median: other work on a shared
machine makes wall times noisy) and the largest peaks. Flat peak memory across N/4, N/2 and N shows that
the export streams. Insert time is reported apart; ``--profile`` prints cProfile tables of the parent
process (with workers, it mostly waits for them: profile the work itself with ``--workers 1``).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import re
import secrets
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

MODEL = "bench-model"
SYSTEM_PROMPTS = [
    "You are a helpful assistant.",
    "Be concise. Answer in English unless asked otherwise.",
    "You are an expert Python programmer. Explain your reasoning step by step before giving code.",
]
_WORD_TEXT = """
the of and to in is that for it as with was on be by this are or at from an but not have which you model
token prompt answer question data train reward value function policy gradient sample batch loss python code
list error result return number string memory speed value state chat turn user system
"""
WORDS = _WORD_TEXT.split()
EOS = 2  # the template's turn closer in this synthetic vocabulary
VOCAB = 150_000


# --- data generation -------------------------------------------------------------------------------


class Ids:
    """Time-ordered UUIDv7-style ids (like ``server.models.new_id``), one millisecond apart, so that ids
    sort by creation and ``created_at`` matches them."""

    def __init__(self, start_ms: int, seed: int) -> None:
        self.ms = start_ms
        self.rand = random.Random(seed)

    def next(self) -> tuple[str, datetime]:
        self.ms += 1
        rand = self.rand.getrandbits(76)
        value = (self.ms << 80) | (0x7 << 76) | (rand & ((1 << 76) - 1))
        value = (value & ~(0x3 << 62)) | (0x2 << 62)
        h = f"{value:032x}"
        return f"{h[:8]}-{h[8:12]}-{h[12:16]}-{h[16:20]}-{h[20:]}", datetime.fromtimestamp(self.ms / 1000, UTC)


def _text(rng: np.random.Generator, n_words: int) -> str:
    return " ".join(WORDS[i] for i in rng.integers(0, len(WORDS), n_words))


def _work(rng: np.random.Generator, system_prompt: str | None) -> dict[str, Any]:
    """What ``WorkParameters.model_dump(mode="json")`` stores for an assistant message."""
    temperature = [None, 0.7, 1.0][int(rng.integers(0, 3))]
    return {
        "model_config_name": MODEL,
        "sampling_parameters": {
            "top_k": [None, 50][int(rng.integers(0, 2))],
            "top_p": [None, 0.9][int(rng.integers(0, 2))],
            "typical_p": None,
            "temperature": temperature,
            "repetition_penalty": None,
            "max_new_tokens": 120,
            "seed": None,
            "stop_token_ids": [],
            "top_logprobs": 0,
        },
        "do_sample": True,
        "seed": int(rng.integers(0, 2**31)),
        "system_prompt": system_prompt,
        "tools": None,
    }


# Every message row carries every column: executemany takes its column list from the first row.
MESSAGE_DEFAULTS: dict[str, Any] = {
    "parent_id": None,
    "content": None,
    "tool_call_id": None,
    "reasoning_content": None,
    "tool_calls": None,
    "score": 0,
    "voted_at": None,
    "model_config_name": None,
    "work_parameters": None,
    "attempt": 0,
    "worker_id": None,
    "error": None,
    "error_code": None,
    "finish_reason": None,
    "prompt_token_count": None,
    "completion_token_count": None,
}


@dataclass
class Rows:
    users: list[dict[str, Any]] = field(default_factory=list)
    chats: list[dict[str, Any]] = field(default_factory=list)
    messages: list[dict[str, Any]] = field(default_factory=list)
    tokens: list[dict[str, Any]] = field(default_factory=list)


def _assistant(
    rows: Rows,
    rng: np.random.Generator,
    ids: Ids,
    chat_id: str,
    parent_id: str,
    prompt: np.ndarray,
    prior: tuple[str, int, int] | None,
    system_prompt: str | None,
) -> tuple[str, np.ndarray, bool]:
    """One complete assistant message with its token row; returns (id, completion, cut by length)."""
    mid, created = ids.next()
    n = int(rng.integers(20, 121))
    cut = rng.random() < 0.1
    completion = rng.integers(3, VOCAB, n).astype(np.int32)
    if not cut:
        completion[-1] = EOS
    logprobs = -rng.exponential(0.6, n).astype(np.float32)
    if rng.random() < 0.02:
        logprobs[int(rng.integers(0, n))] = -np.inf  # a token sampled outside the scorer's support
    content = _text(rng, max(1, n * 3 // 4))
    offsets = np.linspace(0, len(content), n, endpoint=False).astype(np.int32)
    voted = rng.random() < 0.25
    rows.messages.append(
        MESSAGE_DEFAULTS
        | {
            "id": mid,
            "chat_id": chat_id,
            "parent_id": parent_id,
            "role": "assistant",
            "content": content,
            "state": "complete",
            "created_at": created,
            "modified_at": created,
            "score": int(rng.integers(-1, 2)) if voted else 0,
            "voted_at": created if voted else None,
            "model_config_name": MODEL,
            "work_parameters": _work(rng, system_prompt),
            "attempt": 1,
            "worker_id": "bench-worker",
            "finish_reason": "length" if cut else "stop",
            "prompt_token_count": len(prompt),
            "completion_token_count": n,
        }
    )
    rows.tokens.append(
        {
            "message_id": mid,
            "prompt_ids": prompt.tobytes(),
            "completion_ids": completion.tobytes(),
            "logprobs": logprobs.tobytes(),
            "text_offsets": offsets.tobytes(),
            "completion_text": content,
            "finish_reason": "length" if cut else "stop",
            "stop_reason": None if cut else f"i:{EOS}",
            "engine": "hf",
            "tokenizer_hash": "t0k3n1z3r",
            "template_hash": "t3mpl4t3",
            "prior_message_id": prior[0] if prior else None,
            "reused_prefix_len": prior[1] if prior else 0,
            "synthetic_token_count": prior[2] if prior else 0,
            "fork": False,
            "num_cached_tokens": prior[1] if prior else 0,
            "resumed_at": b"",
            "created_at": created,
        }
    )
    return mid, completion, cut


def make_chats(rng: np.random.Generator, ids: Ids, first: int, count: int, turns: int) -> Rows:
    rows = Rows()
    for c in range(first, first + count):
        user = f"bench-user-{c // 5}"
        if c % 5 == 0:  # five chats per user, inserted in order
            rows.users.append({"id": user, "display_name": user, "provider": "apikey", "is_admin": False})
        chat_id, created = ids.next()
        system_prompt = None if rng.random() < 0.3 else SYSTEM_PROMPTS[int(rng.integers(0, len(SYSTEM_PROMPTS)))]
        chat: dict[str, Any] = {
            "id": chat_id,
            "user_id": user,
            "created_at": created,
            "modified_at": created,
            "title": _text(rng, 4),
            "hidden": False,
            "allow_data_use": bool(rng.random() >= 0.02),
            "system_prompt": system_prompt,
            "tools": None,
        }
        rows.chats.append(chat)
        parent: str | None = None
        seq = np.empty(0, dtype=np.int32)  # the previous turn's prompt + completion
        prior: tuple[str, int, int] | None = None
        prior_id, cut = "", False
        for t in range(turns):
            pid, pcreated = ids.next()
            rows.messages.append(
                MESSAGE_DEFAULTS
                | {
                    "id": pid,
                    "chat_id": chat_id,
                    "parent_id": parent,
                    "role": "prompter",
                    "content": _text(rng, int(rng.integers(5, 40))),
                    "state": "manual",
                    "created_at": pcreated,
                    "modified_at": pcreated,
                    "score": 0,
                }
            )
            if t == 0:
                prompt = rng.integers(3, VOCAB, int(rng.integers(40, 81))).astype(np.int32)
            else:
                closer = np.array([EOS], dtype=np.int32) if cut else np.empty(0, dtype=np.int32)
                bridge = rng.integers(3, VOCAB, int(rng.integers(8, 13))).astype(np.int32)
                prompt = np.concatenate([seq, closer, bridge])
                prior = (prior_id, len(seq), len(closer))
            aid, completion, cut = _assistant(rows, rng, ids, chat_id, pid, prompt, prior, system_prompt)
            if t == turns - 1 and rng.random() < 0.1:  # regenerated last reply: a second leaf
                _assistant(rows, rng, ids, chat_id, pid, prompt, prior, system_prompt)
            prior_id, parent = aid, aid
            seq = np.concatenate([prompt, completion])
        chat["active_thread_tail_message_id"] = parent
    return rows


async def insert_rows(conn: Any, rows: Rows) -> None:
    """Insert generated rows on an open connection (SQLAlchemy Core executemany, table by table)."""
    from sqlalchemy import insert

    from server.models import Chat, Message, MessageTokens, User

    for table, values in (
        (User.__table__, rows.users),
        (Chat.__table__, rows.chats),
        (Message.__table__, rows.messages),
        (MessageTokens.__table__, rows.tokens),
    ):
        if values:  # (an empty list would insert one row of defaults)
            await conn.execute(insert(table), values)


async def insert_chats(
    url: str, first: int, count: int, turns: int, rng: np.random.Generator, ids: Ids
) -> tuple[float, float]:
    """Bulk-insert ``count`` chats (Core executemany, one transaction per 500 chats).
    Returns (seconds generating the rows, seconds inserting them)."""
    from server.db import create_engine

    engine = create_engine(url)
    generate = elapsed = 0.0
    try:
        for start in range(first, first + count, 500):
            t0 = time.perf_counter()
            rows = make_chats(rng, ids, start, min(500, first + count - start), turns)
            generate += time.perf_counter() - t0
            t0 = time.perf_counter()
            async with engine.begin() as conn:
                await insert_rows(conn, rows)
            elapsed += time.perf_counter() - t0
        if engine.dialect.name == "postgresql":  # statistics, as after a bulk load (committed: in a
            async with engine.begin() as conn:  # transaction rolled back, ANALYZE's are lost)
                await conn.exec_driver_sql("ANALYZE")
    finally:
        await engine.dispose()
    return generate, elapsed


# --- databases ---------------------------------------------------------------------------------------


async def _pg(admin_url: str, sql: str) -> None:
    import asyncpg

    conn = await asyncpg.connect(admin_url)
    try:
        await conn.execute(sql)
    finally:
        await conn.close()


class Database:
    def __init__(self, backend: str, tmp: Path, postgres: str) -> None:
        self.backend = backend
        if backend == "sqlite":
            self.url = f"sqlite+aiosqlite:///{tmp / 'bench.db'}"
        elif backend == "postgres":
            self.name = f"tt_bench_{secrets.token_hex(4)}"
            self.admin = postgres
            asyncio.run(_pg(postgres, f'CREATE DATABASE "{self.name}"'))
            base = postgres.rsplit("/", 1)[0].replace("postgresql://", "postgresql+asyncpg://", 1)
            self.url = f"{base}/{self.name}"
        else:
            raise SystemExit(f"unknown backend {backend!r}: sqlite or postgres")

    def drop(self) -> None:
        if self.backend == "postgres":
            asyncio.run(_pg(self.admin, f'DROP DATABASE IF EXISTS "{self.name}" WITH (FORCE)'))


# --- one export, in a fresh process ------------------------------------------------------------------


def _status_kb(key: str) -> int:
    with open("/proc/self/status") as fh:
        for line in fh:
            if line.startswith(key + ":"):
                return int(line.split()[1])
    raise RuntimeError(f"{key} not in /proc/self/status")


def child(spec: dict[str, Any]) -> None:
    """Run one export and print a JSON line: seconds, rollouts, RSS before, peak RSS."""
    import pyarrow.parquet  # noqa: F401  (imported before the baseline: a library, not export memory)

    from server.export.run import run_export
    from server.settings import ServerSettings

    settings = ServerSettings(database_url=spec["url"], migrate_on_start=False, data_dir=Path(spec["out"]).parent)
    out = Path(spec["out"])
    # into a new file, as an export usually writes: replacing the last run's (hundreds of MB) would time
    # the kernel dropping that file's pages and, on ext4, writing the new one out when it is closed
    out.unlink(missing_ok=True)
    try:  # reset the high-water mark to the current RSS (Linux >= 4.0); else VmHWM covers start-up too
        with open("/proc/self/clear_refs", "w") as fh:
            fh.write("5")
        reset = True
    except OSError:
        reset = False
    before = _status_kb("VmRSS")
    profiler = None
    if spec.get("profile"):
        import cProfile

        profiler = cProfile.Profile()
        profiler.enable()
    t0, c0 = time.perf_counter(), time.process_time()
    workers = spec.get("workers")
    message = asyncio.run(
        run_export(settings, out, fmt=spec["fmt"], schema="tokentrail", progress=False, workers=workers)
    )
    seconds, cpu = time.perf_counter() - t0, time.process_time() - c0
    if profiler is not None:
        import pstats

        profiler.disable()
        pstats.Stats(profiler, stream=sys.stderr).sort_stats("cumulative").print_stats(35)
        pstats.Stats(profiler, stream=sys.stderr).sort_stats("tottime").print_stats(25)
    peak = _status_kb("VmHWM")
    import resource

    from server.export.parallel import LAST

    children = resource.getrusage(resource.RUSAGE_CHILDREN)
    match = re.match(r"exported (\d+) rollouts", message)
    rollouts = int(match.group(1)) if match else -1
    result = {
        "seconds": seconds,
        "cpu_seconds": cpu,  # this process only (not the database server)
        "rollouts": rollouts,
        "rss_before_mb": before / 1024,
        "peak_rss_mb": peak / 1024,
        "peak_growth_mb": (peak - before) / 1024 if reset else None,
        "workers": LAST.workers,
        "workers_cpu_seconds": children.ru_utime + children.ru_stime,
        "workers_peak_growth_mb": LAST.peak_growth_mb,
        "file_mb": out.stat().st_size / 2**20,
    }
    print(json.dumps(result))


def run_child(url: str, out: Path, fmt: str, profile: bool, workers: int | None) -> dict[str, Any]:
    spec = json.dumps({"url": url, "out": str(out), "fmt": fmt, "profile": profile, "workers": workers})
    proc = subprocess.run(
        [sys.executable, str(Path(__file__).resolve()), "--child", spec],
        capture_output=True,
        text=True,
        cwd=ROOT,
    )
    if proc.returncode != 0:
        raise RuntimeError(f"export child failed:\n{proc.stderr[-4000:]}")
    if profile:
        print(proc.stderr, file=sys.stderr)
    result: dict[str, Any] = json.loads(proc.stdout.strip().splitlines()[-1])
    return result


# --- driver ------------------------------------------------------------------------------------------


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--conversations", type=int, default=10_000)
    parser.add_argument("--turns", type=int, default=4)
    parser.add_argument("--backends", default="sqlite,postgres")
    parser.add_argument("--formats", default="jsonl,parquet")
    parser.add_argument("--postgres", default="postgresql://postgres@127.0.0.1:5432/postgres", help="admin URL")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--repeat", type=int, default=3, help="runs per export: report the fastest (and the median)")
    parser.add_argument("--keep", type=Path, help="copy the exported files of the largest step here")
    parser.add_argument("--profile", action="store_true", help="cProfile each export (stderr); slows it down")
    parser.add_argument("--workers", type=int, help="export worker processes (default: the CLI's, one per core)")
    parser.add_argument("--json", action="store_true", help="print one JSON object instead of a table")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        child(json.loads(args.child))
        return

    from server.migrate import upgrade

    n = args.conversations
    steps = sorted({max(1, n // 4), max(1, n // 2), n})
    backends = [b for b in args.backends.split(",") if b]
    formats = [f for f in args.formats.split(",") if f]
    log = (lambda *a: print(*a, file=sys.stderr, flush=True)) if not args.json else (lambda *a: None)
    report: dict[str, Any] = {
        "conversations": n,
        "turns": args.turns,
        "steps": steps,
        "cpus": os.cpu_count(),
        "python": sys.version.split()[0],
        "loadavg_start": os.getloadavg()[0],
        "insert": {},
        "exports": [],
    }
    for backend in backends:
        with tempfile.TemporaryDirectory(prefix="tt-export-bench-") as tmp_dir:
            tmp = Path(tmp_dir)
            db = Database(backend, tmp, args.postgres)
            try:
                t0 = time.perf_counter()
                upgrade(db.url)
                migrate_s = time.perf_counter() - t0
                rng, ids = np.random.default_rng(args.seed), Ids(int(time.time() * 1000) - 10 * 86_400_000, args.seed)
                inserted, insert_s, generate_s = 0, 0.0, 0.0
                for step in steps:
                    gen, ins = asyncio.run(insert_chats(db.url, inserted, step - inserted, args.turns, rng, ids))
                    generate_s, insert_s = generate_s + gen, insert_s + ins
                    inserted = step
                    log(f"{backend}: {inserted} chats stored (insert {insert_s:.1f}s so far)")
                    for fmt in formats:
                        out = tmp / f"export-{step}.{fmt}"
                        runs = []
                        for _ in range(max(1, args.repeat)):
                            # each run writes a new file: truncating the last run's (hundreds of MB) is the
                            # kernel's work, and ext4 then writes the file back on close (auto_da_alloc)
                            out.unlink(missing_ok=True)
                            runs.append(run_child(db.url, out, fmt, args.profile, args.workers))
                        res = min(runs, key=lambda r: r["seconds"])
                        res.update(backend=backend, format=fmt, conversations=step, runs=len(runs))
                        res["rollouts_per_s"] = res["rollouts"] / res["seconds"]
                        median = sorted(r["seconds"] for r in runs)[len(runs) // 2]
                        res["median_rollouts_per_s"] = res["rollouts"] / median
                        res["peak_rss_mb"] = max(r["peak_rss_mb"] for r in runs)  # memory: the worst run
                        growths = [r["peak_growth_mb"] for r in runs]
                        workers_growth = [sum(r["workers_peak_growth_mb"]) for r in runs]
                        if None not in growths:
                            res["total_growth_mb"] = max(g + w for g, w in zip(growths, workers_growth, strict=True))
                        res["peak_growth_mb"] = None if None in growths else max(growths)
                        res["workers_peak_growth_mb"] = max(workers_growth)
                        report["exports"].append(res)
                        log(
                            f"  {fmt:8} {step:>7} chats  {res['rollouts']:>7} rollouts  {res['seconds']:6.2f}s  "
                            f"{res['rollouts_per_s']:>8,.0f} rollouts/s  peak {res['peak_rss_mb']:.0f} MB  "
                            f"growth {res.get('total_growth_mb', float('nan')):.0f} MB with {res['workers']} workers"
                        )
                        if args.keep and step == n:
                            args.keep.mkdir(parents=True, exist_ok=True)
                            shutil.copy(out, args.keep / f"{backend}.{fmt}")
                        out.unlink()
                report["insert"][backend] = {
                    "chats": n,
                    "migrate_seconds": migrate_s,
                    "seconds": insert_s,  # executing the inserts (not generating the rows)
                    "generate_seconds": generate_s,
                    "chats_per_s": n / insert_s if insert_s else None,
                }
            finally:
                db.drop()

    report["loadavg_end"] = os.getloadavg()[0]
    if args.json:
        print(json.dumps(report, indent=2))
        return
    print(
        f"\nexport benchmark: {n} conversations x {args.turns} turns, {os.cpu_count()} CPUs, load average "
        f"{report['loadavg_start']:.1f} -> {report['loadavg_end']:.1f} (other work on the machine slows wall times)"
    )
    print(
        f"each export: fastest of {args.repeat} runs in fresh processes (seconds, rollouts/s, the cpu s of the "
        "process and of its worker processes), median rollouts/s; peak RSS and its growth during the export "
        "(the process's, and with its workers'): the largest of the runs\n"
    )
    for backend, ins in report["insert"].items():
        print(f"insert {backend:8}: {ins['chats']} chats in {ins['seconds']:.1f}s ({ins['chats_per_s']:,.0f} chats/s)")
    print()
    header = f"{'backend':9} {'format':8} {'N':>7} {'rollouts':>9} {'seconds':>8} {'rollouts/s':>11} {'median/s':>9} "
    header += f"{'cpu s':>6} {'workers':>7} {'their cpu s':>11} "
    header += f"{'peak MB':>8} {'growth MB':>10} {'total MB':>9} {'file MB':>8}"
    print(header)
    print("-" * len(header))
    for r in report["exports"]:
        growth = "n/a" if r["peak_growth_mb"] is None else f"{r['peak_growth_mb']:.1f}"
        total = f"{r['total_growth_mb']:.1f}" if "total_growth_mb" in r else "n/a"
        print(
            f"{r['backend']:9} {r['format']:8} {r['conversations']:>7} {r['rollouts']:>9} {r['seconds']:>8.2f} "
            f"{r['rollouts_per_s']:>11,.0f} {r['median_rollouts_per_s']:>9,.0f} {r['cpu_seconds']:>6.2f} "
            f"{r['workers']:>7} {r['workers_cpu_seconds']:>11.2f} "
            f"{r['peak_rss_mb']:>8.1f} {growth:>10} {total:>9} "
            f"{r['file_mb']:>8.1f}"
        )


if __name__ == "__main__":
    main()
