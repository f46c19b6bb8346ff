"""A leaving server's health (api/health_monitor.py ServerHealth) and its steps
(api/server.py leave()): NOT_SERVING first while still serving, for TOOLREG_DRAIN_S
when a prober is there to hear it, then stop accepting with the grace."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any

import grpc
from grpc_health.v1 import health_pb2

from registry_server.api.config import ServerConfig
from registry_server.api.health_monitor import (
    LIVENESS_SERVICE,
    READINESS_SERVICES,
    SERVICE_NAME,
    ServerHealth,
)
from registry_server.api.server import leave

SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


class Context:
    def __init__(self) -> None:
        self.callbacks: list[Callable[[], None]] = []
        self.code: grpc.StatusCode | None = None

    def set_code(self, code: grpc.StatusCode) -> None:
        self.code = code

    def add_callback(self, callback: Callable[[], None]) -> bool:
        self.callbacks.append(callback)
        return True


def status(health: ServerHealth, service: str) -> int:
    answer = health.Check(health_pb2.HealthCheckRequest(service=service), Context())
    return int(answer.status)


def test_readiness_follows_the_checks_and_liveness_stays_serving() -> None:
    health = ServerHealth()
    assert [status(health, s) for s in (*READINESS_SERVICES, LIVENESS_SERVICE)] == [SERVING] * 3
    health.set_healthy(False)
    assert status(health, "") == status(health, SERVICE_NAME) == NOT_SERVING
    assert status(health, LIVENESS_SERVICE) == SERVING
    health.set_healthy(True)
    assert status(health, "") == SERVING


def test_a_leaving_server_stays_not_serving_whatever_the_checks_say() -> None:
    health = ServerHealth()
    health.leave()
    health.set_healthy(True)  # the engine monitor's next answer must not undo it
    assert status(health, "") == status(health, SERVICE_NAME) == NOT_SERVING
    assert status(health, LIVENESS_SERVICE) == SERVING
    health.enter_graceful_shutdown()  # app.close(): everything NOT_SERVING
    assert status(health, LIVENESS_SERVICE) == NOT_SERVING


def test_it_knows_whether_a_prober_asked_for_readiness_lately() -> None:
    clock = Clock()
    health = ServerHealth(clock)
    assert not health.asked_within(10)  # nobody ever asked
    status(health, LIVENESS_SERVICE)
    assert not health.asked_within(10)  # a liveness probe does not take it out of rotation
    status(health, "")
    clock.now += 10
    assert health.asked_within(10)
    clock.now += 0.5
    assert not health.asked_within(10)
    status(health, SERVICE_NAME)
    assert health.asked_within(0)


def test_an_open_readiness_watch_counts_as_asking_until_it_ends() -> None:
    clock = Clock()
    health = ServerHealth(clock)
    context, sent = Context(), list[Any]()
    health.Watch(health_pb2.HealthCheckRequest(service=""), context, sent.append)
    clock.now += 3600
    assert health.asked_within(1)
    health.leave()
    assert [m.status for m in sent] == [SERVING, NOT_SERVING]  # told at once
    for callback in context.callbacks:
        callback()
    assert health.asked_within(1)  # it ended just now
    clock.now += 2
    assert not health.asked_within(1)


class Server:
    """What leave() needs of a grpc.Server: stop(grace).wait()."""

    def __init__(self) -> None:
        self.stopped: list[tuple[float, float | None]] = []

    def stop(self, grace: float | None) -> threading.Event:
        self.stopped.append((time.monotonic(), grace))
        done = threading.Event()
        done.set()
        return done


def run_leave(health: ServerHealth, drain_s: float, hurry: threading.Event) -> float:
    server = Server()
    config = ServerConfig(drain_s=drain_s, shutdown_grace_s=7)
    started = time.monotonic()
    leave(server, health, config, hurry)  # type: ignore[arg-type]
    [(stopped_at, grace)] = server.stopped
    assert grace == 7
    assert status(health, "") == NOT_SERVING
    return stopped_at - started


def test_it_says_not_serving_for_the_window_before_it_stops_accepting() -> None:
    health = ServerHealth()
    status(health, "")  # a load balancer checks it
    assert run_leave(health, 0.3, threading.Event()) >= 0.3


def test_no_window_when_nothing_asks_for_readiness_or_when_it_is_off() -> None:
    assert run_leave(ServerHealth(), 30, threading.Event()) < 1
    health = ServerHealth()
    status(health, "")
    assert run_leave(health, 0, threading.Event()) < 1


def test_a_second_signal_cuts_the_window_short() -> None:
    health = ServerHealth()
    status(health, "")
    hurry = threading.Event()
    threading.Timer(0.2, hurry.set).start()
    assert run_leave(health, 30, hurry) < 5
