"""Logging: one JSON object per line for operators' collectors, or readable
lines for a terminal. Events carry their fields in ``extra={"fields": {...}}``
(execution id, tool, caller, status, ...), never secrets."""

from __future__ import annotations

import json
import logging
import sys
from datetime import UTC, datetime
from typing import Any

FORMATS = ("auto", "json", "text")


class JsonFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        line: dict[str, Any] = {
            "ts": datetime.fromtimestamp(record.created, UTC).isoformat(timespec="milliseconds"),
            "level": record.levelname.lower(),
            "logger": record.name,
            "event": record.getMessage(),
        }
        fields = getattr(record, "fields", None)
        if isinstance(fields, dict):
            line.update(fields)
        if record.exc_info:
            line["exception"] = self.formatException(record.exc_info)
        return json.dumps(line, ensure_ascii=False, default=str)


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
