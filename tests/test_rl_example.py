"""examples/rl_loop.py, run as a user would: rollouts through the openai SDK, policy-gradient steps,
pushes; every rollout of a step on the version pushed before it, and every token verified under its
version (the script exits non-zero otherwise)."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


# The script uses the trained tiny model from the shared cache. On a machine without it, the test builds
# it first, or waits for another test process building it: on two busy cores that took over 14 minutes
# once. The script's own time limit starts after that.
@pytest.mark.timeout(2700)
def test_rl_loop_runs_and_its_rollouts_follow_the_pushed_versions() -> None:
    from worker.tiny import resolve_model

    resolve_model("tiny")  # (the model examples/rl_loop.py starts from)
    # in a session of its own: however the test ends, the example's server goes with it
    proc = subprocess.Popen(
        [sys.executable, str(ROOT / "examples" / "rl_loop.py"), "--steps", "3", "--agents", "8", "--json"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT, start_new_session=True,
    )  # fmt: skip
    try:
        stdout, stderr = proc.communicate(timeout=840)
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
    assert proc.returncode == 0, stdout[-3000:] + stderr[-3000:]
    rows = json.loads(stdout[stdout.index("[\n") :])
    assert [r["rollout_versions"] for r in rows] == [[0], [1], [2]]
    assert [r["pushed"] for r in rows] == [1, 2, 3]
    assert "(ok)" in stdout
