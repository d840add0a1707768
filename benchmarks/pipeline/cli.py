"""What tokentrail's pipeline costs on top of its engine, and against ``vllm serve``: the same model,
conversations, sampling and closed-loop concurrency for every arm, one arm at a time.

    python benchmarks/pipeline.py [--engine hf|vllm] [--arms engine,embedded,one-process,redis,vllm-serve]
        [--api oa,openai] [--workload single,agent] [--turns 8] [--stop fixed,natural] [--tokens 64]
        [--concurrency 1,8,32] [--duration 20] [--device cpu|cuda] [--dtype float32|bfloat16|float16]
        [--seed-requests] [--run-seed N] [--rounds N] [--json] [--json-out FILE.json] [--plot FILE.png]
    python benchmarks/pipeline.py --ceiling [--api oa,openai] [--concurrency 32] [--readers 4] [--duration 10]
        [--against REF]
    python benchmarks/pipeline.py --prompt-build
    python benchmarks/pipeline.py --idle-streams 5000

Arms (each a fresh process tree, started after the previous one stopped):

- ``engine``: the engine alone in a process of its own, ``c`` tasks calling ``engine.generate``;
- ``embedded``: tokentrail on embedded defaults (SQLite, in-process queue and streams), a server process
  and a worker process;
- ``one-process``: the same defaults, one ``tokentrail serve --model`` process (the worker inside the
  server's process, no websocket between them; its CPU is reported as the server's);
- ``redis``: the same on PostgreSQL + Redis (a fresh database, dropped afterwards);
- ``pgbouncer``: ``redis`` with the database reached through a private PgBouncer in transaction mode
  (``TOKENTRAIL_DB_POOLER=transaction``); its CPU counts with PostgreSQL's;
- ``vllm-serve`` (``--engine vllm``): ``vllm serve`` on the same model, driven with the same OpenAI
  request bodies as tokentrail's ``openai`` front door (plus ``return_token_ids``), with prompt-token
  details on so that prefix-cache hits compare.

Dimensions (each a comma list; every combination is a row): ``--api`` the tokentrail arms' front door
(``oa``: prompter message, assistant message, SSE; ``openai``: streamed ``/v1/chat/completions`` with a
user API key); ``--workload`` ``single`` (one turn per conversation, the same prompt) or ``agent``
(``--turns``-turn closed-loop conversations echoing the history back as received, ~20-word user turns);
``--stop`` ``fixed`` (exactly ``--tokens`` tokens, end tokens ignored) or ``natural`` (at most
``--tokens``, the model's end token honoured). Temperature 1; no sampling seed unless
``--seed-requests``. ``--device``/``--dtype``: where the hf engine runs (the engine-alone arm's
``HFEngine`` and tokentrail's worker, ``tokentrail worker --device --dtype``; vLLM picks its own device,
``--dtype`` goes to it too when given). On CUDA the CPU figures are still per process: the CPU each
process spent driving the GPU (kernel launches, synchronisation) per delivered token.

``--rounds N`` runs the arms N times, every other round in reverse order (A B C, C B A, ...), and pools
each point's windows (tokens, turns, CPU and latency samples over all rounds): on a machine whose speed
drifts during a run, every arm then sees the drift alike. It costs N times the run.

Printed per arm, front door, workload, stop and concurrency: tokens/s delivered to clients, turns done,
errors (a failed turn is counted and its client starts a new conversation), TTFT p50/p99 (the turn's
first request sent to its first token received), inter-token gap p50/p99, for agent loops TTFT p50 and
cached ÷ prompt tokens by turn; CPU ms per token of each process: the tokentrail server, the worker
process alone, the engine's child processes (vLLM's engine core and model runner), ``vllm serve``'s
API-server process alone, the engine-alone process, the benchmark's own clients, PostgreSQL + Redis.
Then the ratios (÷ the engine alone, ÷ ``vllm serve``, PostgreSQL + Redis ÷ embedded, server CPU ÷
``vllm serve``'s API server, TTFT per turn ÷ ``vllm serve``'s) and the targets each point is checked against.

``--ceiling`` measures the pipeline without a model: a benchmark-only synthetic engine (in a worker
process started by this script; not part of tokentrail) emits tokens as fast as the pipeline takes
them, through each ``--api``: the OA flow with ``--readers`` SSE readers per message, or streamed chat
completions with one reader per reply. ``--against REF`` first runs the same ceiling on commit REF of
this repository (its tree from ``git archive``: its server, worker and synthetic worker, keys issued by
its code), so that a change's effect is measured in one run. ``--prompt-build`` times the next turn's
prompt build after 1k / 8k / 32k-token histories. ``--idle-streams N`` holds N SSE readers on one slow
message: the server's memory per reader.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import random
import shlex
import sys
import tempfile
from dataclasses import asdict
from pathlib import Path

from benchmarks.models import prepare_model
from benchmarks.pipeline.clients import drive_tokentrail, drive_vllm_serve
from benchmarks.pipeline.conversation import Workload
from benchmarks.pipeline.measure import CpuMeter, Point, Role, pooled, summary
from benchmarks.pipeline.profile import Profiler
from benchmarks.pipeline.report import checks, plot, print_report, ratios
from benchmarks.pipeline.stack import (
    SYNTHETIC_FLAG,
    burn,
    cpu_burner,
    engine_dtype,
    engine_process,
    postgres_and_redis,
    tokentrail_stack,
    vllm_serve,
)
from benchmarks.pipeline.synthetic import DEFAULT_STEP_MS, STEP_MS_ENV
from benchmarks.progress import say

ARMS = (
    "engine",
    "embedded",
    "one-process",
    "redis",
    "pgbouncer",
    "vllm-serve",
    "embedded-synthetic",
    "one-process-synthetic",
)
APIS = ("oa", "openai")


def _list(value: str, allowed: tuple[str, ...], flag: str) -> list[str]:
    items = [x for x in value.split(",") if x]
    bad = [x for x in items if x not in allowed]
    if bad or not items:
        raise SystemExit(f"{flag}: {value!r}: choose from {', '.join(allowed)} (comma-separated)")
    return items


def _levels(args: argparse.Namespace) -> list[int]:
    return [int(c) for c in args.concurrency.split(",")]


def _counts(text: str) -> list[int]:
    """``--processes``: a comma list of server process counts, each at least 1."""
    try:
        counts = [int(c) for c in text.split(",")]
    except ValueError:
        raise SystemExit(f"--processes: a comma list of whole numbers, not {text!r}") from None
    if not counts or min(counts) < 1:
        raise SystemExit(f"--processes: every count is at least 1, not {text!r}")
    return counts


def workloads(args: argparse.Namespace) -> list[Workload]:
    return [
        Workload(kind, args.turns, stop, args.tokens, args.seed_requests, args.run_seed)
        for kind in _list(args.workload, ("single", "agent"), "--workload")
        for stop in _list(args.stop, ("fixed", "natural"), "--stop")
    ]


def _engine_options(args: argparse.Namespace) -> list[str]:
    """The engine's placement, for the engine child and tokentrail's worker (the same option names):
    ``--device`` for hf (vLLM picks its own), ``--dtype`` when given."""
    out = ["--device", args.device] if args.engine == "hf" else []
    return [*out, "--dtype", args.dtype] if args.dtype else out


def _child_args(args: argparse.Namespace, model_dir: str) -> list[str]:
    """The engine child's command line: the same workloads, the same engine placement."""
    out = ["--engine", args.engine, "--model-dir", model_dir, "--concurrency", args.concurrency, "--tokens",
           str(args.tokens), "--duration", str(args.duration), "--workload", args.workload, "--stop", args.stop,
           "--turns", str(args.turns), "--run-seed", str(args.run_seed), *_engine_options(args)]  # fmt: skip
    return [*out, "--seed-requests"] if args.seed_requests else out


def run(args: argparse.Namespace) -> list[Point]:
    """The arms in the order given, strictly one after another (never two stacks alive at once); with
    ``--rounds N``, N times, every other round in reverse order, the rounds' windows pooled per point."""
    arms = _list(args.arms, ARMS, "--arms")
    apis = _list(args.api, APIS, "--api")
    loads = workloads(args)
    model_dir = args.model_dir or prepare_model("chatml")
    profiler = Profiler(args.profile, rate=args.profile_rate) if args.profile else None
    points: list[Point] = []
    with tempfile.TemporaryDirectory(prefix="tt-pipeline-") as tmp, cpu_burner(args.burn):
        for r in range(args.rounds):
            order = arms if r % 2 == 0 else arms[::-1]
            if args.rounds > 1:
                say(f"round {r + 1} of {args.rounds}: {', '.join(order)}")
            for arm in order:
                sub = Path(tmp) / f"{arm}-{r}"
                sub.mkdir()
                points += _run_arm(args, arm, apis, loads, model_dir, sub, profiler)
    return pooled(points)


def _run_arm(
    args: argparse.Namespace,
    arm: str,
    apis: list[str],
    loads: list[Workload],
    model_dir: str,
    sub: Path,
    profiler: Profiler | None,
) -> list[Point]:
    """One arm's stack, started, measured at every point, stopped."""
    if arm.endswith("-synthetic"):  # the arm with the step clock for its engine, whatever --engine says
        points = _run_arm(
            argparse.Namespace(**{**vars(args), "engine": "synthetic"}),
            arm.removesuffix("-synthetic"),
            apis,
            loads,
            model_dir,
            sub,
            profiler,
        )
        for p in points:
            p.arm = arm
        return points
    levels = _levels(args)
    engine_args = [*_engine_options(args), *args.engine_args]  # the worker's: --device, --dtype, then the user's
    if arm == "engine":
        if args.engine == "synthetic":
            say("engine alone: skipped (the synthetic engine costs next to nothing alone)")
            return []
        say(f"engine alone ({args.engine})...")
        return engine_process(args.engine, _child_args(args, model_dir), sub)
    if arm == "one-process":
        say(f"tokentrail serve --model, one process, embedded ({args.engine})...")
        with tokentrail_stack(
            sub, model_dir, max(levels), args.engine, one_process=True, engine_args=engine_args
        ) as stack:
            # the server process holds the worker (and the hf engine); vLLM's engine core is its child
            roles = [Role("server", stack.pids["server"], "engine_core")]
            meter = CpuMeter(roles, client=True, profiler=profiler, metrics_url=f"{stack.url}/metrics")
            return asyncio.run(
                drive_tokentrail(arm, stack.url, stack.user_key, meter, apis, loads, levels, args.duration)
            )
    if arm in ("embedded", "redis", "pgbouncer"):
        what = {"embedded": "embedded", "redis": "on PostgreSQL + Redis", "pgbouncer": "on PgBouncer + Redis"}[arm]
        say(f"tokentrail {what} ({args.engine})...")
        services: contextlib.AbstractContextManager[dict[str, str]] = (
            contextlib.nullcontext({}) if arm == "embedded" else postgres_and_redis(pooler=arm == "pgbouncer")
        )
        with (
            services as env,
            tokentrail_stack(sub, model_dir, max(levels), args.engine, env, engine_args=engine_args) as stack,
        ):
            roles = [Role("server", stack.pids["server"]), Role("worker", stack.pids["worker"], "engine_core")]
            meter = CpuMeter(
                roles,
                services=arm != "embedded",
                client=True,
                profiler=profiler,
                metrics_url=f"{stack.url}/metrics",
            )
            return asyncio.run(
                drive_tokentrail(arm, stack.url, stack.user_key, meter, apis, loads, levels, args.duration)
            )
    if args.engine != "vllm":
        say("vllm-serve: skipped (it runs with --engine vllm)")
        return []
    say("vllm serve...")
    with vllm_serve(sub, model_dir, max(levels), engine_dtype(args.dtype), args.serve_args) as (url, pid):
        meter = CpuMeter([Role("vllm_api", pid, "engine_core")], client=True, profiler=profiler)
        return asyncio.run(drive_vllm_serve(url, meter, loads, levels, args.duration))


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument(
        "--engine",
        choices=["hf", "vllm", "synthetic"],
        default="hf",
        help="synthetic: a benchmark-only step clock stands in for the model (tokentrail's own CPU per token)",
    )
    ap.add_argument("--arms", default="engine,embedded,redis,vllm-serve", help="run in this order, one at a time")
    ap.add_argument("--api", default="oa", help="the tokentrail arms' front door(s): oa, openai (comma-separated)")
    ap.add_argument("--workload", default="single", help="single, agent (comma-separated)")
    ap.add_argument("--turns", type=int, default=8, help="turns per agent conversation")
    ap.add_argument("--stop", default="fixed", help="fixed (exactly --tokens), natural (at most; comma-separated)")
    ap.add_argument("--concurrency", default="1,8,32", help="comma-separated concurrency levels")
    ap.add_argument("--tokens", type=int, default=64, help="tokens per reply: exactly (fixed) or at most (natural)")
    ap.add_argument("--duration", type=float, default=20.0, help="seconds measured per point")
    ap.add_argument(
        "--rounds",
        type=int,
        default=1,
        help="run the arms N times, every other round in reverse order, and pool each point's windows",
    )
    ap.add_argument("--seed-requests", action="store_true", help="send a sampling seed with every request")
    ap.add_argument("--run-seed", type=int, help="seed of the agent loops' user messages (default: random)")
    ap.add_argument("--model-dir", help="default: the trained tiny chatml model (built once, cached)")
    ap.add_argument("--device", choices=["cpu", "cuda"], default="cpu", help="hf: where the engine runs (both arms)")
    ap.add_argument(
        "--dtype",
        choices=["float32", "bfloat16", "float16"],
        help="every arm's engine dtype, vllm serve's too (default: tokentrail's worker's, float32)",
    )
    ap.add_argument(
        "--step-ms",
        type=float,
        default=DEFAULT_STEP_MS,
        help="--engine synthetic: milliseconds per engine step (every running reply gets a token per step)",
    )
    ap.add_argument(
        "--burn",
        type=float,
        default=0.0,
        help="keep this fraction of one core busy beside every arm (0-1): what extra CPU costs an arm here",
    )
    ap.add_argument("--ceiling", action="store_true", help="the pipeline's own ceiling with a synthetic engine")
    ap.add_argument("--readers", type=int, default=4, help="--ceiling: SSE readers per message")
    ap.add_argument(
        "--against",
        metavar="REF",
        help="--ceiling: first measure commit REF of this repository (its server and worker) in the same run",
    )
    ap.add_argument(
        "--processes",
        help="--ceiling: comma list of server process counts (serve --processes N on PostgreSQL + Redis, N workers)",
    )
    ap.add_argument("--prompt-build", action="store_true", help="time prompt builds after 1k / 8k / 32k tokens")
    ap.add_argument("--idle-streams", type=int, default=0, help="server memory per connected SSE reader (e.g. 5000)")
    ap.add_argument("--profile", type=Path, help="py-spy each process over each window; summaries + raw stacks here")
    ap.add_argument("--profile-rate", type=int, default=100, help="--profile: samples per second")
    ap.add_argument(
        "--engine-args",
        type=shlex.split,
        default=[],
        help="more options for tokentrail's worker, one string: --engine-args='--vllm-chunked-prefill'",
    )
    ap.add_argument(
        "--serve-args",
        type=shlex.split,
        default=[],
        help="more options for the vllm-serve arm, one string: --serve-args='--no-enable-chunked-prefill'",
    )
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--json-out", type=Path, help="also write the --json document to this file (any output mode)")
    ap.add_argument("--plot", type=Path, help="write a PNG of tokens/s and TTFT against concurrency (matplotlib)")
    ap.add_argument("--engine-child", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--synthetic-worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--burn-child", type=float, help=argparse.SUPPRESS)
    ap.add_argument("--server-url", help=argparse.SUPPRESS)
    ap.add_argument("--api-key", help=argparse.SUPPRESS)
    ap.add_argument("--capacity", type=int, default=32, help=argparse.SUPPRESS)
    ap.add_argument("--rate", type=float, default=0.0, help=argparse.SUPPRESS)
    return ap


def main() -> int:
    if sys.argv[1:2] == [SYNTHETIC_FLAG]:  # a child: a tokentrail command with the step-clock engine
        from benchmarks.pipeline.synthetic import run_tokentrail

        run_tokentrail(sys.argv[2:])
        return 0
    args = parser().parse_args()
    os.environ[STEP_MS_ENV] = str(args.step_ms)  # the synthetic engine's children read it
    if args.run_seed is None:
        args.run_seed = random.SystemRandom().randrange(2**31)
    if args.rounds < 1:
        raise SystemExit("--rounds: at least 1")
    if not 0 <= args.burn < 1:
        raise SystemExit("--burn: a fraction of one core, at least 0 and below 1")
    if args.rounds > 1 and args.profile:
        raise SystemExit("--profile takes one round (each round's samples would overwrite the last)")
    if args.engine_child:
        from benchmarks.pipeline.engine import engine_points

        points = asyncio.run(
            engine_points(
                args.engine, args.model_dir, workloads(args), _levels(args), args.duration, args.device, args.dtype
            )
        )
        print(json.dumps([asdict(p) for p in points]))
        return 0
    if args.burn_child is not None:
        burn(args.burn_child)
        return 0
    if args.synthetic_worker:
        from benchmarks.pipeline.modes import run_synthetic_worker

        run_synthetic_worker(args.server_url, args.api_key, args.model_dir, args.capacity, args.rate)
        return 0
    if args.idle_streams:
        from benchmarks.pipeline.modes import run_idle

        result = run_idle(args.model_dir or prepare_model("chatml"), args.idle_streams)
        print(json.dumps(result) if args.json else ", ".join(f"{k}={v}" for k, v in result.items()))
        return 0
    if args.prompt_build:
        from benchmarks.pipeline.modes import prompt_build_rows

        rows = prompt_build_rows(args.model_dir or prepare_model("chatml"), (1_000, 8_000, 32_000))
        print(json.dumps(rows) if args.json else "\n".join(", ".join(f"{k}={v}" for k, v in r.items()) for r in rows))
        return 0
    if args.processes and not args.ceiling:
        raise SystemExit("--processes goes with --ceiling")
    if args.ceiling:
        from benchmarks.pipeline.modes import run_ceiling

        tokens = args.tokens if args.tokens != 64 else 2048
        model_dir = args.model_dir or prepare_model("chatml")
        apis = _list(args.api, APIS, "--api")
        points = []
        if args.against:
            from benchmarks.pipeline.modes import checkout

            say(f"the ceiling of commit {args.against} (--against), then of this checkout")
            with checkout(args.against) as code:
                points += run_ceiling(
                    model_dir, _levels(args), tokens, args.duration, args.readers, apis, code, arm=f"at-{args.against}"
                )
        if args.processes:
            counts = _counts(args.processes)
            say(f"the ceiling with {', '.join(map(str, counts))} server processes, on PostgreSQL + Redis")
            for n in counts:
                points += run_ceiling(
                    model_dir, _levels(args), tokens, args.duration, args.readers, apis, arm=f"processes-{n}",
                    processes=n,
                )  # fmt: skip
        else:
            points += run_ceiling(model_dir, _levels(args), tokens, args.duration, args.readers, apis)
    else:
        where = f" on {args.device}" if args.engine == "hf" else ""
        say(f"run seed {args.run_seed} (--run-seed); engine {args.engine}{where}, dtype {engine_dtype(args.dtype)}")
        if args.burn:
            say(f"a CPU burner keeps {args.burn:.0%} of one core busy beside every arm (--burn)")
        points = run(args)
    if args.json or args.json_out:
        document = json.dumps(
            {
                "engine": args.engine,
                "device": args.device,
                "dtype": args.dtype,
                "run_seed": args.run_seed,
                "rounds": args.rounds,
                "burn": args.burn,
                "points": [summary(p) for p in points],
                "ratios": ratios(points),
                "checks": checks(points, args.engine),
            }
        )
        if args.json_out:
            args.json_out.write_text(document + "\n", encoding="utf-8")
        if args.json:
            print(document)
    if not args.json:
        print_report(points, args.engine)
    if args.plot:
        plot(points, args.plot)
    return 0
