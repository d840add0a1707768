"""The vllm engine's faults on CPU (tests/vllm_faults.py, in the vLLM environment; skipped without it):
seeded long prompts that chunked prefill split killed the engine core (issue 23), and a killed engine
core is reported as ``EngineDead``."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

from tests.test_engine_contract import ROOT, _require_vllm, contract_model  # noqa: F401 (a fixture)

SCRIPT = ROOT / "tests" / "vllm_faults.py"


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_vllm_seeded_long_prompts_and_a_killed_engine_core(contract_model: Path) -> None:  # noqa: F811
    python = _require_vllm()
    env = {
        **os.environ,
        "PYTHONPATH": str(ROOT),
        "VLLM_CPU_KVCACHE_SPACE": os.environ.get("VLLM_CPU_KVCACHE_SPACE", "1"),
    }
    proc = subprocess.run(
        [str(python), str(SCRIPT), "--model", str(contract_model)],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=580,
    )
    lines = [line for line in proc.stdout.splitlines() if line.startswith(("ok ", "FAIL", "["))]
    print("\n".join(lines))
    assert proc.returncode == 0, f"vllm faults failed:\n{proc.stdout[-4000:]}\n{proc.stderr[-6000:]}"
    assert sum(line.startswith("ok ") for line in lines) == 2, lines
