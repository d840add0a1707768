"""README line 1's flow as a user runs it: ``tokentrail demo``, then ``export`` and ``verify``."""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow


def tokentrail(*args: str, timeout: float = 600) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "tokentrail", *args], capture_output=True, text=True, timeout=timeout, check=False
    )


def test_demo_then_export_then_verify(tmp_path: Path, trained_model: Callable[[str], Path]) -> None:
    trained_model("chatml")  # build (or reuse) the cached model first
    demo = tokentrail("demo", "--data-dir", str(tmp_path / "data"), "--max-new-tokens", "12")
    assert demo.returncode == 0, demo.stdout + demo.stderr
    assert demo.stdout.count("assistant>") == 3
    assert "tokens: prompt=" in demo.stdout and "demo finished" in demo.stdout
    out = tmp_path / "rollouts.jsonl"
    exported = tokentrail("export", "--out", str(out), "--data-dir", str(tmp_path / "data"))
    assert exported.returncode == 0, exported.stderr
    rollouts = [json.loads(line) for line in out.read_text().splitlines()]
    assert len(rollouts) == 1 and len(rollouts[0]["turns"]) == 3
    verified = tokentrail("verify", str(out), "--model", "tiny")
    assert verified.returncode == 0, verified.stdout + verified.stderr
    assert "PASS" in verified.stdout
