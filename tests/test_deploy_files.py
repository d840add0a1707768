"""The deployment files: docker-compose.yml is valid (``docker-compose config``, offline, when
installed; CI installs it) and has the layout the README promises; the Grafana dashboard is JSON."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml

ROOT = Path(__file__).resolve().parent.parent
ENV = {"AUTH_SECRET": "compose-test-secret-0123456789", "WORKER_KEY": "tt_w_test"}


def _compose(*args: str, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    binary = shutil.which("docker-compose")
    if binary is None:
        pytest.skip("docker-compose is not installed (apt-get install docker-compose; .ci/run does)")
    clean = {k: v for k, v in os.environ.items() if k not in ("AUTH_SECRET", "WORKER_KEY", "COMPOSE_PROFILES")}
    return subprocess.run(
        [binary, "-f", str(ROOT / "docker-compose.yml"), *args],
        env={**clean, **env},
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )


def test_compose_config_is_valid_and_has_the_promised_layout() -> None:
    plain = _compose("config", "--services", env=ENV)
    assert plain.returncode == 0, plain.stderr
    names = {"postgres", "redis", "migrate", "server-a", "server-b", "worker-cpu", "worker-vllm"}
    assert set(plain.stdout.split()) == names
    gpu = _compose("--profile", "gpu", "config", env=ENV)
    assert gpu.returncode == 0, gpu.stderr
    config: dict[str, Any] = yaml.safe_load(gpu.stdout)
    services = config["services"]
    assert services["migrate"]["command"] == ["db", "upgrade"]
    for name in ("server-a", "server-b"):
        assert services[name]["depends_on"]["migrate"]["condition"] == "service_completed_successfully"
        assert services[name]["environment"]["TOKENTRAIL_AUTH_SECRET"] == ENV["AUTH_SECRET"]
    assert "vllm" in services["worker-vllm"]["command"] and services["worker-vllm"]["profiles"] == ["gpu"]
    assert services["worker-vllm"]["deploy"]["resources"]["reservations"]["devices"][0]["capabilities"] == ["gpu"]
    for worker in ("worker-cpu", "worker-vllm"):  # each worker lists both replicas
        assert services[worker]["environment"]["TOKENTRAIL_SERVER_URL"].count("http://") == 2


def test_compose_refuses_to_start_without_a_secret() -> None:
    missing = _compose("config", "-q", env={"WORKER_KEY": "tt_w_test"})
    assert missing.returncode != 0 and "AUTH_SECRET" in missing.stderr


def test_the_compose_services_run_commands_the_cli_has() -> None:
    """Parsed without docker-compose: every service command is a real tokentrail command."""
    config = yaml.safe_load((ROOT / "docker-compose.yml").read_text())
    commands = {tuple(s["command"][:2]) if s["command"][0] in ("db", "admin") else (s["command"][0],)
                for s in config["services"].values() if s.get("build")}  # fmt: skip
    assert commands == {("db", "upgrade"), ("serve",), ("worker",)}
    for command in commands:
        out = subprocess.run(
            ["python", "-m", "tokentrail", *command, "--help"], capture_output=True, text=True, timeout=120
        )
        assert out.returncode == 0, out.stderr
    for service in config["services"].values():
        flags = [a for a in service.get("command", []) if isinstance(a, str) and a.startswith("--")]
        if service.get("build") and service["command"][0] in ("serve", "worker"):
            help_text = subprocess.run(
                ["python", "-m", "tokentrail", service["command"][0], "--help"],
                capture_output=True,
                text=True,
                timeout=120,
                env={**os.environ, "COLUMNS": "200"},
            ).stdout
            missing = [f for f in flags if f not in help_text]
            assert not missing, (service["command"], missing)
