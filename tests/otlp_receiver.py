"""The tests' own trace collector: an OTLP/gRPC TraceService on loopback, built
from opentelemetry-proto, that keeps every span it is sent."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from concurrent import futures
from dataclasses import dataclass, field
from typing import Any

import grpc
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2 as service_pb
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2_grpc as service_grpc
from opentelemetry.proto.common.v1.common_pb2 import AnyValue
from opentelemetry.proto.trace.v1 import trace_pb2

SERVER = trace_pb2.Span.SPAN_KIND_SERVER
CLIENT = trace_pb2.Span.SPAN_KIND_CLIENT
INTERNAL = trace_pb2.Span.SPAN_KIND_INTERNAL
STATUS_ERROR = trace_pb2.Status.STATUS_CODE_ERROR


def _value(value: AnyValue) -> Any:
    kind = value.WhichOneof("value")
    if kind == "array_value":
        return [_value(v) for v in value.array_value.values]
    return getattr(value, kind) if kind else None


@dataclass(frozen=True)
class ReceivedSpan:
    service: str
    name: str
    trace_id: str  # hex
    span_id: str
    parent_id: str  # "" for a root
    kind: int
    attributes: dict[str, Any]
    status: int
    start_ns: int
    end_ns: int
    raw: bytes = field(repr=False)  # the span as sent, for "nothing leaked" checks


class _Collector(service_grpc.TraceServiceServicer):
    def __init__(self) -> None:
        self.spans: list[ReceivedSpan] = []
        self.changed = threading.Condition()

    def Export(
        self, request: service_pb.ExportTraceServiceRequest, context: grpc.ServicerContext
    ) -> service_pb.ExportTraceServiceResponse:
        received = list(_unpack(request))
        with self.changed:
            self.spans.extend(received)
            self.changed.notify_all()
        return service_pb.ExportTraceServiceResponse()


def _unpack(request: service_pb.ExportTraceServiceRequest) -> Iterator[ReceivedSpan]:
    for resource_spans in request.resource_spans:
        resource = {a.key: _value(a.value) for a in resource_spans.resource.attributes}
        for scope_spans in resource_spans.scope_spans:
            for span in scope_spans.spans:
                yield ReceivedSpan(
                    service=str(resource.get("service.name", "")),
                    name=span.name,
                    trace_id=span.trace_id.hex(),
                    span_id=span.span_id.hex(),
                    parent_id=span.parent_span_id.hex(),
                    kind=span.kind,
                    attributes={a.key: _value(a.value) for a in span.attributes},
                    status=span.status.code,
                    start_ns=span.start_time_unix_nano,
                    end_ns=span.end_time_unix_nano,
                    raw=span.SerializeToString() + resource_spans.resource.SerializeToString(),
                )


class OtlpReceiver:
    """``endpoint`` is what OTEL_EXPORTER_OTLP_ENDPOINT takes (plain gRPC)."""

    def __init__(self) -> None:
        self._collector = _Collector()
        self._server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
        service_grpc.add_TraceServiceServicer_to_server(  # type: ignore[no-untyped-call]
            self._collector, self._server
        )
        self.port = self._server.add_insecure_port("127.0.0.1:0")
        self._server.start()

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def spans(self) -> list[ReceivedSpan]:
        with self._collector.changed:
            return list(self._collector.spans)

    def wait_for(
        self, done: Callable[[list[ReceivedSpan]], bool], timeout_s: float = 30
    ) -> list[ReceivedSpan]:
        """Every span received once ``done`` holds for them; AssertionError after
        ``timeout_s`` with what did arrive."""
        deadline = time.monotonic() + timeout_s
        with self._collector.changed:
            while not done(list(self._collector.spans)):
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    names = sorted({(s.service, s.name) for s in self._collector.spans})
                    raise AssertionError(f"spans never arrived; received: {names}")
                self._collector.changed.wait(remaining)
            return list(self._collector.spans)

    def stop(self) -> None:
        self._server.stop(grace=None)


def main() -> None:
    """Serve in a process of its own (the bench: decoding spans must not share
    the timing process's interpreter). Prints the endpoint, then, on stdin's
    end, how many spans arrived; with ``--dump``, first each span as a line of
    JSON (name, ids, times, attributes) for the bench's phase tables."""
    import json
    import sys

    receiver = OtlpReceiver()
    print(receiver.endpoint, flush=True)
    sys.stdin.read()
    spans = receiver.spans()
    if "--dump" in sys.argv[1:]:
        for s in spans:
            fields = {k: v for k, v in s.__dict__.items() if k != "raw"}
            print(json.dumps(fields, default=str), flush=False)
    print(len(spans), flush=True)
    receiver.stop()


if __name__ == "__main__":
    main()
