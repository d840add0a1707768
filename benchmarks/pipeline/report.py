"""What a run prints: the points (throughput and latency; CPU per token by process; agent loops' TTFT
by turn and prompt-cache hits), the ratios between arms, and the targets each point is checked against."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

from benchmarks.pipeline.measure import Point, summary

TOKENTRAIL_ARMS = (
    "embedded",
    "one-process",
    "redis",
    "pgbouncer",
    "synthetic",
    "embedded-synthetic",
    "one-process-synthetic",
)
CPU_KEYS = ("server", "worker", "engine_core", "vllm_api", "engine", "client")

Key = tuple[str, str, str, int]  # workload, stop, api, concurrency


def _index(points: Sequence[Point]) -> dict[tuple[str, Key], dict[str, Any]]:
    return {(p.arm, (p.workload, p.stop, p.api, p.concurrency)): summary(p) for p in points}


def _total_cpu(s: dict[str, Any]) -> float | None:
    keys = [f"{k}_cpu_ms_per_token" for k in CPU_KEYS if k != "client"]
    present = [s[k] for k in keys if k in s]
    return round(sum(present), 3) if present else None


def _ratio(a: float | None, b: float | None, n: int = 3) -> float | None:
    return round(a / b, n) if a is not None and b else None


def ratios(points: Sequence[Point]) -> list[dict[str, Any]]:
    """Per tokentrail point: ÷ the engine alone (same workload and stop), ÷ ``vllm serve`` (same api,
    workload, stop), PostgreSQL + Redis and one process ÷ embedded; server CPU per token against ``vllm serve``'s API
    server; TTFT p50 per turn against ``vllm serve``'s."""
    by = _index(points)
    out = []
    for (arm, key), s in by.items():
        if arm not in TOKENTRAIL_ARMS and not arm.startswith("processes-"):
            continue
        workload, stop, api, c = key
        row: dict[str, Any] = {"arm": s["arm"], "workload": workload, "stop": stop, "concurrency": c}
        engine = by.get(("engine", (workload, stop, "-", c)))
        if engine and engine["tokens_per_s"]:
            row["x_engine"] = _ratio(s["tokens_per_s"], engine["tokens_per_s"])
            if s["ttft_p50_ms"] is not None and engine["ttft_p50_ms"] is not None:
                row["added_ttft_p50_ms"] = round(s["ttft_p50_ms"] - engine["ttft_p50_ms"], 2)
                row["added_ttft_p99_ms"] = round((s["ttft_p99_ms"] or 0) - (engine["ttft_p99_ms"] or 0), 2)
            mine, base = _total_cpu(s), _total_cpu(engine)
            if mine is not None and base is not None and "worker_cpu_ms_per_token" in s:
                row["worker_beyond_engine_cpu_ms_per_token"] = round(
                    s["worker_cpu_ms_per_token"] + s.get("engine_core_cpu_ms_per_token", 0.0) - base, 3
                )
        serve = by.get(("vllm-serve", (workload, stop, api, c)))
        if serve and arm.endswith("-synthetic"):  # tokentrail's own CPU per token (no engine) ÷ vllm serve's API server
            own = s.get("server_cpu_ms_per_token", 0.0) + s.get("worker_cpu_ms_per_token", 0.0)
            row["own_cpu_x_vllm_api_cpu"] = _ratio(own, serve.get("vllm_api_cpu_ms_per_token"))
        elif serve and serve["tokens_per_s"]:
            row["x_vllm_serve"] = _ratio(s["tokens_per_s"], serve["tokens_per_s"])
            row["ttft_p50_x_vllm_serve"] = _ratio(s["ttft_p50_ms"], serve["ttft_p50_ms"])
            if workload == "agent":
                row["ttft_p50_later_turns_x_vllm_serve"] = _ratio(
                    s.get("ttft_p50_later_turns_ms"), serve.get("ttft_p50_later_turns_ms")
                )
                row["ttft_p50_x_vllm_serve_by_turn"] = [
                    _ratio(a, b) for a, b in zip(s["ttft_p50_ms_by_turn"], serve["ttft_p50_ms_by_turn"], strict=False)
                ]
            api_cpu = serve.get("vllm_api_cpu_ms_per_token")
            if api_cpu is not None and "server_cpu_ms_per_token" in s:
                row["server_cpu_x_vllm_api_cpu"] = _ratio(s["server_cpu_ms_per_token"], api_cpu)
                row["server_plus_worker_cpu_x_vllm_api_cpu"] = _ratio(
                    s["server_cpu_ms_per_token"] + s.get("worker_cpu_ms_per_token", 0.0), api_cpu
                )
        if arm in ("redis", "pgbouncer", "one-process"):
            embedded = by.get(("embedded", key))
            if embedded and embedded["tokens_per_s"]:
                row["x_embedded"] = _ratio(s["tokens_per_s"], embedded["tokens_per_s"])
        if arm == "pgbouncer":  # what the pooler costs: the same stack straight to PostgreSQL
            direct = by.get(("redis", key))
            if direct and direct["tokens_per_s"]:
                row["x_redis"] = _ratio(s["tokens_per_s"], direct["tokens_per_s"])
        if arm == "synthetic":  # the ceiling: against another commit measured in the same run (--against)
            for (other, other_key), o in by.items():
                if other.startswith("at-") and other_key == key and o["tokens_per_s"]:
                    row[f"x_{other}"] = _ratio(s["tokens_per_s"], o["tokens_per_s"])
                    if "server_cpu_ms_per_token" in s and o.get("server_cpu_ms_per_token"):
                        row[f"server_cpu_x_{other}"] = _ratio(
                            s["server_cpu_ms_per_token"], o["server_cpu_ms_per_token"]
                        )
        if arm.startswith("processes-") and arm != "processes-1":  # the ceiling's --processes sweep
            one = by.get(("processes-1", key))
            if one and one["tokens_per_s"]:
                row["x_processes-1"] = _ratio(s["tokens_per_s"], one["tokens_per_s"])
        out.append(row)
    return out


def checks(points: Sequence[Point], engine: str) -> list[dict[str, Any]]:
    """The targets, for whatever this run measured (they are set at c=8 and c=32): against ``vllm serve``,
    tokens/s and TTFT of the vLLM arms, and tokentrail's own CPU per token (``-synthetic`` arms, no engine)
    at most half of what its API server spends; against the engine alone (hf); PostgreSQL + Redis
    against embedded."""
    by = _index(points)
    found: list[tuple[tuple[str, Key], dict[str, Any]]] = []

    def add(what: str, key: Key, value: float | None, target: str, met: bool | None) -> None:
        workload, stop, _, c = key
        row = {"check": what, "workload": workload, "stop": stop, "concurrency": c, "value": value, "target": target,
               "met": met}  # fmt: skip
        found.append(((what, key), row))

    for (arm, key), s in by.items():
        workload, stop, api, c = key
        serve = by.get(("vllm-serve", key))
        if arm in ("embedded", "one-process") and api == "openai" and serve and engine == "vllm":
            x = _ratio(s["tokens_per_s"], serve["tokens_per_s"])
            floor = 1.0 if arm == "one-process" and workload == "agent" else 0.9
            met = x is not None and x >= floor
            add(f"{arm}/openai (vLLM worker) tok/s ÷ vllm serve", key, x, f">= {floor}", met)
            if workload == "agent":
                mine, theirs = s.get("ttft_p50_later_turns_ms"), serve.get("ttft_p50_later_turns_ms")
                later = _ratio(mine, theirs)
                met = later is not None and later <= 1.0
                add(f"{arm}/openai TTFT p50 of turns 2..N ÷ vllm serve's", key, later, "<= 1.0", met)
                pairs = list(zip(s["ttft_p50_ms_by_turn"], serve["ttft_p50_ms_by_turn"], strict=False))[1:]
                worst = max((_ratio(a, b) or 0.0 for a, b in pairs if a is not None and b is not None), default=None)
                add(f"{arm}/openai TTFT p50 ÷ vllm serve's, worst single turn of 2..N", key, worst, "information",
                    None)  # fmt: skip
        if arm.endswith("-synthetic") and serve:
            own = s.get("server_cpu_ms_per_token", 0.0) + s.get("worker_cpu_ms_per_token", 0.0)
            x = _ratio(own, serve.get("vllm_api_cpu_ms_per_token"))
            add(f"{arm}/{api} own CPU ms/token ÷ vllm serve API server's", key, x, "<= 0.5", x is not None and x <= 0.5)
        if arm == "embedded" and api == "openai" and engine == "hf":
            base = by.get(("engine", (workload, stop, "-", c)))
            if base:
                x = _ratio(s["tokens_per_s"], base["tokens_per_s"])
                add("embedded/openai (hf) tok/s ÷ hf engine alone", key, x, ">= 0.5", x is not None and x >= 0.5)
        if arm == "redis":
            embedded = by.get(("embedded", key))
            if embedded:
                x = _ratio(s["tokens_per_s"], embedded["tokens_per_s"])
                add(f"redis/{api} tok/s ÷ embedded/{api}", key, x, ">= 0.8", x is not None and x >= 0.8)
        if arm in ("embedded", "redis") and serve and engine == "vllm":
            mine, theirs = s.get("server_cpu_ms_per_token"), serve.get("vllm_api_cpu_ms_per_token")
            if mine is not None and theirs is not None:
                add(f"{arm}/{api} server CPU ms/token ÷ vllm serve API server's", key, _ratio(mine, theirs),
                    "<= 1.0", mine <= theirs)  # fmt: skip
    errors = {f"{s['arm']} {s['workload']} {s['stop']} c={s['concurrency']}": s["errors"] for s in by.values()}
    failed = {k: v for k, v in errors.items() if v}
    first = {"check": "errors in every point", "value": sum(failed.values()), "target": "0", "met": not failed,
             "detail": failed}  # fmt: skip
    return [first, *(row for _, row in sorted(found, key=lambda f: f[0]))]


# ---- text -----------------------------------------------------------------------------------------
def _cell(v: Any, width: int) -> str:
    text = "-" if v is None or v == "" else str(v)
    return text[:width].rjust(width)


def _table(title: str, head: list[tuple[str, int]], rows: list[list[Any]]) -> None:
    if not rows:
        return
    print(title)
    print(" ".join(_cell(h, w) for h, w in head))
    for r in rows:
        print(" ".join(_cell(v, w) for v, (_, w) in zip(r, head, strict=True)))
    print()


def _workload(s: dict[str, Any]) -> str:
    return "single" if s["workload"] == "single" else f"agent{s['turns_per_conversation']}"


IDENT = [("arm", 18), ("workload", 8), ("stop", 7), ("c", 3)]
MAIN = [("tok/s", 8), ("turns", 6), ("errors", 6), ("TTFT p50", 9), ("TTFT p99", 9), ("ITL p50", 8), ("ITL p99", 8),
        ("ITL mean", 8), ("end p50", 8), ("tok/ev", 6), ("cached", 6)]  # fmt: skip
CPU = [("server", 7), ("worker", 7), ("eng-core", 8), ("vllm-api", 8), ("engine", 7), ("client", 7), ("pg+redis", 8),
       ("total", 7)]  # fmt: skip


def _ident(s: dict[str, Any]) -> list[Any]:
    return [s["arm"], _workload(s), s["stop"], s["concurrency"]]


def _main_row(s: dict[str, Any]) -> list[Any]:
    keys = ("tokens_per_s", "requests", "errors", "ttft_p50_ms", "ttft_p99_ms", "itl_p50_ms", "itl_p99_ms",
            "itl_mean_ms", "end_p50_ms", "tokens_per_event", "cached_share_later_turns")  # fmt: skip
    return [*_ident(s), *(s[k] for k in keys)]


def _cpu_row(s: dict[str, Any]) -> list[Any]:
    services = _sum(s.get("postgres_cpu_ms_per_token"), s.get("redis_cpu_ms_per_token"))
    return [*_ident(s), *(s.get(f"{k}_cpu_ms_per_token") for k in CPU_KEYS), services, _total_cpu(s)]


def _by_turn_row(s: dict[str, Any], key: str, turns: int) -> list[Any]:
    values = list(s[key])
    return [*_ident(s), *values, *([None] * (turns - len(values)))]


def print_report(points: Sequence[Point], engine: str) -> None:
    sums = [summary(p) for p in points]
    title = (
        "throughput and latency (ms); end: a turn's last token -> the end of its stream; tok/ev: tokens per"
        " stream event that carried tokens; cached: cached / prompt tokens of turns 2..N; workload agentN: N turns"
    )
    _table(title, IDENT + MAIN, [_main_row(s) for s in sums])
    title = "CPU ms per delivered token by process (eng-core: the engine's child processes; total: all but client)"
    _table(title, IDENT + CPU, [_cpu_row(s) for s in sums])
    collected = [s for s in sums if "server_gc_share_of_cpu" in s]
    if collected:
        head = [*IDENT, ("GC share of CPU", 16), ("collections", 12), ("pauses > 50 ms", 15)]
        head += [("queue wait", 10), ("TTFT", 7), ("ITL mean", 8)]
        keys = ("server_gc_share_of_cpu", "server_gc_collections", "server_gc_pauses_over_50ms")
        keys += ("server_queue_wait_mean_ms", "server_ttft_mean_ms", "server_itl_mean_ms")
        rows = [[*_ident(s), *(s.get(k) for k in keys)] for s in collected]
        title = "tokentrail server in the window (its /metrics): garbage collector; mean queue wait, TTFT, inter-token"
        _table(title, head, rows)
    agents = [s for s in sums if s["workload"] == "agent"]
    turns = max((len(s["ttft_p50_ms_by_turn"]) for s in agents), default=0)
    head = IDENT + [(f"t{k + 1}", 7) for k in range(turns)]
    _table("agent loops: TTFT p50 (ms) by turn", head, [_by_turn_row(s, "ttft_p50_ms_by_turn", turns) for s in agents])
    rows = [_by_turn_row(s, "cached_share_by_turn", turns) for s in agents]
    _table("agent loops: cached / prompt tokens by turn", head, rows)
    counted = [s for s in sums if s["counts"]]
    if counted:
        print("tokentrail's prompts (OpenAI route): how the worker built them, whether the request forked")
        for s in counted:
            rest = ", ".join(f"{k}={v}" for k, v in sorted(s["counts"].items()))
            print(f"  {s['arm']} {_workload(s)} {s['stop']} c={s['concurrency']}: {rest}")
        print()
    ident = ("arm", "workload", "stop", "concurrency")
    rows_r = ratios(points)
    if rows_r:
        print("ratios")
        for r in rows_r:
            rest = ", ".join(f"{k}={v}" for k, v in r.items() if k not in ident)
            print(f"  {r['arm']} {r['workload']} {r['stop']} c={r['concurrency']}: {rest}")
        print()
    print("targets (at c=8 and c=32)")
    for ch in checks(points, engine):
        where = f" [{ch['workload']} {ch['stop']} c={ch['concurrency']}]" if "concurrency" in ch else ""
        verdict = "-" if ch["met"] is None else "met" if ch["met"] else "NOT met"
        print(f"  {verdict:>7}  {ch['check']}{where}: {ch['value']} (target {ch['target']})")
    failed = [s for s in sums if s["error_samples"]]
    if failed:
        print("\nerrors (first few per point)")
        for s in failed:
            for e in s["error_samples"]:
                print(f"  {s['arm']} {_workload(s)} {s['stop']} c={s['concurrency']}: {e}")


def _sum(*values: float | None) -> float | None:
    present = [v for v in values if v is not None]
    return round(sum(present), 3) if present else None


def plot(points: Sequence[Point], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 4))
    series = dict.fromkeys((p.name, p.workload, p.stop) for p in points)
    for name, workload, stop in series:
        mine = sorted(
            (p for p in points if (p.name, p.workload, p.stop) == (name, workload, stop)), key=lambda p: p.concurrency
        )
        label = name if len({(w, s) for _, w, s in series}) == 1 else f"{name} {workload} {stop}"
        cs = [p.concurrency for p in mine]
        left.plot(cs, [summary(p)["tokens_per_s"] for p in mine], marker="o", label=label)
        right.plot(cs, [summary(p)["ttft_p50_ms"] for p in mine], marker="o", label=label)
    for ax, label in ((left, "tokens/s delivered"), (right, "TTFT p50 (ms)")):
        ax.set_xscale("log", base=2)
        ax.set_xlabel("concurrent conversations")
        ax.set_ylabel(label)
        ax.grid(True, alpha=0.3)
    right.set_yscale("log")
    left.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
