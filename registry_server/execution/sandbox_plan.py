"""Planning one call's sandbox: which OCI runtime its level runs under here
(for runsc-net, with which of gVisor's network modes), and the spec (image,
command, limits, mounts) its definition asks for merged into the server's
ceiling for that level. The server decides; the tool only asks."""

from __future__ import annotations

import contextlib
import dataclasses
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path

from registry_server.domain.models import SafetyLevel, ToolDefinition
from registry_server.execution.secrets import SecretStore, SecretUnavailable
from registry_server.policy.clients import UNRESTRICTED, RegisterGrant
from registry_server.policy.grants import grant_refusal
from registry_server.policy.model import EgressPolicy
from sandbox_runner import (
    EgressSpec,
    HeaderInjection,
    Limits,
    Mount,
    SandboxBackend,
    SandboxError,
    SandboxSpec,
    SecretFile,
)
from sandbox_runner.pieces import gvisor_fix
from sandbox_runner.profiles import (
    FALLBACK_RUNTIME,
    GVISOR,
    GVISOR_NET,
    HOSTINET,
    NETSTACK,
    gvisor_network,
    preferred_runtime,
    profile_for,
)

WORKSPACE_TARGET = "/workspace"  # where a workspace tool sees its directory
# seconds: how stale the engine's runtime list may be when the one a call needs is not in
# it (one registered meanwhile, e.g. runsc-net by scripts/ensure_docker.sh, is found
# without a restart; a missing one costs one engine query per interval, not per call)
RUNTIMES_RECHECK_S = 5.0
TOOL_WORKSPACE_ENV = "TOOLREG_WORKSPACE"  # tells the tool where its workspace is
HOSTINET_SETTING = "TOOLREG_GVISOR_HOSTINET"  # allow|refuse: the server setting below
ENGINE_DOCS = "docs/how-to/deploying.md, 1. The engine"


@dataclass(frozen=True)
class Runtime:
    """The OCI runtime a call runs under here."""

    name: str
    # runsc-net only: gVisor's network mode, as the engine reported its runtimeArgs
    # (profiles.NETSTACK or profiles.HOSTINET); "" for every other runtime.
    gvisor_network: str = ""


def runsc_net_problem(runtime_args: tuple[str, ...] | None, allow_hostinet: bool) -> str | None:
    """Why runsc-net, started with ``runtime_args`` (None: the engine lacks it),
    cannot run a dangerous call with egress on this server, as the end of a
    sentence about it; None when it can. The one place that decides."""
    if runtime_args is None:
        return f"which this engine lacks: {gvisor_fix()}"
    mode = gvisor_network(runtime_args)
    if mode == HOSTINET and not allow_hostinet:
        return (
            f"which this engine runs with {HOSTINET} (--network=host: the tool's socket calls"
            f" reach the host kernel's network stack), refused by {HOSTINET_SETTING}=refuse:"
            " install runsc from gVisor release-20240801 or later, then"
            f" {gvisor_fix()}, for gVisor's {NETSTACK} ({ENGINE_DOCS})"
        )
    if mode not in (NETSTACK, HOSTINET):
        return (
            f"which this engine starts with {' '.join(runtime_args)}: no network for the"
            f" sandbox; register it with --network=sandbox ({ENGINE_DOCS})"
        )
    return None


@dataclass(frozen=True)
class SandboxPolicy:
    """What the server (not the tool) decides about sandboxes."""

    ceilings: Mapping[SafetyLevel, Limits] = field(
        default_factory=lambda: {lvl: profile_for(lvl.value) for lvl in SafetyLevel}
    )
    # Dangerous tools run under gVisor; without it, refuse (True) or fall back
    # to runc with a warning at start-up (False). Never for a dangerous tool
    # with egress: it runs under gVisor with networking or not at all.
    require_gvisor: bool = False
    workspace_dir: Path | None = None
    # Tools that get workspace_dir mounted read-write. Only dangerous tools
    # qualify: a file that outlives the call is a permanent effect.
    workspace_tools: frozenset[str] = frozenset()
    egress: EgressPolicy = field(default_factory=EgressPolicy)
    # What a tool's owner may grant now (egress hosts, secrets); checked again
    # before every call. Default (development mode): everything.
    grant_of: Callable[[str], RegisterGrant | None] = lambda _owner: UNRESTRICTED
    secrets: SecretStore | None = None  # None: tools with secrets cannot run
    # runsc-net with gVisor's hostinet (TOOLREG_GVISOR_HOSTINET=allow|refuse): refused,
    # a dangerous tool with egress runs only where runsc-net has the netstack. The
    # server passes its setting (default allow); a policy made without one refuses.
    allow_hostinet: bool = False


class NotRunnable(Exception):
    """The policy or the server's set-up does not let this tool run now (the
    message says why, naming secrets but never their values)."""


class NoRuntime(NotRunnable):
    """The engine offers no runtime this tool may run under here; the message is
    the whole reason, naming the tool and the fix."""


class SandboxPlanner:
    def __init__(self, backend: SandboxBackend, policy: SandboxPolicy) -> None:
        self._backend = backend
        self.policy = policy
        self._runtimes: Mapping[str, tuple[str, ...]] | None = None  # what the engine offers
        self._runtimes_at = 0.0  # time.monotonic() of that answer

    def runtime_for(self, tool: ToolDefinition) -> Runtime:
        """The OCI runtime ``tool`` runs under here; NoRuntime when it may not run
        (no gVisor for a dangerous tool, or no usable runsc-net for one with egress)."""
        level, egress = tool.safety_level, bool(tool.egress)
        wanted = preferred_runtime(level.value, egress=egress)
        networked = wanted == GVISOR_NET
        # runsc-net's mode decides the call, so its answer is never older than the
        # recheck interval: a reload that changed it is seen within that.
        offered = self._engine_runtimes(wanted, fresh=networked)
        if networked:
            args = None if offered is None else offered.get(GVISOR_NET)
            problem = runsc_net_problem(args, self.policy.allow_hostinet)
            if problem is not None or args is None:
                raise NoRuntime(
                    f"Tool '{tool.name}' needs gVisor with networking (runtime"
                    f" '{GVISOR_NET}'), {problem}"
                )
            return Runtime(GVISOR_NET, gvisor_network(args))
        if offered is not None and wanted in offered:
            return Runtime(wanted)
        if level is not SafetyLevel.DANGEROUS:
            return Runtime(FALLBACK_RUNTIME)
        # The development-mode fallback gives a dangerous tool runc's isolation,
        # never runc's isolation plus a way out: with egress, gVisor with a network
        # (above) or nothing.
        if self.policy.require_gvisor or offered is None:
            raise NoRuntime(
                f"Tool '{tool.name}' needs gVisor ({GVISOR}), which this engine lacks:"
                f" {gvisor_fix()}"
            )
        return Runtime(FALLBACK_RUNTIME)

    def _engine_runtimes(self, wanted: str, *, fresh: bool) -> Mapping[str, tuple[str, ...]] | None:
        """The engine's runtimes and their arguments, asked again when the answer
        is older than RUNTIMES_RECHECK_S and lacks ``wanted`` (or, ``fresh``, in
        any case); the last answer when the engine does not answer now, None
        when it never did."""
        now = time.monotonic()
        cached = self._runtimes
        if cached is not None and (
            now - self._runtimes_at < RUNTIMES_RECHECK_S or (wanted in cached and not fresh)
        ):
            return cached
        # An engine that does not answer now: the call meets that where it
        # starts its sandbox.
        with contextlib.suppress(SandboxError):
            self._runtimes, self._runtimes_at = self._backend.runtimes(), now
        return self._runtimes

    def warm_spec(self, tool: ToolDefinition) -> SandboxSpec | None:
        """What a warm container of ``tool`` is made from (None: it may not run
        here, or not warm). A tool with egress is made on a network of its own
        with its proxy settings, but ``unbound``: its allow-list, injected
        headers and caps reach the proxy only when a call is released, from
        the policy in force then. A ``deliver: file`` secret is bind-mounted
        into the container, so such a tool stays cold: the secret must not
        exist before its call."""
        if any(ref.deliver == "file" for ref in tool.secrets):
            return None
        try:
            runtime = self.runtime_for(tool)
        except NoRuntime:
            return None
        # No secret is read for a container made ahead of its call: the
        # injected values are the call's (``spec``), and ``unbound`` drops them.
        placeholders = {ref.name: b"" for ref in tool.secrets}
        try:
            return unbound(self.spec(tool, b"{}", runtime.name, placeholders))
        except NotRunnable:
            return None

    def spec(
        self,
        tool: ToolDefinition,
        input_bytes: bytes,
        runtime: str,
        secrets: Mapping[str, bytes] | None = None,
    ) -> SandboxSpec:
        """The tool's request merged into its level's ceiling (the tightest wins).
        ``input_bytes``: the RFC 8785 canonical arguments, the very bytes an
        approval's args_digest hashes (1 and 1.0 cannot differ on the way).
        ``secrets``: the tool's secret values (``secret_values``), read once per
        call after ``check_grant`` passed; NotRunnable when they are not all
        there."""
        requested = Limits(**tool.sandbox.limits.as_dict(), tmpfs_mb=0, nofile=0, fsize_mb=0)
        limits = self.policy.ceilings[tool.safety_level].tightest(requested)
        env = dict(tool.sandbox.env)
        mounts: tuple[Mount, ...] = ()
        workspace = self.policy.workspace_dir
        if (
            workspace is not None
            and tool.name in self.policy.workspace_tools
            and tool.safety_level is SafetyLevel.DANGEROUS
        ):
            mounts = (Mount(str(workspace.resolve()), WORKSPACE_TARGET, read_only=False),)
            env[TOOL_WORKSPACE_ENV] = WORKSPACE_TARGET
        egress, files = self._egress_and_secrets(tool, secrets or {})
        # Registration refuses prestart for a dangerous tool; a stored one never
        # gets it either: nothing of its registrant's runs before its approval.
        warm = tool.safety_level is not SafetyLevel.DANGEROUS and bool(tool.sandbox.prestart)
        return SandboxSpec(
            image=tool.sandbox.image,
            command=tool.sandbox.command,
            env=tuple(sorted(env.items())),
            limits=limits,
            runtime=runtime,
            input=input_bytes,
            mounts=mounts,
            egress=egress,
            secret_files=files,
            prestart=tool.sandbox.prestart if warm else "",
            preload=tool.sandbox.preload if warm else (),
        )

    def check_grant(self, tool: ToolDefinition) -> None:
        """NotRunnable when the policy in force no longer lets the tool's owner
        give it what it has: its level, its image, its egress or secrets (or
        its level may not have egress). A narrowed grant stops stored tools."""
        policy = self.policy
        refusal = grant_refusal(tool, tool.owner, policy.grant_of(tool.owner), policy.egress)
        if refusal is not None:
            raise NotRunnable(refusal)

    def secret_values(self, tool: ToolDefinition) -> dict[str, bytes]:
        """The values of the tool's secrets (NotRunnable when one is missing)."""
        if not tool.secrets:
            return {}
        if self.policy.secrets is None:
            raise NotRunnable("this server has no secrets directory")
        try:
            return {ref.name: self.policy.secrets.value(ref.name) for ref in tool.secrets}
        except SecretUnavailable as exc:
            raise NotRunnable(str(exc)) from None

    def _egress_and_secrets(
        self, tool: ToolDefinition, values: Mapping[str, bytes]
    ) -> tuple[EgressSpec | None, tuple[SecretFile, ...]]:
        if not tool.egress and not tool.secrets:
            return None, ()
        policy = self.policy  # the executor ran check_grant before reading the values
        if set(values) != {ref.name for ref in tool.secrets}:
            raise NotRunnable(f"the secrets of '{tool.name}' were not read for this call")
        files = tuple(
            SecretFile(ref.name, values[ref.name]) for ref in tool.secrets if ref.deliver == "file"
        )
        if not tool.egress:
            return None, files
        inject = []
        for ref in tool.secrets:
            if ref.inject is None:
                continue
            raw = values[ref.name].decode("utf-8", "replace")
            if any(c in raw for c in "\r\n\0"):
                raise NotRunnable(f"secret {ref.name} contains a line break; it cannot be a header")
            rendered = ref.inject.render(raw)
            inject.append(
                HeaderInjection(
                    ref.inject.host,
                    ref.inject.port,
                    ref.inject.header,
                    rendered,
                    mask=(raw, rendered),
                )
            )
        spec = EgressSpec(
            allow=tool.egress,
            max_bytes=policy.egress.max_bytes_per_call,
            max_connections=policy.egress.max_connections_per_call,
            allow_private=policy.egress.allow_private,
            inject=tuple(inject),
        )
        return spec, files


def unbound(spec: SandboxSpec) -> SandboxSpec:
    """``spec`` as a container made ahead of its call is: its egress kept to
    what shapes the container (a network, and the injected hosts, for which
    the sandbox trusts the server's CA), without the grants (allow-list,
    header values, caps), which are the call's. An empty allow-list is never
    registered at the proxy: such a container reaches nothing until a call
    is bound to it (``PreparedSandbox.bind_egress``)."""
    egress = spec.egress
    if egress is None:
        return spec
    shape = EgressSpec(
        allow=(),
        max_bytes=0,
        max_connections=0,
        inject=tuple(HeaderInjection(i.host, i.port, i.header, "") for i in egress.inject),
    )
    return dataclasses.replace(spec, egress=shape)


def within_deadline(spec: SandboxSpec, deadline: float | None) -> SandboxSpec:
    """No container outlives the client's deadline: nobody would read its result."""
    if deadline is None:
        return spec
    remaining_ms = max(1, int((deadline - time.monotonic()) * 1000))
    if remaining_ms >= spec.limits.timeout_ms:
        return spec
    return dataclasses.replace(spec, limits=spec.limits.replace(timeout_ms=remaining_ms))
