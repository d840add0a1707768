"""examples/rl_loop.py, run as a user would: rollouts through the openai SDK, policy-gradient steps,
pushes; every rollout of a step on the version pushed before it, and every token verified under its
version (the script exits non-zero otherwise)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


# The script uses the trained tiny model from the shared cache: on a machine without it, its first run
# builds it, or waits for another test process building it (minutes on two busy cores).
@pytest.mark.timeout(900)
def test_rl_loop_runs_and_its_rollouts_follow_the_pushed_versions() -> None:
    proc = subprocess.run(
        [sys.executable, str(ROOT / "examples" / "rl_loop.py"), "--steps", "3", "--agents", "8", "--json"],
        capture_output=True, text=True, timeout=840, cwd=ROOT,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    rows = json.loads(proc.stdout[proc.stdout.index("[\n") :])
    assert [r["rollout_versions"] for r in rows] == [[0], [1], [2]]
    assert [r["pushed"] for r in rows] == [1, 2, 3]
    assert "(ok)" in proc.stdout
