"""Runs the engine contract suite (tests/engine_contract.py) against every engine.

``hf`` runs with this interpreter, on CPU and (where torch sees one) on CUDA; ``vllm`` runs with the vLLM
environment's python (built by scripts/vllm_env.sh at $TOKENTRAIL_VLLM_VENV or ~/.cache/tokentrail/vllm-venv)
and is skipped when that environment does not exist.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SUITE = ROOT / "tests" / "engine_contract.py"


def _vllm_python() -> Path:
    venv = os.environ.get("TOKENTRAIL_VLLM_VENV") or str(Path.home() / ".cache" / "tokentrail" / "vllm-venv")
    return Path(venv) / "bin" / "python"


@pytest.fixture(scope="module")
def contract_model() -> Path:
    """The untrained tiny model, built once into the shared cache: at a fixed path vLLM finds its
    compiled graphs from an earlier run (at a fresh path it compiled them again, ~40 s)."""
    from worker.tiny import build_tiny_model
    from worker.tiny.build import BUILD_VERSION
    from worker.tiny.cache import build_cached, default_cache_dir

    final = default_cache_dir() / "models" / f"contract-untrained-s0-v{BUILD_VERSION}"
    return Path(build_cached(final, lambda out: build_tiny_model(out, train=False)))


def _run_suite(python: Path | str, engine: str, model: Path, timeout: int, options: tuple[str, ...] = ()) -> None:
    env = {
        **os.environ,
        "PYTHONPATH": str(ROOT),
        "VLLM_CPU_KVCACHE_SPACE": os.environ.get("VLLM_CPU_KVCACHE_SPACE", "1"),
    }
    proc = subprocess.run(
        [str(python), str(SUITE), "--engine", engine, "--model", str(model), *options],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    lines = [line for line in proc.stdout.splitlines() if line.startswith(("ok ", "FAIL", "note", "["))]
    print("\n".join(lines))
    assert proc.returncode == 0, f"{engine} contract failed:\n{proc.stdout[-6000:]}\n{proc.stderr[-6000:]}"


@pytest.mark.timeout(600)
def test_hf_engine_contract(contract_model: Path) -> None:
    _run_suite(sys.executable, "hf", contract_model, timeout=580)


def _cuda() -> bool:
    import torch

    return bool(torch.cuda.is_available())


@pytest.mark.timeout(600)
def test_hf_engine_contract_on_cuda(contract_model: Path) -> None:
    """The same suite with the engine and its teacher-forced reference on the GPU, float32, TF32 off."""
    if not _cuda():
        pytest.skip("torch sees no CUDA device")
    _run_suite(sys.executable, "hf", contract_model, timeout=580, options=("--device", "cuda"))


def test_cuda_without_a_gpu_fails_at_once(tmp_path: Path) -> None:
    """``--device cuda`` where torch sees no GPU: one FAIL line and exit 1, before any model is loaded."""
    if _cuda():
        pytest.skip("a CUDA device is present")
    proc = subprocess.run(
        [sys.executable, str(SUITE), "--engine", "hf", "--model", str(tmp_path / "absent"), "--device", "cuda"],
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert "FAIL hf setup: --device cuda" in proc.stdout, proc.stdout


def test_tolerance_by_dtype() -> None:
    from tests import engine_contract

    assert engine_contract.tolerance("hf", "float32") == 1e-4
    assert engine_contract.tolerance("vllm", "float32") == 1e-4
    assert engine_contract.tolerance("hf", "bfloat16") > engine_contract.tolerance("hf", "float16") > 1e-4


def _require_vllm() -> Path:
    python = _vllm_python()
    if not python.exists():
        message = f"no vLLM environment at {python.parent.parent}: build it with scripts/vllm_env.sh"
        if os.environ.get("CI"):  # CI builds it (.ci/run): the vLLM half must really run there
            pytest.fail(message)
        pytest.skip(message)
    return python


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_vllm_engine_contract(contract_model: Path) -> None:
    _run_suite(_require_vllm(), "vllm", contract_model, timeout=880)


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_vllm_worker_serves_a_chat(contract_model: Path, tmp_path: Path) -> None:
    """A real server (this env) and a `tokentrail worker --engine vllm` process (the vLLM env)."""
    from server.settings import ServerSettings
    from tests.stack import ServerThread, wait_for, worker_key
    from tests.test_e2e_embedded import events, login, turn
    from tokentrail.launcher import free_port

    python = _require_vllm()
    settings = ServerSettings(data_dir=tmp_path, port=free_port())
    server = ServerThread(settings).start()
    log = tmp_path / "worker.log"
    env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": os.environ.get("VLLM_CPU_KVCACHE_SPACE", "1")}
    with log.open("wb") as out:
        worker = subprocess.Popen(
            [str(python), "-m", "tokentrail", "worker", "--server-url", server.url, "--api-key", worker_key(settings),
             "--model", str(contract_model), "--served-model-name", "tiny", "--engine", "vllm",
             "--max-model-len", "1024", "--gpu-memory-utilization", "0.2", "--max-parallel", "4",
             "--vllm-enforce-eager"],
            stdout=out, stderr=subprocess.STDOUT, env=env, cwd=ROOT,
        )  # fmt: skip
    try:
        import httpx

        def offered() -> bool:
            assert worker.poll() is None, log.read_text()[-4000:]
            return any(m["name"] == "tiny" for m in httpx.get(f"{server.url}/configs/model_configs").json())

        wait_for(offered, 600, "vllm worker")
        headers = login(server.url, "vllm-user")
        chat_id = httpx.post(f"{server.url}/chats", json={}, headers=headers).json()["id"]
        parent = None
        for text in ("first", "second"):
            _, reply = turn(server.url, headers, chat_id, parent, text, max_new_tokens=16, seed=3)
            evs = events(server.url, f"/chats/{chat_id}/messages/{reply['id']}/events", headers)
            assert evs[-1]["event_type"] == "message", evs[-3:]
            stored = httpx.get(
                f"{server.url}/chats/{chat_id}/messages/{reply['id']}?include=tokens", headers=headers
            ).json()
            assert stored["completion_token_ids"] == [e["token_id"] for e in evs if e["event_type"] == "token"]
            assert stored["num_cached_tokens"] is not None  # vLLM reports its prefix-cache hits
            if parent is not None:
                assert stored["prior_message_id"] == parent and stored["reused_prefix_len"] > 0
            parent = reply["id"]

        # a push through the route reaches the vLLM worker; a refused one changes nothing
        from benchmarks.policy_check import TOLERANCE, Scorer, perturbed_checkpoint
        from server.admin import issue_user_key

        admin = {"Authorization": f"Bearer {issue_user_key(settings, 'vllm-trainer', admin=True)}"}
        checkpoint = perturbed_checkpoint(contract_model, tmp_path / "v1", seed=1)
        pickles = tmp_path / "pickles"
        pickles.mkdir()
        (pickles / "pytorch_model.bin").write_bytes(b"never unpickled")
        url = f"{server.url}/admin/models/tiny/weights"
        refused = httpx.post(url, json={"path": str(pickles), "version": 1}, headers=admin, timeout=120)
        assert (refused.status_code, refused.json()["code"]) == (422, "weights_not_safetensors")
        pushed = httpx.post(url, json={"path": str(checkpoint), "version": 1}, headers=admin, timeout=300)
        assert pushed.status_code == 200, pushed.text
        _, reply = turn(server.url, headers, chat_id, parent, "third", max_new_tokens=16, seed=3)
        events(server.url, f"/chats/{chat_id}/messages/{reply['id']}/events", headers)
        stored = httpx.get(
            f"{server.url}/chats/{chat_id}/messages/{reply['id']}?include=tokens", headers=headers
        ).json()
        assert stored["policy_versions"] == [[0, 1]]
        assert Scorer({1: checkpoint}).max_delta(stored) < TOLERANCE
    finally:
        worker.terminate()
        try:
            worker.wait(timeout=30)
        except subprocess.TimeoutExpired:
            worker.kill()
        server.stop()
