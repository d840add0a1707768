#!/usr/bin/env bash
# Fill .whl/ (git-ignored) with what scripts/gpu_check.sh carries to a GPU machine that has no network:
# CPython 3.12 manylinux x86-64 (or pure-Python) wheels of tokentrail's runtime dependencies that the
# lent machine's image (Python 3.12, torch, transformers, tokenizers, huggingface-hub, numpy, httpx, ...)
# lacks, at the versions of this environment, and the trained tiny chatml model. Then call the device
# with carry [".whl"] and the command `bash scripts/gpu_check.sh`.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
mkdir -p .whl
python -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_24_x86_64 --platform manylinux_2_17_x86_64 \
    --platform manylinux2014_x86_64 --platform manylinux1_x86_64 --platform manylinux_2_5_x86_64 -d .whl \
    aiosqlite==0.22.1 alembic==1.20.1 annotated_doc==0.0.7 annotated_types==0.7.0 anyio==4.16.0 \
    asyncpg==0.32.0 fastapi==0.165.0 greenlet==3.5.6 httptools==0.9.0 mako==1.4.3 opentelemetry_api==1.45.2 \
    orjson==3.13.0 prompt_toolkit==3.0.52 pydantic==2.13.4 pydantic_core==2.46.4 pydantic_settings==2.14.1 \
    pyjwt==2.15.1 python_dotenv==1.2.2 redis==8.1.0 rich==15.0.0 sqlalchemy==2.1.9 sse_starlette==3.7.0 \
    starlette==1.10.0 typer==0.29.2 typing_extensions==4.16.0 typing_inspection==0.4.2 uvicorn==0.54.0 \
    watchfiles==1.3.0 wcwidth==0.7.0 websockets==17.4
[ -f .whl/tiny-chatml/config.json ] || python -m tokentrail model tiny --out .whl/tiny-chatml
du -sh .whl
