"""Child processes of tokentrail, for ``tokentrail up``/``demo``, the benchmarks and the tests.

``spawn`` starts ``python -m tokentrail ARGS`` (or another program), ``wait_ready`` waits until a check
passes while watching that the children live, ``stop`` asks a child to stop and kills it if it does not;
``running_stack`` is a server and one worker on embedded defaults.
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path

import httpx

from server.settings import ServerSettings

_STOP_TIMEOUT_S = 15
_PROGRESS_EVERY_S = 15


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _die_with_parent() -> None:
    """preexec_fn of a child process: the kernel sends it SIGTERM when this process dies, even by
    SIGKILL (Linux ``PR_SET_PDEATHSIG``), so no child outlives its parent."""
    if not sys.platform.startswith("linux"):
        return
    import ctypes

    parent = os.getppid()
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    if os.getppid() != parent:  # the parent died before the line above: nothing will signal us
        os.kill(os.getpid(), signal.SIGTERM)


def spawn(
    args: Sequence[str],
    *,
    program: Sequence[str] | None = None,
    output: Path | int | None = None,
    append: bool = False,
    env: Mapping[str, str] | None = None,
    die_with_parent: bool = False,
) -> subprocess.Popen[bytes]:
    """``program ARGS`` (default ``python -m tokentrail``) as a child process.

    ``output``: a log file for stdout and stderr (truncated, or appended to with ``append``),
    ``subprocess.DEVNULL``, or None to share this process's. ``env`` is added to this process's
    environment (with ``PYTHONUNBUFFERED=1``). ``die_with_parent`` sets ``PR_SET_PDEATHSIG``: opt-in,
    since the signal follows the *thread* that spawned the child, not the process.
    """
    command = [*(program or (sys.executable, "-m", "tokentrail")), *args]
    environ = {**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})}
    preexec = _die_with_parent if die_with_parent else None  # only prctl: safe between fork and exec
    if not isinstance(output, Path):
        return subprocess.Popen(command, stdout=output, stderr=output, env=environ, preexec_fn=preexec)
    with open(output, "ab" if append else "wb") as out:  # the child keeps its own descriptor
        return subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT, env=environ, preexec_fn=preexec)


def stop(proc: subprocess.Popen[bytes], name: str) -> None:
    """SIGINT (a server shuts down, a worker hands its work back), then SIGKILL after 15 s, for the
    child and every process below it."""
    if proc.poll() is not None:
        return
    proc.send_signal(signal.SIGINT)
    try:
        proc.wait(timeout=_STOP_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        print(f"{name} did not stop in {_STOP_TIMEOUT_S}s; killing it", file=sys.stderr, flush=True)
        # A vLLM worker's engine-core and model-runner processes would outlive it, reparented, each
        # holding its share of the memory (GPU memory on a GPU): listed while they are still its
        # descendants, killed after it, so that no supervisor in it starts them again meanwhile.
        below = descendants(proc.pid)
        proc.kill()
        proc.wait()
        for pid in below:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(pid, signal.SIGKILL)


def descendants(pid: int) -> list[int]:
    """The processes below ``pid``, nearest first (Linux ``/proc/PID/task/TID/children``; none where
    that is not available)."""
    found: list[int] = []
    pending = [pid]
    while pending:
        parent = pending.pop(0)
        try:
            threads = os.listdir(f"/proc/{parent}/task")
        except OSError:
            continue
        for tid in threads:
            try:
                with open(f"/proc/{parent}/task/{tid}/children") as f:
                    children = [int(c) for c in f.read().split()]
            except (OSError, ValueError):
                continue
            found += children
            pending += children
    return found


def answers(url: str) -> bool:
    """Does the server at ``url`` answer ``/health``?"""
    with contextlib.suppress(httpx.HTTPError):
        return httpx.get(f"{url}/health", timeout=2).status_code == 200
    return False


def offers(url: str, models: Sequence[str]) -> bool:
    """Does the server at ``url`` offer every one of ``models`` (a worker serving each is connected)?"""
    with contextlib.suppress(httpx.HTTPError, ValueError):
        resp = httpx.get(f"{url}/configs/model_configs", timeout=2)
        return resp.status_code == 200 and {m["name"] for m in resp.json()} >= set(models)
    return False


def wait_ready(
    ready: Callable[[], bool],
    procs: Mapping[str, subprocess.Popen[bytes]],
    what: str,
    timeout_s: float,
    *,
    logs: Path | None = None,
    progress: bool = False,
) -> None:
    """Poll ``ready`` until it holds; raise RuntimeError if one of ``procs`` exits first (with the tail of
    its log ``logs/NAME.log``, when the children log there) or after ``timeout_s``. ``progress`` says on
    stderr every 15 s what is still awaited."""
    start = time.monotonic()
    deadline, report = start + timeout_s, start + _PROGRESS_EVERY_S
    while time.monotonic() < deadline:
        if progress and time.monotonic() >= report:
            report += _PROGRESS_EVERY_S
            print(f"waiting for {what}: {time.monotonic() - start:.0f} s", file=sys.stderr, flush=True)
        for name, proc in procs.items():
            if proc.poll() is not None:
                if logs is None:
                    raise RuntimeError(f"{name} exited with code {proc.returncode}; see its output above")
                tail = (logs / f"{name}.log").read_text(errors="replace")[-3000:]
                raise RuntimeError(f"{name} exited with code {proc.returncode}:\n{tail}")
        if ready():
            return
        time.sleep(0.2)
    raise RuntimeError(f"{what} not ready after {timeout_s:.0f} s" + (f" (logs in {logs})" if logs else ""))


@contextlib.contextmanager
def running_stack(data_dir: Path, port: int, model: str, *, quiet: bool, max_parallel: int = 4) -> Iterator[str]:
    """A server and a worker (``PR_SET_PDEATHSIG``: they die with this process); yields the server URL
    once the worker's model is offered. Progress goes to stdout; ``quiet`` hides the children's output."""
    # imported here: the worker's environment (e.g. the vLLM venv) runs the CLI without the server's deps
    from server.admin import issue_worker_key
    from worker.tiny import resolve_model

    url = f"http://127.0.0.1:{port}"
    print(f"preparing model {model!r} (built once, then cached)...", flush=True)
    model_path = resolve_model(model)
    key = issue_worker_key(ServerSettings(data_dir=data_dir), "launcher")
    output = subprocess.DEVNULL if quiet else None
    server = spawn(
        ["serve", "--port", str(port), "--data-dir", str(data_dir), "--log-level", "warning"],
        output=output,
        die_with_parent=True,
    )
    worker: subprocess.Popen[bytes] | None = None
    try:
        wait_ready(lambda: answers(url), {"server": server}, "server", 60)
        print(f"server up at {url} (database in {data_dir})", flush=True)
        worker = spawn(
            ["worker", "--server-url", url, "--api-key", key, "--model", model_path, "--served-model-name", model,
             "--max-parallel", str(max_parallel), "--log-level", "warning"],
            output=output,
            die_with_parent=True,
        )  # fmt: skip
        wait_ready(lambda: offers(url, [model]), {"worker": worker}, "worker", 180)
        print(f"worker connected, serving {model!r}", flush=True)
        yield url
    finally:
        if worker is not None:
            stop(worker, "worker")
        stop(server, "server")
