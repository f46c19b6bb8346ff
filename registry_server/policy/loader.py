"""The policy file (docs/how-to/deploying.md): who may approve what, which clients may do what,
and the sandbox ceilings of each safety level.

The YAML is validated in two passes: pydantic input models (strict, frozen,
unknown keys forbidden) check each field, then cross-checks catch what no
single field shows (duplicate ids and credentials, one key serving two
approvers, rules naming groups nobody is in, rules no set of approvers can
satisfy). Every problem names the file, the YAML line of the offending node
when there is one, and the field path. The validated file becomes a frozen
``Policy`` that the server only reads.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import replace
from pathlib import Path
from types import MappingProxyType
from typing import Any

import yaml
from pydantic import ValidationError

from registry_server.domain.models import (
    SafetyLevel,
)
from registry_server.policy.clients import UNRESTRICTED, Client, Quota, RegisterGrant, Role
from registry_server.policy.conditions import Scope, compile_condition
from registry_server.policy.identity import GroupGrant, IdentityProvider
from registry_server.policy.model import (
    MAX_POLICY_BYTES,
    ApprovalRule,
    Approver,
    DenyRule,
    EgressPolicy,
    Policy,
    PolicyError,
    QuotaPolicy,
    RuleMatch,
)
from registry_server.policy.schema import (
    _ApproverIn,
    _CeilingIn,
    _ClientIn,
    _IdentityProviderIn,
    _PolicyIn,
    _QuotaIn,
    _RegisterIn,
)
from registry_server.signing.keys import public_key_from_text, raw_public_bytes
from registry_server.signing.passkeys import PasskeyCredential, WebAuthnSettings
from registry_server.signing.passkeys import public_key_from_text as passkey_key_from_text

Loc = tuple[int | str, ...]


def load_policy(path: Path) -> Policy:
    """Read and validate the policy file; PolicyError lists every problem."""
    source = str(path)
    try:
        data = path.read_bytes()
    except OSError as exc:
        raise PolicyError(f"{source}: cannot read the policy file: {exc.strerror or exc}") from None
    if len(data) > MAX_POLICY_BYTES:
        raise PolicyError(f"{source}: larger than {MAX_POLICY_BYTES} bytes")
    root, raw = _parse_yaml(data, source)
    try:
        parsed = _PolicyIn.model_validate(raw)
    except ValidationError as exc:
        raise PolicyError(
            _problems(source, root, [(tuple(e["loc"]), _describe(e)) for e in exc.errors()])
        ) from None
    problems = _problems(source, root, list(_cross_check(parsed)))
    if problems:
        raise PolicyError(problems)
    # Each endpoint keeps where it was written: its secret is read only at the
    # server's start (notify/endpoints.py), whose errors must name the line too.
    webhooks = tuple(
        w.spec(f"{source} line {_line_of(root, ('webhooks', i))}: webhooks[{i}]")
        for i, w in enumerate(parsed.webhooks)
    )
    providers = tuple(
        _identity_provider(p, f"{source} line {_line_of(root, ('identity_providers', i))}")
        for i, p in enumerate(parsed.identity_providers)
    )
    return replace(
        _freeze(parsed, source), webhooks=webhooks, console_url=parsed.console_url or "",
        digest=hashlib.sha256(data).hexdigest(), identity_providers=providers,
    )  # fmt: skip


# libyaml's parser gives the same nodes and marks (line numbers) as the pure-Python
# one at a tenth of the time: a policy reload or `toolreg policy test` parses a few
# hundred lines. PyYAML built without libyaml falls back to the Python parser.
_YAML_LOADER = getattr(yaml, "CSafeLoader", yaml.SafeLoader)


def _parse_yaml(data: bytes, source: str) -> tuple[yaml.Node, dict[str, Any]]:
    """The node tree (for line numbers) and the plain data built from it."""
    loader = _YAML_LOADER(data)
    try:
        root = loader.get_single_node()
        if root is None:
            raise PolicyError(f"{source}: is empty; expected a mapping with at least 'audience'")
        duplicates = list(_duplicate_keys(root, ()))
        if duplicates:
            raise PolicyError(
                [_format(source, line, loc, message) for line, loc, message in sorted(duplicates)]
            )
        raw = loader.construct_document(root)
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f" line {mark.line + 1}, column {mark.column + 1}" if mark is not None else ""
        problem = getattr(exc, "problem", None) or str(exc)
        raise PolicyError(f"{source}{where}: not valid YAML: {problem}") from None
    finally:
        loader.dispose()
    if not isinstance(raw, dict):
        raise PolicyError(f"{source} line {root.start_mark.line + 1}: must be a mapping")
    return root, raw


def _duplicate_keys(node: yaml.Node, loc: Loc) -> Iterator[tuple[int, Loc, str]]:
    """PyYAML silently keeps the last of two equal keys; in a policy that would
    hide, say, a second public_key. Each node is visited once (aliases share nodes)."""
    seen: set[int] = set()
    stack: list[tuple[yaml.Node, Loc]] = [(node, loc)]
    while stack:
        current, where = stack.pop()
        if id(current) in seen:
            continue
        seen.add(id(current))
        if isinstance(current, yaml.MappingNode):
            keys: set[str] = set()
            for key, value in current.value:
                if isinstance(key, yaml.ScalarNode):
                    if key.value in keys:
                        line = key.start_mark.line + 1  # the repeat, not the first
                        yield line, (*where, key.value), f"duplicate key {key.value!r}"
                    keys.add(key.value)
                    stack.append((value, (*where, key.value)))
        elif isinstance(current, yaml.SequenceNode):
            stack.extend((item, (*where, i)) for i, item in enumerate(current.value))


def _cross_check(policy: _PolicyIn) -> Iterator[tuple[Loc, str]]:
    """The rules no single field can check."""
    first_id: dict[str, int] = {}
    first_key: dict[bytes, int] = {}
    for i, approver in enumerate(policy.approvers):
        if approver.id in first_id:
            first = first_id[approver.id]
            yield (
                ("approvers", i, "id"),
                f"duplicate approver id {approver.id!r} (also approvers[{first}])",
            )
        first_id.setdefault(approver.id, i)
        if approver.public_key is None:
            continue
        raw = raw_public_bytes(public_key_from_text(approver.public_key))
        if raw in first_key:
            other = first_key[raw]
            yield (
                ("approvers", i, "public_key"),
                (
                    f"same key as approvers[{other}] ({policy.approvers[other].id!r});"
                    " one key must not count as two approvers"
                ),
            )
        first_key.setdefault(raw, i)
    yield from _passkey_cross_check(policy)

    # Approvers whose ids a provider's subjects take may also be in the groups
    # its mappings give (policy/identity.py): count them as such here.
    idp_groups = {
        _prefix(p): {a for g in p.groups for a in g.approver_groups}
        for p in policy.identity_providers
    }

    def groups_of(approver: _ApproverIn) -> set[str]:
        given = (gs for prefix, gs in idp_groups.items() if approver.id.startswith(prefix))
        return set(approver.groups).union(*given)

    known_groups = {g for a in policy.approvers for g in groups_of(a)}
    first_match: dict[tuple[str | None, ...], int] = {}
    first_name: dict[str, str] = {}
    named = [("approval_rules", i, r.name) for i, r in enumerate(policy.approval_rules)]
    named += [("deny_rules", i, r.name) for i, r in enumerate(policy.deny_rules)]
    for where, i, name in named:
        if name is None:
            continue
        if name in first_name:
            yield ((where, i, "name"), f"duplicate rule name {name!r} (also {first_name[name]})")
        first_name.setdefault(name, f"{where}[{i}]")
    for i, rule in enumerate(policy.approval_rules):
        # Two rules for the same tool under different conditions are the point
        # of conditions; the same match under the same condition is a mistake.
        match = (rule.match.tool, rule.match.category, rule.match.level, rule.when)
        if match in first_match:
            first = first_match[match]
            yield (
                ("approval_rules", i, "match"),
                f"same match and condition as approval_rules[{first}]; this rule adds nothing",
            )
        first_match.setdefault(match, i)
        for j, group in enumerate(rule.groups):
            if group not in known_groups:
                yield (
                    ("approval_rules", i, "groups", j),
                    f"unknown group {group!r} (no approver is in it)",
                )
        eligible = sorted(
            {a.id for a in policy.approvers if not rule.groups or groups_of(a) & set(rule.groups)}
        )
        if rule.approvals_required > len(eligible):
            who = f" ({', '.join(eligible)})" if eligible else ""
            scope = f"in groups {', '.join(rule.groups)}" if rule.groups else "in the policy"
            yield (
                ("approval_rules", i, "approvals_required"),
                (
                    f"unsatisfiable rule: needs {rule.approvals_required} approvals but only"
                    f" {len(eligible)} approver(s){who} are {scope}"
                ),
            )

    seen: dict[tuple[str, str], int] = {}
    for i, client in enumerate(policy.clients):
        for name in ("id", "token_sha256", "mtls_subject"):
            value = getattr(client, name)
            if value is None:
                continue
            if (name, value) in seen:
                what = "client id" if name == "id" else f"credential ({name})"
                yield (
                    ("clients", i, name),
                    (f"duplicate {what}: same as clients[{seen[(name, value)]}]"),
                )
            seen.setdefault((name, value), i)
        if client.approver is not None and client.approver not in first_id:
            yield (("clients", i, "approver"), f"unknown approver {client.approver!r}")
        if client.grant is not None and "register" not in client.roles:
            yield (("clients", i, "register"), "given without the register role")

    yield from _identity_cross_check(policy)

    ids = [w.id for w in policy.webhooks]  # at most MAX_WEBHOOKS
    for i, webhook_id in enumerate(ids):
        if webhook_id in ids[:i]:
            first = ids.index(webhook_id)
            yield (
                ("webhooks", i, "id"),
                f"duplicate webhook id {webhook_id!r} (also webhooks[{first}])",
            )


def _passkey_cross_check(policy: _PolicyIn) -> Iterator[tuple[Loc, str]]:
    """One passkey (by id, or by key) counts for one approver; passkeys need a
    relying party (``webauthn``) to be verified against."""
    first_id: dict[str, tuple[int, int]] = {}
    first_key: dict[str, tuple[int, int]] = {}
    for i, approver in enumerate(policy.approvers):
        if approver.passkeys and policy.webauthn is None:
            yield (
                ("approvers", i, "passkeys"),
                "passkeys need the policy's webauthn: {rp_id, origins}",
            )
        for j, passkey in enumerate(approver.passkeys):
            for seen, value, what in (
                (first_id, passkey.id, "id"), (first_key, passkey.public_key, "public_key"),
            ):  # fmt: skip
                if value in seen:
                    a, b = seen[value]
                    yield (
                        ("approvers", i, "passkeys", j, what),
                        f"same passkey {what} as approvers[{a}].passkeys[{b}]"
                        f" ({policy.approvers[a].id!r}); one passkey must not count twice",
                    )
                seen.setdefault(value, (i, j))


def _identity_cross_check(policy: _PolicyIn) -> Iterator[tuple[Loc, str]]:
    providers = policy.identity_providers
    prefixes = [_prefix(p) for p in providers]
    for i, provider in enumerate(providers):
        for name in ("id", "issuer"):
            earlier = [p for p in providers[:i] if getattr(p, name) == getattr(provider, name)]
            if earlier:
                first = providers.index(earlier[0])
                yield (
                    ("identity_providers", i, name),
                    f"same {name} as identity_providers[{first}]",
                )
        for j, other in enumerate(prefixes):
            if j != i and prefixes[i].startswith(other) and (j < i or other != prefixes[i]):
                yield (
                    ("identity_providers", i, "client_id_prefix"),
                    f"{prefixes[i]!r} starts with identity_providers[{j}]'s prefix {other!r}:"
                    " their clients' ids could be the same",
                )
        groups = [g.group for g in provider.groups]
        for k, group in enumerate(groups):
            if group in groups[:k]:
                yield (("identity_providers", i, "groups", k, "group"), f"repeats group {group!r}")
    ids = {p.id for p in providers}
    pinned: dict[tuple[str, str], int] = {}
    for i, client in enumerate(policy.clients):
        for prefix in prefixes:
            if client.id.startswith(prefix):
                yield (
                    ("clients", i, "id"),
                    f"starts with {prefix!r}, an identity provider's client_id_prefix:"
                    " a subject of that provider could take this client's id",
                )
        if client.idp is None:
            continue
        if client.idp.provider not in ids:
            yield (
                ("clients", i, "idp", "provider"),
                f"unknown identity provider {client.idp.provider!r}",
            )
        key = (client.idp.provider, client.idp.subject)
        if key in pinned:
            yield (("clients", i, "idp"), f"same subject as clients[{pinned[key]}]")
        pinned.setdefault(key, i)


def _prefix(provider: _IdentityProviderIn) -> str:
    return provider.id + "." if provider.client_id_prefix is None else provider.client_id_prefix


def _identity_provider(p: _IdentityProviderIn, where: str) -> IdentityProvider:
    return IdentityProvider(
        id=p.id, issuer=p.issuer, audiences=tuple(p.audiences), algorithms=tuple(p.algorithms),
        clock_skew_s=p.clock_skew_s, max_token_lifetime_s=p.max_token_lifetime_s,
        client_claim=p.client_claim, groups_claim=p.groups_claim, client_id_prefix=_prefix(p),
        subject_ids=p.subject_ids,
        groups=tuple(
            GroupGrant(
                group=g.group, roles=frozenset(Role(r) for r in g.roles),
                max_safety_level=(
                    None if g.max_safety_level is None else SafetyLevel(g.max_safety_level)
                ),
                register=None if g.grant is None else _register_grant(g.grant),
                quota=None if g.quotas is None else _quota(g.quotas),
                approver_groups=tuple(g.approver_groups),
            )
            for g in p.groups
        ),
        denied_subjects=frozenset(p.denied_subjects), actors=frozenset(p.actors),
        jwks_uri=p.jwks_uri, ca_file=p.ca_file,
        allow_http_loopback=p.allow_http_loopback, jwks_refresh_s=p.jwks_refresh_s,
        min_refresh_interval_s=p.min_refresh_interval_s, where=where,
    )  # fmt: skip


def _freeze(policy: _PolicyIn, source: str) -> Policy:
    profiles: dict[SafetyLevel, Mapping[str, int]] = {}
    for level in SafetyLevel:
        ceiling: _CeilingIn | None = getattr(policy.profiles, level.value)
        if ceiling is not None:
            profiles[level] = MappingProxyType(ceiling.model_dump(exclude_none=True))
    return Policy(
        audience=policy.audience,
        approval_request_ttl_s=policy.approval_request_ttl_s,
        approvers=tuple(
            Approver(
                a.id,
                None if a.public_key is None else public_key_from_text(a.public_key),
                tuple(a.groups),
                tuple(
                    PasskeyCredential(a.id, p.id, passkey_key_from_text(p.public_key))
                    for p in a.passkeys
                ),
            )
            for a in policy.approvers
        ),
        webauthn=None
        if policy.webauthn is None
        else WebAuthnSettings(policy.webauthn.rp_id, tuple(policy.webauthn.origins)),
        rules=tuple(
            ApprovalRule(
                match=RuleMatch(
                    tool=r.match.tool,
                    category=r.match.category,
                    level=None if r.match.level is None else SafetyLevel(r.match.level),
                ),
                approvals_required=r.approvals_required,
                groups=tuple(r.groups),
                max_token_ttl_s=r.max_token_ttl_s,
                name=r.name or "",
                when=None if r.when is None else compile_condition(r.when, Scope.POLICY),
            )
            for r in policy.approval_rules
        ),
        deny_rules=tuple(
            DenyRule(
                name=r.name,
                reason=r.reason,
                match=None
                if r.match is None
                else RuleMatch(
                    tool=r.match.tool,
                    category=r.match.category,
                    level=None if r.match.level is None else SafetyLevel(r.match.level),
                ),
                when=None if r.when is None else compile_condition(r.when, Scope.POLICY),
            )
            for r in policy.deny_rules
        ),
        profiles=MappingProxyType(profiles),
        clients=tuple(
            Client(
                id=c.id,
                roles=frozenset(Role(r) for r in c.roles),
                max_safety_level=SafetyLevel(c.max_safety_level),
                token_sha256=c.token_sha256,
                mtls_subject=c.mtls_subject,
                register=_grant(c),
                approver=c.approver,
                quota=_quota(c.quotas),
                idp_subject=None if c.idp is None else (c.idp.provider, c.idp.subject),
            )
            for c in policy.clients
        ),
        quotas=QuotaPolicy(_quota(policy.quotas.default), policy.quotas.servers),
        egress=EgressPolicy(
            levels=frozenset(SafetyLevel(v) for v in policy.egress.levels),
            allow_private=tuple(policy.egress.allow_private),
            max_bytes_per_call=policy.egress.max_bytes_per_call,
            max_connections_per_call=policy.egress.max_connections_per_call,
        ),
        source=source,
    )


def _quota(given: _QuotaIn | None) -> Quota:
    return Quota() if given is None else Quota(**given.model_dump())


def _grant(client: _ClientIn) -> RegisterGrant:
    if "admin" in client.roles and client.grant is None:
        return UNRESTRICTED  # an operator's own client: trusted like the policy file
    return _register_grant(client.grant or _RegisterIn())


def _register_grant(given: _RegisterIn) -> RegisterGrant:
    return RegisterGrant(
        SafetyLevel(given.max_safety_level),
        tuple(given.images),
        egress=tuple(given.egress),
        secrets=frozenset(given.secrets),
    )


# ------------------------------------------------------------------- messages


def _problems(source: str, root: yaml.Node, found: Sequence[tuple[Loc, str]]) -> list[str]:
    """One line per problem, in file order (the order an operator fixes them)."""
    lines = sorted(
        ((_line_of(root, loc) or 0, index), _problem(source, root, loc, message))
        for index, (loc, message) in enumerate(found)
    )
    return [text for _, text in lines]


def _problem(source: str, root: yaml.Node, loc: Loc, message: str) -> str:
    name = _rule_name(root, loc)
    message = f"(rule {name}) {message}" if name else message
    return _format(source, _line_of(root, loc), loc, message)


def _rule_name(root: yaml.Node, loc: Loc) -> str | None:
    """The ``name`` of the approval or deny rule ``loc`` is in, if it has one
    (an operator looks rules up by name), read from the YAML as written."""
    if (
        len(loc) < 2
        or loc[0] not in ("approval_rules", "deny_rules")
        or not isinstance(loc[1], int)
        or loc[-1] == "name"
    ):
        return None
    rules = _value_of(root, str(loc[0]))
    if not isinstance(rules, yaml.SequenceNode) or not 0 <= loc[1] < len(rules.value):
        return None
    name = _value_of(rules.value[loc[1]], "name")
    if isinstance(name, yaml.ScalarNode) and isinstance(name.value, str):
        return name.value[:64]
    return None


def _value_of(node: yaml.Node, key: str) -> yaml.Node | None:
    if not isinstance(node, yaml.MappingNode):
        return None
    return next(
        (v for k, v in node.value if isinstance(k, yaml.ScalarNode) and k.value == key), None
    )


def _format(source: str, line: int | None, loc: Loc, message: str) -> str:
    path = _path(loc)
    where = f"{source} line {line}" if line is not None else source
    return f"{where}: {path}: {message}" if path else f"{where}: {message}"


def _path(loc: Loc) -> str:
    """("approvers", 1, "public_key") -> "approvers[1].public_key"."""
    out = ""
    for part in loc:
        out += f"[{part}]" if isinstance(part, int) else (f".{part}" if out else str(part))
    return out


def _line_of(root: yaml.Node, loc: Loc) -> int | None:
    """The 1-based line of the deepest node on ``loc``: the key itself for a
    mapping entry (an unknown or bad key), else the closest enclosing node
    (a missing key is reported at the mapping that lacks it)."""
    node: yaml.Node = root
    mark = root.start_mark
    for part in loc:
        if isinstance(node, yaml.MappingNode):
            entry = next(
                (
                    (k, v)
                    for k, v in node.value
                    if isinstance(k, yaml.ScalarNode) and k.value == str(part)
                ),
                None,
            )
            if entry is None:
                break
            mark = entry[0].start_mark
            node = entry[1]
        elif isinstance(node, yaml.SequenceNode) and isinstance(part, int):
            if not 0 <= part < len(node.value):
                break
            node = node.value[part]
            mark = node.start_mark
        else:
            break
    return mark.line + 1 if mark is not None else None


def _describe(error: Mapping[str, Any]) -> str:
    kind = error["type"]
    if kind == "extra_forbidden":
        return "unknown key"
    if kind == "missing":
        return "is required"
    if kind in ("dict_type", "model_type"):
        return "must be a mapping"
    if kind == "list_type":
        return "must be a list"
    if kind == "value_error" and "ctx" in error:
        return str(error["ctx"]["error"])
    # pydantic says "Input should be a valid string"; say what the field must be.
    return str(error["msg"]).replace("Input should be", "must be").replace("Value error, ", "")
