"""Weight pushes under load: users in agent loops while new versions are pushed, then every stored token
teacher-forced under the weights of the version it records.

    python benchmarks/weights.py [--engine hf|vllm] [--mode drain|inflight] [--users 8] [--pushes 5]
                                 [--push-every 6] [--tokens 48] [--restart-worker] [--json]

Real processes: a server on embedded defaults (SQLite) and one worker (``--engine``; vllm runs with the
python of ``$TOKENTRAIL_VLLM_VENV``) serving the tiny chatml model. ``--users`` closed-loop users play
agent loops through ``POST /v1/chat/completions`` (each conversation ``--turns`` turns, every turn
appended to its history); meanwhile ``--pushes`` checkpoints (the tiny model moved by seeded noise: a
stand-in for a training step) are pushed one every ``--push-every`` seconds, in ``--mode``, through
``POST /admin/models/tiny/weights``. ``--restart-worker``: the worker is SIGKILLed and started again
between the second and third push (it comes back on version 0 and must load the current one).

Printed: each push's seconds (the route's answer), the throughput (completion tokens/s) outside pushes
and during them (each push's window, from its request until 1 s after its answer), and the checks:

- lost: turns that got no 200 answer; failed: answers whose message did not complete;
- duplicated: generated assistant messages stored beyond the turns answered;
- versions_unknown: versions a message records that the registry (``GET /admin/models/tiny/weights``)
  does not have (0 aside);
- max_teacher_forcing_delta: the largest |stored - teacher-forced| logprob over every completion token,
  each span under the checkpoint of its version (goal: below 1e-4);
- spanning: messages whose tokens came from more than one version (``inflight`` only).

Exit status 1 if lost, failed, duplicated or versions_unknown is not 0, a push was refused, or the
teacher-forcing delta is over 1e-4.
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import json
import os
import signal
import statistics
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.exactness.processes import VLLM_STARTUP_S, running_server
from benchmarks.models import prepare_model, vllm_python
from benchmarks.policy_check import TOLERANCE, Scorer, perturbed_checkpoint
from benchmarks.progress import say
from tokentrail.launcher import offers, spawn, stop, wait_ready

MODEL = "tiny"


@dataclass
class Tally:
    answers: list[tuple[float, int]] = field(default_factory=list)  # (finished at, completion tokens)
    messages: list[tuple[str, str, int]] = field(default_factory=list)  # (chat id, message id, user) answered
    lost: int = 0
    chats: dict[str, int] = field(default_factory=dict)  # chat id -> its user


def _worker(url: str, key: str, model_dir: str, work: Path, engine: str, max_parallel: int) -> Any:
    program, env, args = None, {"OMP_NUM_THREADS": "1"}, ["--engine", engine]
    if engine == "vllm":
        program, env = (vllm_python(), "-m", "tokentrail"), {"VLLM_CPU_KVCACHE_SPACE": "1"}
        args += ["--max-model-len", "2048", "--gpu-memory-utilization", "0.2"]
    return spawn(
        ["worker", "--server-url", url, "--api-key", key, "--model", model_dir, "--served-model-name", MODEL,
         "--max-parallel", str(max_parallel), "--log-level", "warning", *args],
        program=program,
        output=work / "worker.log",
        append=True,
        env=env,
    )  # fmt: skip


async def user(
    client: httpx.AsyncClient, url: str, headers: dict[str, str], tally: Tally, args: argparse.Namespace,
    stop: asyncio.Event, index: int,
) -> None:  # fmt: skip
    """Agent loops: a conversation of ``--turns`` turns, then a new one, until ``stop`` is set."""
    n, name = 0, f"a{index}"
    while not stop.is_set():
        n += 1
        history: list[dict[str, Any]] = [{"role": "system", "content": f"agent {name}"}]
        for turn in range(args.turns):
            history.append({"role": "user", "content": f"{name} task {n} step {turn}"})
            body = {"model": MODEL, "messages": history, "max_tokens": args.tokens, "ignore_eos": True,
                    "temperature": 1.0}  # fmt: skip
            try:
                resp = await client.post(f"{url}/v1/chat/completions", json=body, headers=headers, timeout=300)
            except httpx.HTTPError:
                tally.lost += 1
                break
            if resp.status_code != 200:
                tally.lost += 1
                break
            data = resp.json()
            info = data["choices"][0]["tokentrail"]
            tally.messages.append((info["chat_id"], info["message_id"], index))
            tally.chats[info["chat_id"]] = index
            tally.answers.append((time.monotonic(), int(data["usage"]["completion_tokens"])))
            history.append({"role": "assistant", "content": data["choices"][0]["message"]["content"] or ""})
            if stop.is_set():
                break


async def pushes(
    client: httpx.AsyncClient, url: str, admin: dict[str, str], paths: dict[int, Path], args: argparse.Namespace,
    restart: Any,
) -> list[dict[str, Any]]:  # fmt: skip
    out: list[dict[str, Any]] = []
    for version in range(1, args.pushes + 1):
        await asyncio.sleep(args.push_every)
        if version == 3 and restart is not None:
            await restart()
        body = {"path": str(paths[version]), "version": version, "mode": args.mode}
        began = time.monotonic()
        resp = await client.post(f"{url}/admin/models/{MODEL}/weights", json=body, headers=admin, timeout=900)
        ended = time.monotonic()
        answer = resp.json()
        out.append({"version": version, "status": resp.status_code, "began": began, "ended": ended,
                    "seconds": answer.get("seconds"), "answer": answer})  # fmt: skip
        say(f"  pushed version {version}: {resp.status_code} in {answer.get('seconds')}s")
    return out


def _rate(
    answers: list[tuple[float, int]], windows: list[tuple[float, float]], inside: bool, span: tuple[float, float]
) -> float:
    """Completion tokens/s of answers finished inside (or outside) ``windows``, within ``span``."""

    def hit(t: float) -> bool:
        return any(a <= t <= b for a, b in windows)

    total = sum(w[1] - w[0] for w in windows)
    seconds = total if inside else (span[1] - span[0]) - total
    tokens = sum(n for t, n in answers if span[0] <= t <= span[1] and hit(t) == inside)
    return tokens / seconds if seconds > 0 else 0.0


def run(args: argparse.Namespace) -> dict[str, Any]:
    """Checkpoints, the server and the worker, then the load (``drive``); the processes stop at the end."""
    from server.admin import issue_user_key
    from server.settings import ServerSettings

    model_dir = prepare_model("chatml")
    with tempfile.TemporaryDirectory(prefix="tt-weights-") as tmp:
        work = Path(tmp)
        say(f"writing {args.pushes} checkpoints...")
        paths: dict[int, Path] = {0: Path(model_dir)}
        for v in range(1, args.pushes + 1):
            paths[v] = perturbed_checkpoint(model_dir, work / f"v{v}", seed=v, scale=0.2)
        with running_server(work) as (url, key):
            settings = ServerSettings(data_dir=work / "data")
            admin = {"Authorization": f"Bearer {issue_user_key(settings, 'trainer', admin=True)}"}
            users = [{"Authorization": f"Bearer {issue_user_key(settings, f'agent-{i}')}"} for i in range(args.users)]
            procs = {"worker": _worker(url, key, model_dir, work, args.engine, args.max_parallel)}
            timeout = VLLM_STARTUP_S if args.engine == "vllm" else 180
            try:
                wait_ready(lambda: offers(url, [MODEL]), procs, "worker", timeout, logs=work, progress=True)

                async def restart(client: httpx.AsyncClient) -> None:
                    say("  killing the worker (SIGKILL) and starting it again")
                    os.kill(procs["worker"].pid, signal.SIGKILL)
                    procs["worker"].wait()
                    procs["worker"] = _worker(url, key, model_dir, work, args.engine, args.max_parallel)
                    began = time.monotonic()
                    while True:  # back, and brought up to the current version (2) before any work
                        rows = (await client.get(f"{url}/admin/workers", headers=admin, timeout=10)).json()
                        if [w["policy_version"] for w in rows] == [2]:
                            break
                        if procs["worker"].poll() is not None or time.monotonic() - began > timeout:
                            raise RuntimeError(f"the restarted worker did not serve version 2: {rows}")
                        await asyncio.sleep(0.2)
                    say(f"  the restarted worker serves version 2 ({time.monotonic() - began:.1f}s after its start)")

                return asyncio.run(drive(url, admin, users, paths, args, restart if args.restart_worker else None))
            finally:
                for name, proc in procs.items():
                    stop(proc, name)


async def drive(
    url: str,
    admin: dict[str, str],
    users: list[dict[str, str]],
    paths: dict[int, Path],
    args: argparse.Namespace,
    restart: Callable[[httpx.AsyncClient], Awaitable[None]] | None,
) -> dict[str, Any]:
    """Users in agent loops while the pushes run, then every stored token checked."""
    tally = Tally()
    say(f"{args.users} users for {args.pushes} pushes ({args.mode}, {args.engine}), one every {args.push_every}s")
    async with httpx.AsyncClient(limits=httpx.Limits(max_connections=4 * args.users)) as client:
        began = time.monotonic()
        stop = asyncio.Event()
        again = functools.partial(restart, client) if restart is not None else None

        async def pushing() -> list[dict[str, Any]]:
            try:
                done = await pushes(client, url, admin, paths, args, again)
                await asyncio.sleep(args.push_every)  # the last version serves for a while too
                return done
            finally:
                stop.set()

        pusher = asyncio.create_task(pushing())
        await asyncio.gather(*(user(client, url, h, tally, args, stop, i) for i, h in enumerate(users)))
        pushed = await pusher
        ended = time.monotonic()
        say(f"{len(tally.messages)} turns answered; checking every stored token")
        history = (await client.get(f"{url}/admin/models/{MODEL}/weights", headers=admin)).json()
        registry = {int(r["version"]) for r in history}
        scorer = Scorer(dict(paths))
        failed = unknown = spanning = 0
        worst = 0.0
        versions_seen: set[int] = set()
        for chat, mid, who in tally.messages:
            path = f"{url}/chats/{chat}/messages/{mid}"
            msg = (await client.get(path, params={"include": "tokens"}, headers=users[who])).json()
            if msg.get("state") != "complete":
                failed += 1
                continue
            spans = msg["policy_versions"]
            versions = {v for _, v in spans}
            versions_seen |= versions
            unknown += len(versions - registry - {0})
            spanning += len(spans) > 1
            worst = max(worst, await asyncio.to_thread(scorer.max_delta, msg))
        stored = 0
        for chat, who in tally.chats.items():
            body = (await client.get(f"{url}/chats/{chat}", headers=users[who])).json()
            # generated replies only: a client-written turn (the history's text differing from a stored
            # reply's) is stored as a manual message, not generated
            stored += sum(m["role"] == "assistant" and m["state"] != "manual" for m in body["messages"])
    windows = [(p["began"], p["ended"] + 1.0) for p in pushed]
    push_s = [float(p["seconds"]) for p in pushed if p["status"] == 200]
    return {
        "engine": args.engine,
        "mode": args.mode,
        "users": args.users,
        "tokens_per_turn": args.tokens,
        "pushes": len(pushed),
        "pushes_refused": sum(p["status"] != 200 for p in pushed),
        "push_seconds": {
            "p50": round(statistics.median(push_s), 3) if push_s else None,
            "max": round(max(push_s), 3) if push_s else None,
            "each": [p["seconds"] for p in pushed],
        },
        "restart_worker": restart is not None,
        "turns_answered": len(tally.messages),
        "tokens_per_s_outside_pushes": round(_rate(tally.answers, windows, False, (began, ended)), 1),
        "tokens_per_s_during_pushes": round(_rate(tally.answers, windows, True, (began, ended)), 1),
        "lost": tally.lost,
        "failed": failed,
        "duplicated": max(0, stored - len(tally.messages)),
        "versions_seen": sorted(versions_seen),
        "versions_unknown": unknown,
        "spanning": spanning,
        "max_teacher_forcing_delta": worst,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--engine", choices=("hf", "vllm"), default="hf")
    ap.add_argument("--mode", choices=("drain", "inflight"), default="drain")
    ap.add_argument("--users", type=int, default=8)
    ap.add_argument("--pushes", type=int, default=5)
    ap.add_argument("--push-every", type=float, default=6.0)
    ap.add_argument("--tokens", type=int, default=48, help="completion tokens per turn (ignore_eos)")
    ap.add_argument("--turns", type=int, default=4, help="turns per agent conversation")
    ap.add_argument("--max-parallel", type=int, default=8)
    ap.add_argument("--restart-worker", action="store_true", help="SIGKILL and restart the worker before push 3")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    result = run(args)
    print(json.dumps(result, indent=2) if args.json else "\n".join(f"{k}: {v}" for k, v in result.items()))
    bad = result["lost"] or result["failed"] or result["duplicated"] or result["versions_unknown"]
    bad = bad or result["pushes_refused"] or result["max_teacher_forcing_delta"] > TOLERANCE
    sys.exit(1 if bad else 0)


if __name__ == "__main__":
    main()
