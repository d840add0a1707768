"""Progress lines of the benchmarks: on stderr, so that stdout keeps only the results (``--json``)."""

from __future__ import annotations

import sys


def say(line: str) -> None:
    print(line, file=sys.stderr, flush=True)
