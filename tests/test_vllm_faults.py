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


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_serve_model_with_vllm_serves_again_after_its_engine_core_is_killed(
    contract_model: Path,  # noqa: F811
    tmp_path: Path,
) -> None:
    """``tokentrail serve --model --engine vllm``: the engine core SIGKILLed mid-reply. The in-process worker
    restarts the engine without stalling the server's event loop (a stall of 20 s made the hub drop the
    in-process worker as silent, and its redial was refused); the reply is resumed, one unbroken stream
    equal to SQL, and the next reply is served by the new engine."""
    import re
    import signal
    import threading
    from typing import Any

    import httpx

    from tests.stack import MODEL, start_reply, wait_for
    from tests.test_e2e_embedded import events, login
    from tokentrail.launcher import answers, free_port, offers, spawn, stop, wait_ready

    python = _require_vllm()
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    log = tmp_path / "serve.log"
    proc = spawn(
        [
            "serve",
            "--port",
            str(port),
            "--data-dir",
            str(tmp_path / "data"),
            "--model",
            str(contract_model),
            "--engine",
            "vllm",
            "--served-model-name",
            MODEL,
            "--max-model-len",
            "1024",
            "--vllm-enforce-eager",
            "--max-parallel",
            "4",
        ],
        program=[str(python), "-m", "tokentrail"],
        output=log,
        env={
            "PYTHONPATH": str(ROOT),
            "TOKENTRAIL_FAULT_INJECTION": "engine",
            "VLLM_CPU_KVCACHE_SPACE": os.environ.get("VLLM_CPU_KVCACHE_SPACE", "1"),
        },
    )
    try:
        wait_ready(lambda: answers(url) and offers(url, [MODEL]), {"serve": proc}, "serve --model", 300)
        headers = login(url, "engine-death")
        chat, mid = start_reply(url, headers, MODEL, 600)
        seen: list[dict[str, Any]] = []
        path = f"/chats/{chat}/messages/{mid}/events"
        reader = threading.Thread(target=events, args=(url, path, headers, None, seen))
        reader.start()
        wait_for(lambda: sum(e["event_type"] == "token" for e in seen) >= 5, 120, "tokens from vLLM")
        proc.send_signal(signal.SIGUSR1)  # the worker kills its engine core (worker/fault_injection.py)
        reader.join(timeout=300)
        assert seen and seen[-1]["event_type"] == "message", (seen[-1:], log.read_text()[-3000:])
        streamed = [e["token_id"] for e in seen if e["event_type"] == "token"]
        assert [int(e["_id"]) for e in seen if e["event_type"] == "token"] == list(range(600))
        record = httpx.get(f"{url}/chats/{chat}/messages/{mid}", params={"include": "tokens"}, headers=headers).json()
        assert record["state"] == "complete" and record["completion_token_ids"] == streamed
        assert record["attempt"] >= 2  # resumed after the death
        metrics = httpx.get(f"{url}/metrics").text
        assert re.search(r"tokentrail_engine_restarts_total\{[^}]*\} 1\.0", metrics), metrics[-2000:]
        chat2, mid2 = start_reply(url, headers, MODEL, 8)  # the restarted engine serves
        final = events(url, f"/chats/{chat2}/messages/{mid2}/events", headers)[-1]
        assert final["event_type"] == "message", final
        assert "silent" not in log.read_text()  # the hub never dropped the in-process worker
    finally:
        stop(proc, "serve")
