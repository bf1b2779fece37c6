"""One logging setup for every entry point (control plane, router, worker, CLI).

``RUDDER_LOG_FORMAT`` chooses the format: ``text`` (the default, for a terminal) or ``json``: one
JSON object per line with ``time`` (ISO-8601 UTC), ``level``, ``logger``, ``message`` and the ids
known where the line was logged (``request_id``, ``trace_id``, ``span_id``, ``revision``,
``router_id``, ``worker_id``), plus ``exc_info`` for a traceback.

The ids come from three places, the later winning: the ids bound to the current context
(:func:`bind` / :func:`bound`, a ``ContextVar``, so each request and each task carries its own and
tasks inherit their creator's), the current OpenTelemetry span (``trace_id``, ``span_id``), and a
call's own ``extra={...}``. Library code only binds and logs; :func:`configure_logging` is called by
entry points alone.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import sys
from collections.abc import Iterator, Mapping
from contextvars import ContextVar, Token
from datetime import UTC, datetime
from types import MappingProxyType
from typing import IO, Any

from opentelemetry import trace

FORMAT_ENV = "RUDDER_LOG_FORMAT"
TEXT_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"
# The ids a JSON line carries when known, in this order.
IDS = ("request_id", "trace_id", "span_id", "revision", "router_id", "worker_id", "model")

_NONE: Mapping[str, Any] = MappingProxyType({})
_ids: ContextVar[Mapping[str, Any]] = ContextVar("rudder_log_ids", default=_NONE)


def bind(**ids: Any) -> Token[Mapping[str, Any]]:
    """Add ``ids`` to the current context's (None removes one); returns the token to reset."""
    merged = {**_ids.get(), **ids}
    if None in ids.values():  # the bound ids hold no None: only what is given here may
        merged = {k: v for k, v in merged.items() if v is not None}
    return _ids.set(merged)


def reset(token: Token[Mapping[str, Any]]) -> None:
    _ids.reset(token)


@contextlib.contextmanager
def bound(**ids: Any) -> Iterator[None]:
    """``ids`` bound for the duration of the block."""
    token = bind(**ids)
    try:
        yield
    finally:
        _ids.reset(token)


def current_ids() -> dict[str, Any]:
    """The ids bound to the current context, with the current span's trace and span ids."""
    ids = dict(_ids.get())
    ctx = trace.get_current_span().get_span_context()
    if ctx.is_valid:
        ids.setdefault("trace_id", format(ctx.trace_id, "032x"))
        ids.setdefault("span_id", format(ctx.span_id, "016x"))
    return ids


class ContextIds(logging.Filter):
    """Puts the context's ids on every record (an ``extra`` of the call keeps its own value)."""

    def filter(self, record: logging.LogRecord) -> bool:
        for name, value in current_ids().items():
            if not hasattr(record, name):
                setattr(record, name, value)
        return True


class JsonFormatter(logging.Formatter):
    """One JSON object per record, on one line (newlines in a message are escaped by JSON)."""

    def format(self, record: logging.LogRecord) -> str:
        line: dict[str, Any] = {
            "time": datetime.fromtimestamp(record.created, UTC).isoformat(timespec="milliseconds")
            .replace("+00:00", "Z"),
            "level": record.levelname,
            "logger": record.name,
            "message": record.getMessage(),
        }
        for name in IDS:
            value = getattr(record, name, None)
            if value is not None:
                line[name] = value
        if record.exc_info:
            line["exc_info"] = self.formatException(record.exc_info)
        return json.dumps(line, default=str, ensure_ascii=False)


def log_format(value: str | None = None) -> str:
    """``text`` or ``json`` (from ``RUDDER_LOG_FORMAT`` when not given). Raises ValueError on
    anything else, naming the setting."""
    fmt = (value if value is not None else os.environ.get(FORMAT_ENV, "text")).strip().lower() or "text"
    if fmt not in ("text", "json"):
        raise ValueError(f"{FORMAT_ENV} must be text or json, not {fmt!r}")
    return fmt


def handler(fmt: str | None, stream: IO[str]) -> logging.Handler:
    """A handler writing to ``stream`` in ``fmt`` (``RUDDER_LOG_FORMAT``) with the context's ids."""
    out = logging.StreamHandler(stream)
    out.addFilter(ContextIds())
    out.setFormatter(JsonFormatter() if log_format(fmt) == "json" else logging.Formatter(TEXT_FORMAT))
    return out


def configure_logging(level: str = "INFO", *, fmt: str | None = None, stream: IO[str] | None = None) -> None:
    """Replace the root logger's handlers with one writing to ``stream`` (stderr) in ``fmt``
    (``RUDDER_LOG_FORMAT``), with the context's ids on every record. Entry points only."""
    root = logging.getLogger()
    for old in list(root.handlers):
        root.removeHandler(old)
    root.addHandler(handler(fmt, stream or sys.stderr))
    root.setLevel(level.upper())
