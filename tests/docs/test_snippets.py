"""Every policy and tool-manifest snippet of the docs loads as the server would
load it.

Scope: README.md and every docs/**/*.md, each ```yaml block whose top-level
keys are all keys of one kind of file:
- a policy: every key a policy file's (audience, approvers, clients, ...),
  checked with the server's loader (`toolreg policy check`'s
  registry_server.policy.loader.load_policy);
- a tool manifest: every key a manifest's (name, sandbox, parameters, ...),
  checked with registry_server.domain.manifests.load_manifest (`toolreg tools
  register`'s parser).
Other YAML (Kubernetes objects, CI files) is neither and is not checked here.

A page often shows one section of a file (`approval_rules:` alone, a
manifest's `sandbox:`): the required keys it leaves out are taken from
SECTION_BASE, and a policy that shows rules but no approvers gets approvers
enough for the groups its rules name (approvers_for), so every key it does show is checked in full (unknown keys,
types, the loader's cross-checks). The one placeholder a page may write in a
snippet is an approver's key as `NAME_PUBLIC_KEY` (the first-approved-call
tutorial's, filled in with sed there): each is checked as a new Ed25519 key.

A snippet that cannot load as it stands (values elided for the reader) is
marked with a first line `# fragment: <reason>` (or `<!-- fragment: <reason>
-->` before its fence), listed in FRAGMENTS below, and shows as a skipped test.
"""

from __future__ import annotations

import base64
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from cryptography.hazmat.primitives.serialization import Encoding, PublicFormat

from registry_server.domain.manifests import load_manifest
from registry_server.domain.models import ToolManifest
from registry_server.policy.loader import load_policy
from registry_server.policy.schema import _PolicyIn
from tests.docs.blocks import Block, fenced_blocks

ROOT = Path(__file__).resolve().parents[2]
POLICY_KEYS = frozenset(_PolicyIn.model_fields)
MANIFEST_KEYS = frozenset(ToolManifest.model_fields)
SECTION_BASE: dict[str, dict[str, Any]] = {
    "policy": {"audience": "toolreg-docs"},
    "manifest": {
        "name": "docs_snippet",
        "description": "A snippet of the docs, completed for the check.",
        "parameters": {"type": "object"},
        "sandbox": {"image": "toolreg/base", "command": ["cat"]},
    },
}
KEY_PLACEHOLDER = re.compile(r"\b[A-Z][A-Z0-9_]*_PUBLIC_KEY\b")

# Every snippet marked as a fragment, by page, with the reason the page gives.
FRAGMENTS: dict[str, list[str]] = {
    "docs/how-to/approvals.md": ["credential ids and keys shortened (...) for the page"],
}


def approvers_for(rules: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Approvers enough for every group the rules name: the rest of the file of
    a page that shows its rules alone."""
    need: dict[str, int] = {}
    for rule in rules:
        for group in rule.get("groups") or []:
            need[group] = max(need.get(group, 0), int(rule.get("approvals_required", 1)))
    return [
        {"id": f"{group}-{i}", "public_key": _new_key(), "groups": [group]}
        for group, count in need.items()
        for i in range(count)
    ]


def _new_key() -> str:
    raw = Ed25519PrivateKey.generate().public_key().public_bytes(Encoding.Raw, PublicFormat.Raw)
    return base64.b64encode(raw).decode()


def pages() -> list[Path]:
    return [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]


def kind(block: Block) -> str:
    """ "policy", "manifest", or "" for YAML that is neither."""
    try:
        data = yaml.safe_load("\n".join(block.lines))
    except yaml.YAMLError:
        return "policy" if block.mark else ""  # a fragment may not parse; others must
    if not isinstance(data, dict) or not data:
        return ""
    keys = set(data)
    if keys <= POLICY_KEYS:
        return "policy"
    if keys <= MANIFEST_KEYS:
        return "manifest"
    return ""


def snippets() -> Iterator[object]:
    for page in pages():
        for block in fenced_blocks(page):
            if block.lang in ("yaml", "yml") and (found := kind(block)):
                rel = block.path.relative_to(ROOT)
                yield pytest.param(block, found, id=f"{rel}:{block.line}")


@pytest.mark.parametrize(("block", "what"), list(snippets()))
def test_snippet_loads(block: Block, what: str, tmp_path: Path) -> None:
    if block.mark:
        pytest.skip(f"{block.mark}: {block.reason}")
    keys: dict[str, str] = {}
    text = KEY_PLACEHOLDER.sub(lambda m: keys.setdefault(m[0], _new_key()), "\n".join(block.lines))
    data = yaml.safe_load(text)
    missing = {k: v for k, v in SECTION_BASE[what].items() if k not in data}
    if what == "policy" and "approvers" not in data:
        missing["approvers"] = approvers_for(data.get("approval_rules") or [])
    if missing:
        text += "\n" + yaml.safe_dump(missing, sort_keys=False)
    file = tmp_path / "snippet.yaml"
    file.write_text(text, encoding="utf-8")
    try:
        load_policy(file) if what == "policy" else load_manifest(file)
    except Exception as exc:
        where = f"{block.path.relative_to(ROOT)} line {block.line}"
        pytest.fail(
            f"{where}: the {what} snippet does not load:\n{exc}\n--- as checked ---\n{text}"
        )


def test_fragments_are_listed() -> None:
    """Every snippet marked as a fragment is in FRAGMENTS, and nothing else is."""
    found: dict[str, list[str]] = {}
    for page in pages():
        reasons = sorted(
            b.reason
            for b in fenced_blocks(page)
            if b.lang in ("yaml", "yml") and b.mark == "fragment"
        )
        if reasons:
            found[str(page.relative_to(ROOT))] = reasons
    assert found == {page: sorted(reasons) for page, reasons in FRAGMENTS.items()}


def test_the_checks_can_fail(tmp_path: Path) -> None:
    """A wrong value in a policy section and a broken manifest are refused."""
    wrong_rule = Block(ROOT / "page.md", 1, "yaml", "yaml", ["approval_rules: [{match: 3}]"])
    assert kind(wrong_rule) == "policy"
    with pytest.raises(pytest.fail.Exception, match="does not load"):
        test_snippet_loads(wrong_rule, "policy", tmp_path)
    bad_tool = Block(ROOT / "page.md", 1, "yaml", "yaml", ["name: Bad-Name", "sandbox: {}"])
    with pytest.raises(pytest.fail.Exception, match="does not load"):
        test_snippet_loads(bad_tool, "manifest", tmp_path)
