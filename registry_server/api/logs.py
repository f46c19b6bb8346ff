"""Logging: one JSON object per line for operators' collectors, or readable
lines for a terminal. Events carry their fields in ``extra={"fields": {...}}``
(execution id, tool, caller, status, ...), never secrets.

A JSON line written during a call also carries the call's ``execution_id``
and, when a trace is active, its ``trace_id`` and ``span_id``, so a log
search and a trace view lead to each other."""

from __future__ import annotations

import json
import logging
import sys
from datetime import UTC, datetime
from typing import Any

from opentelemetry import trace

from registry_server.execution.tracing import current_execution_id

FORMATS = ("auto", "json", "text")


class JsonFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        line: dict[str, Any] = {
            "ts": datetime.fromtimestamp(record.created, UTC).isoformat(timespec="milliseconds"),
            "level": record.levelname.lower(),
            "logger": record.name,
            "event": record.getMessage(),
        }
        line.update(_call_context())
        fields = getattr(record, "fields", None)
        if isinstance(fields, dict):
            line.update(fields)
        if record.exc_info:
            line["exception"] = self.formatException(record.exc_info)
        return json.dumps(line, ensure_ascii=False, default=str)


def _call_context() -> dict[str, str]:
    """The call this line was written for: its execution id and trace, if any.
    A trace id a caller sent passed W3C's format check (32 hex digits) first."""
    context: dict[str, str] = {}
    if execution_id := current_execution_id.get():
        context["execution_id"] = execution_id
    span = trace.get_current_span().get_span_context()
    if span.is_valid:
        context["trace_id"] = trace.format_trace_id(span.trace_id)
        context["span_id"] = trace.format_span_id(span.span_id)
    return context


class TextFormatter(logging.Formatter):
    def __init__(self) -> None:
        super().__init__("%(asctime)s %(levelname)s %(name)s: %(message)s")

    def format(self, record: logging.LogRecord) -> str:
        text = super().format(record)
        fields = getattr(record, "fields", None)
        if isinstance(fields, dict):
            text += " " + " ".join(
                f"{k}={v}" for k, v in fields.items() if v not in (None, "", [], {})
            )
        return text


def configure(level: str = "INFO", fmt: str = "auto") -> None:
    """Set up the root logger once, on stderr. ``auto``: text on a terminal,
    JSON otherwise (a service manager or a container log)."""
    if fmt not in FORMATS:
        raise ValueError(f"log format {fmt!r}: use {', '.join(FORMATS)}")
    if fmt == "auto":
        fmt = "text" if sys.stderr.isatty() else "json"
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(JsonFormatter() if fmt == "json" else TextFormatter())
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level.upper())
