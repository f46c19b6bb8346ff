"""The ``toolreg`` command: the server, and client verbs that talk to it over gRPC.

User mistakes (bad manifest, unknown tool, server not running) print one
clear line and exit non-zero; tracebacks are for bugs only.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Callable
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Annotated, Any, NoReturn

import grpc
import typer

from registry_server.client import approval_view
from registry_server.client import registry_client as client_mod
from registry_server.client.registry_client import RegistryClient, describe_rpc_error, open_channel
from registry_server.client.terminal import escape
from registry_server.domain.errors import ToolregError
from registry_server.domain.files import read_credential
from registry_server.domain.models import SafetyLevel, ToolDefinition
from registry_server.domain.schemas import SchemaFormat, tool_belt
from registry_server.wire import convert

app = typer.Typer(
    name="toolreg",
    help="A tool registry for LLM agents that runs every call in a fresh sandbox.",
    no_args_is_help=True,
    pretty_exceptions_enable=False,
    add_completion=False,
)
tools_app = typer.Typer(help="Register, list and export tools.", no_args_is_help=True)
app.add_typer(tools_app, name="tools")
approvals_app = typer.Typer(help="See and sign approval requests.", no_args_is_help=True)
app.add_typer(approvals_app, name="approvals")
keys_app = typer.Typer(help="Approver key pairs (Ed25519).", no_args_is_help=True)
app.add_typer(keys_app, name="keys")
audit_app = typer.Typer(help="The hash-chained audit log.", no_args_is_help=True)
app.add_typer(audit_app, name="audit")
policy_app = typer.Typer(help="Check, reload and show the policy.", no_args_is_help=True)
app.add_typer(policy_app, name="policy")


@dataclass(frozen=True)
class Connection:
    """How client verbs reach the server (root options, before the verb)."""

    token: str | None = None
    tls_ca: Path | None = None
    tls_cert: Path | None = None
    tls_key: Path | None = None
    tls: bool = False


@app.callback()
def root(
    ctx: typer.Context,
    token: Annotated[
        str | None,
        typer.Option("--token", envvar="TOOLREG_TOKEN", help="Bearer token of this client."),
    ] = None,
    tls_ca: Annotated[
        Path | None,
        typer.Option("--tls-ca", envvar="TOOLREG_TLS_CA", help="CA that signed the server."),
    ] = None,
    tls_cert: Annotated[
        Path | None,
        typer.Option("--tls-cert", envvar="TOOLREG_TLS_CERT", help="Client certificate (mTLS)."),
    ] = None,
    tls_key: Annotated[
        Path | None, typer.Option("--tls-key", envvar="TOOLREG_TLS_KEY", help="Client key (mTLS).")
    ] = None,
    tls: Annotated[
        bool, typer.Option("--tls", envvar="TOOLREG_TLS", help="Use TLS (system CAs).")
    ] = False,
) -> None:
    ctx.obj = Connection(token, tls_ca, tls_cert, tls_key, tls)
    _start_tracing(ctx)


# The service name each kind of process reports when OTEL_SERVICE_NAME is unset.
SERVICE_NAMES = {"serve": "toolreg", "mcp": "toolreg-mcp", "console": "toolreg-console"}
LONG_RUNNING = frozenset(SERVICE_NAMES)  # no span for the whole life of a server


def _start_tracing(ctx: typer.Context) -> None:
    """Tracing, when the OTEL_* variables ask for it: a command is one span, and
    its RPCs are client spans under it, which the server continues."""
    from registry_server.api import tracing

    command = ctx.invoked_subcommand or ""
    try:
        started = tracing.configure(SERVICE_NAMES.get(command, "toolreg-cli"))
    except ToolregError as exc:
        fail(exc.message, 2)
    if started is None:
        return
    ctx.call_on_close(started.shutdown)  # exports the last spans before the process ends
    if command not in LONG_RUNNING:
        from opentelemetry import trace

        tracer = trace.get_tracer("toolreg.cli")
        ctx.with_resource(tracer.start_as_current_span(f"toolreg {command}".strip()))


AddressOpt = Annotated[
    str | None,
    typer.Option("--address", envvar=client_mod.ADDRESS_ENV, help="Server HOST:PORT."),
]
LevelOpt = Annotated[
    str | None,
    typer.Option("--max-level", help="Only tools at or below: safe, cautious, dangerous."),
]
CategoryOpt = Annotated[
    list[str] | None, typer.Option("--category", help="Only tools in any of these (repeatable).")
]
PageSizeOpt = Annotated[
    int,
    typer.Option(
        "--page-size",
        min=0,
        help="Items asked for per page (0 = the server's default); every page is shown.",
    ),
]


def fail(message: str, code: int = 1) -> NoReturn:
    typer.echo(f"toolreg: {message}", err=True)
    raise typer.Exit(code)


def _level(text: str | None) -> SafetyLevel | None:
    if text is None:
        return None
    try:
        return SafetyLevel.parse(text)
    except ValueError as exc:
        fail(f"--max-level: {exc}", 2)


def _client(ctx: typer.Context, address: str | None, *, token: str | None = None) -> RegistryClient:
    """A client with the root options' TLS and bearer (``token`` overrides the bearer)."""
    conn = ctx.find_root().obj
    if not isinstance(conn, Connection):
        conn = Connection()
    target = address or client_mod.default_address()

    def read(path: Path | None, what: str) -> bytes | None:
        try:
            return None if path is None else read_credential(path, what)
        except ToolregError as exc:
            fail(exc.message, 2)

    channel = open_channel(
        target, token=token or conn.token, tls_ca=read(conn.tls_ca, "TLS CA"),
        tls_cert=read(conn.tls_cert, "client certificate"),
        tls_key=read(conn.tls_key, "client key"), tls=conn.tls,
    )  # fmt: skip
    return RegistryClient(target, channel=channel)


def _rpc_failed(err: grpc.RpcError, address: str) -> NoReturn:
    if isinstance(err, grpc.Call) and err.code() == grpc.StatusCode.UNAVAILABLE:
        fail(
            f"cannot reach the toolreg server at {address} ({err.details()});"
            " is `toolreg serve` running?"
        )
    fail(describe_rpc_error(err))


# ------------------------------------------------------------------ server


@app.command()
def serve(
    host: Annotated[str | None, typer.Option(help="Address to listen on.")] = None,
    port: Annotated[int | None, typer.Option(help="Port (0 = any free port).")] = None,
    data_dir: Annotated[
        Path | None, typer.Option("--data-dir", help="Where the store lives.")
    ] = None,
    tools: Annotated[
        Path | None,
        typer.Option("--tools", help="Register the manifests of this directory at start."),
    ] = None,
    policy: Annotated[Path | None, typer.Option("--policy", help="Policy file (YAML).")] = None,
    tls_cert: Annotated[
        Path | None, typer.Option("--tls-cert", help="Server certificate (PEM).")
    ] = None,
    tls_key: Annotated[Path | None, typer.Option("--tls-key", help="Server key (PEM).")] = None,
    tls_client_ca: Annotated[
        Path | None,
        typer.Option("--tls-client-ca", help="Require client certificates from this CA."),
    ] = None,
    log_level: Annotated[str, typer.Option("--log-level", envvar="TOOLREG_LOG_LEVEL")] = "INFO",
    log_format: Annotated[
        str, typer.Option("--log-format", envvar="TOOLREG_LOG_FORMAT", help="auto, json or text.")
    ] = "auto",
    metrics_port: Annotated[
        int | None, typer.Option("--metrics-port", help="Serve Prometheus metrics on this port.")
    ] = None,
    store_url: Annotated[
        str | None,
        typer.Option(
            "--store-url", help="sqlite:///PATH or postgresql://... (default: in --data-dir)."
        ),
    ] = None,
) -> None:
    """Run the gRPC server in the foreground until SIGTERM/SIGINT."""
    from pydantic import ValidationError

    from registry_server.api import logs
    from registry_server.api.config import ServerConfig
    from registry_server.api.server import serve as run_server

    try:
        logs.configure(log_level, log_format)
    except ValueError as exc:
        fail(f"--log-format/--log-level: {exc}", 2)
    overrides: dict[str, Any] = {
        k: v
        for k, v in {
            "host": host,
            "port": port,
            "data_dir": data_dir,
            "tools_dir": tools,
            "policy_file": policy,
            "tls_cert": tls_cert,
            "tls_key": tls_key,
            "tls_client_ca": tls_client_ca,
            "metrics_port": metrics_port,
            "store_url": store_url,
        }.items()
        if v is not None
    }
    try:
        config = ServerConfig(**overrides)
    except ValidationError as exc:
        problems = "; ".join(f"{'.'.join(map(str, e['loc']))}: {e['msg']}" for e in exc.errors())
        fail(f"invalid configuration: {problems}", 2)
    try:
        run_server(config)
    except ToolregError as exc:
        fail(exc.message)
    except OSError as exc:
        fail(str(exc))


# ------------------------------------------------------------------- tools


@tools_app.command("register")
def tools_register(
    ctx: typer.Context,
    path: Annotated[Path, typer.Argument(help="A manifest file or a directory of them.")],
    replace: Annotated[
        bool, typer.Option("--replace", help="Overwrite different definitions.")
    ] = False,
    address: AddressOpt = None,
) -> None:
    """Register tools from YAML manifests."""
    from registry_server.domain.manifests import load_manifests

    if not path.exists():
        fail(f"{path}: no such file or directory", 2)
    try:
        tools = load_manifests(path)
    except ToolregError as exc:
        fail(exc.message, 2)
    if not tools:
        fail(f"{path}: no manifests (*.yaml, *.yml) found", 2)
    with _client(ctx, address) as client:
        for tool in tools:
            try:
                stored = client.register(tool, replace=replace)
            except grpc.RpcError as err:
                _rpc_failed(err, client.address)
            typer.echo(f"registered {stored.name} ({stored.digest[:12]})")


@tools_app.command("list")
def tools_list(
    ctx: typer.Context,
    max_level: LevelOpt = None,
    category: CategoryOpt = None,
    as_json: Annotated[bool, typer.Option("--json", help="Print JSON.")] = False,
    page_size: PageSizeOpt = 0,
    address: AddressOpt = None,
) -> None:
    """List registered tools (all of them, a page at a time)."""
    level = _level(max_level)
    with _client(ctx, address) as client:
        try:
            tools = [
                client_mod.tool_from_message(t)
                for t in client.list_tools(level, category or (), page_size)
            ]
        except grpc.RpcError as err:
            _rpc_failed(err, client.address)
    if as_json:
        typer.echo(json.dumps([_shown_tool(t) for t in tools], indent=2))
        return
    if not tools:
        typer.echo("no tools")
        return
    width = max(len(t.name) for t in tools)
    for t in tools:
        cats = ",".join(t.categories) or "-"
        summary = t.description.splitlines()[0]
        line = f"{t.name:<{width}}  {t.safety_level.value:<9}  {cats:<20}  {t.owner:<12}  {summary}"
        if t.disabled:
            line += f"  [DISABLED: {t.disabled_reason}]"
        typer.echo(escape(line))


@tools_app.command("get")
def tools_get(ctx: typer.Context, name: str, address: AddressOpt = None) -> None:
    """Show one tool's definition (JSON)."""
    with _client(ctx, address) as client:
        try:
            tool = client_mod.tool_from_message(client.get(name))
        except grpc.RpcError as err:
            _rpc_failed(err, client.address)
    shown = _shown_tool(tool)
    typer.echo(escape(json.dumps(shown, indent=2, ensure_ascii=False), keep_newlines=True))


def _shown_tool(tool: ToolDefinition) -> dict[str, Any]:
    """A tool as `tools get` and `tools list --json` print it: the manifest,
    its digest and owner, and the kill switch when it is set."""
    shown = tool.as_manifest() | {"digest": tool.digest, "owner": tool.owner}
    if tool.disabled:
        shown |= {"disabled": True, "disabled_reason": tool.disabled_reason}
    return shown


ReasonOpt = Annotated[
    str,
    typer.Option("--reason", help="Why: for the audit log and the voided approval requests."),
]


@tools_app.command("delete")
def tools_delete(
    ctx: typer.Context, name: str, reason: ReasonOpt = "", address: AddressOpt = None
) -> None:
    """Delete a tool (its owner or an admin). Its open approval requests are
    voided; a call already running finishes; the name may be registered again."""

    def delete(client: RegistryClient) -> str:
        client.delete_tool(name, reason)
        return f"deleted {name}"

    _switch(ctx, address, delete)


@tools_app.command("disable")
def tools_disable(
    ctx: typer.Context,
    name: str,
    reason: Annotated[
        str,
        typer.Option(
            "--reason", help="Why: every refused call and voided request says it (required)."
        ),
    ],
    address: AddressOpt = None,
) -> None:
    """The kill switch (admins): every call of the tool is refused with
    TOOL_DISABLED, on every server within a second; it stays listed, its warm
    containers go and its open approval requests are voided."""

    def disable(client: RegistryClient) -> str:
        tool = client.set_tool_enabled(name, False, reason)
        return f"disabled {tool.name}: {tool.disabled_reason}"

    _switch(ctx, address, disable)


@tools_app.command("enable")
def tools_enable(
    ctx: typer.Context, name: str, reason: ReasonOpt = "", address: AddressOpt = None
) -> None:
    """Make a disabled tool callable again (admins); approvals must be asked for again."""

    def enable(client: RegistryClient) -> str:
        return f"enabled {client.set_tool_enabled(name, True, reason).name}"

    _switch(ctx, address, enable)


def _switch(ctx: typer.Context, address: str | None, act: Callable[[RegistryClient], str]) -> None:
    """One kill-switch call; prints the line ``act`` returns."""
    with _client(ctx, address) as client:
        try:
            done = act(client)
        except grpc.RpcError as err:
            _rpc_failed(err, client.address)
    typer.echo(escape(done))


@tools_app.command("schemas")
def tools_schemas(
    ctx: typer.Context,
    fmt: Annotated[
        str,
        typer.Option(
            "--format", help="openai, anthropic, mcp, or text (a tool belt for a prompt)."
        ),
    ] = "openai",
    max_level: LevelOpt = None,
    category: CategoryOpt = None,
    page_size: PageSizeOpt = 0,
    address: AddressOpt = None,
) -> None:
    """Export tool schemas for an LLM API (all of them, a page at a time)."""
    level = _level(max_level)
    with _client(ctx, address) as client:
        try:
            if fmt.strip().lower() == "text":
                tools = [
                    client_mod.tool_from_message(t)
                    for t in client.list_tools(level, category or (), page_size)
                ]
                # as GetToolSchemas: a disabled tool is not offered to the model
                typer.echo(tool_belt([t for t in tools if not t.disabled]), nl=False)
                return
            try:
                schema_format = SchemaFormat.parse(fmt)
            except ValueError as exc:
                fail(f"--format: {exc}", 2)
            text = client.schemas(schema_format, level, category or (), page_size)
        except grpc.RpcError as err:
            _rpc_failed(err, client.address)
    typer.echo(json.dumps(json.loads(text), indent=2, ensure_ascii=False))


# --------------------------------------------------------------- execution


@app.command("exec")
def exec_tool(
    ctx: typer.Context,
    name: Annotated[str, typer.Argument(help="The tool to run.")],
    args: Annotated[str, typer.Option("--args", help="Arguments as a JSON object.")] = "{}",
    stream: Annotated[bool, typer.Option("--stream", help="Print output as it arrives.")] = False,
    as_json: Annotated[
        bool, typer.Option("--json", help="Print the whole ToolResult as JSON.")
    ] = False,
    approval_request: Annotated[
        str, typer.Option("--approval-request", help="Run with the approvals of this request.")
    ] = "",
    token: Annotated[
        list[str] | None,
        typer.Option("--approval-token", help="A signed approval token (repeatable)."),
    ] = None,
    address: AddressOpt = None,
) -> None:
    """Run a tool once and print its result. Exit status 0 only on success."""
    from google.protobuf import json_format

    with _client(ctx, address) as client:
        try:
            if stream:
                result = None
                for event in client.stream(
                    name, args, tokens=token or (), request_id=approval_request
                ):
                    kind = event.WhichOneof("event")
                    if kind == "stdout":
                        sys.stdout.buffer.write(event.stdout)
                        sys.stdout.flush()
                    elif kind == "stderr":
                        sys.stderr.buffer.write(event.stderr)
                        sys.stderr.flush()
                    else:
                        result = event.result
                if result is None:
                    fail("the server ended the stream without a result")
            else:
                result = client.execute(name, args, tokens=token or (), request_id=approval_request)
        except grpc.RpcError as err:
            _rpc_failed(err, client.address)
    if as_json:
        typer.echo(json_format.MessageToJson(result, preserving_proto_field_name=True))
    elif not stream and result.content:
        typer.echo(result.content, nl=not result.content.endswith("\n"))
    if result.HasField("approval_request") and result.approval_request.id:
        req = result.approval_request
        typer.echo(
            f"approval request {req.id}: {len(req.approved_by)} of {req.approvals_required}"
            " approvals;"
            f" approvers run `toolreg approvals approve {req.id} --key KEY`, then run this again"
            f" with --approval-request {req.id}",
            err=True,
        )
    if not result.success:
        status = convert.status_name(result.status)
        fail(f"{status}: {result.error}" if result.error else status)


@app.command()
def reap(
    docker_url: Annotated[
        str | None,
        typer.Option("--docker-url", envvar="TOOLREG_DOCKER_URL", help="Engine address."),
    ] = None,
) -> None:
    """Remove sandbox containers left behind by toolreg servers that are gone.
    Containers of running servers are never touched."""
    from registry_server.api.app import open_backend
    from registry_server.api.config import ServerConfig
    from sandbox_runner import SandboxError

    backend = open_backend(ServerConfig(docker_url=docker_url), reaper=True)
    try:
        removed = backend.reap()
    except SandboxError as exc:
        fail(str(exc))
    finally:
        backend.close()
    typer.echo(f"removed {removed} leftover container{'s' if removed != 1 else ''}")


# --------------------------------------------------------------- approvals


def _request_lines(req: Any) -> list[str]:
    """What an approver reads before signing: every client-supplied text escaped."""
    fields = [f"{label:<9} {value}" for label, value in approval_view.request_fields(req)]
    heading = escape(f"arguments (digest {req.arguments_digest}):")
    return [*fields, heading, approval_view.shown_arguments(req)]


@approvals_app.command("list")
def approvals_list(
    ctx: typer.Context,
    state: Annotated[
        str,
        typer.Option("--state", help="PENDING, APPROVED, CONSUMED, REJECTED, VOIDED or EXPIRED."),
    ] = "",
    page_size: PageSizeOpt = 0,
    address: AddressOpt = None,
) -> None:
    """List approval requests, newest first (all you may see, a page at a time)."""
    with _client(ctx, address) as client:
        try:
            found = client.approval_requests(state, page_size=page_size)
        except grpc.RpcError as err:
            _rpc_failed(err, client.address)
    if not found:
        typer.echo("no approval requests")
    for req in found:
        have = f"{len(req.approved_by)}/{req.approvals_required}"
        image = f"  image {req.tool.sandbox.image}" if req.HasField("tool") else ""
        line = f"{req.id}  {req.state:<9} {have:>5}  {req.tool_name}  by {req.requested_by}{image}"
        typer.echo(escape(line))


@approvals_app.command("show")
def approvals_show(ctx: typer.Context, request_id: str, address: AddressOpt = None) -> None:
    """Show one request with its arguments in full."""
    with _client(ctx, address) as client:
        try:
            req = client.approval_request(request_id)
        except grpc.RpcError as err:
            _rpc_failed(err, client.address)
    typer.echo("\n".join(_request_lines(req)))


@approvals_app.command("approve")
def approvals_approve(
    ctx: typer.Context,
    request_id: str,
    key: Annotated[Path, typer.Option("--key", help="Your Ed25519 private key (PEM).")],
    approver: Annotated[
        str | None, typer.Option("--as", help="Your approver id (default: the key file's name).")
    ] = None,
    ttl: Annotated[
        int | None,
        typer.Option("--ttl", help="Token lifetime, seconds (default: the policy maximum)."),
    ] = None,
    print_only: Annotated[
        bool, typer.Option("--print", help="Print the token instead of submitting it.")
    ] = False,
    address: AddressOpt = None,
) -> None:
    """Sign exactly this request (tool digest + arguments digest) with your key.
    The key never leaves this process."""
    from registry_server.signing.keys import load_private_key
    from registry_server.signing.tokens import mint_for

    try:
        private_key = load_private_key(key.read_bytes())
    except OSError as exc:
        fail(f"cannot read {key}: {exc.strerror}", 2)
    except ValueError as exc:
        fail(f"{key}: {exc}", 2)
    issuer = approver or key.name.split(".")[0]
    with _client(ctx, address) as client:
        try:
            req = client.approval_request(request_id)
            if req.state in ("CONSUMED", "REJECTED", "EXPIRED"):
                fail(f"request {request_id} is {req.state.lower()}; nothing to approve")
            if req.HasField("tool") and not approval_view.definition_matches(req):
                fail(f"request {request_id}: the definition shown does not match tool_digest;"
                     " refusing to sign")  # fmt: skip
            token = mint_for(
                private_key, issuer=issuer, request=req, ttl_s=ttl, bind_request=True,
            )  # fmt: skip
            if print_only:
                typer.echo(token)
                return
            updated = client.submit_approval(request_id, token)
        except grpc.RpcError as err:
            _rpc_failed(err, client.address)
    typer.echo(
        f"approved {request_id} as {issuer}: {len(updated.approved_by)} of"
        f" {updated.approvals_required} approvals, state {updated.state}"
    )


@approvals_app.command("reject")
def approvals_reject(
    ctx: typer.Context,
    request_id: str,
    reason: Annotated[
        str, typer.Option("--reason", help="Why (the agent is told; the audit keeps it).")
    ],
    address: AddressOpt = None,
) -> None:
    """Refuse a request for good: the agent's call gets APPROVAL_DENIED with your reason."""
    with _client(ctx, address) as client:
        try:
            rejected = client.reject_approval_request(request_id, reason)
        except grpc.RpcError as err:
            _rpc_failed(err, client.address)
    typer.echo(f"rejected {request_id} as {rejected.rejected_by}")


def _event_line(event: Any) -> str:
    """One line per watch event; every client-supplied text escaped."""
    if event.type == "SYNCED":
        return "-- up to date; watching for changes (Ctrl-C to stop)"
    req = event.request
    at = (event.at or datetime.now(UTC)).strftime("%H:%M:%S")
    have = f"{len(req.approved_by)}/{req.approvals_required}"
    who = f" by {event.actor}" if event.actor else ""
    why = f": {event.reason}" if event.reason else ""
    return escape(
        f"{at} {event.type:<14} {req.id}  {req.state:<9} {have:>5}  {req.tool_name}"
        f"  asked by {req.requested_by}{who}{why}"
    )


@approvals_app.command("watch")
def approvals_watch(
    ctx: typer.Context,
    request_id: Annotated[
        str, typer.Option("--request", help="Only this request (e.g. your own call's).")
    ] = "",
    timeout: Annotated[
        float | None, typer.Option("--timeout", help="Stop after this many seconds.")
    ] = None,
    address: AddressOpt = None,
) -> None:
    """Print the open requests you may see, then every change as it happens."""
    with _client(ctx, address) as client:
        try:
            for event in client.watch_approval_requests(request_id, timeout_s=timeout):
                typer.echo(_event_line(event))
        except grpc.RpcError as err:
            if err.code() is not grpc.StatusCode.DEADLINE_EXCEEDED:
                _rpc_failed(err, client.address)
        except KeyboardInterrupt:
            pass


# -------------------------------------------------------------------- keys


@keys_app.command("generate")
def keys_generate(
    out: Annotated[
        Path, typer.Option("--out", help="Where to write the private key (PEM, mode 600).")
    ],
    install: Annotated[
        Path | None,
        typer.Option(
            "--install", help="Development mode: also trust this key in this data directory."
        ),
    ] = None,
) -> None:
    """Make an approver key pair; print the public key to paste into the policy."""
    import os

    from registry_server.signing.keys import generate_keypair

    if out.exists():
        fail(f"{out} exists; refusing to overwrite a key", 2)
    private_pem, public_text = generate_keypair()
    out.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(out, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "wb") as f:
        f.write(private_pem)
    approver = out.name.split(".")[0]
    public_file = out.with_name(f"{approver}.pub")
    public_file.write_text(public_text + "\n")
    typer.echo(f"private key: {out} (keep it secret; it never goes to the server)")
    typer.echo(f"public key:  {public_text}")
    typer.echo(f'policy entry: {{id: {approver}, public_key: "{public_text}", groups: [...]}}')
    if install is not None:
        target = install / "approvers" / f"{approver}.pub"
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_text(public_text + "\n")
        typer.echo(f"trusted in development mode as approver '{approver}': {target}")


# ------------------------------------------------------------------ policy


def _info_line(info: Any) -> str:
    if not info.policy_digest:
        return "development mode (no policy file)"
    loaded = info.policy_loaded_at.ToDatetime().strftime("%Y-%m-%d %H:%M:%S")
    return f"policy {info.policy_source} digest {info.policy_digest} loaded {loaded} UTC"


@policy_app.command("check")
def policy_check(file: Path) -> None:
    """Validate a policy file offline, as the server would load it (exit 2 when not)."""
    from registry_server.policy.loader import load_policy
    from registry_server.policy.model import PolicyError

    try:
        policy = load_policy(file)
    except PolicyError as exc:
        fail("\n".join(exc.problems), 2)
    typer.echo(
        f"{file}: ok, digest {policy.digest}; {len(policy.clients)} client(s),"
        f" {len(policy.approvers)} approver(s), {len(policy.rules)} rule(s)"
    )


@policy_app.command("reload")
def policy_reload(ctx: typer.Context, address: AddressOpt = None) -> None:
    """Make the server, and every server on its store, re-read its policy
    file (admins). A file that does not load is refused; the old policy stays."""
    with _client(ctx, address) as client:
        try:
            info = client.reload_policy()
        except grpc.RpcError as err:
            _rpc_failed(err, client.address)
    typer.echo(f"reloaded: {_info_line(info)}")


@policy_app.command("show")
def policy_show(ctx: typer.Context, address: AddressOpt = None) -> None:
    """Which policy the server enforces (compare digests across servers)."""
    with _client(ctx, address) as client:
        try:
            info = client.server_info()
        except grpc.RpcError as err:
            _rpc_failed(err, client.address)
    typer.echo(_info_line(info))


# ------------------------------------------------------------------- audit


DataDirOpt = Annotated[
    Path | None,
    typer.Option("--data-dir", envvar="TOOLREG_DATA_DIR", help="The server's data directory."),
]


StoreUrlOpt = Annotated[
    str | None,
    typer.Option(
        "--store-url",
        envvar="TOOLREG_STORE_URL",
        help="The server's store (default: in --data-dir).",
    ),
]


def _open_store(data_dir: Path | None, store_url: str | None) -> Any:
    from registry_server.api.app import open_store
    from registry_server.api.config import DEFAULT_DATA_DIR, default_store_url

    url = store_url or default_store_url(data_dir or DEFAULT_DATA_DIR)
    try:
        return open_store(url, must_exist=True)
    except ToolregError as exc:
        fail(exc.message, 2)


@audit_app.command("verify")
def audit_verify(data_dir: DataDirOpt = None, store_url: StoreUrlOpt = None) -> None:
    """Walk the hash chain; exit 1 at the first broken record."""
    from registry_server.store import audit_chain as audit

    store = _open_store(data_dir, store_url)
    verdict = audit.verify(store)
    store.close()
    typer.echo(str(verdict))
    if not verdict.ok:
        raise typer.Exit(1)


@audit_app.command("tail")
def audit_tail(
    count: Annotated[int, typer.Option("-n", help="How many records.")] = 20,
    data_dir: DataDirOpt = None,
    store_url: StoreUrlOpt = None,
) -> None:
    """Show the most recent audit records, one JSON line each."""
    from registry_server.store import audit_chain as audit

    store = _open_store(data_dir, store_url)
    for entry in audit.tail(store, count):
        typer.echo(json.dumps(entry, ensure_ascii=False))
    store.close()


# --------------------------------------------------------------------- mcp


@app.command("mcp")
def mcp_serve(
    ctx: typer.Context,
    max_level: LevelOpt = None,
    category: CategoryOpt = None,
    address: AddressOpt = None,
    log_level: Annotated[str, typer.Option("--log-level", envvar="TOOLREG_LOG_LEVEL")] = "INFO",
    http: Annotated[
        str | None,
        typer.Option(
            "--http", metavar="HOST:PORT", help="Serve Streamable HTTP at HOST:PORT/mcp, not stdio."
        ),
    ] = None,
    policy: Annotated[
        Path | None,
        typer.Option(
            "--policy",
            help="With --http: accept the bearer tokens of this policy's clients (the server's"
            " policy file); each MCP client is then its own registry client.",
        ),
    ] = None,
    insecure_dev: Annotated[
        bool,
        typer.Option(
            "--insecure-dev",
            help="With --http and no --policy: no authentication; loopback only (development).",
        ),
    ] = False,
    allow_host: Annotated[
        list[str] | None,
        typer.Option("--allow-host", help="With --http: another Host to accept, NAME:PORT."),
    ] = None,
    allow_origin: Annotated[
        list[str] | None,
        typer.Option(
            "--allow-origin", help="With --http: a browser Origin to accept (default: none)."
        ),
    ] = None,
    http_tls_cert: Annotated[
        Path | None, typer.Option("--http-tls-cert", help="With --http: serve HTTPS (PEM).")
    ] = None,
    http_tls_key: Annotated[
        Path | None, typer.Option("--http-tls-key", help="With --http: the key (PEM).")
    ] = None,
    max_sessions: Annotated[
        int | None, typer.Option("--max-sessions", help="With --http: open sessions (64).")
    ] = None,
    session_idle_s: Annotated[
        float | None,
        typer.Option("--session-idle-s", help="With --http: close idle sessions after (600 s)."),
    ] = None,
    max_body_bytes: Annotated[
        int | None,
        typer.Option("--max-body-bytes", help="With --http: request body cap (1 MiB + 64 KiB)."),
    ] = None,
) -> None:
    """Serve the registry's tools as an MCP server, for MCP hosts: over stdio,
    or over Streamable HTTP with --http.

    Lists the tools this client may see and runs calls through ExecuteTool; a
    call with a progress token runs through StreamExecuteTool and reports its
    output as progress. A dangerous call answers with its approval request id;
    once approved, call again with "_approval_request_id": ID added to the
    arguments. Over stdio the registry sees --token; over HTTP it sees the bearer
    token each MCP client sends, checked against --policy (401 otherwise).
    Without a policy, HTTP is refused unless --insecure-dev on loopback. Logs go
    to stderr (over stdio, stdout is the MCP channel)."""
    from registry_server.client import mcp_bridge

    level = _level(max_level)
    try:
        mcp_bridge.configure_logging(log_level)
    except ValueError as exc:
        fail(f"--log-level: {exc}", 2)
    http_only = {
        "--policy": policy is not None, "--insecure-dev": insecure_dev,
        "--allow-host": bool(allow_host), "--allow-origin": bool(allow_origin),
        "--http-tls-cert": http_tls_cert is not None, "--http-tls-key": http_tls_key is not None,
        "--max-sessions": max_sessions is not None, "--session-idle-s": session_idle_s is not None,
        "--max-body-bytes": max_body_bytes is not None,
    }  # fmt: skip
    if http is None:
        given = [name for name, set_ in http_only.items() if set_]
        if given:
            fail(f"{', '.join(given)}: only with --http", 2)
        with _client(ctx, address) as client:
            mcp_bridge.serve(client, max_level=level, categories=category or ())
        return
    _serve_mcp_http(
        ctx, address, http, policy=policy, insecure_dev=insecure_dev,
        allowed_hosts=allow_host or (), allowed_origins=allow_origin or (),
        tls_cert=http_tls_cert, tls_key=http_tls_key, max_sessions=max_sessions,
        session_idle_s=session_idle_s, max_body_bytes=max_body_bytes,
        max_level=level, categories=category or (),
    )  # fmt: skip


def _serve_mcp_http(
    ctx: typer.Context, address: str | None, endpoint: str, *, policy: Path | None, **options: Any
) -> None:
    from registry_server.client import mcp_http, mcp_http_settings

    conn = ctx.find_root().obj
    if policy is not None and isinstance(conn, Connection) and conn.token:
        # One fixed identity for every MCP client would share its roles and approvals.
        fail(
            "--token/TOOLREG_TOKEN does not apply to --http with --policy: each MCP client's"
            " own bearer token is its registry identity",
            2,
        )
    try:
        settings = mcp_http_settings.http_settings(endpoint, policy_file=policy, **options)
    except ToolregError as exc:
        fail(exc.message, 2)
    _client(ctx, address).close()  # the TLS files are read now, not at the first request
    try:
        mcp_http.serve_http(
            lambda token: _client(ctx, address, token=token),
            settings,
            address=address or client_mod.default_address(),
        )
    except ToolregError as exc:
        fail(exc.message)


# ----------------------------------------------------------------- console


@app.command("console")
def console_serve(
    ctx: typer.Context,
    address: AddressOpt = None,
    http: Annotated[
        str, typer.Option("--http", metavar="HOST:PORT", help="Where to serve the page.")
    ] = "127.0.0.1:8780",
    policy: Annotated[
        Path | None,
        typer.Option(
            "--policy",
            help="The server's policy file: its approvers sign in with their client tokens.",
        ),
    ] = None,
    allow_host: Annotated[
        list[str] | None, typer.Option("--allow-host", help="Another Host to accept, NAME:PORT.")
    ] = None,
    http_tls_cert: Annotated[
        Path | None, typer.Option("--http-tls-cert", help="Serve HTTPS (PEM).")
    ] = None,
    http_tls_key: Annotated[Path | None, typer.Option("--http-tls-key", help="The key.")] = None,
    max_sessions: Annotated[
        int | None, typer.Option("--max-sessions", help="Signed-in sessions at once (32).")
    ] = None,
    session_idle_s: Annotated[
        float | None, typer.Option("--session-idle-s", help="End idle sessions after (900 s).")
    ] = None,
    max_body_bytes: Annotated[
        int | None, typer.Option("--max-body-bytes", help="Request body cap (64 KiB).")
    ] = None,
    log_level: Annotated[str, typer.Option("--log-level", envvar="TOOLREG_LOG_LEVEL")] = "INFO",
) -> None:
    """Serve the approval console: a web page where approvers see, live, the
    requests they may approve, read each in full (checked against its digests)
    and sign it in their browser with their own key, which never leaves it.

    Approvers sign in with their client token from --policy; each is then its
    own registry client. Beyond loopback it needs --http-tls-cert/--http-tls-key."""
    import logging

    from registry_server.client.console.app import serve_console
    from registry_server.client.console.settings import ConsoleSettings

    conn = ctx.find_root().obj
    if isinstance(conn, Connection) and conn.token:
        fail(
            "--token/TOOLREG_TOKEN does not apply to the console: each approver's own client"
            " token is its registry identity",
            2,
        )
    try:
        logging.basicConfig(
            stream=sys.stderr, level=log_level.upper(), format="%(asctime)s %(name)s %(message)s"
        )
    except ValueError as exc:
        fail(f"--log-level: {exc}", 2)
    try:
        settings = ConsoleSettings.from_options(
            http, policy_file=policy, allowed_hosts=tuple(allow_host or ()),
            tls_cert=http_tls_cert, tls_key=http_tls_key, max_sessions=max_sessions,
            session_idle_s=session_idle_s, max_body_bytes=max_body_bytes,
        )  # fmt: skip
    except ToolregError as exc:
        fail(exc.message, 2)
    _client(ctx, address).close()  # the TLS files are read now, not at the first sign-in
    try:
        serve_console(
            lambda token: _client(ctx, address, token=token),
            settings,
            address=address or client_mod.default_address(),
        )
    except ToolregError as exc:
        fail(exc.message)


def main() -> None:
    try:
        app()
    except KeyboardInterrupt:
        sys.exit(130)


if __name__ == "__main__":
    main()
