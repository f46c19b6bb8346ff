"""Watches the container engine and says so in the health service: a load
balancer or supervisor stops sending executions while it is down, and sends
them again when it answers, without a restart."""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable

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
