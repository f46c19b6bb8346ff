"""The runner protocol: the only surface the server codes against."""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Protocol, runtime_checkable

from .spec import SandboxResult, SandboxSpec

__all__ = ["OutputSink", "Runner"]

# ("stdout" | "stderr", chunk), called on the runner's thread as output arrives. Chunks are
# already within the caps: the concatenation of a stream's chunks equals that stream in
# the final SandboxResult. An exception raised by the sink stops the execution (the
# container is still removed) and propagates out of run().
OutputSink = Callable[[str, bytes], None]


@runtime_checkable
class Runner(Protocol):
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

    def ping(self) -> bool:
        """True when the engine answers."""
        ...

    def runtimes(self) -> frozenset[str]:
        """OCI runtimes the engine offers (e.g. {'runc', 'runsc'})."""
        ...

    def retry_removals(self) -> int:
        """Remove again the containers whose removal failed (say, while the engine was
        down); returns how many are still there."""
        ...

    def reap(self) -> int:
        """Remove containers left by dead server instances; returns how many were removed."""
        ...
