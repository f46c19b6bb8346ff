"""Replace exact occurrences of a call's secret values in what it returns:
its output (whole, and as it streams) and the hosts it asked the proxy for.

A guard against accidents, not against the tool: a tool that is handed a
value (deliver: file) can always transform it before printing it
(docs/how-to/writing-tools.md says so).
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

    def safe_cut(self, data: bytes) -> int:
        """How much of ``data`` can be passed on now: all but the last bytes
        that may start a secret, and never through the middle of one (a
        shorter secret inside a longer one must not be replaced first)."""
        cut = max(0, len(data) - self._hold)
        moved = True
        while moved:
            moved = False
            for value, _ in self._pairs:
                start = data.find(value, max(0, cut - len(value) + 1))
                if 0 <= start < cut < start + len(value):
                    cut, moved = start, True
        return cut

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
        data = self._pending.get(stream, b"") + chunk
        cut = self._redactor.safe_cut(data)
        self._pending[stream] = data[cut:]  # raw: the next chunk may complete a secret
        if cut:
            self._sink(stream, self._redactor.redact(data[:cut]))

    def flush(self) -> None:
        for stream, rest in self._pending.items():
            if rest:
                self._sink(stream, self._redactor.redact(rest))
        self._pending.clear()
