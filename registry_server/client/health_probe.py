"""A check of a server's cleartext health port (TOOLREG_HEALTH_PORT, api/server.py):
SERVING exits 0, anything else (NOT_SERVING, no answer) exits 1.

Kept apart from the CLI so the server image's HEALTHCHECK, run every few seconds, loads
grpc alone: `python3 -m registry_server.client.health_probe` costs about 0.1 s of CPU,
the full `toolreg` command about 1.3 s. `toolreg health` runs the same check.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Mapping, Sequence
from typing import Final

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

DEFAULT_TIMEOUT_S: Final = 4.0  # seconds for the answer (the image's check allows 5)
# A server listening on every address answers on loopback too.
_ANY: Final = ("0.0.0.0", "::", "[::]", "")


def health_address(env: Mapping[str, str] = os.environ) -> str:
    """HOST:PORT of the health port the server's environment configures."""
    port = env.get("TOOLREG_HEALTH_PORT", "").strip()
    if not port:
        raise ValueError("TOOLREG_HEALTH_PORT is not set: give the health port's address")
    host = env.get("TOOLREG_HEALTH_HOST", "127.0.0.1").strip()
    if host in _ANY:
        host = "127.0.0.1"
    if ":" in host and not host.startswith("["):
        host = f"[{host}]"
    return f"{host}:{port}"


def check(address: str, service: str = "", timeout_s: float = DEFAULT_TIMEOUT_S) -> str:
    """The status's name (SERVING, NOT_SERVING, ...); grpc.RpcError when no answer."""
    with grpc.insecure_channel(address) as channel:
        answer = health_pb2_grpc.HealthStub(channel).Check(
            health_pb2.HealthCheckRequest(service=service), timeout=timeout_s
        )
    return str(health_pb2.HealthCheckResponse.ServingStatus.Name(answer.status))


def probe(address: str | None, service: str = "", timeout_s: float = DEFAULT_TIMEOUT_S) -> int:
    """Print the status, or why there is none; 0 when SERVING."""
    try:
        where = address or health_address()
    except ValueError as exc:
        print(f"toolreg health: {exc}", file=sys.stderr)
        return 2
    try:
        status = check(where, service, timeout_s)
    except grpc.RpcError as exc:
        code = exc.code() if isinstance(exc, grpc.Call) else None
        print(f"toolreg health: {where}: no answer ({code.name if code else exc})", file=sys.stderr)
        return 1
    print(status)
    return 0 if status == "SERVING" else 1


def main(argv: Sequence[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    return probe(args[0] if args else None)


if __name__ == "__main__":
    sys.exit(main())
