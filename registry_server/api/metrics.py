"""Prometheus metrics, on their own HTTP port, in a registry per server (so
several servers in one process, as in the tests, never mix their numbers)."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import grpc
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, start_http_server
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from registry_server.api.handlers import rewrap
from registry_server.domain.outcome import Outcome
from registry_server.execution.admission import Admission
from registry_server.execution.heavy_gate import CLIENT_QUEUE, SERVER_QUEUE, WAIT, HeavyGate
from registry_server.execution.quotas import RateLimits

# Seconds: from a cached listing (~1 ms) to a slow tool under gVisor (~minutes).
UNREGISTERED = "(unregistered)"  # the tool label of calls to names no tool has
LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60)


class Metrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.rpcs = Counter("toolreg_grpc_calls", "gRPC calls by method and status code",
                            ["method", "code"], registry=r)  # fmt: skip
        self.rpc_seconds = Histogram("toolreg_grpc_call_seconds", "gRPC call latency by method",
                                     ["method"], buckets=LATENCY_BUCKETS, registry=r)  # fmt: skip
        self.executions = Counter("toolreg_executions", "Tool executions by tool, level and status",
                                  ["tool", "level", "status"], registry=r)  # fmt: skip
        self.sandbox_seconds = Histogram(
            "toolreg_sandbox_seconds", "Time in the sandbox by level and warm/cold",
            ["level", "warm"], buckets=LATENCY_BUCKETS, registry=r,
        )  # fmt: skip
        self.approvals = Counter(
            "toolreg_approval_decisions", "Decisions on dangerous calls (approved, denied, ...)",
            ["decision"], registry=r,
        )  # fmt: skip
        self.live = Gauge("toolreg_live_sandboxes", "Sandboxes running calls now", registry=r)
        self.queued = Gauge("toolreg_queued_calls", "Calls waiting for a sandbox slot", registry=r)
        self.warm = Gauge(
            "toolreg_warm_containers", "Started containers waiting for a call", registry=r
        )
        self.pool_misses = Gauge("toolreg_warm_pool_misses", "Calls that found their pool empty",
                                 registry=r)  # fmt: skip
        self.pool_refill_failures = Gauge(
            "toolreg_warm_pool_refill_failures", "Times a pool could not make a container",
            registry=r,
        )  # fmt: skip
        self.engine_up = Gauge(
            "toolreg_engine_up", "1 when the container engine answers", registry=r
        )
        self.store_up = Gauge("toolreg_store_up", "1 when the store answers", registry=r)
        # Labelled by the allow-list entry a connection fell under, never by the
        # host a tool asked for: that is the tool's to choose, without bound.
        self.egress_connections = Counter(
            "toolreg_egress_connections", "Egress connections by tool, allow-list entry, outcome",
            ["tool", "host", "outcome"], registry=r,
        )  # fmt: skip
        self.egress_bytes = Counter(
            "toolreg_egress_bytes", "Bytes through the egress proxy by tool, entry and direction",
            ["tool", "host", "direction"], registry=r,
        )  # fmt: skip
        # Labelled by the policy's endpoint ids (a bounded set), never by URL.
        self.webhook_deliveries = Counter(
            "toolreg_webhook_deliveries",
            "Webhook delivery attempts by endpoint and outcome (delivered, retried, failed)",
            ["endpoint", "outcome"], registry=r,
        )  # fmt: skip
        self._heavy: HeavyGate | None = None
        self.webhook_backlog = Gauge(
            "toolreg_webhook_backlog", "Webhook deliveries not yet delivered nor given up",
            registry=r,
        )  # fmt: skip

    def watch(
        self, admission: Admission, pool_stats: Callable[[], Any] | None,
        rates: RateLimits | None = None,
    ) -> None:  # fmt: skip
        self.live.set_function(lambda: admission.running)
        self.queued.set_function(lambda: admission.waiting)
        self.registry.register(_ClientShares(admission, rates, lambda: self._heavy))
        if pool_stats is not None:
            self.warm.set_function(lambda: sum(pool_stats().warm.values()))
            self.pool_misses.set_function(lambda: pool_stats().misses)
            self.pool_refill_failures.set_function(lambda: pool_stats().refill_failures)

    def watch_heavy(self, gate: HeavyGate) -> None:
        """Calls with large arguments: at their turn, waiting for one, how long
        they waited, and refusals by reason (a fixed set). Per client, the
        refusals join toolreg_client_refused_calls (limit heavy_*)."""
        r = self.registry
        Gauge("toolreg_heavy_calls_working", "Calls with large arguments being checked",
              registry=r).set_function(lambda: gate.working)  # fmt: skip
        Gauge("toolreg_heavy_calls_waiting", "Calls with large arguments waiting for a turn",
              registry=r).set_function(lambda: gate.waiting)  # fmt: skip
        waits = Histogram(
            "toolreg_heavy_wait_seconds", "Time calls with large arguments waited for their turn",
            buckets=LATENCY_BUCKETS, registry=r,
        )  # fmt: skip
        gate.on_wait = waits.observe
        self.registry.register(_HeavyRefusals(gate))
        self._heavy = gate

    def observe_execution(self, record: Mapping[str, Any], outcome: Outcome) -> None:
        """An Executor observer: one finished execution attempt."""
        level = str(record.get("level") or "unknown")
        # Only registered names become labels: a label set is never freed, and
        # an unknown name is whatever a client typed.
        tool = str(record.get("tool")) if record.get("tool_digest") else UNREGISTERED
        self.executions.labels(tool, level, outcome.status.value).inc()
        if record.get("runtime"):
            warm = "warm" if record.get("warm") else "cold"
            self.sandbox_seconds.labels(level, warm).observe(outcome.duration_ms / 1000)
        decision = str(record.get("decision", ""))
        if decision.startswith("approv"):
            self.approvals.labels(decision).inc()
        for conn in record.get("egress") or ():
            host = str(conn.get("entry") or "(not allowed)")
            outcome_label = "allowed" if conn.get("allowed") else "refused"
            self.egress_connections.labels(tool, host, outcome_label).inc()
            self.egress_bytes.labels(tool, host, "up").inc(int(conn.get("bytes_up") or 0))
            self.egress_bytes.labels(tool, host, "down").inc(int(conn.get("bytes_down") or 0))

    def observe_webhook(self, endpoint: str, outcome: str) -> None:
        """A webhook Dispatcher observer: one finished delivery attempt."""
        self.webhook_deliveries.labels(endpoint, outcome).inc()

    def serve(self, host: str, port: int) -> tuple[Any, int]:
        """Start the HTTP endpoint; returns (server, bound port)."""
        server, _thread = start_http_server(port, addr=host, registry=self.registry)
        return server, int(server.server_address[1])


class _ClientShares(Collector):
    """Each client's running and queued calls and its refusals by limit, read
    when scraped. Client ids come from the policy (an unknown caller never
    gets this far), so the label sets stay bounded."""

    def __init__(
        self, admission: Admission, rates: RateLimits | None,
        heavy: Callable[[], HeavyGate | None] = lambda: None,
    ) -> None:  # fmt: skip
        self._admission = admission
        self._rates = rates
        self._heavy = heavy

    def collect(self) -> Iterator[Metric]:
        running = GaugeMetricFamily(
            "toolreg_client_running_sandboxes", "Sandboxes running each client's calls",
            labels=["client"],
        )  # fmt: skip
        queued = GaugeMetricFamily(
            "toolreg_client_queued_calls", "Each client's calls waiting for a slot",
            labels=["client"],
        )  # fmt: skip
        for client, (run, wait) in sorted(self._admission.by_client().items()):
            running.add_metric([client], run)
            queued.add_metric([client], wait)
        refused = CounterMetricFamily(
            "toolreg_client_refused_calls", "Calls refused by client and the limit hit",
            labels=["client", "limit"],
        )  # fmt: skip
        counts = dict(self._admission.refused_by)
        if self._rates is not None:
            counts.update({(c, "rate"): n for c, n in self._rates.refused.items()})
        heavy = self._heavy()
        if heavy is not None:
            counts.update(heavy.refused_by)
        for (client, limit), count in sorted(counts.items()):
            refused.add_metric([client, limit], count)
        yield from (running, queued, refused)


class _HeavyRefusals(Collector):
    """Calls with large arguments refused, by reason: client_queue (its own
    waiting calls), server_queue (everyone's), wait (no turn in time)."""

    def __init__(self, gate: HeavyGate) -> None:
        self._gate = gate

    def collect(self) -> Iterator[Metric]:
        refused = CounterMetricFamily(
            "toolreg_heavy_calls_refused", "Calls with large arguments refused, by reason",
            labels=["reason"],
        )  # fmt: skip
        for reason in (CLIENT_QUEUE, SERVER_QUEUE, WAIT):
            refused.add_metric([reason], self._gate.refused[reason])
        yield refused


class MetricsInterceptor(grpc.ServerInterceptor):
    """Counts every RPC by method and final status code, with its latency."""

    def __init__(self, metrics: Metrics) -> None:
        self._metrics = metrics

    def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], grpc.RpcMethodHandler[Any, Any] | None],
        details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler[Any, Any] | None:
        method = details.method.rsplit("/", 1)[-1]
        return rewrap(
            continuation(details),
            lambda b: self._unary(b, method),
            lambda b: self._stream(b, method),
        )

    def _done(
        self, method: str, context: grpc.ServicerContext, started: float, failed: bool
    ) -> None:
        code = context.code() if hasattr(context, "code") else None
        name = code.name if isinstance(code, grpc.StatusCode) else ("UNKNOWN" if failed else "OK")
        self._metrics.rpcs.labels(method, name).inc()
        self._metrics.rpc_seconds.labels(method).observe(time.perf_counter() - started)

    def _unary(self, behavior: Callable[..., Any], method: str) -> Callable[..., Any]:
        def run(request: Any, context: grpc.ServicerContext) -> Any:
            started, failed = time.perf_counter(), True
            try:
                response = behavior(request, context)
                failed = False
                return response
            finally:
                self._done(method, context, started, failed)

        return run

    def _stream(
        self, behavior: Callable[..., Iterator[Any]], method: str
    ) -> Callable[..., Iterator[Any]]:
        def run(request: Any, context: grpc.ServicerContext) -> Iterator[Any]:
            started, failed = time.perf_counter(), True
            try:
                yield from behavior(request, context)
                failed = False
            finally:
                self._done(method, context, started, failed)

        return run
