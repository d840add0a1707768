"""The rollout feed under agent load: every rewarded episode reaches a consumer that is killed and restarted,
and how long after its reward each episode is in the feed.

    python benchmarks/feed.py [--store sqlite|postgres] [--users 8] [--episodes 10] [--turns 2-6]
                              [--tokens 16] [--kills 3] [--json]

Real processes: ``--store sqlite`` is embedded defaults (one server, its queue in-process, one worker);
``--store postgres`` two server replicas on a fresh PostgreSQL database and a private Redis, one worker
on each. ``--users`` users each play ``--episodes`` agent episodes through the official ``openai`` SDK
(``--turns`` turns each, the history echoed, a new conversation per episode, the replicas taken in
turn) and post ``POST /v1/rewards`` with ``done: true`` on each episode's last reply (the next replica's
turn for that, so episodes end on both).

Two consumers read the feed with an admin key:
- ``tokentrail export --follow`` (a child process, appending to a JSONL file with a cursor file), killed
  with SIGKILL ``--kills`` times spread over the run and started again at once, each time with the
  replicas' URLs in the other order (it switches replicas). The file is watched every 10 ms.
- ``tokentrail.rollouts`` in this process, never killed: latency is from each reward's answer to the
  rollout's arrival here.

Checks, after the users stop and the file has caught up (or 60 s): missing (rewarded episodes not in
the file), unexpected (rollouts in it that no user ended), duplicate lines (at-least-once deliveries;
removed by ``rollout_id``), and mismatches against a full ``tokentrail export`` of the database (turn
ids, token ids, loss masks, logprobs, policy versions and reward of each rollout). Exit status 1 if
missing, unexpected or mismatches is not 0, or the live reader's p99 latency is over 1 s.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import random
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import orjson

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.chaos import MODEL, cluster
from benchmarks.models import prepare_model
from benchmarks.progress import say


@dataclass
class Tally:
    rewarded: dict[str, float] = field(default_factory=dict)  # rollout id -> when its reward was answered
    rewards: dict[str, float] = field(default_factory=dict)  # rollout id -> reward
    turns: int = 0
    failed: int = 0
    live: dict[str, float] = field(default_factory=dict)  # rollout id -> arrival at the live reader
    filed: dict[str, float] = field(default_factory=dict)  # rollout id -> first seen in the follow file


def _pct(xs: list[float], q: float) -> float | None:
    if not xs:
        return None
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))]


async def agent(
    urls: list[str], key: str, tally: Tally, args: argparse.Namespace, index: int, rng: random.Random
) -> None:
    from openai import AsyncOpenAI

    clients = [AsyncOpenAI(base_url=f"{u}/v1", api_key=key, max_retries=2, timeout=300) for u in urls]
    import httpx

    async with httpx.AsyncClient(timeout=60) as http:
        for episode in range(args.episodes):
            turns = rng.randint(args.min_turns, args.max_turns)
            history: list[dict[str, Any]] = [{"role": "user", "content": f"agent {index} episode {episode}"}]
            mid = None
            for turn in range(turns):
                client = clients[(index + episode + turn) % len(clients)]
                try:
                    reply = await client.chat.completions.create(
                        model=MODEL,
                        messages=history,
                        max_tokens=args.tokens,
                        temperature=1.0,  # type: ignore[arg-type]
                    )
                except Exception as exc:  # counted; the run goes on
                    say(f"  agent {index}: turn failed: {exc!r}")
                    tally.failed += 1
                    mid = None
                    break
                tally.turns += 1
                mid = (reply.choices[0].model_extra or {})["tokentrail"]["message_id"]
                history += [{"role": "assistant", "content": reply.choices[0].message.content or ""},
                            {"role": "user", "content": f"observation {turn}"}]  # fmt: skip
            if mid is None:
                continue
            reward = round(rng.uniform(-1, 1), 3)
            url = urls[(index + episode + 1) % len(urls)]
            for attempt in range(3):  # posting a reward again replaces it: safe to retry
                try:
                    resp = await http.post(
                        f"{url}/v1/rewards",
                        json={"message_id": mid, "reward": reward, "done": True},
                        headers={"Authorization": f"Bearer {key}"},
                    )
                    break
                except httpx.TransportError as exc:  # e.g. a kept-alive connection the server closed
                    if attempt == 2:
                        raise
                    say(f"  agent {index}: reward post failed ({exc!r}); posting it again")
            if resp.status_code != 200:
                say(f"  agent {index}: reward refused: {resp.status_code} {resp.text[:200]}")
                tally.failed += 1
                continue
            tally.rewarded[mid] = time.monotonic()
            tally.rewards[mid] = reward


def _live_reader(urls: list[str], key: str, tally: Tally, stop: threading.Event) -> None:
    import tokentrail

    feed = tokentrail.rollouts(urls, key)
    try:
        for rollout in feed:
            tally.live.setdefault(rollout["rollout_id"], time.monotonic())
            if stop.is_set():
                return
    finally:
        feed.close()


def _watch_file(path: Path, tally: Tally, stop: threading.Event) -> None:
    """Timestamps each rollout id's first complete line in the follow file."""
    seen = 0
    while not stop.is_set():
        data = path.read_bytes() if path.exists() else b""
        if len(data) < seen:  # a restarted follower cut a half-written line
            seen = data.rfind(b"\n", 0, len(data)) + 1
        end = data.rfind(b"\n") + 1
        for line in data[seen:end].splitlines():
            with contextlib.suppress(orjson.JSONDecodeError):
                tally.filed.setdefault(orjson.loads(line)["rollout_id"], time.monotonic())
        seen = max(seen, end)
        time.sleep(0.01)


@contextlib.contextmanager
def follower(urls: list[str], key: str, out: Path, cursor: Path, log: Path) -> Iterator[list[subprocess.Popen[bytes]]]:
    """``tokentrail export --follow`` as a child process; the list holds the current one (restarts replace it)."""
    procs: list[subprocess.Popen[bytes]] = []
    _restart(procs, urls, key, out, cursor, log)
    try:
        yield procs
    finally:
        for p in procs:
            if p.poll() is None:
                p.send_signal(signal.SIGINT)
                try:
                    p.wait(timeout=10)
                except subprocess.TimeoutExpired:
                    p.kill()


def _full_export(database: str, out: Path) -> dict[str, dict[str, Any]]:
    env = {**os.environ, "TOKENTRAIL_DATABASE_URL": database}
    done = subprocess.run(
        [sys.executable, "-m", "tokentrail", "export", "--out", str(out), "--quiet"], env=env, capture_output=True
    )
    if done.returncode != 0:
        raise RuntimeError(done.stderr.decode()[-3000:])
    return {r["rollout_id"]: r for r in map(orjson.loads, out.read_bytes().splitlines())}


def _same(fed: dict[str, Any], full: dict[str, Any]) -> bool:
    if [t["message_id"] for t in fed["turns"]] != [t["message_id"] for t in full["turns"]]:
        return False
    keys = ("token_ids", "loss_mask", "logprobs", "policy_versions")
    return fed["reward"] == full["reward"] and all(
        [s[k] for s in fed["samples"]] == [s[k] for s in full["samples"]] for k in keys
    )


async def drive(args: argparse.Namespace) -> dict[str, Any]:
    from server.admin import issue_user_key
    from server.settings import ServerSettings

    model_dir = prepare_model("chatml")
    sqlite = args.store == "sqlite"
    with contextlib.ExitStack() as stack:
        tmp = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="tt-feed-")))
        if sqlite:
            database = f"sqlite+aiosqlite:///{tmp}/tokentrail.db"
        else:
            from tests import services

            database = stack.enter_context(services.postgres_service())
        replicas = 1 if sqlite else 2
        say(f"starting {replicas} server(s) and {replicas} worker(s) on {args.store}...")
        c = stack.enter_context(
            cluster(tmp, replicas, replicas, model_dir, None, database, "all", with_redis=not sqlite)
        )
        settings = ServerSettings(database_url=database, migrate_on_start=False)
        admin = c.admin_key
        keys = [await asyncio.to_thread(issue_user_key, settings, f"agent-{i}") for i in range(args.users)]
        tally = Tally()
        stop = threading.Event()
        out, cursor, log = tmp / "feed.jsonl", tmp / "feed.cursor", tmp / "follow.log"
        threads = [
            threading.Thread(target=_live_reader, args=(c.urls, admin, tally, stop), daemon=True),
            threading.Thread(target=_watch_file, args=(out, tally, stop), daemon=True),
        ]
        for t in threads:
            t.start()
        procs = stack.enter_context(follower(c.urls, admin, out, cursor, log))
        rng = random.Random(args.seed)
        say(f"{args.users} agents x {args.episodes} episodes of {args.min_turns}-{args.max_turns} turns;"
            f" the follower is SIGKILLed {args.kills} times")  # fmt: skip
        began = time.monotonic()
        agents = asyncio.gather(
            *(agent(c.urls, k, tally, args, i, random.Random(rng.random())) for i, k in enumerate(keys))
        )
        kills = 0
        order = list(c.urls)
        while not agents.done():
            await asyncio.sleep(0.1)
            # spread the kills over the run: the n-th once n/(kills+1) of the episodes have been rewarded
            total = args.users * args.episodes
            if kills < args.kills and len(tally.rewarded) >= (kills + 1) * total / (args.kills + 1):
                kills += 1
                os.kill(procs[-1].pid, signal.SIGKILL)
                procs[-1].wait()
                order = order[1:] + order[:1]  # the next replica first
                say(f"  follower SIGKILLed ({kills}/{args.kills}) at {len(tally.rewarded)} rewarded; restarted on"
                    f" {order[0]}")  # fmt: skip
                _restart(procs, order, admin, out, cursor, log)
        await agents
        elapsed = time.monotonic() - began
        deadline = time.monotonic() + 60
        caught_up = lambda: set(tally.rewarded) <= set(tally.filed) and set(tally.rewarded) <= set(tally.live)  # noqa: E731
        while time.monotonic() < deadline and not caught_up():  # noqa: ASYNC110 - threads fill the tally
            await asyncio.sleep(0.1)
        stop.set()
        lines = [orjson.loads(x) for x in out.read_bytes().splitlines()] if out.exists() else []
        full = _full_export(database, tmp / "full.jsonl")
    ids = [r["rollout_id"] for r in lines]
    unique = {r["rollout_id"]: r for r in lines}  # the consumer's de-duplication: the last line per id
    live = [tally.live[m] - t for m, t in tally.rewarded.items() if m in tally.live]
    filed = [tally.filed[m] - t for m, t in tally.rewarded.items() if m in tally.filed]
    result = {
        "store": args.store,
        "replicas": 1 if sqlite else 2,
        "users": args.users,
        "episodes_rewarded": len(tally.rewarded),
        "turns": tally.turns,
        "failed_turns_or_rewards": tally.failed,
        "seconds": round(elapsed, 1),
        "follower_kills": kills,
        "missing": len(set(tally.rewarded) - set(unique)),
        "unexpected": len(set(unique) - set(tally.rewarded)),
        "duplicate_lines": len(ids) - len(unique),
        "mismatches": sum(1 for i, r in unique.items() if i not in full or not _same(r, full[i])),
        "reward_mismatches": sum(1 for i, r in unique.items() if r["reward"] != tally.rewards.get(i)),
        "live_missing": len(set(tally.rewarded) - set(tally.live)),
        "live_latency_s": {"p50": _pct(live, 0.5), "p99": _pct(live, 0.99), "max": max(live, default=None)},
        "follow_file_latency_s": {"p50": _pct(filed, 0.5), "p99": _pct(filed, 0.99), "max": max(filed, default=None)},
    }
    return result


def _restart(
    procs: list[subprocess.Popen[bytes]], order: list[str], key: str, out: Path, cursor: Path, log: Path
) -> None:
    cmd = [sys.executable, "-m", "tokentrail", "export", "--follow", "--api-key", key, "--out", str(out),
           "--cursor-file", str(cursor), "--quiet"]  # fmt: skip
    for u in order:
        cmd += ["--server-url", u]
    with open(log, "ab") as fh:
        procs.append(subprocess.Popen(cmd, stdout=fh, stderr=subprocess.STDOUT))


def _fmt(x: float | None) -> str:
    return "-" if x is None else f"{x:.3f}"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--store", choices=("sqlite", "postgres"), default="sqlite")
    p.add_argument("--users", type=int, default=8)
    p.add_argument("--episodes", type=int, default=10, help="episodes per user")
    p.add_argument("--turns", default="2-6", help="turns per episode: MIN-MAX")
    p.add_argument("--tokens", type=int, default=16, help="max_tokens per turn")
    p.add_argument("--kills", type=int, default=3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", action="store_true")
    args = p.parse_args()
    lo, _, hi = args.turns.partition("-")
    args.min_turns, args.max_turns = int(lo), int(hi or lo)
    r = asyncio.run(drive(args))
    if args.json:
        print(json.dumps(r, indent=2))
    else:
        head = f"{r['store']} ({r['replicas']} replica(s)), {r['users']} users: {r['episodes_rewarded']} episodes"
        print(f"\n{head} ({r['turns']} turns) rewarded in {r['seconds']} s; follower SIGKILLed {r['follower_kills']}x")
        for name in ("missing", "unexpected", "duplicate_lines", "mismatches", "reward_mismatches", "live_missing",
                     "failed_turns_or_rewards"):  # fmt: skip
            print(f"  {name}: {r[name]}")
        for name in ("live_latency_s", "follow_file_latency_s"):
            lat = r[name]
            print(f"  {name}: p50 {_fmt(lat['p50'])}  p99 {_fmt(lat['p99'])}  max {_fmt(lat['max'])}")
    bad = r["missing"] or r["unexpected"] or r["mismatches"] or r["reward_mismatches"] or r["live_missing"]
    p99 = r["live_latency_s"]["p99"]
    sys.exit(1 if bad or p99 is None or p99 > 1.0 else 0)


if __name__ == "__main__":
    main()
