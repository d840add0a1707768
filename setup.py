"""The compiled part of the package: the export's page encoder (server/export/fastpage_c/). Optional: where
it cannot be built (no C compiler), the export runs the same encoding in Python."""

from pathlib import Path

from setuptools import Extension, setup

setup(
    ext_modules=[
        Extension(
            "server.export._fastpage",
            sorted(str(p) for p in Path("server/export/fastpage_c").glob("*.c")),
            depends=sorted(str(p) for p in Path("server/export/fastpage_c").glob("*.h")),
            extra_compile_args=["-O2", "-std=c11", "-Wall", "-Wextra", "-Wno-unused-parameter"],
            optional=True,
        )
    ]
)
