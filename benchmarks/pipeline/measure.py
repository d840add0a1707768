"""What one point measures: tokens and turns the clients saw, their timings, errors, prompt-cache hits,
and the CPU each process spent in the measured window."""

from __future__ import annotations

import os
import time
import urllib.request
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from benchmarks.pipeline.profile import Profiler
from benchmarks.progress import say

CLK_TCK = os.sysconf("SC_CLK_TCK")
MAX_ERROR_SAMPLES = 5


@dataclass
class Point:
    """One arm at one concurrency for one front door, workload and stop rule."""

    arm: str  # engine | embedded | redis | vllm-serve | synthetic
    api: str  # oa | openai | "-" (the engine arm has no front door)
    workload: str  # single | agent
    stop: str  # fixed | natural
    concurrency: int
    turns: int = 1  # turns per conversation
    wall_s: float = 0.0
    tokens: int = 0
    events: int = 0  # stream events (SSE chunks) that carried tokens
    requests: int = 0  # turns completed inside the window
    errors: int = 0
    error_samples: list[str] = field(default_factory=list)
    ttft_s: list[float] = field(default_factory=list)
    gaps_s: list[float] = field(default_factory=list)
    tails_s: list[float] = field(default_factory=list)  # a turn's last token -> the end of its stream
    ttft_by_turn_s: list[list[float]] = field(default_factory=list)  # [turn index - 1] -> TTFTs
    prompt_tokens_by_turn: list[int] = field(default_factory=list)  # summed over turns that reported usage
    cached_tokens_by_turn: list[int] = field(default_factory=list)
    usage_by_turn: list[int] = field(default_factory=list)  # how many turns reported usage
    cpu_s: dict[str, float] = field(default_factory=dict)  # process (role) -> CPU seconds in the window
    server: dict[str, float] = field(default_factory=dict)  # the server's own figures over the window (/metrics)
    counts: dict[str, int] = field(default_factory=dict)  # e.g. tokentrail's prompt methods, forks

    def count(self, window: Window, what: str) -> None:
        if window.open:
            self.counts[what] = self.counts.get(what, 0) + 1

    @property
    def name(self) -> str:
        return self.arm if self.api == "-" else f"{self.arm}/{self.api}"

    def fail(self, window: Window, exc: BaseException) -> None:
        if not window.open:
            return
        self.errors += 1
        text = f"{type(exc).__name__}: {exc}"[:300]
        if len(self.error_samples) < MAX_ERROR_SAMPLES and text not in self.error_samples:
            self.error_samples.append(text)

    def usage(self, turn: int, prompt_tokens: int | None, cached_tokens: int | None) -> None:
        """Prompt and cached tokens of a turn (1-based) that completed inside the window."""
        if prompt_tokens is None:
            return
        for xs in (self.prompt_tokens_by_turn, self.cached_tokens_by_turn, self.usage_by_turn):
            xs.extend([0] * (turn - len(xs)))
        self.prompt_tokens_by_turn[turn - 1] += prompt_tokens
        self.cached_tokens_by_turn[turn - 1] += cached_tokens or 0
        self.usage_by_turn[turn - 1] += 1


def _add_by_turn(into: list[Any], more: list[Any], blank: Callable[[], Any] = int) -> None:
    """``into[k] += more[k]`` for every turn, ``into`` first padded with ``blank()`` to ``more``'s length."""
    into.extend(blank() for _ in range(len(more) - len(into)))
    for k, v in enumerate(more):
        into[k] += v


def pooled(points: Sequence[Point]) -> list[Point]:
    """The rounds of a run (``--rounds``) pooled point by point (same arm, front door, workload, stop and
    concurrency), in first-seen order: windows, tokens, turns, errors, CPU and the server's totals added
    up, the latency samples joined, so that each figure is over every round's window. With the arms'
    order reversed every other round, a machine that grows slower or faster during the run weighs on
    every arm alike."""
    out: dict[tuple[str, str, str, str, int], Point] = {}
    for p in points:
        key = (p.arm, p.api, p.workload, p.stop, p.concurrency)
        acc = out.get(key)
        if acc is None:
            acc = out[key] = Point(p.arm, p.api, p.workload, p.stop, p.concurrency, p.turns)
        acc.wall_s += p.wall_s
        acc.tokens += p.tokens
        acc.events += p.events
        acc.requests += p.requests
        acc.errors += p.errors
        acc.error_samples += [e for e in p.error_samples if e not in acc.error_samples][
            : MAX_ERROR_SAMPLES - len(acc.error_samples)
        ]
        acc.ttft_s += p.ttft_s
        acc.gaps_s += p.gaps_s
        acc.tails_s += p.tails_s
        _add_by_turn(acc.ttft_by_turn_s, p.ttft_by_turn_s, list)
        _add_by_turn(acc.prompt_tokens_by_turn, p.prompt_tokens_by_turn)
        _add_by_turn(acc.cached_tokens_by_turn, p.cached_tokens_by_turn)
        _add_by_turn(acc.usage_by_turn, p.usage_by_turn)
        for into, totals in ((acc.cpu_s, p.cpu_s), (acc.server, p.server)):
            for k, v in totals.items():
                into[k] = into.get(k, 0.0) + v
        for k, n in p.counts.items():
            acc.counts[k] = acc.counts.get(k, 0) + n
    return list(out.values())


def pct(xs: Sequence[float], q: float) -> float | None:
    if not xs:
        return None
    s = sorted(xs)
    return s[min(len(s) - 1, int(q * len(s)))]


def ms(x: float | None) -> float | None:
    return None if x is None else round(1000 * x, 2)


class Window:
    """The measured window of one point: tokens, turns and errors count only while it is open."""

    def __init__(self, duration_s: float) -> None:
        self.start = time.perf_counter()
        self.end = self.start + duration_s

    @property
    def open(self) -> bool:
        return time.perf_counter() < self.end


class Arrivals:
    """Records one turn's token arrivals into a point: TTFT (overall and by turn index), inter-token
    gaps, tokens. The clock starts when it is made: make it when the turn's first request is sent."""

    def __init__(self, point: Point, window: Window, turn: int = 1) -> None:
        self.point = point
        self.window = window
        self.turn = turn
        self.sent = self.last = time.perf_counter()
        self.first = True

    def tokens(self, n: int) -> None:
        now = time.perf_counter()
        if not n or not self.window.open:
            return
        if self.first:
            ttft = now - self.sent
            self.point.ttft_s.append(ttft)
            by_turn = self.point.ttft_by_turn_s
            by_turn.extend([] for _ in range(self.turn - len(by_turn)))
            by_turn[self.turn - 1].append(ttft)
            self.first = False
        else:
            self.point.gaps_s.append(now - self.last)
        self.point.gaps_s += [0.0] * (n - 1)  # tokens that arrived together
        self.last = now
        self.point.tokens += n
        self.point.events += 1

    def done(self) -> None:
        """The turn's stream ended (``[DONE]``, the OA flow's final message): the wait after its last
        token, which a closed-loop client spends before its next turn."""
        if not self.first and self.window.open:
            self.point.tails_s.append(time.perf_counter() - self.last)


# ---- CPU ------------------------------------------------------------------------------------------
def _proc_table() -> tuple[dict[int, list[int]], dict[int, float], dict[int, str]]:
    """Children, CPU seconds (user + system, all threads) and command name of every process."""
    children: dict[int, list[int]] = {}
    times: dict[int, float] = {}
    names: dict[int, str] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                head, _, rest = f.read().rpartition(")")
        except OSError:
            continue
        fields = rest.split()
        p = int(entry)
        children.setdefault(int(fields[1]), []).append(p)
        times[p] = (int(fields[11]) + int(fields[12])) / CLK_TCK
        names[p] = head.partition("(")[2]
    return children, times, names


def _descendants(children: dict[int, list[int]], pid: int) -> list[int]:
    out, stack = [], list(children.get(pid, []))
    while stack:
        p = stack.pop()
        out.append(p)
        stack += children.get(p, [])
    return out


def tree_cpu_s(pid: int) -> float:
    """CPU seconds of a process and all its descendants."""
    children, times, _ = _proc_table()
    return sum(times.get(p, 0.0) for p in [pid, *_descendants(children, pid)])


@dataclass(frozen=True)
class Role:
    """A process whose CPU a point reports: ``name`` gets the process alone; its descendants (vLLM's
    engine core and model runner) go to ``children`` if given, else to ``name`` as well."""

    name: str
    pid: int
    children: str | None = None


class CpuMeter:
    """CPU seconds per role over a window; ``services`` adds the local PostgreSQL and Redis servers
    (by command name), ``client`` this process (the benchmark's own clients)."""

    def __init__(
        self,
        roles: Sequence[Role],
        *,
        services: bool = False,
        client: bool = False,
        profiler: Profiler | None = None,
        metrics_url: str | None = None,
    ) -> None:
        self.roles = list(roles)
        self.metrics_url = metrics_url  # a tokentrail server's /metrics: its own figures are read too
        self._server0: dict[str, float] = {}
        self.last_server: dict[str, float] = {}
        self.services = services
        self.client = client
        self.profiler = profiler
        self.label = "point"  # names the window's profile files (set per point)
        self._start: dict[str, float] = {}
        self._client0 = 0.0

    def _targets(self) -> dict[str, int]:
        """The processes to profile: each role's process, and its descendants under the children's name."""
        children, _, _ = _proc_table()
        out: dict[str, int] = {}
        for role in self.roles:
            out[role.name] = role.pid
            if role.children:
                for k, pid in enumerate(_descendants(children, role.pid)):
                    out[f"{role.children}{k}"] = pid
        return out

    def _read(self) -> dict[str, float]:
        children, times, names = _proc_table()
        out: dict[str, float] = {}
        for role in self.roles:
            mine = [role.pid] if role.children else [role.pid, *_descendants(children, role.pid)]
            out[role.name] = out.get(role.name, 0.0) + sum(times.get(p, 0.0) for p in mine)
            if role.children:
                below = _descendants(children, role.pid)
                out[role.children] = out.get(role.children, 0.0) + sum(times.get(p, 0.0) for p in below)
        if self.services:
            out["postgres"] = sum(t for p, t in times.items() if names.get(p, "").startswith(("postgres", "pgbouncer")))
            out["redis"] = sum(t for p, t in times.items() if names.get(p, "").startswith("redis-server"))
        return out

    def start(self, duration_s: float = 0.0) -> None:
        """Open the window; with a profiler, sample each process for ``duration_s``."""
        if self.profiler is not None:
            self.profiler.start(self.label, self._targets(), duration_s)
        self._server0 = server_totals(self.metrics_url) if self.metrics_url else {}
        self._start = self._read()
        self._client0 = time.process_time()

    def stop(self) -> dict[str, float]:
        now = self._read()
        out = {k: v - self._start.get(k, 0.0) for k, v in now.items()}
        if self.metrics_url:
            now_server = server_totals(self.metrics_url)
            self.last_server = {k: v - self._server0.get(k, 0.0) for k, v in now_server.items()}
        if self.client:
            out["client"] = time.process_time() - self._client0
        if self.profiler is not None:
            for line in self.profiler.stop(self.label):
                say(line)
        return out


def server_totals(metrics_url: str) -> dict[str, float]:
    """From a tokentrail server's ``/metrics``, summed over labels: seconds in garbage collection,
    collections and those over 50 ms (``tokentrail_gc_pause_seconds``); queue waits (request -> a
    worker starts it), server-side TTFTs and inter-token gaps, their sums and counts. Read at a window's ends."""
    with urllib.request.urlopen(metrics_url, timeout=10) as resp:
        text = resp.read().decode()
    out = dict.fromkeys(
        ("gc_s", "collections", "upto_50ms", "wait_s", "waits", "ttft_s", "ttfts", "itl_s", "itls"), 0.0
    )
    series = {
        "tokentrail_gc_pause_seconds_sum": "gc_s",
        "tokentrail_gc_pause_seconds_count": "collections",
        "tokentrail_queue_wait_seconds_sum": "wait_s",
        "tokentrail_queue_wait_seconds_count": "waits",
        "tokentrail_ttft_seconds_sum": "ttft_s",
        "tokentrail_ttft_seconds_count": "ttfts",
        "tokentrail_inter_token_seconds_sum": "itl_s",
        "tokentrail_inter_token_seconds_count": "itls",
    }
    for line in text.splitlines():
        if not line.startswith("tokentrail_"):
            continue
        name, _, value = line.rpartition(" ")
        key = series.get(name.partition("{")[0])
        if key is not None:
            out[key] += float(value)
        elif name.startswith("tokentrail_gc_pause_seconds_bucket") and 'le="0.05"' in name:
            out["upto_50ms"] += float(value)  # buckets are cumulative: the pauses of at most 50 ms
    out["long"] = out["collections"] - out["upto_50ms"]
    return out


def summary(p: Point) -> dict[str, Any]:
    """The point's figures, as printed and as ``--json`` gives them."""
    turns = len(p.ttft_by_turn_s)
    later_prompt = sum(p.prompt_tokens_by_turn[1:])
    out: dict[str, Any] = {
        "arm": p.name,
        "base_arm": p.arm,
        "api": p.api,
        "workload": p.workload,
        "turns_per_conversation": p.turns,
        "stop": p.stop,
        "concurrency": p.concurrency,
        "tokens_per_s": round(p.tokens / p.wall_s if p.wall_s else 0.0, 1),
        "tokens": p.tokens,
        "requests": p.requests,
        "errors": p.errors,
        "error_samples": p.error_samples,
        "ttft_p50_ms": ms(pct(p.ttft_s, 0.5)),
        "ttft_p99_ms": ms(pct(p.ttft_s, 0.99)),
        "itl_p50_ms": ms(pct(p.gaps_s, 0.5)),
        "itl_p99_ms": ms(pct(p.gaps_s, 0.99)),
        "itl_mean_ms": ms(sum(p.gaps_s) / len(p.gaps_s)) if p.gaps_s else None,
        "end_p50_ms": ms(pct(p.tails_s, 0.5)),
        "tokens_per_event": round(p.tokens / p.events, 2) if p.events else None,
        "ttft_p50_ms_by_turn": [ms(pct(p.ttft_by_turn_s[k], 0.5)) for k in range(turns)],
        # every turn from the second on, pooled: one p50 over all of them (a per-turn p50 rests on a few
        # dozen samples at most; the worst of seven such ratios exceeds 1.0 even between equal arms)
        "ttft_p50_later_turns_ms": ms(pct([t for later in p.ttft_by_turn_s[1:] for t in later], 0.5)),
        "counts": p.counts,
        "prompt_tokens": sum(p.prompt_tokens_by_turn),
        "prompt_tokens_mean_by_turn": [
            round(t / n, 1) if n else None for t, n in zip(p.prompt_tokens_by_turn, p.usage_by_turn, strict=True)
        ],
        "cached_tokens": sum(p.cached_tokens_by_turn),
        "cached_share_by_turn": [
            round(c / t, 3) if t else None
            for c, t in zip(p.cached_tokens_by_turn, p.prompt_tokens_by_turn, strict=True)
        ],
        "cached_share_later_turns": round(sum(p.cached_tokens_by_turn[1:]) / later_prompt, 3) if later_prompt else None,
    }
    if p.tokens:
        for k, v in p.cpu_s.items():
            out[f"{k}_cpu_ms_per_token"] = round(1000 * v / p.tokens, 3)
    s = p.server
    if s and p.cpu_s.get("server"):
        out["server_gc_share_of_cpu"] = round(s["gc_s"] / p.cpu_s["server"], 3)
        out["server_gc_collections"] = int(s["collections"])
        out["server_gc_pauses_over_50ms"] = int(s["long"])
        out["server_queue_wait_mean_ms"] = round(1000 * s["wait_s"] / s["waits"], 1) if s["waits"] else None
        out["server_ttft_mean_ms"] = round(1000 * s["ttft_s"] / s["ttfts"], 1) if s["ttfts"] else None
        out["server_itl_mean_ms"] = round(1000 * s["itl_s"] / s["itls"], 2) if s.get("itls") else None
    return out
