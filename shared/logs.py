"""Process logging for the server and the worker: plain text, or one JSON object per line
(``--log-format json``) for log collectors."""

from __future__ import annotations

import logging
from datetime import UTC, datetime

import orjson

# LogRecord attributes that are not the caller's ``extra`` fields.
_STANDARD = set(vars(logging.LogRecord("", 0, "", 0, "", None, None))) | {"message", "asctime", "taskName"}


class JsonFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        entry: dict[str, object] = {
            "time": datetime.fromtimestamp(record.created, UTC).isoformat(timespec="milliseconds"),
            "level": record.levelname.lower(),
            "logger": record.name,
            "message": record.getMessage(),
        }
        for key, value in vars(record).items():
            if key not in _STANDARD and not key.startswith("_"):
                entry[key] = value
        if record.exc_info:
            entry["exception"] = self.formatException(record.exc_info)
        return orjson.dumps(entry, default=str).decode()


def configure_logging(level: str, fmt: str = "text") -> None:
    """Root logging for a process; uvicorn's loggers propagate to it (see ``uvicorn_log_config``)."""
    if fmt not in ("text", "json"):
        raise ValueError(f"log format {fmt!r}: choose text or json")
    handler = logging.StreamHandler()
    if fmt == "json":
        handler.setFormatter(JsonFormatter())
    else:
        handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level.upper())


_UVICORN = ("uvicorn", "uvicorn.error", "uvicorn.access")


def uvicorn_log_config() -> dict[str, object]:
    """uvicorn's loggers without handlers of their own: they go through the root's format."""
    return {
        "version": 1,
        "disable_existing_loggers": False,
        "loggers": {
            name: {"handlers": [], "propagate": True} for name in ("uvicorn", "uvicorn.error", "uvicorn.access")
        },
    }
