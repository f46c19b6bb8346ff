"""Health answers name the policy in force: `grpc.health.v1.Health/Check`
carries it as trailing metadata (`toolreg-policy-digest`), so an operator, or
a probe, sees at a glance whether every server enforces the same policy
(docs/how-to/deploying.md, "A live policy"). The digest is a hash of the operator's
file and reveals nothing a port scan would not."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import grpc

from registry_server.api.handlers import Unary, rewrap

HEALTH_CHECK = "/grpc.health.v1.Health/Check"
DIGEST_KEY = "toolreg-policy-digest"


class PolicyDigestInterceptor(grpc.ServerInterceptor):
    def __init__(self, digest: Callable[[], str]) -> None:
        self._digest = digest

    def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], grpc.RpcMethodHandler[Any, Any] | None],
        details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler[Any, Any] | None:
        handler = continuation(details)
        if details.method != HEALTH_CHECK:
            return handler
        return rewrap(handler, self._with_digest, lambda stream: stream)

    def _with_digest(self, behavior: Unary) -> Unary:
        def run(request: Any, context: grpc.ServicerContext) -> Any:
            context.set_trailing_metadata(((DIGEST_KEY, self._digest() or "development"),))
            return behavior(request, context)

        return run
