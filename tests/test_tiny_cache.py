"""The tiny-model cache (worker/tiny/cache.py): processes that want the same model at once build it once."""

from __future__ import annotations

import multiprocessing
import time
from pathlib import Path

from worker.tiny.cache import build_cached


def _build(out: Path) -> None:
    with open(out.parent / "builds.log", "a") as log:  # one line per build that ran
        log.write(f"{out.name}\n")
    time.sleep(0.5)  # long enough for the others to arrive while it runs
    (out / "tokentrail.json").write_text("{}")


def _want(final: str, results: multiprocessing.Queue) -> None:  # type: ignore[type-arg]
    results.put(build_cached(Path(final), _build))


def test_processes_wanting_the_same_model_build_it_once(tmp_path: Path) -> None:
    final = tmp_path / "models" / "tiny-test"
    ctx = multiprocessing.get_context("spawn")
    results = ctx.Queue()
    procs = [ctx.Process(target=_want, args=(str(final), results)) for _ in range(3)]
    for proc in procs:
        proc.start()
    got = [results.get(timeout=60) for _ in procs]
    for proc in procs:
        proc.join(10)
    assert got == [str(final)] * 3
    assert (final / "tokentrail.json").is_file()
    assert len((final.parent / "builds.log").read_text().splitlines()) == 1
    assert build_cached(final, _build) == str(final)  # built: returned at once, no build
    assert len((final.parent / "builds.log").read_text().splitlines()) == 1
    assert not [p for p in final.parent.iterdir() if p.name.endswith(".tmp")]  # no partial build left
