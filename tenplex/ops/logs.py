"""``--log-format json``: one JSON object per log line, for log pipelines; the human format stays the default.

May import: pythonjsonlogger and the standard library.

Every JSON line carries ``time`` (ISO 8601, UTC), ``level``, ``logger`` and ``message``, plus what is known
of ``host``, ``job``, ``world``, ``version`` and ``step`` (:func:`set_context`; keys not known are left
out). The format travels to ``tenplex run``'s workers in ``TENPLEX_LOG_FORMAT``.
"""

from __future__ import annotations

import logging
import os
import sys
import time
from typing import Any

from pythonjsonlogger.json import JsonFormatter

FORMATS = ("text", "json")
FORMAT_ENV = "TENPLEX_LOG_FORMAT"
CONTEXT_KEYS = ("host", "job", "world", "version", "step")
TEXT_FORMAT = "%(asctime)s %(name)s %(levelname)s %(message)s"
_context: dict[str, Any] = {}


def set_context(**values: Any) -> None:
    """Remember what later log lines are about (``host``, ``job``, ``world``, ``version``, ``step``)."""
    unknown = set(values) - set(CONTEXT_KEYS)
    if unknown:
        raise ValueError(f"unknown log context {sorted(unknown)}: use {', '.join(CONTEXT_KEYS)}")
    _context.update({k: v for k, v in values.items() if v is not None})


class _WithContext(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        for key, value in _context.items():
            if not hasattr(record, key):
                setattr(record, key, value)
        return True


def json_formatter() -> logging.Formatter:
    formatter = JsonFormatter("%(asctime)s %(levelname)s %(name)s %(message)s",
                              rename_fields={"asctime": "time", "levelname": "level", "name": "logger"})
    formatter.converter = time.gmtime
    formatter.default_time_format = "%Y-%m-%dT%H:%M:%S"
    formatter.default_msec_format = "%s.%03dZ"
    return formatter


def from_environment(**context: Any) -> None:
    """In a worker of ``tenplex run --log-format json``: JSON lines, unless the program set up logging itself
    (the level: ``TENPLEX_LOG``, default warnings)."""
    if os.environ.get(FORMAT_ENV) == "json" and not logging.getLogger().handlers:
        level = getattr(logging, os.environ.get("TENPLEX_LOG", "warning").upper(), logging.WARNING)
        setup("json", level, **context)
    else:
        set_context(**context)


def setup(log_format: str | None = None, level: int = logging.INFO, **context: Any) -> None:
    """Send log records to stderr in ``log_format`` (default: ``TENPLEX_LOG_FORMAT``, else text), replacing
    the root logger's handlers; the format is also set in the environment for child processes."""
    log_format = log_format or os.environ.get(FORMAT_ENV) or "text"
    if log_format not in FORMATS:
        raise ValueError(f"log format {log_format!r}: use one of {', '.join(FORMATS)}")
    os.environ[FORMAT_ENV] = log_format
    set_context(**context)
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(json_formatter() if log_format == "json" else logging.Formatter(TEXT_FORMAT))
    handler.addFilter(_WithContext())
    root = logging.getLogger()
    for old in list(root.handlers):
        root.removeHandler(old)
    root.addHandler(handler)
    root.setLevel(level)
