"""Runs one tool execution in one fresh, locked-down container. Knows nothing of gRPC.

The Docker backend lives in `sandbox_runner.docker_backend` (the only module importing
`docker`), so importing the domain types stays cheap.
"""

from .backend import OutputSink, PreparedSandbox, SandboxBackend
from .profiles import CAUTIOUS_LIMITS, DANGEROUS_LIMITS, SAFE_LIMITS, profile_for, runtime_for
from .spec import (
    EgressConnection,
    EgressSpec,
    EngineUnavailable,
    HeaderInjection,
    Limits,
    Mount,
    SandboxError,
    SandboxResult,
    SandboxSpec,
    SecretFile,
)

__all__ = [
    "CAUTIOUS_LIMITS",
    "DANGEROUS_LIMITS",
    "SAFE_LIMITS",
    "EgressConnection",
    "EgressSpec",
    "EngineUnavailable",
    "HeaderInjection",
    "Limits",
    "Mount",
    "OutputSink",
    "PreparedSandbox",
    "SandboxBackend",
    "SandboxError",
    "SandboxResult",
    "SandboxSpec",
    "SecretFile",
    "profile_for",
    "runtime_for",
]
