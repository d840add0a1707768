"""The compiled part of the package: the export's page encoder (server/export/_fastpage.c). Optional: where
it cannot be built (no C compiler), the export runs the same encoding in Python."""

from setuptools import Extension, setup

setup(
    ext_modules=[
        Extension(
            "server.export._fastpage",
            ["server/export/_fastpage.c"],
            extra_compile_args=["-O2", "-std=c11", "-Wall", "-Wextra", "-Wno-unused-parameter"],
            optional=True,
        )
    ]
)
