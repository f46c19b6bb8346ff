"""The server's side of the egress proxy's control channel: one JSON line
out, one JSON line back, over the Unix socket the proxy listens on. A
connection per request keeps callers on different threads independent."""

from __future__ import annotations

import json
import socket
from pathlib import Path
from typing import Any

CONTROL_TIMEOUT_S = 10.0  # seconds one request may take
MAX_REPLY_BYTES = 4 * 1024 * 1024  # bytes of one reply line (records of one call)


class ControlError(Exception):
    """The proxy did not answer, or answered ok=false."""


def request(
    path: Path, message: dict[str, Any], timeout_s: float = CONTROL_TIMEOUT_S
) -> dict[str, Any]:
    data = (json.dumps(message, separators=(",", ":")) + "\n").encode()
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
            sock.settimeout(timeout_s)
            sock.connect(str(path))
            sock.sendall(data)
            reply = bytearray()
            while not reply.endswith(b"\n"):
                chunk = sock.recv(65536)
                if not chunk:
                    break
                reply += chunk
                if len(reply) > MAX_REPLY_BYTES:
                    raise ControlError("egress proxy reply too long")
    except OSError as exc:
        raise ControlError(f"egress proxy unreachable: {exc}") from exc
    try:
        answer = json.loads(reply)
    except ValueError as exc:
        raise ControlError("egress proxy sent a malformed reply") from exc
    if not isinstance(answer, dict) or answer.get("ok") is not True:
        error = answer.get("error") if isinstance(answer, dict) else None
        raise ControlError(f"egress proxy refused: {str(error)[:200]}")
    return answer
