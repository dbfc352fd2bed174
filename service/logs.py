"""Structured logs: one JSON object per line, carrying the job id, for log collectors.

``STACKFUSE_LOG_FORMAT=json`` makes the API's and the workers' logs (ours, RQ's and uvicorn's)
JSON lines on stderr; ``text`` (the default) leaves Python's and RQ's own formats, which read
better in a terminal. The job a worker is compiling is a context variable (:func:`job_scope`),
so every line logged while it runs names it, whichever module logs it.
"""

from __future__ import annotations

import contextvars
import json
import logging
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import UTC, datetime

_JOB_ID: contextvars.ContextVar[str | None] = contextvars.ContextVar("job_id", default=None)
#: attributes every LogRecord has: the rest are ``extra=`` fields, kept in the JSON object
_STANDARD = set(vars(logging.LogRecord("", 0, "", 0, "", (), None))) | {"message", "asctime"}


@contextmanager
def job_scope(job_id: str) -> Iterator[None]:
    """Every log record made inside carries ``job_id``."""
    token = _JOB_ID.set(job_id)
    try:
        yield
    finally:
        _JOB_ID.reset(token)


class JsonFormatter(logging.Formatter):
    """``{"time", "level", "logger", "message", "pid", "job_id"?, "exception"?, extras...}``."""

    def format(self, record: logging.LogRecord) -> str:
        doc: dict[str, object] = {
            "time": datetime.fromtimestamp(record.created, UTC).isoformat(timespec="milliseconds"),
            "level": record.levelname.lower(),
            "logger": record.name,
            "message": record.getMessage(),
            "pid": record.process,
        }
        job_id = getattr(record, "job_id", None) or _JOB_ID.get()
        if job_id:
            doc["job_id"] = job_id
        for key, value in vars(record).items():
            if key not in _STANDARD and key not in doc:
                doc[key] = value if isinstance(value, str | int | float | bool) else repr(value)
        if record.exc_info:
            doc["exception"] = self.formatException(record.exc_info)
        return json.dumps(doc, ensure_ascii=False)


def configure(log_format: str, level: int = logging.INFO) -> bool:
    """Install the JSON handler on the root logger (once per process) when ``log_format`` is
    ``json``; True when it did. Loggers that propagate (ours, RQ's, uvicorn's with
    ``log_config=None``) then all write JSON lines."""
    if log_format != "json":
        return False
    root = logging.getLogger()
    if not any(isinstance(h.formatter, JsonFormatter) for h in root.handlers):
        handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(JsonFormatter())
        root.addHandler(handler)
    root.setLevel(level)
    return True
