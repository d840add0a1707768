"""benchmarks/pipeline.py runs end to end and reports every arm and figure (no timing assertions:
the figures are printed by CI and the README; this keeps the benchmark from rotting)."""

from __future__ import annotations

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
    assert set(points) == {("engine", 1), ("engine", 2), ("embedded", 1), ("embedded", 2)}
    for p in points.values():
        assert p["tokens_per_s"] > 0 and p["requests"] > 0 and p["ttft_p50_ms"] is not None
    for c in (1, 2):
        assert "engine_cpu_ms_per_token" in points[("engine", c)]
        embedded = points[("embedded", c)]
        assert {"server_cpu_ms_per_token", "worker_cpu_ms_per_token", "client_cpu_ms_per_token"} <= set(embedded)
    ratios = {r["concurrency"]: r for r in data["ratios"]}
    assert set(ratios) == {1, 2} and all(r["x_engine"] > 0 for r in ratios.values())


def test_ceiling_mode_fans_out_synthetic_tokens_to_every_reader(tiny_model_dir: Path) -> None:
    data = _run(
        "--model-dir", str(tiny_model_dir), "--ceiling", "--concurrency", "2", "--readers", "3",
        "--duration", "1.5", "--tokens", "200",
    )  # fmt: skip
    [point] = data["points"]
    assert point["arm"] == "synthetic" and point["tokens_per_s"] > 0
    assert point["server_cpu_ms_per_token"] > 0
