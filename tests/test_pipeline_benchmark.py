"""benchmarks/pipeline.py runs end to end and reports every arm and figure (no timing assertions:
the figures are printed by CI and the README; this keeps the benchmark from rotting)."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parent.parent

pytestmark = pytest.mark.slow


def _run(*args: str) -> dict[str, Any]:
    out = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "pipeline.py"), "--json", *args],
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    return dict(json.loads(out.stdout.strip().splitlines()[-1]))


def test_engine_and_embedded_arms_report_throughput_latency_and_cpu(tiny_model_dir: Path) -> None:
    data = _run(
        "--model-dir", str(tiny_model_dir), "--arms", "engine,embedded", "--concurrency", "1,2",
        "--duration", "1.5", "--tokens", "8",
    )  # fmt: skip
    points = {(p["arm"], p["concurrency"]): p for p in data["points"]}
    assert set(points) == {("engine", 1), ("engine", 2), ("embedded/oa", 1), ("embedded/oa", 2)}
    for p in points.values():
        assert p["tokens_per_s"] > 0 and p["requests"] > 0 and p["ttft_p50_ms"] is not None
        assert p["errors"] == 0 and (p["workload"], p["stop"]) == ("single", "fixed")
    for c in (1, 2):
        assert "engine_cpu_ms_per_token" in points[("engine", c)]
        embedded = points[("embedded/oa", c)]
        assert {"server_cpu_ms_per_token", "worker_cpu_ms_per_token", "client_cpu_ms_per_token"} <= set(embedded)
    ratios = {r["concurrency"]: r for r in data["ratios"]}
    assert set(ratios) == {1, 2} and all(r["x_engine"] > 0 for r in ratios.values())


def test_openai_agent_loops_report_turns_usage_and_checks(tiny_model_dir: Path) -> None:
    data = _run(
        "--model-dir", str(tiny_model_dir), "--arms", "engine,embedded", "--api", "openai", "--workload", "agent",
        "--turns", "2", "--stop", "natural", "--concurrency", "2", "--duration", "1.5", "--tokens", "8",
    )  # fmt: skip
    points = {p["arm"]: p for p in data["points"]}
    assert set(points) == {"engine", "embedded/openai"}
    for p in points.values():
        assert (p["workload"], p["stop"], p["turns_per_conversation"]) == ("agent", "natural", 2)
        assert p["errors"] == 0 and p["requests"] > 0 and p["tokens_per_s"] > 0
        assert p["tokens_per_event"] >= 1.0  # each event that carried tokens carried at least one
        assert len(p["ttft_p50_ms_by_turn"]) == 2 and p["ttft_p50_ms_by_turn"][0] is not None
        first, second = p["prompt_tokens_mean_by_turn"]
        assert second is None or second > first  # the history is echoed back
    assert {"server_cpu_ms_per_token", "worker_cpu_ms_per_token"} <= set(points["embedded/openai"])
    [row] = data["ratios"]
    assert row["arm"] == "embedded/openai" and row["x_engine"] > 0
    assert any("hf engine alone" in c["check"] for c in data["checks"])


def test_ceiling_mode_fans_out_synthetic_tokens_to_every_reader(tiny_model_dir: Path) -> None:
    data = _run(
        "--model-dir", str(tiny_model_dir), "--ceiling", "--concurrency", "2", "--readers", "3",
        "--duration", "1.5", "--tokens", "200",
    )  # fmt: skip
    [point] = data["points"]
    assert point["arm"] == "synthetic/oa" and point["tokens_per_s"] > 0
    assert point["server_cpu_ms_per_token"] > 0


def test_synthetic_engine_arms_measure_tokentrails_own_cpu(tiny_model_dir: Path) -> None:
    """``--engine synthetic``: tokentrail's own commands (server + worker, and ``serve --model``) with the
    step clock in place of the model; agent loops end on the template's end token (natural stops)."""
    data = _run(
        "--model-dir", str(tiny_model_dir), "--engine", "synthetic", "--arms", "engine,embedded,one-process",
        "--api", "openai", "--workload", "agent", "--turns", "2", "--stop", "natural", "--concurrency", "2",
        "--duration", "1.5", "--tokens", "12", "--step-ms", "4", "--burn", "0.1",
    )  # fmt: skip
    assert data["engine"] == "synthetic" and data["burn"] == 0.1
    points = {p["arm"]: p for p in data["points"]}
    assert set(points) == {"embedded/openai", "one-process/openai"}  # the engine arm is skipped
    for p in points.values():
        assert p["errors"] == 0 and p["requests"] > 0 and p["server_cpu_ms_per_token"] > 0
        assert p["counts"].get("prompt_method:stitch/masked", 0) > 0  # second turns were stitched
    assert points["embedded/openai"]["worker_cpu_ms_per_token"] > 0


async def test_step_clock_gives_every_running_request_a_token_per_step() -> None:
    from benchmarks.pipeline.synthetic import StepClockEngine
    from worker.engines.contract import GenerationParams

    engine = StepClockEngine([5, 6, 7], step_s=0.001)
    await engine.start()
    try:

        async def reply(rid: str, params: GenerationParams) -> list[Any]:
            return [step async for step in engine.generate(rid, [1, 2, 3], params)]

        fixed, natural = await asyncio.gather(
            reply("a", GenerationParams(max_new_tokens=6)),
            reply("b", GenerationParams(max_new_tokens=40, stop_token_ids=(99,))),
        )
    finally:
        await engine.close()
    assert [len(s.token_ids) for s in fixed] == [1] * 6 and fixed[-1].finish_reason == "length"
    assert fixed[0].prompt_token_ids == [1, 2, 3] and fixed[1].prompt_token_ids is None
    assert 10 <= len(natural) <= 40 and natural[-1].token_ids == [99] and natural[-1].finish_reason == "stop"
    assert natural[-1].stop_reason == 99 and all(s.token_ids[0] in (5, 6, 7) for s in natural[:-1])


def test_profile_summary_charges_samples_to_the_innermost_known_library(tmp_path: Path) -> None:
    from benchmarks.pipeline.profile import OTHER, summarize

    site = "/usr/lib/python3.11/site-packages"
    raw = tmp_path / "server.txt"
    raw.write_text(
        f"run (/repo/server/cli.py);chat (/repo/server/api/openai_chat.py);execute ({site}/sqlalchemy/engine/base.py);"
        "cast (/usr/lib/python3.11/typing.py) 6\n"  # a standard-library frame under SQLAlchemy
        f"run (/repo/server/cli.py);chat (/repo/server/api/openai_chat.py) 3\n"
        f"serve ({site}/uvicorn/server.py);_run (/usr/lib/python3.11/threading.py) 1\n"
        "<native> 2\n"
    )
    s = summarize(raw)
    assert s.samples == 12
    assert s.by_category["SQLAlchemy"] == 6
    assert s.by_category["tokentrail server"] == 3
    assert s.by_category["HTTP server (uvicorn, h11, httptools)"] == 1
    assert s.by_category[OTHER] == 2
    assert s.tokentrail_inclusive["server/api/openai_chat.py:chat"] == 9
    assert "server/cli.py:run" not in s.tokentrail_inclusive  # entry points hold everything: left out
    assert s.tokentrail_own == {"server/api/openai_chat.py:chat": 3}


def test_rounds_alternate_the_arms_order_and_pool_each_points_windows(monkeypatch: pytest.MonkeyPatch) -> None:
    """``--rounds``: A B, B A, A B; the rounds' points pooled per point (sums, joined samples). The arms'
    stacks are replaced by a recorder here; the end-to-end tests above run real ones."""
    from benchmarks.pipeline import cli
    from benchmarks.pipeline.measure import Point, summary

    ran: list[str] = []

    def fake_arm(args: Any, arm: str, apis: Any, loads: Any, model_dir: str, sub: Path, profiler: Any) -> list[Point]:
        ran.append(arm)
        k = len(ran)
        p = Point(arm, "openai", "agent", "natural", 8, turns=2, wall_s=10.0, tokens=100 * k, events=50 * k)
        p.requests, p.ttft_s, p.ttft_by_turn_s = k, [0.01 * k], [[0.01 * k], [0.02 * k]] if k % 2 else [[0.01 * k]]
        turns = 1 + k % 2
        p.prompt_tokens_by_turn, p.cached_tokens_by_turn, p.usage_by_turn = (
            [10, 20][:turns],
            [0, 5][:turns],
            [1, 1][:turns],
        )
        p.cpu_s, p.counts = {"server": 0.5 * k}, {"forked:False": k}
        return [p]

    monkeypatch.setattr(cli, "_run_arm", fake_arm)
    args = cli.parser().parse_args(
        ["--arms", "embedded,vllm-serve", "--api", "openai", "--rounds", "3", "--model-dir", "/unused"]
    )
    points = cli.run(args)
    assert ran == ["embedded", "vllm-serve", "vllm-serve", "embedded", "embedded", "vllm-serve"]
    by_arm = {p.arm: p for p in points}
    assert list(by_arm) == ["embedded", "vllm-serve"]
    embedded = by_arm["embedded"]  # runs 1, 4 and 5
    assert (embedded.wall_s, embedded.tokens, embedded.events, embedded.requests) == (30.0, 1000, 500, 10)
    assert embedded.cpu_s == {"server": 5.0} and embedded.counts == {"forked:False": 10}
    assert sorted(embedded.ttft_s) == pytest.approx([0.01, 0.04, 0.05])
    turns = [sorted(xs) for xs in embedded.ttft_by_turn_s]
    assert len(turns) == 2 and turns[0] == pytest.approx([0.01, 0.04, 0.05]) and turns[1] == pytest.approx([0.02, 0.1])
    assert embedded.prompt_tokens_by_turn == [30, 40] and embedded.usage_by_turn == [3, 2]
    s = summary(embedded)
    assert s["tokens_per_s"] == round(1000 / 30, 1) and s["tokens_per_event"] == 2.0


def test_later_turns_ttft_check_pools_turns_two_on_and_reports_the_worst_turn_apart() -> None:
    """The TTFT done-when line compares one p50 over every turn from the second on; the worst single
    turn's ratio is printed beside it as information (no verdict)."""
    from benchmarks.pipeline.measure import Point
    from benchmarks.pipeline.report import checks, ratios

    def point(arm: str, by_turn: list[list[float]]) -> Point:
        p = Point(arm, "openai", "agent", "natural", 8, turns=len(by_turn), wall_s=10.0, tokens=1000)
        p.ttft_by_turn_s = by_turn
        p.ttft_s = [t for turn in by_turn for t in turn]
        return p

    # turn 2 is slower than serve's, turn 3 faster: pooled over turns 2-3 it is faster
    mine = point("embedded", [[0.5], [0.11, 0.11, 0.11], [0.05, 0.05, 0.05]])
    serve = point("vllm-serve", [[0.1], [0.10, 0.10, 0.10], [0.20, 0.20, 0.20]])
    by_check = {c["check"]: c for c in checks([mine, serve], "vllm")}
    pooled = by_check["embedded/openai TTFT p50 of turns 2..N ÷ vllm serve's"]
    assert pooled["value"] == pytest.approx(110 / 200, abs=1e-3) and pooled["met"] is True
    worst = by_check["embedded/openai TTFT p50 ÷ vllm serve's, worst single turn of 2..N"]
    assert worst["value"] == pytest.approx(1.1) and worst["met"] is None
    (row,) = ratios([mine, serve])  # the tokentrail point
    assert row["ttft_p50_later_turns_x_vllm_serve"] == pytest.approx(0.55, abs=1e-3)

    slower = point("embedded", [[0.1], [0.3, 0.3, 0.3], [0.3, 0.3, 0.3]])
    by_check = {c["check"]: c for c in checks([slower, serve], "vllm")}
    assert by_check["embedded/openai TTFT p50 of turns 2..N ÷ vllm serve's"]["met"] is False


def test_vllm_arms_run_the_dtype_of_tokentrails_worker() -> None:
    """``vllm serve`` and the engine-alone arm get the dtype ``tokentrail worker`` runs when ``--dtype``
    is not given: serve's own default (bfloat16 for a float32 model on CPU) would compare two
    precisions' speeds."""
    import inspect

    from benchmarks.pipeline.stack import engine_dtype
    from worker.cli import worker

    assert engine_dtype("bfloat16") == "bfloat16"
    assert engine_dtype(None) == inspect.signature(worker).parameters["dtype"].default == "float32"


def test_own_cpu_of_synthetic_arms_is_checked_against_vllm_serves_api_server() -> None:
    """``embedded-synthetic`` (the step clock, whatever ``--engine``) beside ``vllm-serve`` in one run: the
    server's and worker's CPU per token together ÷ the API server's, against the target of half."""
    from benchmarks.pipeline.measure import Point
    from benchmarks.pipeline.report import checks, ratios

    def point(arm: str, cpu: dict[str, float]) -> Point:
        p = Point(arm, "openai", "single", "natural", 8, wall_s=10.0, tokens=1000, requests=10)
        p.cpu_s = cpu
        return p

    serve = point("vllm-serve", {"vllm_api": 0.4, "engine_core": 1.0})
    cheap = point("embedded-synthetic", {"server": 0.1, "worker": 0.08})
    dear = point("one-process-synthetic", {"server": 0.3})
    by_check = {c["check"]: c for c in checks([cheap, dear, serve], "vllm")}
    mine = by_check["embedded-synthetic/openai own CPU ms/token ÷ vllm serve API server's"]
    assert mine["value"] == pytest.approx(0.45) and mine["met"] is True
    other = by_check["one-process-synthetic/openai own CPU ms/token ÷ vllm serve API server's"]
    assert other["value"] == pytest.approx(0.75) and other["met"] is False
    rows = {r["arm"]: r for r in ratios([cheap, dear, serve])}
    assert rows["embedded-synthetic/openai"]["own_cpu_x_vllm_api_cpu"] == pytest.approx(0.45)
    assert "x_vllm_serve" not in rows["embedded-synthetic/openai"]  # tokens/s of a step clock say nothing


def _short_ceiling(model_dir: Path, *more: str) -> tuple[dict[str, Any], dict[str, Any]]:
    """A short ``--ceiling`` on the OpenAI route: the run's JSON, and its points by arm."""
    data = _run(
        "--model-dir", str(model_dir), "--ceiling", "--api", "openai", "--concurrency", "2",
        "--duration", "1.5", "--tokens", "100", *more,
    )  # fmt: skip
    return data, {p["arm"]: p for p in data["points"]}


def test_ceiling_against_another_commit_runs_that_commits_code(tiny_model_dir: Path) -> None:
    """``--against HEAD``: the same ceiling first on the tree of a commit (``git archive``), then here."""
    data, points = _short_ceiling(tiny_model_dir, "--against", "HEAD")
    assert set(points) == {"at-HEAD/openai", "synthetic/openai"}
    assert all(p["errors"] == 0 and p["tokens_per_s"] > 0 for p in points.values())
    [row] = data["ratios"]
    assert row["x_at-HEAD"] > 0 and row["server_cpu_x_at-HEAD"] > 0


def test_ceiling_processes_sweep_serves_from_n_processes_on_postgres_and_redis(tiny_model_dir: Path) -> None:
    """``--processes 1,2``: the ceiling on ``serve --processes N`` (PostgreSQL + Redis) with N synthetic
    workers; 2 is compared with 1, and the server's CPU is its processes' (the parent's children too)."""
    data, points = _short_ceiling(tiny_model_dir, "--processes", "1,2")
    assert set(points) == {"processes-1/openai", "processes-2/openai"}
    for p in points.values():
        assert p["errors"] == 0 and p["tokens_per_s"] > 0 and p["server_cpu_ms_per_token"] > 0
    rows = {r["arm"]: r for r in data["ratios"]}
    assert rows["processes-2/openai"]["x_processes-1"] > 0


def test_processes_is_refused_without_ceiling() -> None:
    out = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "pipeline.py"), "--processes", "2"],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert out.returncode != 0 and "--processes goes with --ceiling" in out.stderr
