"""README line 1's flow as a user runs it: ``tokentrail demo``, then ``export`` and ``verify``; and what
``tokentrail up``/``demo`` print while they start: only lines the user acts on, no library warnings."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from tokentrail.launcher import free_port

pytestmark = pytest.mark.slow

# What the warnings module prints: "path.py:123: FutureWarning: message" (also UserWarning, DeprecationWarning...).
WARNING_LINE = re.compile(r"\b\w*Warning: ")


def warning_lines(text: str) -> list[str]:
    return [line for line in text.splitlines() if WARNING_LINE.search(line)]


def tokentrail(*args: str, timeout: float = 600) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "tokentrail", *args], capture_output=True, text=True, timeout=timeout, check=False
    )


def test_demo_then_export_then_verify(tmp_path: Path, trained_model: Callable[[str], Path]) -> None:
    trained_model("chatml")  # build (or reuse) the cached model first
    demo = tokentrail("demo", "--data-dir", str(tmp_path / "data"), "--max-new-tokens", "12")
    assert demo.returncode == 0, demo.stdout + demo.stderr
    assert not warning_lines(demo.stdout + demo.stderr), demo.stdout + demo.stderr
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


def test_up_prints_only_its_own_lines(tmp_path: Path, tiny_model_dir: Path) -> None:
    """``tokentrail up`` start-up and Ctrl-C, with every warning shown (``PYTHONWARNINGS=default``, inherited
    by the server and worker children, also shows DeprecationWarnings): nothing but its own progress lines.
    A library warning here (e.g. transformers' FutureWarning for a deprecated argument the hf engine passes,
    printed by the worker between "server up" and "ready") is fixed at its cause, not filtered."""
    port = free_port()
    log = tmp_path / "up.log"
    cmd = [sys.executable, "-m", "tokentrail", "up", "--port", str(port), "--data-dir", str(tmp_path / "data"),
           "--model", str(tiny_model_dir)]  # fmt: skip
    env = {**os.environ, "PYTHONWARNINGS": "default"}
    with open(log, "wb") as out:
        up = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env)
    try:
        deadline = time.monotonic() + 180
        while "Ctrl-C stops." not in log.read_text() and up.poll() is None and time.monotonic() < deadline:
            time.sleep(0.2)
        assert up.poll() is None and "Ctrl-C stops." in log.read_text(), log.read_text()[-3000:]
        up.send_signal(signal.SIGINT)
        assert up.wait(timeout=60) == 0, log.read_text()[-3000:]
    finally:
        if up.poll() is None:
            up.kill()
            up.wait()
    output = log.read_text()
    assert not warning_lines(output), output
    expected = ("preparing model ", "server up at ", "worker connected, serving ", "ready. chat in a browser: ",
                "Ctrl-C stops.")  # fmt: skip
    lines = [line for line in output.splitlines() if line.strip()]
    assert [next((p for p in expected if line.startswith(p)), line) for line in lines] == list(expected), output
