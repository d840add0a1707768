"""The server's exception tree and its mapping to HTTP error bodies.

ApiError(code, detail)            -> {"detail": ..., "code": ...} with HTTP_STATUS[code]
RequestValidationError (FastAPI)  -> 422 {"detail": [...], "code": "validation_error"}
anything else                     -> 500 {"detail": "internal error", "code": "internal_error"}
"""

from __future__ import annotations

import logging

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from shared.errors import HTTP_STATUS, ErrorCode

log = logging.getLogger(__name__)


class ApiError(Exception):
    def __init__(self, code: ErrorCode, detail: str, *, headers: dict[str, str] | None = None) -> None:
        super().__init__(detail)
        self.code = code
        self.detail = detail
        self.status_code = HTTP_STATUS.get(code, 400)
        self.headers = headers


def install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(ApiError)
    async def _api_error(_request: Request, exc: ApiError) -> JSONResponse:
        return JSONResponse(
            {"detail": exc.detail, "code": exc.code.value}, status_code=exc.status_code, headers=exc.headers
        )

    @app.exception_handler(RequestValidationError)
    async def _validation_error(_request: Request, exc: RequestValidationError) -> JSONResponse:
        errors = exc.errors()
        # Oversized content is a size problem (413), not a shape problem.
        for err in errors:
            if err.get("type") == "string_too_long" and "content" in err.get("loc", ()):
                return JSONResponse(
                    {"detail": "content is too long", "code": ErrorCode.content_too_long.value},
                    status_code=413,
                )
        safe = [{k: v for k, v in e.items() if k in ("type", "loc", "msg")} for e in errors]
        return JSONResponse({"detail": safe, "code": ErrorCode.validation_error.value}, status_code=422)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(_request: Request, exc: StarletteHTTPException) -> JSONResponse:
        code = {404: ErrorCode.bad_request, 405: ErrorCode.bad_request}.get(exc.status_code, ErrorCode.bad_request)
        return JSONResponse(
            {"detail": exc.detail, "code": "not_found" if exc.status_code == 404 else code.value},
            status_code=exc.status_code,
            headers=getattr(exc, "headers", None),
        )

    @app.exception_handler(Exception)
    async def _unexpected(_request: Request, exc: Exception) -> JSONResponse:
        log.exception("unhandled error", exc_info=exc)
        return JSONResponse({"detail": "internal error", "code": ErrorCode.internal_error.value}, status_code=500)
