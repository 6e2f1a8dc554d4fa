"""``--log-format json``: one JSON object per log line, for log pipelines; the human format stays the default.

May import: pythonjsonlogger and the standard library.

Every JSON line carries ``time`` (ISO 8601, UTC), ``level``, ``logger`` and ``message``, plus what is known
of ``host``, ``job``, ``world``, ``version`` and ``step`` (:func:`set_context` for the process, :func:`scope`
for one task or thread: an operator reconciles many jobs at once; keys not known are left out). The format
travels to ``tenplex run``'s workers in ``TENPLEX_LOG_FORMAT``.

Under the JSON format every line a command prints is an object: its own lines (a start-up line, a leave)
go through :func:`line`, warnings and uncaught exceptions through logging.
"""

from __future__ import annotations

import contextvars
import logging
import os
import sys
import threading
import time
from contextlib import contextmanager
from typing import Any, Iterator, TextIO

from pythonjsonlogger.json import JsonFormatter

FORMATS = ("text", "json")
FORMAT_ENV = "TENPLEX_LOG_FORMAT"
CONTEXT_KEYS = ("host", "job", "world", "version", "step")
TEXT_FORMAT = "%(asctime)s %(name)s %(levelname)s %(message)s"
JOB_ENV = "TENPLEX_JOB"  # the job's name where one is known (the operator's worker pods: NAMESPACE/NAME)
RUN_ID_ENV = "TORCHELASTIC_RUN_ID"  # torchrun's --rdzv-id, in the environment of its workers: the job otherwise
JOB_KIND = "TenplexJob"
_context: dict[str, Any] = {}
_scoped: contextvars.ContextVar[dict[str, Any] | None] = contextvars.ContextVar("tenplex_log_scope", default=None)


def _checked(values: dict[str, Any]) -> dict[str, Any]:
    unknown = set(values) - set(CONTEXT_KEYS)
    if unknown:
        raise ValueError(f"unknown log context {sorted(unknown)}: use {', '.join(CONTEXT_KEYS)}")
    return {k: v for k, v in values.items() if v is not None}


def set_context(**values: Any) -> None:
    """Remember what later log lines are about (``host``, ``job``, ``world``, ``version``, ``step``)."""
    _context.update(_checked(values))


@contextmanager
def scope(**values: Any) -> Iterator[None]:
    """What the log lines of this task or thread (and the threads ``asyncio.to_thread`` starts for it) are
    about while the block runs, over :func:`set_context`'s: say the job an operator's reconciliation is for."""
    token = _scoped.set({**(_scoped.get() or {}), **_checked(values)})
    try:
        yield
    finally:
        _scoped.reset(token)


def _job_of_object(record: logging.LogRecord) -> dict[str, Any]:
    """``job`` of a record that kopf logged about a TenplexJob (its ``k8s_ref``): NAMESPACE/NAME."""
    ref = getattr(record, "k8s_ref", None)
    if isinstance(ref, dict) and ref.get("kind") == JOB_KIND and ref.get("name"):
        return {"job": f"{ref.get('namespace') or ''}/{ref['name']}".lstrip("/")}
    return {}


class _WithContext(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        for key, value in {**_context, **(_scoped.get() or {}), **_job_of_object(record)}.items():
            if not hasattr(record, key):
                setattr(record, key, value)
        return True


def job_name(run_id: str | None = None) -> str | None:
    """The job this process works for: ``TENPLEX_JOB``, else the rendezvous id (``run_id``, default torchrun's
    ``TORCHELASTIC_RUN_ID``) unless it is torchrun's default "none"; None when neither says."""
    run_id = run_id if run_id is not None else os.environ.get(RUN_ID_ENV)
    return os.environ.get(JOB_ENV) or (run_id if run_id and run_id != "none" else None)


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
    context.setdefault("job", job_name())
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
    logging.captureWarnings(True)  # a warning is a log line too (JSON under the JSON format)
    if log_format == "json":
        sys.excepthook, threading.excepthook = _log_uncaught, _log_uncaught_in_thread


def is_json() -> bool:
    """Whether this process logs JSON lines (``--log-format json``, or a worker of such a ``tenplex run``)."""
    return os.environ.get(FORMAT_ENV) == "json"


def line(message: str, stream: TextIO | None = None, level: int = logging.INFO, logger: str = "tenplex",
         **fields: Any) -> None:
    """Print one line of a command's own (``stream``: default stdout): ``message`` as it is in the text format;
    under the JSON format an object like a log record's (time, level, logger, message, the context known) with
    ``fields`` (say the port a server bound) as keys of their own, so that a log shipper gets only JSON."""
    text = message
    if is_json():
        record = logging.LogRecord(logger, level, "", 0, message, None, None)
        record.__dict__.update(fields)
        _WithContext().filter(record)
        text = json_formatter().format(record)
    print(text, file=stream or sys.stdout, flush=True)


def _log_uncaught(kind, value, traceback) -> None:
    if issubclass(kind, KeyboardInterrupt):
        sys.__excepthook__(kind, value, traceback)
        return
    logging.getLogger("tenplex").critical("uncaught %s: %s", kind.__name__, value, exc_info=(kind, value, traceback))


def _log_uncaught_in_thread(args) -> None:
    if args.exc_type is SystemExit:
        return
    logging.getLogger("tenplex").critical("uncaught %s in thread %s: %s", args.exc_type.__name__,
                                          getattr(args.thread, "name", "?"), args.exc_value,
                                          exc_info=(args.exc_type, args.exc_value, args.exc_traceback))
