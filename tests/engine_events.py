"""What the Docker engine did during a test, from a live event stream.

Asking the engine afterwards (`docker events --since --until`) replays only its
last 256 events (moby's in-memory history): with other tests' containers coming
and going beside a test (make test runs test files in parallel), a window's own
events are pushed out of that history, and a check reading them fails, or worse,
passes on nothing. A stream opened before the test acts misses none of them. It
ends at a marker: a network this recorder creates and removes, whose `destroy`
the engine reports after every event before it.
"""

from __future__ import annotations

import contextlib
import threading
import time
import uuid
from collections.abc import Iterator
from typing import Any

import docker
import docker.errors

MARK_TIMEOUT_S = 30.0  # seconds for the engine to report the end marker
KINDS = ("container", "network")


class Recording:
    def __init__(self) -> None:
        self.events: list[dict[str, Any]] = []  # complete once the recording has ended


@contextlib.contextmanager
def recorded(engine: docker.DockerClient) -> Iterator[Recording]:
    """Container and network events from entering the block to leaving it."""
    recording, seen = Recording(), threading.Event()
    mark = f"toolreg-test-mark-{uuid.uuid4().hex[:12]}"
    stream = engine.events(decode=True, filters={"type": list(KINDS)})
    got: list[dict[str, Any]] = []

    def read() -> None:
        with contextlib.suppress(Exception):  # the stream closed under it
            for event in stream:
                attributes = event.get("Actor", {}).get("Attributes", {})
                if event.get("Type") == "network" and attributes.get("name") == mark:
                    if event.get("Action") == "destroy":
                        seen.set()
                        return
                    continue
                got.append(event)

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    try:
        yield recording
    finally:
        try:
            network = engine.networks.create(mark, labels={"toolreg.test": "1"})
            network.remove()
            deadline = time.monotonic() + MARK_TIMEOUT_S
            while not seen.wait(0.1):
                assert time.monotonic() < deadline, "the engine never reported the end marker"
        finally:
            stream.close()
            reader.join(5)
    recording.events = got


def of_label(events: list[dict[str, Any]], label: str, value: str) -> list[dict[str, Any]]:
    """The events of containers labelled ``label=value``."""
    return [e for e in events if e.get("Actor", {}).get("Attributes", {}).get(label) == value]
