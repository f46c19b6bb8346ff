"""`toolreg policy`: check, explain and test a policy file offline; reload
and show the server's."""

from __future__ import annotations

import json
from datetime import UTC, datetime
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any

import grpc
import typer

from registry_server.cli.common import AddressOpt, connect, fail, rpc_failed
from registry_server.client.terminal import escape

if TYPE_CHECKING:
    from registry_server.policy.model import Policy

policy_app = typer.Typer(
    help="Check, explain, test, reload and show the policy.", no_args_is_help=True
)

# The variable `toolreg serve` reads its policy file from (api/config.py).
POLICY_ENV = "TOOLREG_POLICY_FILE"
PolicyFileArg = Annotated[
    Path | None,
    typer.Argument(
        envvar=POLICY_ENV,
        show_default=False,
        help=f"The policy file (default: ${POLICY_ENV}, as `toolreg serve` reads it).",
    ),
]


def _info_line(info: Any) -> str:
    if not info.policy_digest:
        return "development mode (no policy file)"
    loaded = info.policy_loaded_at.ToDatetime().strftime("%Y-%m-%d %H:%M:%S")
    return f"policy {info.policy_source} digest {info.policy_digest} loaded {loaded} UTC"


@policy_app.command("check")
def policy_check(file: PolicyFileArg = None) -> None:
    """Validate a policy file offline, as the server would load it (exit 2 when not)."""
    policy = _load(file)
    typer.echo(
        f"{file}: ok, digest {policy.digest}; {len(policy.clients)} client(s),"
        f" {len(policy.approvers)} approver(s), {len(policy.rules)} rule(s)"
        + (f", {len(policy.deny_rules)} deny rule(s)" if policy.deny_rules else "")
    )


@policy_app.command("reload")
def policy_reload(ctx: typer.Context, address: AddressOpt = None) -> None:
    """Make the server, and every server on its store, re-read its policy
    file (admins). A file that does not load is refused; the old policy stays.
    In development mode the server re-reads its approver keys."""
    with connect(ctx, address) as client:
        try:
            info = client.reload_policy()
        except grpc.RpcError as err:
            rpc_failed(err, client.address)
    if info.policy_digest:
        typer.echo(f"reloaded: {_info_line(info)}")
    else:  # nothing to read but the keys `toolreg keys generate --install` puts there
        typer.echo("reloaded: development mode (no policy file): the approver keys in the"
                   " server's data directory were read again")  # fmt: skip


@policy_app.command("show")
def policy_show(ctx: typer.Context, address: AddressOpt = None) -> None:
    """Which policy the server enforces (compare digests across servers)."""
    with connect(ctx, address) as client:
        try:
            info = client.server_info()
        except grpc.RpcError as err:
            rpc_failed(err, client.address)
    typer.echo(_info_line(info))


def _load(file: Path | None) -> Policy:
    """The policy file, loaded as the server would (exit 2 when it does not load)."""
    from registry_server.policy.loader import load_policy
    from registry_server.policy.model import PolicyError

    if file is None:
        fail(f"no policy file: give FILE or set {POLICY_ENV}", 2)
    try:
        return load_policy(file)
    except PolicyError as exc:
        fail("\n".join(exc.problems), 2)


@policy_app.command("explain")
def policy_explain(
    file: PolicyFileArg = None,
    tool: Annotated[
        str | None,
        typer.Option(
            "--tool",
            help="The tool's name (with --manifest DIR: which of its tools).",
            show_default=False,
        ),
    ] = None,
    args: Annotated[str, typer.Option("--args", help="The call's arguments (a JSON object).")] = (
        "{}"
    ),
    client: Annotated[
        str, typer.Option("--client", help="The calling client's id.", show_default=False)
    ] = "",
    level: Annotated[
        str | None,
        typer.Option(
            "--level",
            help="The tool's level without --manifest: safe, cautious or dangerous"
            " (default: dangerous).",
            show_default=False,
        ),
    ] = None,
    category: Annotated[
        list[str] | None,
        typer.Option("--category", help="A category of the tool, without --manifest (repeatable)."),
    ] = None,
    egress_host: Annotated[
        list[str] | None,
        typer.Option(
            "--egress-host", help="A host the tool reaches, without --manifest (repeatable)."
        ),
    ] = None,
    manifest: Annotated[
        Path | None,
        typer.Option(
            "--manifest",
            help="The tool's manifest (or a directory of them, as for `serve --tools`):"
            " its level, categories and egress, and its JSON Schema and guards are checked.",
        ),
    ] = None,
    owner: Annotated[
        str,
        typer.Option(
            "--owner",
            help="The client that registered the tool (tool.owner; with --manifest its"
            " register grant is checked). The tools of `serve --tools` are \\[operator]'s.",
        ),
    ] = "",
    at: Annotated[
        str | None,
        typer.Option(
            "--at",
            help="The call's time, ISO 8601 with its zone (default: now).",
            show_default=False,
        ),
    ] = None,
    claims: Annotated[
        str | None,
        typer.Option("--claims", help="The caller's identity provider token claims (JSON)."),
    ] = None,
    group: Annotated[
        list[str] | None,
        typer.Option(
            "--group",
            help="A group of the caller's identity provider token, for a client the"
            " provider's groups make (repeatable; default: from --claims).",
        ),
    ] = None,
) -> None:
    """What the policy decides for one call, and why (offline).

    Every deny and approval rule (matched or not, each condition true, false
    or erring), the approvals and approver groups required and who can give
    them, and the client's roles, quotas and register grant.

    The tool comes from --manifest, else from --tool with --level (default
    dangerous: only dangerous tools need approvals), --category and
    --egress-host. Without a manifest the arguments are not checked against
    a JSON Schema or guards. Exit 0 whatever the decision; 2 when the policy
    or the call is unusable.

    Example: toolreg policy explain examples/policy.yaml --tool deploy
    --args '{"env": "prod"}' --client agent-1
    """
    from registry_server.policy.explain import Call, ExplainError, explain

    policy = _load(file)
    if not client:
        fail("--client: required (the id of the client that calls)", 2)
    the_tool, definition = _tool(tool, level, category, egress_host, manifest, owner)
    call = Call(
        the_tool, args, client, _time(at), claims=_claims(claims),
        idp_groups=None if group is None else frozenset(group), definition=definition,
    )  # fmt: skip
    try:
        explanation = explain(policy, call)
    except ExplainError as exc:
        option = {"client": "--client", "groups": "--group", "claims": "--claims"}
        fail(f"{option.get(exc.field, '--' + exc.field)}: {exc.message}", 2)
    typer.echo(escape(explanation.render(), keep_newlines=True), nl=False)


def _tool(
    name: str | None,
    level: str | None,
    categories: list[str] | None,
    egress_hosts: list[str] | None,
    manifest: Path | None,
    owner: str,
) -> tuple[Any, Any]:
    """The tool's facts and, from a manifest, its definition."""
    import re

    from registry_server.domain.errors import ToolregError
    from registry_server.domain.manifests import load_manifests
    from registry_server.domain.models import CATEGORY_PATTERN, NAME_PATTERN, SafetyLevel
    from registry_server.policy.conditions import ToolFacts
    from registry_server.policy.explain import manifest_tool

    if manifest is not None:
        given = [
            option for option, value in
            (("--level", level), ("--category", categories), ("--egress-host", egress_hosts))
            if value
        ]  # fmt: skip
        if given:
            fail(f"{', '.join(given)}: the manifest says; give either --manifest or these", 2)
        if not manifest.exists():
            fail(f"--manifest: {manifest}: no such file or directory", 2)
        try:
            tools = load_manifests(manifest)
        except ToolregError as exc:
            fail(f"--manifest: {exc.message}", 2)
        found = [t for t in tools if name is None or t.name == name]
        if len(found) != 1:
            names = ", ".join(t.name for t in tools) or "none"
            wanted = f"no tool {name!r}" if name else "several tools; choose one with --tool"
            fail(f"--manifest: {manifest} has {wanted} (it has: {names})", 2)
        return manifest_tool(found[0], owner)
    if name is None:
        fail("--tool: required (the tool's name), or --manifest", 2)
    if not re.fullmatch(NAME_PATTERN, name):
        fail(f"--tool: not a tool name: {name!r}", 2)
    try:
        parsed = SafetyLevel.parse(level or "dangerous")
    except ValueError as exc:
        fail(f"--level: {exc}", 2)
    for cat in categories or ():
        if not re.fullmatch(CATEGORY_PATTERN, cat):
            fail(f"--category: not a category: {cat!r}", 2)
    facts = ToolFacts(
        name=name, level=parsed.value, categories=tuple(sorted(set(categories or ()))),
        owner=owner, egress_hosts=tuple(dict.fromkeys(egress_hosts or ())),
    )  # fmt: skip
    return facts, None


def _time(text: str | None) -> datetime:
    from registry_server.policy.explain import parse_time

    if text is None:
        return datetime.now(UTC)
    try:
        return parse_time(text)
    except ValueError as exc:
        fail(str(exc), 2)


def _claims(text: str | None) -> dict[str, Any]:
    if text is None:
        return {}
    try:
        value = json.loads(text)
    except ValueError as exc:
        fail(f"--claims: not JSON: {exc}", 2)
    if not isinstance(value, dict):
        fail("--claims: must be a JSON object", 2)
    return value


@policy_app.command("test")
def policy_test(
    file: Annotated[Path, typer.Argument(help="The policy file.", show_default=False)],
    tests: Annotated[
        Path, typer.Argument(help="The tests file (YAML; see examples/policy.tests.yaml).")
    ],
) -> None:
    """Run policy unit tests: the decision each call of TESTS must get (offline).

    Each case of TESTS is a call (tool, args, client, optional at, claims,
    groups) and the decision the policy must give it: forbidden, invalid,
    denied, refused, approval or allowed, with the deny rule, or the
    approvals, groups and rules (examples/policy.tests.yaml says how). Prints
    PASS or FAIL per case; exit 1 when any fails, 2 when a file is unusable."""
    from registry_server.policy.policy_tests import TestsFileError, load_tests, run

    policy = _load(file)
    try:
        cases = load_tests(tests, datetime.now(UTC))
    except TestsFileError as exc:
        fail("\n".join(exc.problems), 2)
    results = run(policy, cases)
    for result in results:
        typer.echo(escape(result.line(), keep_newlines=True))
    failed = sum(1 for r in results if not r.passed)
    typer.echo(f"{len(results) - failed} passed, {failed} failed ({tests} against {file})")
    if failed:
        raise typer.Exit(1)
