"""``GET /metrics`` scraped during a chat: a real server, worker and SSE reader (embedded stack)."""

from __future__ import annotations

import threading
from typing import Any

import httpx
from prometheus_client.parser import text_string_to_metric_families

from tests.stack import MODEL, start_reply
from tests.test_e2e_embedded import events, login


def scrape(url: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    resp = httpx.get(f"{url}/metrics")
    assert resp.status_code == 200 and resp.headers["content-type"].startswith("text/plain")
    samples: dict[tuple[str, tuple[tuple[str, str], ...]], float] = {}
    for family in text_string_to_metric_families(resp.text):
        for s in family.samples:
            samples[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return samples


def value(samples: dict[Any, float], name: str, **labels: str) -> float:
    return samples.get((name, tuple(sorted(labels.items()))), 0.0)


def idle_scrape(url: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """A scrape once no message is pending or in progress: the stack is shared by the tests of one
    xdist process, and a reply an earlier test left running would add its tokens to the counters."""
    for _ in range(600):
        samples = scrape(url)
        if not any(value(samples, "tokentrail_cluster_open_messages", state=st) for st in ("pending", "in_progress")):
            return samples
        threading.Event().wait(0.1)
    raise AssertionError("the shared stack still had open messages after 60 s")


def test_metrics_follow_a_chat(embedded_stack: str) -> None:
    url = embedded_stack
    headers = login(url, "metrics-user")
    before = idle_scrape(url)
    assert value(before, "tokentrail_workers_connected", model=MODEL) == 1
    assert value(before, "tokentrail_cluster_workers", model=MODEL) == 1

    chat, mid = start_reply(url, headers, MODEL, 200)
    seen: list[dict[str, Any]] = []
    reader = threading.Thread(
        target=events, args=(url, f"/chats/{chat}/messages/{mid}/events", headers), kwargs={"sink": seen}
    )
    reader.start()
    during: dict[Any, float] = {}
    for _ in range(200):
        if sum(e["event_type"] == "token" for e in seen) >= 5:
            during = scrape(url)
            break
        threading.Event().wait(0.02)
    reader.join(timeout=60)
    assert seen[-1]["event_type"] == "message"
    assert during, "never saw the reply stream"
    assert value(during, "tokentrail_sse_readers") >= 1
    assert value(during, "tokentrail_cluster_open_messages", state="in_progress") >= 1

    missing = httpx.get(f"{url}/chats/no-such-chat", headers=headers)
    assert missing.status_code == 404
    after = scrape(url)
    grew = {
        name: value(after, name, **labels) - value(before, name, **labels)
        for name, labels in [
            ("tokentrail_ttft_seconds_count", {"model": MODEL}),
            ("tokentrail_queue_wait_seconds_count", {"model": MODEL}),
            ("tokentrail_generated_tokens_total", {"model": MODEL}),
            ("tokentrail_messages_finished_total", {"state": "complete"}),
            ("tokentrail_errors_total", {"code": "chat_not_found"}),
        ]
    }
    assert grew == {
        "tokentrail_ttft_seconds_count": 1,
        "tokentrail_queue_wait_seconds_count": 1,
        "tokentrail_generated_tokens_total": 200,
        "tokentrail_messages_finished_total": 1,
        "tokentrail_errors_total": 1,
    }, grew
    gaps = value(after, "tokentrail_inter_token_seconds_count", model=MODEL) - value(
        before, "tokentrail_inter_token_seconds_count", model=MODEL
    )
    assert 0 < gaps <= 199  # one observation per engine step after the first
    assert value(after, "tokentrail_ttft_seconds_sum", model=MODEL) > 0
    assert value(after, "tokentrail_worker_free_slots", model=MODEL) >= 1
    assert value(after, "tokentrail_cluster_queue_depth", model=MODEL) == 0


def test_openai_streams_count_as_sse_readers(embedded_stack: str) -> None:
    """Both dialects' event streams are counted (the OA events route above, OpenAI's streams here)."""
    url = embedded_stack
    headers = login(url, "metrics-openai-user")
    body = {
        "model": MODEL,
        "messages": [{"role": "user", "content": "go on"}],
        "max_tokens": 200,
        "ignore_eos": True,
        "stream": True,
    }
    during: dict[Any, float] = {}
    with httpx.stream("POST", f"{url}/v1/chat/completions", json=body, headers=headers, timeout=60) as resp:
        assert resp.status_code == 200
        for line in resp.iter_lines():
            if line.startswith("data: {") and not during:
                during = scrape(url)
    assert value(during, "tokentrail_sse_readers") >= 1
    assert value(scrape(url), "tokentrail_sse_readers") == 0


def test_the_grafana_dashboard_plots_metrics_the_server_exports(embedded_stack: str) -> None:
    import json
    import re
    from pathlib import Path

    dashboard = json.loads((Path(__file__).parent.parent / "deploy/grafana/tokentrail.json").read_text())
    exprs = [t["expr"] for p in dashboard["panels"] for t in p["targets"]]
    used = {re.sub(r"_(bucket|count|sum|total)$", "", n) for e in exprs for n in re.findall(r"tokentrail_[a-z_]+", e)}
    text = httpx.get(f"{embedded_stack}/metrics").text
    exported = {family.name for family in text_string_to_metric_families(text)}  # listed even before a sample
    assert used and used <= exported, used - exported


def test_garbage_collector_pauses_are_timed_while_watched() -> None:
    import gc

    from server.metrics import Metrics

    metrics = Metrics()

    def collections() -> float:
        samples = {(s.name, s.labels.get("generation")): s.value for f in metrics.gc_pause.collect() for s in f.samples}
        return samples.get(("tokentrail_gc_pause_seconds_count", "2"), 0.0)

    metrics.watch_gc()
    metrics.watch_gc()  # once only
    try:
        gc.collect()
        assert collections() == 1
    finally:
        metrics.unwatch_gc()
    gc.collect()
    assert collections() == 1
