"""The engine health monitor's transitions and the log line formats."""

from __future__ import annotations

import json
import logging

from registry_server.api.health_monitor import HealthMonitor
from registry_server.api.logs import JsonFormatter, TextFormatter


def test_health_reports_only_changes() -> None:
    answers = iter([True, True, False, False, True])
    seen: list[bool] = []
    monitor = HealthMonitor(lambda: next(answers), seen.append, interval_s=60)
    for _ in range(5):
        monitor.check()
    assert seen == [True, False, True]


def test_a_failing_ping_means_unhealthy() -> None:
    def boom() -> bool:
        raise ConnectionError("engine gone")

    seen: list[bool] = []
    assert HealthMonitor(boom, seen.append).check() is False
    assert seen == [False]


def _record(fields: dict[str, object] | None) -> logging.LogRecord:
    record = logging.LogRecord(
        "toolreg.executions", logging.INFO, __file__, 1, "execution", None, None
    )
    if fields is not None:
        record.fields = fields
    return record


def test_json_lines_carry_the_event_fields() -> None:
    line = JsonFormatter().format(_record({"execution_id": "e1", "tool": "echo", "status": "OK"}))
    parsed = json.loads(line)
    assert "\n" not in line
    assert parsed["event"] == "execution" and parsed["level"] == "info"
    assert (parsed["execution_id"], parsed["tool"], parsed["status"]) == ("e1", "echo", "OK")


def test_text_lines_are_readable() -> None:
    line = TextFormatter().format(_record({"tool": "echo", "status": "OK", "jtis": []}))
    assert line.endswith("execution tool=echo status=OK")
