"""OpenTelemetry set-up for the server and the command line.

Off unless the standard variables ask for it: ``OTEL_TRACES_EXPORTER``
(``otlp``, ``console``, or ``none``), or an OTLP endpoint
(``OTEL_EXPORTER_OTLP_TRACES_ENDPOINT`` / ``OTEL_EXPORTER_OTLP_ENDPOINT``);
``OTEL_SDK_DISABLED=true`` wins over both. Everything else is the SDK's own
reading of the environment: ``OTEL_SERVICE_NAME``, ``OTEL_RESOURCE_ATTRIBUTES``,
``OTEL_TRACES_SAMPLER``, ``OTEL_BSP_*``, and the exporter's endpoint, headers,
certificate and ``OTEL_EXPORTER_OTLP_INSECURE``. Spans leave over OTLP/gRPC.

What a caller sends is bounded before it can reach an exporter: attribute
values are cut at ``DEFAULT_ATTRIBUTE_CHARS`` (a user agent is the caller's
text), unless the operator sets ``OTEL_ATTRIBUTE_VALUE_LENGTH_LIMIT``.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING

import grpc

from registry_server.domain.errors import ConfigError

if TYPE_CHECKING:
    from opentelemetry.sdk.trace import TracerProvider

EXPORTERS = ("otlp", "console")
DEFAULT_ATTRIBUTE_CHARS = 256  # characters of any span attribute value
_SHOWN_CHARS = 60  # characters of a bad variable's value quoted in an error


@dataclass(frozen=True)
class Tracing:
    """This process's tracer provider; ``shutdown`` exports what is left."""

    provider: TracerProvider

    def shutdown(self) -> None:
        self.provider.shutdown()


_active: Tracing | None = None  # what this process configured; None: off


def requested_exporters(env: Mapping[str, str]) -> tuple[str, ...]:
    """The exporters the environment asks for; () means tracing stays off.
    Raises ConfigError naming the variable when it asks for one we lack."""
    if env.get("OTEL_SDK_DISABLED", "").strip().lower() == "true":
        return ()
    named = [e.strip().lower() for e in env.get("OTEL_TRACES_EXPORTER", "").split(",")]
    named = [e for e in named if e]
    if not named:
        endpoint = env.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT") or env.get(
            "OTEL_EXPORTER_OTLP_ENDPOINT"
        )
        named = ["otlp"] if endpoint else []
    if "none" in named:
        return ()
    for exporter in named:
        if exporter not in EXPORTERS:
            raise ConfigError(
                f"OTEL_TRACES_EXPORTER: {exporter[:_SHOWN_CHARS]!r} is not supported"
                f" (use {', '.join(EXPORTERS)} or none)"
            )
    if "otlp" in named:
        for variable in ("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL", "OTEL_EXPORTER_OTLP_PROTOCOL"):
            protocol = env.get(variable, "").strip().lower()
            if protocol and protocol != "grpc":
                raise ConfigError(
                    f"{variable}: {protocol[:_SHOWN_CHARS]!r} is not supported"
                    " (toolreg exports OTLP over gRPC: use grpc)"
                )
            if protocol:
                break
    return tuple(dict.fromkeys(named))


def configure(default_service: str, env: Mapping[str, str] | None = None) -> Tracing | None:
    """Install a tracer provider for this process when the environment asks for
    one (once per process); None when tracing is off."""
    global _active
    env = os.environ if env is None else env
    exporters = requested_exporters(env)
    if not exporters:
        return None
    if _active is not None:
        return _active
    # The SDK is imported only when used: a command that does not trace never loads it.
    from opentelemetry import trace
    from opentelemetry.sdk.resources import SERVICE_NAME, Resource
    from opentelemetry.sdk.trace import SpanLimits, TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor, ConsoleSpanExporter

    resource = Resource.create()
    if str(resource.attributes.get(SERVICE_NAME, "")).startswith("unknown_service"):
        resource = resource.merge(Resource({SERVICE_NAME: default_service}))
    limits = SpanLimits(
        max_span_attribute_length=None
        if "OTEL_ATTRIBUTE_VALUE_LENGTH_LIMIT" in env
        or "OTEL_SPAN_ATTRIBUTE_VALUE_LENGTH_LIMIT" in env
        else DEFAULT_ATTRIBUTE_CHARS
    )
    provider = TracerProvider(resource=resource, span_limits=limits)
    for exporter in exporters:
        if exporter == "otlp":
            from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter

            provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter()))
        else:
            provider.add_span_processor(BatchSpanProcessor(ConsoleSpanExporter(out=sys.stderr)))
    trace.set_tracer_provider(provider)
    _active = Tracing(provider)
    return _active


def server_interceptor() -> grpc.ServerInterceptor | None:
    """One span per RPC, continuing the caller's W3C trace context; None when off."""
    tracing = _active
    if tracing is None:
        return None
    from opentelemetry.instrumentation.grpc import server_interceptor as otel_interceptor

    interceptor: grpc.ServerInterceptor = otel_interceptor(  # type: ignore[no-untyped-call]
        tracer_provider=tracing.provider
    )
    return interceptor
