"""``--profile DIR``: py-spy samples of each measured process over each point's window, and a summary of
where their CPU went, by library.

A sample is charged to the innermost frame that belongs to a known library or to tokentrail (the
standard library frames under it count for their caller: ``sqlite3`` under SQLAlchemy is SQLAlchemy's
cost). py-spy records only threads that are running (``--idle`` off), so shares are of CPU, not of wall
time. Sampling costs CPU on the same cores: throughput measured with ``--profile`` is lower; take
figures from runs without it.
"""

from __future__ import annotations

import math
import shutil
import subprocess
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

# (path fragment, category), first match wins: specific libraries before the packages that wrap them
CATEGORIES: tuple[tuple[str, str], ...] = (
    ("/sqlalchemy/", "SQLAlchemy"),
    ("/aiosqlite/", "SQL driver"),
    ("/asyncpg/", "SQL driver"),
    ("/sqlite3/", "SQL driver"),
    ("/server/sqlite_inline.py", "SQL driver"),  # the shim whose frames hold sqlite3's C calls
    ("/server/raw_sqlite.py", "SQL driver"),  # the raw connection of the per-turn statements
    ("/alembic/", "SQLAlchemy"),
    ("/uvicorn/", "HTTP server (uvicorn, h11, httptools)"),
    ("/h11/", "HTTP server (uvicorn, h11, httptools)"),
    ("/httptools/", "HTTP server (uvicorn, h11, httptools)"),
    ("/sse_starlette/", "ASGI (starlette, FastAPI, sse-starlette)"),
    ("/fastapi/", "ASGI (starlette, FastAPI, sse-starlette)"),
    ("/starlette/", "ASGI (starlette, FastAPI, sse-starlette)"),
    ("/pydantic/", "pydantic"),
    ("/pydantic_core/", "pydantic"),
    ("/jinja2/", "jinja2 (chat templates)"),
    ("/websockets/", "websockets"),
    ("/redis/", "redis client"),
    ("/tokenizers/", "tokenizers / transformers"),
    ("/transformers/", "tokenizers / transformers"),
    ("/torch/", "torch"),
    ("/vllm/entrypoints/", "vLLM API server (entrypoints)"),
    ("/vllm/v1/engine/", "vLLM engine client / core"),
    ("/vllm/", "vLLM other"),
    ("/zmq/", "zmq"),
    ("/msgspec/", "msgspec"),
    ("/orjson", "JSON"),
    ("/json/", "JSON"),
    ("/uvloop/", "event loop"),
    ("/asyncio/", "event loop"),
    ("/selectors.py", "event loop"),
    ("/server/", "tokentrail server"),
    ("/worker/", "tokentrail worker"),
    ("/shared/", "tokentrail shared"),
)
OTHER = "other (standard library, native)"
TOP_FUNCTIONS = 8


def category(frame: str) -> str | None:
    """The category of a raw py-spy frame, ``function (path)``, or None for frames charged to their caller."""
    path = frame[frame.rfind("(") + 1 :] if "(" in frame else frame
    for fragment, name in CATEGORIES:
        if fragment in path:
            if name.startswith("tokentrail") and "site-packages" in path:
                continue  # a library's own server/ or worker/ folder
            return name
    return None


@dataclass
class Summary:
    samples: int = 0
    by_category: Counter[str] = field(default_factory=Counter)
    tokentrail_inclusive: Counter[str] = field(default_factory=Counter)  # tokentrail function -> samples under it
    tokentrail_own: Counter[str] = field(default_factory=Counter)  # samples charged to tokentrail, by function

    def add(self, stack: list[str], count: int) -> None:
        self.samples += count
        charged, frame = next(((c, f) for f in reversed(stack) if (c := category(f)) is not None), (OTHER, ""))
        self.by_category[charged] += count
        if charged.startswith("tokentrail"):
            self.tokentrail_own[_short(frame)] += count
        # entry points (cli.py) hold every sample: they say nothing
        seen = {f for f in stack if (category(f) or "").startswith("tokentrail") and "cli.py" not in f}
        for f in seen:
            self.tokentrail_inclusive[_short(f)] += count

    def lines(self) -> list[str]:
        if not self.samples:
            return ["    (no samples)"]
        out = [f"    {100 * n / self.samples:5.1f}%  {name}" for name, n in self.by_category.most_common()]
        for title, counts in (("inclusive", self.tokentrail_inclusive), ("own", self.tokentrail_own)):
            top = counts.most_common(TOP_FUNCTIONS)
            if top:
                out.append(f"    tokentrail functions, {title}:")
                out += [f"    {100 * n / self.samples:5.1f}%  {name}" for name, n in top]
        return out


def _short(frame: str) -> str:
    """``function (…/server/chats/enqueue.py)`` -> ``server/chats/enqueue.py:function``."""
    name, _, path = frame.partition(" (")
    path = path.rstrip(")")
    for root in ("/server/", "/worker/", "/shared/"):
        k = path.rfind(root)
        if k >= 0:
            return f"{path[k + 1 :]}:{name}"
    return frame


def summarize(raw: Path) -> Summary:
    """A py-spy ``--format raw`` file: one ``frame;frame;...;leaf count`` line per distinct stack, the
    outermost frame first (a thread's ``process ...`` / ``thread ...`` lines come first when present)."""
    s = Summary()
    for line in raw.read_text(errors="replace").splitlines():
        stack_text, _, count = line.rpartition(" ")
        if not count.isdigit():
            continue
        s.add([f for f in stack_text.split(";") if f], int(count))
    return s


class Profiler:
    """One ``py-spy record`` per process over a window; ``stop`` waits for them and summarizes."""

    def __init__(self, directory: Path, rate: int = 100) -> None:
        if shutil.which("py-spy") is None:
            raise SystemExit("--profile needs py-spy: pip install -e '.[bench]'")
        self.directory = directory
        self.rate = rate
        directory.mkdir(parents=True, exist_ok=True)
        self._running: list[tuple[str, Path, subprocess.Popen[bytes]]] = []

    def start(self, label: str, targets: dict[str, int], duration_s: float) -> None:
        self._running = []
        for role, pid in targets.items():
            out = self.directory / f"{label}.{role}.txt"
            cmd = ["py-spy", "record", "--pid", str(pid), "--duration", str(max(1, math.ceil(duration_s))),
                   "--rate", str(self.rate), "--format", "raw", "--full-filenames", "--nolineno", "--nonblocking",
                   "--output", str(out)]  # fmt: skip
            proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
            self._running.append((role, out, proc))

    def stop(self, label: str) -> list[str]:
        """Wait for the samplers; the summary lines (also written to ``DIR/<label>.summary.txt``)."""
        lines = [f"profile {label}:"]
        for role, out, proc in self._running:
            try:
                proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                proc.kill()
            if not out.exists():
                lines.append(f"  {role}: py-spy wrote nothing (exit {proc.returncode})")
                continue
            s = summarize(out)
            lines.append(f"  {role} ({s.samples} samples at {self.rate}/s):")
            lines += s.lines()
        self._running = []
        (self.directory / f"{label}.summary.txt").write_text("\n".join(lines) + "\n")
        return lines
