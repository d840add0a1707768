"""Prefix-match lookup time against the number of stored messages (DESIGN D12).

Fills a fresh database (SQLite by default, or ``--database-url``) with N messages of OpenAI-API chats
(chains of 20 messages, chain hashes as the server computes them, spread over 100 users), then times
``ConversationStore.longest_match`` for requests of 21 messages whose first 10 match a stored chat of
the requesting user: the query the server runs for every ``/v1/chat/completions``. Prints one row per
size: median and p99 lookup time, and the rows inserted. Lookup cost should stay flat as N grows
(one index probe per request message), not grow with N.

    python benchmarks/prefix_index.py [--sizes 1000,10000,100000,1000000] [--lookups 300]
        [--database-url postgresql+asyncpg://postgres@127.0.0.1:5432/test]
"""

from __future__ import annotations

import argparse
import asyncio
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from sqlalchemy import delete, insert, text

from server import migrate
from server.db import create_engine, create_session_factory
from server.hot_sql import HotSql
from server.models import Chat, Message, User
from server.openai.conversations import ConversationStore
from shared.chain import chain_hashes, chain_seed, normalized

CHAIN = 20
USERS = 100


def _chain(user: str, chat: int) -> list[str]:
    seed = chain_seed(user, "bench", None, None)
    msgs = [normalized("user" if k % 2 == 0 else "assistant", f"chat {chat} message {k}") for k in range(CHAIN)]
    return chain_hashes(seed, msgs)


async def fill(url: str, total: int, have: int) -> int:
    engine = create_engine(url)
    try:
        async with engine.begin() as conn:
            if have == 0:
                await conn.execute(
                    insert(User), [{"id": f"u{u}", "display_name": "b", "provider": "apikey"} for u in range(USERS)]
                )
            chats = range(have // CHAIN, total // CHAIN)
            batch_chats: list[dict[str, Any]] = []
            batch_msgs: list[dict[str, Any]] = []
            for c in chats:
                user = f"u{c % USERS}"
                chat_id = f"c{c:010d}"
                batch_chats.append({"id": chat_id, "user_id": user})
                parent = None
                for k, h in enumerate(_chain(user, c)):
                    mid = f"m{c:010d}-{k:02d}"
                    role = "prompter" if k % 2 == 0 else "assistant"
                    state = "manual" if k % 2 == 0 else "complete"
                    batch_msgs.append(
                        {
                            "id": mid,
                            "chat_id": chat_id,
                            "parent_id": parent,
                            "role": role,
                            "state": state,
                            "content": "x",
                            "chain_hash": h,
                        }
                    )
                    parent = mid
                if len(batch_msgs) >= 20_000:
                    await conn.execute(insert(Chat), batch_chats)
                    await conn.execute(insert(Message), batch_msgs)
                    batch_chats, batch_msgs = [], []
            if batch_msgs:
                await conn.execute(insert(Chat), batch_chats)
                await conn.execute(insert(Message), batch_msgs)
    finally:
        await engine.dispose()
    return (total // CHAIN) * CHAIN


async def lookups(url: str, stored_chats: int, n: int) -> list[float]:
    engine = create_engine(url)
    sessions = create_session_factory(engine)
    sql = HotSql(engine)  # through SQLAlchemy, as measured since this benchmark was written
    rng = random.Random(0)
    times = []
    try:
        for _ in range(n):
            c = rng.randrange(stored_chats)
            user = f"u{c % USERS}"
            hashes = _chain(user, c)[:10]
            seed = hashes[-1]
            tail = chain_hashes(seed, [normalized("user", f"new {rng.random()}") for _ in range(11)])
            async with sessions() as s:
                store = ConversationStore(s, user, sql)
                start = time.perf_counter()
                msg, matched = await store.longest_match(hashes + tail, None)
                times.append(time.perf_counter() - start)
            assert msg is not None and matched == 10, (matched, c)
    finally:
        await engine.dispose()
    return times


async def reset(url: str) -> None:
    engine = create_engine(url)
    try:
        async with engine.begin() as conn:
            await conn.execute(delete(Message))
            await conn.execute(delete(Chat))
            await conn.execute(delete(User).where(User.id.like("u%")))
            if url.startswith("postgresql"):
                await conn.execute(text("ANALYZE messages"))
    finally:
        await engine.dispose()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--sizes", default="1000,10000,100000,1000000")
    parser.add_argument("--lookups", type=int, default=300)
    parser.add_argument("--database-url", help="an empty database to fill (default: a temporary SQLite file)")
    args = parser.parse_args(argv)
    sizes = sorted(int(x) for x in args.sizes.split(","))
    with tempfile.TemporaryDirectory(prefix="tokentrail-prefix-") as tmp:
        url = args.database_url or f"sqlite+aiosqlite:///{Path(tmp) / 'bench.db'}"
        migrate.upgrade(url)
        if args.database_url:
            asyncio.run(reset(url))
        print(f"{'stored messages':>16} {'median ms':>10} {'p99 ms':>8} {'fill s':>7}")
        have = 0
        for size in sizes:
            start = time.monotonic()
            have = asyncio.run(fill(url, size, have))
            filled = time.monotonic() - start
            times = sorted(asyncio.run(lookups(url, have // CHAIN, args.lookups)))
            p99 = times[min(len(times) - 1, int(len(times) * 0.99))]
            print(f"{have:>16,} {statistics.median(times) * 1000:>10.3f} {p99 * 1000:>8.3f} {filled:>7.1f}", flush=True)
        if args.database_url:
            asyncio.run(reset(url))
    return 0


if __name__ == "__main__":
    sys.exit(main())
