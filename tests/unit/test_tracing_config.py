"""Tracing is off unless the standard OTEL_* variables ask for it, and a JSON
log line names the call and trace it was written for."""

from __future__ import annotations

import json
import logging

import pytest
from opentelemetry.sdk.trace import TracerProvider

from registry_server.api.logs import JsonFormatter
from registry_server.api.tracing import requested_exporters
from registry_server.domain.errors import ConfigError
from registry_server.execution import tracing


@pytest.mark.parametrize(
    ("env", "exporters"),
    [
        ({}, ()),
        ({"OTEL_SERVICE_NAME": "x"}, ()),
        ({"OTEL_EXPORTER_OTLP_ENDPOINT": "http://collector:4317"}, ("otlp",)),
        ({"OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": "http://collector:4317"}, ("otlp",)),
        ({"OTEL_TRACES_EXPORTER": "otlp"}, ("otlp",)),
        ({"OTEL_TRACES_EXPORTER": " Console , otlp,console"}, ("console", "otlp")),
        ({"OTEL_TRACES_EXPORTER": "none", "OTEL_EXPORTER_OTLP_ENDPOINT": "http://c:4317"}, ()),
        ({"OTEL_SDK_DISABLED": "true", "OTEL_TRACES_EXPORTER": "otlp"}, ()),
        ({"OTEL_SDK_DISABLED": "false", "OTEL_TRACES_EXPORTER": "otlp"}, ("otlp",)),
        ({"OTEL_TRACES_EXPORTER": "otlp", "OTEL_EXPORTER_OTLP_PROTOCOL": "grpc"}, ("otlp",)),
    ],
)
def test_which_exporters_the_environment_asks_for(
    env: dict[str, str], exporters: tuple[str, ...]
) -> None:
    assert requested_exporters(env) == exporters


@pytest.mark.parametrize(
    ("env", "named"),
    [
        ({"OTEL_TRACES_EXPORTER": "zipkin"}, "OTEL_TRACES_EXPORTER"),
        (
            {
                "OTEL_EXPORTER_OTLP_ENDPOINT": "http://c:4318",
                "OTEL_EXPORTER_OTLP_PROTOCOL": "http/protobuf",
            },
            "OTEL_EXPORTER_OTLP_PROTOCOL",
        ),
        (
            {
                "OTEL_TRACES_EXPORTER": "otlp",
                "OTEL_EXPORTER_OTLP_TRACES_PROTOCOL": "http/json",
                "OTEL_EXPORTER_OTLP_PROTOCOL": "grpc",
            },
            "OTEL_EXPORTER_OTLP_TRACES_PROTOCOL",
        ),
    ],
)
def test_an_exporter_toolreg_lacks_is_an_error_naming_the_variable(
    env: dict[str, str], named: str
) -> None:
    with pytest.raises(ConfigError) as refused:
        requested_exporters(env)
    assert refused.value.message.startswith(f"{named}: ")


def test_a_long_bad_value_is_not_echoed_whole() -> None:
    with pytest.raises(ConfigError) as refused:
        requested_exporters({"OTEL_TRACES_EXPORTER": "z" * 10_000})
    assert len(refused.value.message) < 200


def _line(message: str) -> dict[str, object]:
    record = logging.LogRecord("toolreg.test", logging.INFO, __file__, 1, message, None, None)
    parsed: dict[str, object] = json.loads(JsonFormatter().format(record))
    return parsed


def test_a_log_line_outside_a_call_names_no_call() -> None:
    line = _line("idle")
    assert "execution_id" not in line and "trace_id" not in line


def test_a_log_line_inside_a_traced_call_names_the_call_and_the_trace() -> None:
    tracer = TracerProvider().get_tracer("test")  # not installed globally
    with tracer.start_as_current_span("rpc") as span, tracing.execution("ab" * 16):
        line = _line("working")
    context = span.get_span_context()
    assert line["execution_id"] == "ab" * 16
    assert line["trace_id"] == f"{context.trace_id:032x}"
    assert line["span_id"] == f"{context.span_id:016x}"
    assert tracing.current_execution_id.get() is None  # reset when the call ends
