"""Prometheus metrics of one server process (``GET /metrics``).

Event metrics (latencies, tokens, finished messages, errors) are recorded where they happen, once
per engine step at most, never per token. State metrics (queue depth, open messages, workers and
their free slots) are read when scraped. Each process has its own registry: scrape every replica;
series named ``tokentrail_cluster_*`` describe the whole cluster and are the same on every replica
(take ``max``, not ``sum``). The processes of one ``serve --processes N`` share a port: a scrape of
any of them answers for all of them (``server/metrics_group.py``).
"""

from __future__ import annotations

import contextlib
import gc
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import UTC, datetime

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from sqlalchemy import func, select

from server.db import SessionFactory
from server.models import MESSAGE_IS_OPEN, Message
from server.queue.protocol import WorkerDirectory, WorkQueue
from shared.api import MessageState

# Seconds: from a few milliseconds (a warm GPU) to minutes (a long queue).
_LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300)
_ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.08, 0.16, 0.32, 0.64, 1.28, 2.56, 5)
_GC_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1)
_OPEN = (MessageState.pending.value, MessageState.in_progress.value)


def seconds_since(when: datetime) -> float:
    if when.tzinfo is None:  # SQLite hands datetimes back naive (they were stored as UTC)
        when = when.replace(tzinfo=UTC)
    return max((datetime.now(UTC) - when).total_seconds(), 0.0)


@dataclass(frozen=True, slots=True)
class ModelSeries:
    """One model's children of the per-token series: ``labels()`` takes a lock and builds its key at
    every call, and the hub records once per engine step per message."""

    ttft: Histogram
    inter_token: Histogram
    tokens: Counter


class Metrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        self._series: dict[str, ModelSeries] = {}
        r = self.registry
        self.ttft = Histogram(
            "tokentrail_ttft_seconds",
            "Time from an assistant message's request to its first token, by model",
            ["model"],
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.queue_wait = Histogram(
            "tokentrail_queue_wait_seconds",
            "Time an assistant message waited before a worker started it (first attempt), by model",
            ["model"],
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.inter_token = Histogram(
            "tokentrail_inter_token_seconds",
            "Time between a message's consecutive tokens arriving from its worker, by model",
            ["model"],
            buckets=_ITL_BUCKETS,
            registry=r,
        )
        self.tokens = Counter(
            "tokentrail_generated_tokens", "Tokens streamed from workers to readers, by model", ["model"], registry=r
        )
        self.finished = Counter(
            "tokentrail_messages_finished",
            "Assistant messages that ended, by final state",
            ["state"],
            registry=r,
        )
        self.errors = Counter(
            "tokentrail_errors", "Error answers and failed messages, by machine-readable code", ["code"], registry=r
        )
        self.sse_readers = Gauge("tokentrail_sse_readers", "Open SSE event streams of this process", registry=r)
        self.workers = Gauge(
            "tokentrail_workers_connected", "Workers connected to this process, by model", ["model"], registry=r
        )
        self.free_slots = Gauge(
            "tokentrail_worker_free_slots",
            "Free generation slots (credits) of workers connected to this process, by model",
            ["model"],
            registry=r,
        )
        self.cluster_workers = Gauge(
            "tokentrail_cluster_workers", "Workers connected to any server process, by model", ["model"], registry=r
        )
        self.queue_depth = Gauge(
            "tokentrail_cluster_queue_depth", "Messages waiting in a model's queue", ["model"], registry=r
        )
        self.open_messages = Gauge(
            "tokentrail_cluster_open_messages", "Assistant messages pending or in progress", ["state"], registry=r
        )
        self.policy_version = Gauge(
            "tokentrail_policy_version",
            "A model's current weights version as this process knows it (0: the weights its workers started with)",
            ["model"],
            registry=r,
        )
        self.weights_pushes = Counter(
            "tokentrail_weights_pushes", "Weights pushes handled by this process, by model and outcome",
            ["model", "outcome"], registry=r,
        )  # fmt: skip
        self.weights_push_seconds = Histogram(
            "tokentrail_weights_push_seconds",
            "A weights push from its request until every worker served the new version, by model and mode",
            ["model", "mode"],
            buckets=(0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300),
            registry=r,
        )
        self.engine_deaths = Counter(
            "tokentrail_engine_deaths",
            "Engine deaths reported by workers connected to this process (their work was requeued), by model",
            ["model"],
            registry=r,
        )
        self.engine_restarts = Counter(
            "tokentrail_engine_restarts",
            "Engines restarted by workers connected to this process after a death, by model",
            ["model"],
            registry=r,
        )
        self.engines_down = Gauge(
            "tokentrail_workers_engine_down",
            "Workers connected to this process whose engine is restarting or failed (they take no work), by model",
            ["model"],
            registry=r,
        )
        self.routing = Counter(
            "tokentrail_routing_dispatches",
            "First attempts dispatched, by model and routing outcome: preferred (the worker holding the "
            "prefix took it), handed_over (it was busy or gone past the wait bound; another took it), "
            "unrouted (no preference)",
            ["model", "outcome"],
            registry=r,
        )
        self.prompt_tokens = Counter(
            "tokentrail_prompt_tokens",
            "Prompt tokens of stored replies whose engine reports prefix-cache hits, by model",
            ["model"],
            registry=r,
        )
        self.cached_prompt_tokens = Counter(
            "tokentrail_cached_prompt_tokens",
            "Of those, the tokens the engine's prefix cache held (hit rate: this / tokentrail_prompt_tokens)",
            ["model"],
            registry=r,
        )
        self.lineage = Counter(
            "tokentrail_lineage_decisions",
            "Chat requests (OpenAI, Responses, Messages routes) by model and how they met the stored tree: "
            "extended, forked, root",
            ["model", "decision"],
            registry=r,
        )
        self.prefix_breaks = Counter(
            "tokentrail_prefix_breaks",
            "Chat requests whose history left the stored path (forked, or a root that echoes assistant "
            "messages), by model (rate: this / tokentrail_lineage_decisions)",
            ["model"],
            registry=r,
        )
        self.scrape_errors = Counter(
            "tokentrail_metrics_scrape_errors", "State reads that failed during a scrape", ["what"], registry=r
        )
        self.gc_pause = Histogram(
            "tokentrail_gc_pause_seconds",
            "Garbage-collector pauses of this process (the event loop stops for each), by generation",
            ["generation"],
            buckets=_GC_BUCKETS,
            registry=r,
        )
        self._gc_children = [self.gc_pause.labels(str(g)) for g in range(3)]
        self._gc_started = 0.0

    def _on_gc(self, phase: str, info: dict[str, int]) -> None:
        if phase == "start":
            self._gc_started = time.perf_counter()
        else:
            self._gc_children[info["generation"]].observe(time.perf_counter() - self._gc_started)

    def watch_gc(self) -> None:
        """Time this process's garbage collections until ``unwatch_gc``."""
        if self._on_gc not in gc.callbacks:
            gc.callbacks.append(self._on_gc)

    def unwatch_gc(self) -> None:
        with contextlib.suppress(ValueError):
            gc.callbacks.remove(self._on_gc)

    def model_series(self, model: str) -> ModelSeries:
        series = self._series.get(model)
        if series is None:
            series = ModelSeries(self.ttft.labels(model), self.inter_token.labels(model), self.tokens.labels(model))
            self._series[model] = series
        return series

    @contextmanager
    def sse_reader(self) -> Iterator[None]:
        """Counts an open SSE event stream (either dialect) while it lasts."""
        self.sse_readers.inc()
        try:
            yield
        finally:
            self.sse_readers.dec()

    async def render(
        self,
        local: dict[str, tuple[int, int]],
        engines_down: dict[str, int],
        directory: WorkerDirectory,
        queue: WorkQueue,
        sessions: SessionFactory,
    ) -> bytes:
        """Refresh the state gauges, then the exposition text. ``local``: per model, the workers
        connected to this process and their free slots (``WorkerHub.load``); ``engines_down``: per model,
        those whose engine is not ready (``EngineHealth.down_by_model``). A backing service that
        is away leaves its gauges as they were (and counts a scrape error) instead of failing the scrape."""
        self.workers.clear()
        self.free_slots.clear()
        self.engines_down.clear()
        for model, down in engines_down.items():
            self.engines_down.labels(model).set(down)
        for model, (count, free) in local.items():
            self.workers.labels(model).set(count)
            self.free_slots.labels(model).set(free)
        models = set(local)
        try:
            cluster: dict[str, int] = {}
            for w in await directory.workers():
                cluster[w.model_name] = cluster.get(w.model_name, 0) + 1
            self.cluster_workers.clear()
            for model, count in cluster.items():
                self.cluster_workers.labels(model).set(count)
            models |= set(cluster)
            for model in models:
                self.queue_depth.labels(model).set((await queue.position(model, ""))[1])
        except Exception:
            self.scrape_errors.labels("queue").inc()
        try:
            async with sessions() as s:
                q = select(Message.state, func.count()).where(MESSAGE_IS_OPEN).group_by(Message.state)
                counts = dict((await s.execute(q)).tuples().all())
            for name in _OPEN:
                self.open_messages.labels(name).set(counts.get(name, 0))
        except Exception:
            self.scrape_errors.labels("database").inc()
        return generate_latest(self.registry)


class StreamTimer:
    """Per-message timing on the hub's token path: the first token's latency, then the gaps."""

    __slots__ = ("created_at", "last_at")

    def __init__(self, created_at: datetime | None) -> None:
        self.created_at = created_at  # None: a resumed attempt (its first token was long ago)
        self.last_at = 0.0

    def tokens(self, series: ModelSeries, count: int, now: float) -> None:
        """``count`` tokens arrived at ``now`` (monotonic): the first token's latency, else the gap per
        token. The tokens counter is the caller's (one increment per engine step and model)."""
        if self.last_at:
            series.inter_token.observe((now - self.last_at) / count)
        elif self.created_at is not None:
            series.ttft.observe(seconds_since(self.created_at))
        self.last_at = now
