"""The processes an arm runs in, each started fresh and stopped before the next arm starts: a tokentrail
server and worker (embedded or on PostgreSQL + Redis), or one ``tokentrail serve --model`` process,
``vllm serve``, the engine-alone child."""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import httpx

from benchmarks.models import vllm_python
from benchmarks.pipeline.conversation import MODEL
from benchmarks.pipeline.measure import Point
from tokentrail.launcher import answers, free_port, offers, spawn, stop, wait_ready

ENTRY = Path(__file__).resolve().parent.parent / "pipeline.py"  # the command, for child processes
ROOT = ENTRY.parent.parent  # this checkout
MAX_MODEL_LEN = 2048
VLLM_ENV = {"VLLM_CPU_KVCACHE_SPACE": "1"}
SYNTHETIC_FLAG = "--synthetic-tokentrail"  # this script as a tokentrail command with the step-clock engine


def engine_dtype(asked: str | None) -> str:
    """The dtype of every arm: ``--dtype``, else the one tokentrail's worker runs when given none.
    ``vllm serve``'s own default (auto: bfloat16 for this float32 model on CPU) would make the arms
    compare two precisions: bfloat16 is faster than float32 on CPUs with bfloat16 instructions and far
    slower on those without."""
    from worker.spec import DEFAULT_DTYPE

    return asked or DEFAULT_DTYPE


@dataclass(frozen=True)
class Stack:
    url: str
    pids: dict[str, int]  # server, worker
    user_key: str  # an API key of the benchmark's user (the OpenAI route)


@contextlib.contextmanager
def tokentrail_stack(
    work: Path,
    model_dir: str,
    max_parallel: int,
    engine: str,
    env: dict[str, str] | None = None,
    worker_cmd: list[str] | None = None,
    one_process: bool = False,
    engine_args: Sequence[str] = (),
    code: Path | None = None,
    processes: int = 1,
    workers: int = 1,
) -> Iterator[Stack]:
    """A server process and a worker process (``worker_cmd``: another worker program); ``one_process``:
    ``tokentrail serve --model``, the worker inside the server's process (pids: the server only);
    ``engine_args``: more of the worker's options (``--vllm-chunked-prefill``); ``code``: another checkout
    of tokentrail whose server and worker run (its packages first on their ``PYTHONPATH``);
    ``processes``: ``tokentrail serve --processes N`` (the server's pid is their parent's; Redis must be in
    ``env``); ``workers``: that many worker processes (pids ``worker``, ``worker-2``...)."""
    data = work / "data"
    data.mkdir(exist_ok=True)
    env = {
        "TOKENTRAIL_DATA_DIR": str(data),
        "TOKENTRAIL_ALLOW_DEBUG_AUTH": "true",
        "TOKENTRAIL_RATE_LIMIT_PER_MINUTE": "0",  # a load generator, not a user to be slowed down
        **({"PYTHONPATH": str(code)} if code is not None else {}),
        **(env or {}),
    }
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    # the engine's options, the same for a worker process and for serve --model
    program, extra = None, None
    model_args = ["--model", model_dir, "--served-model-name", MODEL, "--max-parallel", str(max_parallel),
                  "--engine", "hf" if engine == "synthetic" else engine, *engine_args]  # fmt: skip
    if engine == "synthetic":  # tokentrail's own commands, the model replaced by the step clock
        program = (sys.executable, str(ENTRY), SYNTHETIC_FLAG)
    elif engine == "vllm":
        program, extra = (vllm_python(), "-m", "tokentrail"), VLLM_ENV
        model_args += ["--max-model-len", str(MAX_MODEL_LEN), "--gpu-memory-utilization", "0.2"]
    load_s = 600 if engine == "vllm" else 180
    try:
        if "TOKENTRAIL_DATABASE_URL" in env:
            up = spawn(["db", "upgrade"], output=work / "upgrade.log")
            if up.wait(timeout=300) != 0:
                raise RuntimeError((work / "upgrade.log").read_text()[-3000:])
        key, user_key = _issue_keys()  # by the code that serves (its migrations make the database)
        port = free_port()
        url = f"http://127.0.0.1:{port}"
        serve = ["serve", "--port", str(port), "--log-level", "warning"]
        if processes > 1:
            serve += ["--processes", str(processes)]
        if one_process:
            server = spawn([*serve, *model_args], program=program, output=work / "server.log", env=extra)
        else:
            server = spawn(serve, program=program if engine == "synthetic" else None, output=work / "server.log")
        procs = {"server": server}
        try:
            wait_ready(lambda: answers(url), procs, "server", load_s if one_process else 180, logs=work)
            for k in range(1, workers + 1 if not one_process or worker_cmd is not None else 1):
                name = "worker" if k == 1 else f"worker-{k}"
                if worker_cmd is not None:
                    args = ["--server-url", url, "--api-key", key]
                    procs[name] = spawn(args, program=worker_cmd, output=work / f"{name}.log")
                else:
                    procs[name] = spawn(
                        ["worker", "--server-url", url, "--api-key", key, *model_args, "--log-level", "warning"],
                        program=program,
                        output=work / f"{name}.log",
                        env=extra,
                    )
            wait_ready(lambda: offers(url, [MODEL]), procs, "worker", load_s, logs=work)
            if workers > 1:
                wait_ready(lambda: _connected(url) >= workers, procs, "workers", load_s, logs=work)
            yield Stack(url, {name: p.pid for name, p in procs.items()}, user_key)
        finally:
            for name, p in reversed(procs.items()):
                stop(p, name)
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def _connected(url: str) -> int:
    """Workers connected to any of the server's processes (its ``tokentrail_cluster_workers``)."""
    with contextlib.suppress(httpx.HTTPError):
        for line in httpx.get(f"{url}/metrics", timeout=2).text.splitlines():
            if line.startswith("tokentrail_cluster_workers{") and f'model="{MODEL}"' in line:
                return int(float(line.rsplit(" ", 1)[1]))
    return 0


_ISSUE_KEYS = """
import json
from server.admin import issue_user_key, issue_worker_key
from server.settings import ServerSettings
settings = ServerSettings(migrate_on_start=True)
print(json.dumps([issue_worker_key(settings, "pipeline"), issue_user_key(settings, "pipeline-bench")]))
"""


def _issue_keys() -> tuple[str, str]:
    """A worker key and a user key, issued in a child process (``PYTHONPATH`` picks its code)."""
    out = subprocess.run([sys.executable, "-c", _ISSUE_KEYS], capture_output=True, text=True, check=True)
    worker_key, user_key = json.loads(out.stdout.strip().splitlines()[-1])
    return str(worker_key), str(user_key)


@contextlib.contextmanager
def postgres_and_redis(pooler: bool = False) -> Iterator[dict[str, str]]:
    """A fresh PostgreSQL database (dropped afterwards) and a Redis database of its own; ``pooler``: the
    database reached through a private PgBouncer in transaction mode."""
    from tests import services

    with contextlib.ExitStack() as stack:
        pg = stack.enter_context(services.postgres_service())
        rd = stack.enter_context(services.redis_service())
        if pooler:
            pg = stack.enter_context(services.pgbouncer_service(pg))  # 16 server connections
        yield {
            "TOKENTRAIL_DATABASE_URL": pg,
            "TOKENTRAIL_REDIS_URL": rd,
            "TOKENTRAIL_AUTH_SECRET": "pipeline-benchmark-secret-0123456789",
            "TOKENTRAIL_DB_POOLER": "transaction" if pooler else "none",
        }


@contextlib.contextmanager
def vllm_serve(
    work: Path, model_dir: str, max_seqs: int, dtype: str, extra: Sequence[str] = ()
) -> Iterator[tuple[str, int]]:
    """``vllm serve`` on the model as the vLLM worker runs it (same context, KV space, dtype, prefix
    caching on as vLLM's default), ``--max-num-seqs`` = the highest concurrency, prompt-token details in usage so
    that cache hits compare. Its per-request access log is off (tokentrail's server logs warnings only).
    ``extra``: more of its options (``--serve-args``)."""
    port = free_port()
    args = ["--model", model_dir, "--served-model-name", MODEL, "--port", str(port),
            "--max-model-len", str(MAX_MODEL_LEN), "--max-num-seqs", str(max_seqs), "--gpu-memory-utilization", "0.2",
            "--dtype", dtype,
            "--enable-prompt-tokens-details", "--disable-uvicorn-access-log", *extra]  # fmt: skip
    program = (vllm_python(), "-m", "vllm.entrypoints.openai.api_server")
    proc = spawn(args, program=program, output=work / "vllm-serve.log", env=VLLM_ENV)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_ready(lambda: answers(url), {"vllm-serve": proc}, "vllm serve", 600, logs=work)
        yield url, proc.pid
    finally:
        stop(proc, "vllm serve")


@contextlib.contextmanager
def cpu_burner(fraction: float) -> Iterator[None]:
    """``--burn``: a process beside the arms that keeps ``fraction`` of one core busy (a calibration: on this
    machine every process shares two cores with the engine, so any CPU spent beside it costs it)."""
    if fraction <= 0:
        yield
        return
    proc = subprocess.Popen([sys.executable, str(ENTRY), "--burn-child", str(fraction)])
    try:
        yield
    finally:
        proc.kill()
        proc.wait()


def burn(fraction: float, period_s: float = 0.004) -> None:
    """Spin ``fraction`` of every ``period_s``, sleep the rest, until killed."""
    while True:
        start = time.perf_counter()
        while time.perf_counter() - start < period_s * fraction:
            pass
        time.sleep(period_s * (1 - fraction))


def engine_process(engine: str, child_args: list[str], work: Path) -> list[Point]:
    """The engine-alone arm: this script with ``--engine-child`` in the engine's environment; its points
    come back as one JSON line on stdout."""
    python = vllm_python() if engine == "vllm" else sys.executable
    cmd = [python, str(ENTRY), "--engine-child", *child_args]
    with open(work / "engine.log", "wb") as log:
        out = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=log, env={**os.environ, **VLLM_ENV}, check=False)
    if out.returncode != 0:
        raise RuntimeError((work / "engine.log").read_text()[-3000:])
    # vLLM logs to stdout too (its shutdown comes after the figures): take the figures' line
    line = next(x for x in out.stdout.decode().splitlines() if x.startswith("[{"))
    return [Point(**p) for p in json.loads(line)]
