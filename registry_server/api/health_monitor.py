"""Watches the container engine and says so in the health service: a load
balancer or supervisor stops sending executions while it is down, and sends
them again when it answers, without a restart. A server that leaves says
NOT_SERVING before it stops accepting calls (ServerHealth.leave)."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from typing import Any

from grpc_health.v1 import health, health_pb2

from registry_server._proto.toolregistry.v1 import registry_pb2 as pb

log = logging.getLogger(__name__)

HEALTH_INTERVAL_S = 5.0  # seconds between engine checks


class HealthMonitor:
    def __init__(
        self, ping: Callable[[], bool], on_change: Callable[[bool], None],
        interval_s: float = HEALTH_INTERVAL_S,
    ) -> None:  # fmt: skip
        self._ping = ping
        self._on_change = on_change
        self._interval_s = interval_s
        self._stop = threading.Event()
        self._healthy: bool | None = None
        self._thread = threading.Thread(target=self._run, name="health", daemon=True)

    def start(self) -> None:
        self.check()
        self._thread.start()

    def check(self) -> bool:
        try:
            healthy = bool(self._ping())
        except Exception:  # a broken ping is an unhealthy engine, not a dead monitor
            healthy = False
        if healthy != self._healthy:
            self._healthy = healthy
            if healthy:
                log.info("container engine answers: serving executions")
            else:
                log.error("container engine does not answer: health NOT_SERVING")
            self._on_change(healthy)
        return healthy

    def _run(self) -> None:
        while not self._stop.wait(self._interval_s):
            self.check()

    def stop(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout=10)


# Health "services" of the registry: readiness ("" and the API's own name) is SERVING while
# the engine and the store answer and the server is not leaving; liveness is SERVING
# while the process serves at all (for liveness probes: a database outage must not restart
# every server).
SERVICE_NAME = pb.DESCRIPTOR.services_by_name["ToolRegistry"].full_name
READINESS_SERVICES = ("", SERVICE_NAME)
LIVENESS_SERVICE = "toolreg.liveness"


class ServerHealth(health.HealthServicer):  # type: ignore[misc]  # grpc_health is untyped
    """grpc.health.v1 for the main port and the health port, which also remembers when a
    prober last asked for readiness: a server that leaves says NOT_SERVING for
    TOOLREG_DRAIN_S only when something is there to hear it (docs/how-to/scaling.md,
    "Leaving without a failed call")."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        super().__init__()
        self._clock = clock
        self._state = threading.Lock()
        self._healthy = True
        self._leaving = False
        self._asked_at: float | None = None  # clock() of the last readiness Check or Watch
        self._watching = 0  # readiness Watch streams open now
        self._apply()
        self.set(LIVENESS_SERVICE, health_pb2.HealthCheckResponse.SERVING)

    def Check(self, request: Any, context: Any) -> Any:
        if request.service in READINESS_SERVICES:
            with self._state:
                self._asked_at = self._clock()
        return super().Check(request, context)

    def Watch(self, request: Any, context: Any, send_response_callback: Any = None) -> Any:
        if request.service in READINESS_SERVICES:
            with self._state:
                self._asked_at = self._clock()
                self._watching += 1
            context.add_callback(self._watch_ended)
        return super().Watch(request, context, send_response_callback)

    def _watch_ended(self) -> None:
        with self._state:
            self._watching -= 1
            self._asked_at = self._clock()

    def set_healthy(self, healthy: bool) -> None:
        """What the engine and store checks say; readiness follows unless leaving."""
        with self._state:
            self._healthy = healthy
            self._apply()

    def leave(self) -> None:
        """Readiness NOT_SERVING from now on, whatever the checks say; liveness unchanged."""
        with self._state:
            self._leaving = True
            self._apply()

    def asked_within(self, seconds: float) -> bool:
        """Whether a prober asked for readiness in the last ``seconds``, or watches it now.
        A prober that needs N answers, P seconds apart, to take a server out of rotation
        asks every P <= N * P seconds: one that a window of ``seconds`` can serve has."""
        with self._state:
            if self._watching > 0:
                return True
            return self._asked_at is not None and self._clock() - self._asked_at <= seconds

    def _apply(self) -> None:
        status = (
            health_pb2.HealthCheckResponse.SERVING
            if self._healthy and not self._leaving
            else health_pb2.HealthCheckResponse.NOT_SERVING
        )
        for service in READINESS_SERVICES:
            self.set(service, status)
