"""``python benchmarks/exactness.py [--help]``: the exactness benchmark of the package ``benchmarks/exactness/``
(its docstring describes the run and defines the metrics)."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.exactness.cli import main

if __name__ == "__main__":
    sys.exit(main())
