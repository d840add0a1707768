"""The startup heap kept out of the garbage collector's full collections.

A server or worker process imports and builds hundreds of thousands of long-lived objects at startup
(modules, FastAPI's routes, SQLAlchemy's compiled statements, tokenizers, vLLM's client). Each full
collection walks all of them again; under load those collections paused the event loop for tens of
milliseconds each (issue 22). Frozen, they are skipped until ``unfreeze``; vLLM's API server does the
same after its startup. Young collections are also made rarer (``YOUNG_THRESHOLD``)."""

from __future__ import annotations

import gc

# Young collections every 50,000 net allocations rather than 700: objects of a request or an engine step
# that live across a few awaits die young instead of being promoted into the old generations, whose
# growth is what triggers full collections.
YOUNG_THRESHOLD = 50_000
_before: list[int] = []  # the young threshold ``freeze_startup_heap`` replaced


def freeze_startup_heap() -> None:
    gc.collect()
    gc.freeze()
    young, middle, old = gc.get_threshold()
    if not _before:
        _before.append(young)
    gc.set_threshold(YOUNG_THRESHOLD, middle, old)


def unfreeze_heap() -> None:
    """At shutdown: what was frozen may be collected again (tests run many apps in one process)."""
    gc.unfreeze()
    if _before:
        gc.set_threshold(_before.pop(), *gc.get_threshold()[1:])
