"""The sandbox backend interface: the only surface the server codes against.

A backend runs each call in a fresh sandbox and removes it after: ``run`` for
a call made now, ``prepare`` + ``PreparedSandbox.finish`` for a sandbox made
ahead of its call (warm pools), ``remove``/``reap`` for cleaning up, and
``health`` for the server's health check. Docker (docker_backend.py) is the
one implementation; the server picks it in registry_server/api/app.py.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Mapping
from typing import Protocol, runtime_checkable

from .spec import EgressSpec, SandboxResult, SandboxSpec

__all__ = ["OutputSink", "PreparedSandbox", "SandboxBackend"]

# ("stdout" | "stderr", chunk), called on the runner's thread as output arrives. Chunks are
# already within the caps: the concatenation of a stream's chunks equals that stream in
# the final SandboxResult. An exception raised by the sink stops the execution (the
# container is still removed) and propagates out of run().
OutputSink = Callable[[str, bytes], None]


class PreparedSandbox(Protocol):
    """A started container holding its tool until ``finish`` hands it a call (the
    tool's command does not run before): used once, or thrown away unused."""

    @property
    def container_id(self) -> str: ...

    @property
    def created(self) -> float:
        """time.monotonic() when it was made."""
        ...

    def alive(self) -> bool:
        """True while it still waits for its call."""
        ...

    def bind_egress(self, egress: EgressSpec | None, execution_id: str) -> None:
        """Made ahead of its call (with a network): the call's egress grants and
        id, told to the egress proxy by ``finish`` right before the tool starts."""
        ...

    def finish(
        self,
        input_bytes: bytes,
        deadline: float | None = None,
        on_output: OutputSink | None = None,
        cancel: threading.Event | None = None,
    ) -> SandboxResult:
        """Release the tool with this input and see it through; removed after."""
        ...

    def discard(self) -> None:
        """Remove it unused; its tool never runs."""
        ...


@runtime_checkable
class SandboxBackend(Protocol):
    def run(
        self,
        spec: SandboxSpec,
        *,
        execution_id: str,
        on_output: OutputSink | None = None,
        cancel: threading.Event | None = None,
    ) -> SandboxResult:
        """Run `spec` once in a fresh container and remove it, whatever happens.

        Raises SandboxError (EngineUnavailable) only when the engine fails; anything the
        tool does is reported in the result. Safe to call from many threads at once.
        """
        ...

    def prepare(
        self, spec: SandboxSpec, *, execution_id: str, lifetime_s: float = 0
    ) -> PreparedSandbox:
        """Create and start a container for one call, its tool held until
        ``finish``; ``lifetime_s``: how long it may wait for that call."""
        ...

    def health(self) -> bool:
        """True when the engine answers; then also removes again what an outage
        kept it from removing (``retry_removals``). Cheap: called every few seconds."""
        ...

    def remove(self, container_id: str) -> None:
        """Remove a sandbox, whatever state it is in (in the background when the
        backend removes in the background); a failure is retried by ``health``."""
        ...

    def flush(self) -> None:
        """Wait until every sandbox handed to background removal is gone."""
        ...

    def close(self) -> None:
        """Finish queued removals and let go of the engine."""
        ...

    def runtimes(self) -> Mapping[str, tuple[str, ...]]:
        """OCI runtimes the engine offers, each with the arguments the engine
        starts it with (e.g. {'runc': (), 'runsc': ('--network=none',)})."""
        ...

    def image_volumes(self, image: str) -> tuple[str, ...] | None:
        """The VOLUME paths the local image declares (sorted; () for none), or None when
        the image is not present locally. An image with volumes is refused at create:
        each would be an anonymous, writable and unbounded volume. Raises SandboxError
        (EngineUnavailable) when the engine fails."""
        ...

    def retry_removals(self) -> int:
        """Remove again the containers whose removal failed (say, while the engine was
        down); returns how many are still there."""
        ...

    def reap(self) -> int:
        """Remove containers left by dead server instances; returns how many were removed."""
        ...
