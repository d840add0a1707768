"""The server and the workers of a run as child processes (``tokentrail.launcher``): one worker per arm, each
served under the arm's name with its ``--prompt-mode``.
"""

from __future__ import annotations

import contextlib
import os
import subprocess
from collections.abc import Iterator, Sequence
from pathlib import Path

from benchmarks.models import vllm_python
from benchmarks.progress import say
from tokentrail.launcher import answers, free_port, offers, spawn, stop, wait_ready

ARMS = ("stitch", "naive")
VLLM_STARTUP_S = 600  # vLLM on CPU takes 30-60 s to start (more on a busy machine): two start at once


@contextlib.contextmanager
def running_server(work: Path) -> Iterator[tuple[str, str]]:
    """One server (embedded SQLite under ``work``) as a child process; yields (URL, worker key)."""
    from server.admin import issue_worker_key
    from server.settings import ServerSettings

    url = f"http://127.0.0.1:{free_port()}"
    data = work / "data"
    data.mkdir()
    key = issue_worker_key(ServerSettings(data_dir=data), "exactness")
    proc = spawn(
        ["serve", "--port", url.rsplit(":", 1)[1], "--data-dir", str(data), "--log-level", "warning"],
        output=work / "server.log",
        env={"TOKENTRAIL_RATE_LIMIT_PER_MINUTE": "0"},  # a load generator, not a user to be slowed down
    )
    try:
        wait_ready(lambda: answers(url), {"server": proc}, "server", 180, logs=work)
        yield url, key
    finally:
        stop(proc, "server")


@contextlib.contextmanager
def running_workers(
    url: str,
    key: str,
    work: Path,
    model_dir: str,
    modes: dict[str, str],
    max_parallel: int,
    engine: str = "hf",
    extra_args: Sequence[str] = (),
) -> Iterator[None]:
    """One worker per served name (``modes``: name -> prompt mode) on ``model_dir``, as child processes.

    ``engine`` vllm starts them with the vLLM environment's python (``vllm_python``)."""
    procs: dict[str, subprocess.Popen[bytes]] = {}
    try:
        program, env, engine_args = None, {}, ["--engine", engine]
        if engine == "vllm":
            program, env = (vllm_python(), "-m", "tokentrail"), {"VLLM_CPU_KVCACHE_SPACE": "1"}
            engine_args += ["--max-model-len", "2048", "--gpu-memory-utilization", "0.2"]
            say(f"starting {len(modes)} vLLM worker(s) with {program[0]} (30-60 s or more each)...")
        env["OMP_NUM_THREADS"] = str(max(1, (os.cpu_count() or 2) // len(modes)))
        for name, mode in modes.items():
            procs[name] = spawn(
                ["worker", "--server-url", url, "--api-key", key, "--model", model_dir, "--served-model-name", name,
                 "--prompt-mode", mode, "--max-parallel", str(max_parallel), "--log-level", "warning",
                 *engine_args, *extra_args],
                program=program,
                output=work / f"{name}.log",
                env=env,
            )  # fmt: skip
        timeout = VLLM_STARTUP_S if engine == "vllm" else 180
        wait_ready(
            lambda: offers(url, list(modes)), procs, f"workers {', '.join(modes)}", timeout, logs=work, progress=True
        )
        yield
    finally:
        for name, proc in reversed(procs.items()):
            stop(proc, name)


@contextlib.contextmanager
def running_arms(
    model_dir: str, work: Path, max_parallel: int, engine: str = "hf", extra_args: Sequence[str] = ()
) -> Iterator[str]:
    """One server and one worker per arm (same model dir) as child processes; yields the server URL."""
    modes = {arm: arm for arm in ARMS}
    with (
        running_server(work) as (url, key),
        running_workers(url, key, work, model_dir, modes, max_parallel, engine, extra_args),
    ):
        say(f"server at {url}, {engine} workers 'stitch' and 'naive' connected")
        yield url
