"""``python benchmarks/pipeline.py [--help]``: the pipeline overhead benchmark of the package
``benchmarks/pipeline/`` (``benchmarks/pipeline/cli.py``'s docstring describes the run)."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.pipeline.cli import main

if __name__ == "__main__":
    sys.exit(main())
