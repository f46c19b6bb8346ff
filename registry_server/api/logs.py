"""Logging: one JSON object per line for operators' collectors, or readable
lines for a terminal. Events carry their fields in ``extra={"fields": {...}}``
(execution id, tool, caller, status, ...), never secrets.

A JSON line written during a call also carries the call's ``execution_id``
and, when a trace is active, its ``trace_id`` and ``span_id``, so a log
search and a trace view lead to each other.

HTTP client libraries' own loggers never show a request's text: see
``quiet_http_clients``, which a process calls where it sets up logging
(``configure`` here, for ``toolreg serve``; ``serve_console``)."""

from __future__ import annotations

import json
import logging
import sys
from datetime import UTC, datetime
from typing import Any

from opentelemetry import trace

from registry_server.execution.tracing import current_execution_id

FORMATS = ("auto", "json", "text")

# The loggers of the HTTP client libraries in the tree or under it (httpx for
# webhooks and OIDC/JWKS fetches, httpcore under it, httpx2/httpcore2 under
# the MCP SDK, urllib3 and requests under the Docker SDK and the OTLP
# exporter, websockets, h2/hpack): a name covers the logger and its children.
# They log every request's URL (httpx at INFO: "HTTP Request: POST
# https://hooks.slack.com/services/T../B../<secret>"), and at DEBUG its
# headers too; a URL can be a credential (a Slack webhook's path is its
# secret). Toolreg's own lines name an endpoint by its id instead.
HTTP_CLIENT_LOGGERS = (
    "httpx", "httpx2", "httpcore", "httpcore2", "urllib3", "requests", "websockets",
    "h11", "h2", "hpack", "aiohttp", "mcp.client", "docker",
)  # fmt: skip
HTTP_CLIENT_LEVEL = logging.WARNING  # their loggers' level, whatever the operator's level
WITHHELD = "text withheld (an HTTP client library's log line can carry a request URL, a credential)"


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
    quiet_http_clients()


def quiet_http_clients() -> None:
    """Keep request URLs (credentials, some of them) out of the log, for
    good, in this process: HTTP client libraries' loggers are pinned at
    WARNING, so their INFO/DEBUG lines are never made whatever level the
    operator sets; and every record one of them still makes (a warning, or a
    child logger someone set lower) has its text withheld as it is made:
    only the logger, the level and an exception's type remain. A record
    factory rather than a handler filter, so it holds for every handler
    (``basicConfig``'s, a test's, one added later) and every child logger.
    Idempotent."""
    for name in HTTP_CLIENT_LOGGERS:
        logging.getLogger(name).setLevel(HTTP_CLIENT_LEVEL)
    make = logging.getLogRecordFactory()
    if getattr(make, "withholds_http_clients", False):
        return

    def withholding(*args: Any, **kwargs: Any) -> logging.LogRecord:
        record = make(*args, **kwargs)
        if from_http_client(record.name):
            withhold(record)
        return record

    withholding.withholds_http_clients = True  # type: ignore[attr-defined]
    logging.setLogRecordFactory(withholding)


def from_http_client(logger_name: str) -> bool:
    return any(
        logger_name == name or logger_name.startswith(name + ".") for name in HTTP_CLIENT_LOGGERS
    )


def withhold(record: logging.LogRecord) -> None:
    """Drop everything of ``record`` that came from the request: its message
    and arguments, its exception's text and traceback, its stack."""
    exc_type = record.exc_info[0] if record.exc_info else None
    record.msg = WITHHELD + (f"; exception {exc_type.__name__}" if exc_type is not None else "")
    record.args = None
    record.exc_info = None
    record.exc_text = None
    record.stack_info = None
