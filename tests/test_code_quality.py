"""The code stays ruff-clean, formatted, and type-checked (mypy strict per pyproject)."""

from __future__ import annotations

import ast
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from worker.tiny.cache import default_cache_dir

ROOT = Path(__file__).resolve().parent.parent
# mypy's cache outside the checkout: a fresh clone (CI) checks in seconds, not a minute (entries are
# validated by the sources' hashes, so another checkout's cache is safe to reuse)
MYPY_CACHE = str(default_cache_dir() / "mypy")


@pytest.mark.parametrize(
    "cmd",
    [
        ["ruff", "check", "."],
        ["ruff", "format", "--check", "."],
        [sys.executable, "-m", "mypy", "--cache-dir", MYPY_CACHE],
    ],
    ids=["ruff-check", "ruff-format", "mypy"],
)
def test_tool_passes(cmd: list[str]) -> None:
    if cmd[0] == "ruff" and shutil.which("ruff") is None:
        pytest.skip("ruff is not installed (pip install -e '.[test]')")
    result = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stdout[-5000:] + result.stderr[-2000:]


_PACKAGES = ("server", "worker", "benchmarks")


def _import_graph() -> dict[str, set[str]]:
    """Module -> the modules of ``_PACKAGES`` it imports: every import, TYPE_CHECKING and function-level
    ones included (a circle hidden under TYPE_CHECKING is still a circle to a reader)."""
    files: dict[str, Path] = {}
    for pkg in _PACKAGES:
        for path in (ROOT / pkg).rglob("*.py"):
            parts = list(path.relative_to(ROOT).with_suffix("").parts)
            files[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    graph: dict[str, set[str]] = {}
    for module, path in files.items():
        package = module.split(".") if path.name == "__init__.py" else module.split(".")[:-1]
        targets: set[str] = set()
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            names: list[str] = []
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    base = ".".join([*package[: len(package) - node.level + 1], *([base] if base else [])])
                names = [f"{base}.{alias.name}" if f"{base}.{alias.name}" in files else base for alias in node.names]
            for name in names:
                while name and name not in files:
                    name = name.rpartition(".")[0]
                if name and name != module:
                    targets.add(name)
        graph[module] = targets
    return graph


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components with more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = stack[stack.index(v) :]
            del stack[stack.index(v) :]
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


@pytest.mark.parametrize("package", _PACKAGES)
def test_no_import_cycle(package: str) -> None:
    cycles = [c for c in _cycles(_import_graph()) if any(m.split(".")[0] == package for m in c)]
    assert not cycles, "import cycles: " + "; ".join(" <-> ".join(c) for c in cycles)
