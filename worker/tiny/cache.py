"""The tiny models that ``tiny``/``tiny-<template>`` name, built once into the cache directory."""

from __future__ import annotations

import contextlib
import os
import shutil
import stat
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path

from worker.tiny.build import BUILD_VERSION, build_tiny_model
from worker.tiny.layout import template_layout

__all__ = ["build_cached", "default_cache_dir", "resolve_model"]

_MODEL_PREFIX = "tiny"


def default_cache_dir() -> Path:
    """$TOKENTRAIL_CACHE_DIR or ~/.cache/tokentrail"""
    env = os.environ.get("TOKENTRAIL_CACHE_DIR")
    if env:
        return Path(env).expanduser()
    return Path.home() / ".cache" / "tokentrail"


def _tiny_template(name: str) -> str | None:
    """The template a ``tiny``/``tiny-<template>`` name asks for, or None if it is not such a name."""
    if name == _MODEL_PREFIX:
        return "chatml"
    prefix = _MODEL_PREFIX + "-"
    if not name.startswith(prefix) or Path(name).exists():
        return None
    template = name[len(prefix) :]
    template_layout(template)  # "tiny-<unknown>" is a mistake, not a hub id: say so
    return template


def resolve_model(name_or_path: str, *, cache_dir: Path | None = None) -> str:
    """'tiny' or 'tiny-<template>' -> path of a tiny model built (once) into the cache; else unchanged.

    The model is built into ``<cache>/models/tiny-<template>-s0-v<BUILD_VERSION>``: first into a
    temporary sibling directory, which is then renamed into place, so a reader never sees a partial
    build and concurrent processes racing to build it both end up with the same complete directory.
    Anything else (a model directory, a hub id) is returned unchanged; so is an existing path named like
    ``tiny-...``. ``tiny-<unknown template>`` raises ValueError.
    """
    template = _tiny_template(name_or_path)
    if template is None:
        return name_or_path
    models_dir = Path(cache_dir if cache_dir is not None else default_cache_dir()).expanduser() / "models"
    final = (models_dir / f"{_MODEL_PREFIX}-{template}-s0-v{BUILD_VERSION}").absolute()
    return build_cached(final, lambda out: build_tiny_model(out, template=template, seed=0))


def build_cached(final: Path, build: Callable[[Path], object]) -> str:
    """Build a model directory once, atomically: ``build(tmp)`` into a temporary sibling, then rename
    it to ``final``. A reader never sees a partial build. Processes of this machine that want it at the
    same time take turns on a lock file beside it, so one builds and the others wait for its build (a
    training run on every one of them at once multiplied the time each took); where the lock is not
    available (no ``fcntl``), they race and the loser uses the winner's directory."""
    if (final / "tokentrail.json").is_file():
        return str(final)
    final.parent.mkdir(parents=True, exist_ok=True)
    with _build_lock(final.parent / f".{final.name}.lock"):
        if (final / "tokentrail.json").is_file():  # built while this process waited
            return str(final)
        tmp = Path(tempfile.mkdtemp(prefix=f".{final.name}.", suffix=".tmp", dir=final.parent))
        try:
            build(tmp)
            # mkdtemp made it 0700; give it the mode of the models directory it lands in.
            tmp.chmod(stat.S_IMODE(final.parent.stat().st_mode))
            try:
                os.rename(tmp, final)
            except OSError:
                # Another process finished first (the target exists and is not empty): use its build.
                if not (final / "tokentrail.json").is_file():
                    raise
        finally:
            if tmp.exists():
                shutil.rmtree(tmp, ignore_errors=True)
    return str(final)


@contextlib.contextmanager
def _build_lock(path: Path) -> Iterator[None]:
    """An exclusive lock on ``path`` (created if missing), held until the block ends: ``flock``, which
    the kernel releases if the holder dies."""
    try:
        import fcntl
    except ImportError:  # (not POSIX)
        yield
        return
    with open(path, "a") as fh:
        fcntl.flock(fh.fileno(), fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(fh.fileno(), fcntl.LOCK_UN)
