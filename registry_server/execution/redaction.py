"""Replace exact occurrences of a call's secret values in what it returns:
its output (whole, and as it streams) and the hosts it asked the proxy for.

A guard against accidents, not against the tool: a tool that is handed a
value (deliver: file) can always transform it before printing it
(docs/writing-tools.md says so).
"""

from __future__ import annotations

from collections.abc import Mapping

from sandbox_runner import OutputSink


class Redactor:
    def __init__(self, secrets: Mapping[str, bytes]) -> None:
        # Longest first, so a secret containing another is replaced whole.
        self._pairs = sorted(
            ((value, f"[secret {name}]".encode()) for name, value in secrets.items() if value),
            key=lambda pair: -len(pair[0]),
        )
        self._hold = max((len(v) for v, _ in self._pairs), default=1) - 1

    def __bool__(self) -> bool:
        return bool(self._pairs)

    def redact(self, data: bytes) -> bytes:
        for value, marker in self._pairs:
            if value in data:
                data = data.replace(value, marker)
        return data

    def text(self, data: str) -> str:
        return self.redact(data.encode("utf-8", "surrogateescape")).decode(
            "utf-8", "surrogateescape"
        )

    def stream(self, sink: OutputSink) -> StreamRedaction:
        return StreamRedaction(self, sink)


class StreamRedaction:
    """A sink that passes chunks on redacted, holding back the last few bytes
    of each stream until it knows they do not start a secret."""

    def __init__(self, redactor: Redactor, sink: OutputSink) -> None:
        self._redactor = redactor
        self._sink = sink
        self._pending: dict[str, bytes] = {}

    def __call__(self, stream: str, chunk: bytes) -> None:
        data = self._redactor.redact(self._pending.get(stream, b"") + chunk)
        hold = self._redactor._hold
        keep = data[-hold:] if hold else b""
        out = data[: len(data) - len(keep)]
        self._pending[stream] = keep
        if out:
            self._sink(stream, out)

    def flush(self) -> None:
        for stream, rest in self._pending.items():
            if rest:
                self._sink(stream, self._redactor.redact(rest))
        self._pending.clear()
