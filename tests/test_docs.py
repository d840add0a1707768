"""The documentation: the site builds with warnings as errors (broken links and anchors, pages left out of
the nav), the references match the code, and README stays a short door whose links resolve."""

from __future__ import annotations

import importlib.util
import os
import re
import subprocess
import sys
from pathlib import Path
from types import ModuleType

import pytest

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
DOCS = ROOT / "docs"


def _reference_module() -> ModuleType:
    spec = importlib.util.spec_from_file_location("docs_reference", ROOT / "scripts" / "docs_reference.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_reference_pages_match_the_code() -> None:
    """Every CLI command and option, HTTP route and setting is in docs/reference as the code has it now."""
    stale = _reference_module().stale_pages()
    assert not stale, f"docs/reference/{stale} differ from the code: run python scripts/docs_reference.py"


_BUILTIN_OPTIONS = {"help", "install_completion", "show_completion"}


def test_cli_reference_names_every_command_and_option() -> None:
    """Independent of the generator's formatting: each command path and each option form is on the page."""
    import typer

    from tokentrail.cli import app

    page = (DOCS / "reference" / "cli.md").read_text()
    reference = _reference_module()
    missing = []
    for path, command in reference._commands(typer.main.get_command(app), "tokentrail"):
        if f"## `{path}`" not in page:
            missing.append(path)
        ctx = reference._context(command, path)
        for param in command.get_params(ctx):
            if param.param_type_name == "option" and param.name not in {
                "help",
                "install_completion",
                "show_completion",
            }:
                missing += [f"{path} {form}" for form in param.opts if form not in page]
    assert not missing, missing


def test_docs_site_builds_strict(tmp_path: Path) -> None:
    pytest.importorskip("mkdocs", reason="pip install -e '.[test]' brings mkdocs-material")
    env = {**os.environ, "NO_MKDOCS_2_WARNING": "1"}
    result = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(tmp_path / "site")],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
        env=env,
    )
    assert result.returncode == 0, result.stdout[-5000:] + result.stderr[-5000:]
    assert (tmp_path / "site" / "architecture" / "index.html").exists()


def test_readme_is_a_short_door() -> None:
    lines = README.read_text().splitlines()
    assert len(lines) <= 250, f"README.md has {len(lines)} lines; details belong in docs/"
    assert lines[0].startswith("pip install") and lines[1].startswith("pip install"), "the two commands come first"


_LINK = re.compile(r"\]\(([^)\s]+)\)")


def _anchors(markdown: str) -> set[str]:
    from markdown.extensions.toc import slugify

    found = set()
    for line in markdown.splitlines():
        if heading := re.match(r"#{1,6}\s+(.*?)\s*(\{#([\w-]+)\})?\s*$", line):
            found.add(heading.group(3) or slugify(re.sub(r"[`*]", "", heading.group(1)), "-"))
    return found


def test_readme_links_resolve() -> None:
    """README is read on the repository's front page, outside the site: its relative links and their
    anchors must exist."""
    broken = []
    for target in _LINK.findall(README.read_text()):
        if re.match(r"[a-z]+:", target):
            continue
        path, _, anchor = target.partition("#")
        file = (ROOT / path) if path else README
        missing_anchor = file.exists() and anchor and file.suffix == ".md" and anchor not in _anchors(file.read_text())
        if not file.exists() or missing_anchor:
            broken.append(target)
    assert not broken, broken


def test_user_docs_carry_no_issue_numbers() -> None:
    """History belongs in git and CHANGELOG.md, not in the pages a user reads."""
    pattern = re.compile(r"\bissues? #?\d+", re.IGNORECASE)
    hits = [
        f"{path.relative_to(ROOT)}: {match.group(0)}"
        for path in [README, *DOCS.rglob("*.md")]
        for match in pattern.finditer(path.read_text())
    ]
    assert not hits, hits
