"""Pages (AIP-158, domain/pages.py): the page token codec (tampering, other
queries, size caps), page sizes, keyset pages of tools over a changing
registry with the listing cache, approval requests a page at a time with the
in-memory store (ties on created_at, state filters, who may see what), and the
client's following of tokens."""

from __future__ import annotations

import base64
import hashlib
import hmac
import json
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from registry_server.approvals import service as approvals_service
from registry_server.approvals.service import (
    DEFAULT_REQUESTS_PAGE,
    MAX_REQUESTS_PAGE,
    Approvals,
    Viewer,
)
from registry_server.catalog.registry import Registry
from registry_server.catalog.views import DEFAULT_TOOLS_PAGE, MAX_TOOLS_PAGE, RegistryViews
from registry_server.client.registry_client import follow_pages, join_json_arrays
from registry_server.domain import strict_json
from registry_server.domain.errors import InvalidArgument
from registry_server.domain.models import ToolDefinition
from registry_server.domain.pages import (
    MAX_PAGE_TOKEN_CHARS,
    PAGE_KEY_BYTES,
    PageQuery,
    PageTokens,
    page_size,
)
from registry_server.policy.loader import load_policy
from registry_server.signing.keys import generate_keypair
from registry_server.store.base import (
    APPROVED,
    CONSUMED,
    EXPIRED,
    PENDING,
    ApprovalRequestRecord,
    StoredTool,
)
from registry_server.store.memory import MemoryStore
from registry_server.store.page_key import page_tokens
from tests.factories import sha, tool

KEY = bytes(range(PAGE_KEY_BYTES))
TOOLS = PageQuery.of("tools", level="", categories=[])


def refused(call: Callable[[], object]) -> InvalidArgument:
    """The INVALID_ARGUMENT a call raises; it must name page_token."""
    with pytest.raises(InvalidArgument) as info:
        call()
    assert info.value.message.startswith("page_token: ")
    assert [v.field for v in info.value.violations] == ["page_token"]
    return info.value


def forge(payload: dict[str, Any], key: bytes = KEY) -> str:
    """A token as the server makes them, with any payload, under ``key``."""
    raw = json.dumps(payload, separators=(",", ":")).encode()
    mac = hmac.new(key, raw, hashlib.sha256).digest()
    return base64.urlsafe_b64encode(raw + mac).rstrip(b"=").decode()


# ---------------------------------------------------------------- the codec


def test_a_token_says_where_the_next_page_starts() -> None:
    tokens = PageTokens(KEY)
    token = tokens.issue(TOOLS, ("write_file",))
    assert len(token) < 200 and "=" not in token
    assert tokens.read(token, TOOLS, (str,)) == ("write_file",)
    assert tokens.read("", TOOLS, (str,)) is None  # the first page
    key = (1_732_551_234.123456789, "0f" * 16)  # a float survives exactly
    approvals = PageQuery.of("approvals", state="PENDING", viewer="agent-1")
    assert tokens.read(tokens.issue(approvals, key), approvals, (float, str)) == key


def test_a_token_is_the_same_for_the_same_page() -> None:
    """Deterministic: a page's answer (token included) can be cached."""
    assert PageTokens(KEY).issue(TOOLS, ("a",)) == PageTokens(KEY).issue(TOOLS, ("a",))


def test_every_altered_character_is_refused() -> None:
    tokens = PageTokens(KEY)
    token = tokens.issue(TOOLS, ("write_file",))
    for i, char in enumerate(token):
        for other in {"A", "b", "_", "-"} - {char}:
            altered = token[:i] + other + token[i + 1 :]
            err = refused(lambda altered=altered: tokens.read(altered, TOOLS, (str,)))
            assert "not a page token this registry issued" in err.message


@pytest.mark.parametrize(
    "token",
    ["x", "!!!!", "AAAA", "a b", "abc=", "aGVsbG8", "é" * 10, "\x00" * 40, "A" * 60],
)
def test_garbage_and_truncation_are_refused(token: str) -> None:
    refused(lambda: PageTokens(KEY).read(token, TOOLS, (str,)))


def test_truncated_tokens_are_refused() -> None:
    token = PageTokens(KEY).issue(TOOLS, ("write_file",))
    for cut in (1, 5, len(token) // 2, len(token) - 1):
        refused(lambda cut=cut: PageTokens(KEY).read(token[:cut], TOOLS, (str,)))


def test_another_key_means_not_ours() -> None:
    """A token of another store (or made by whoever does not hold the key)."""
    theirs = PageTokens(bytes(PAGE_KEY_BYTES)).issue(TOOLS, ("a",))
    refused(lambda: PageTokens(KEY).read(theirs, TOOLS, (str,)))
    forged = forge({"v": 1, "k": "tools", "q": TOOLS.digest, "a": ["a"]}, key=b"x" * 32)
    refused(lambda: PageTokens(KEY).read(forged, TOOLS, (str,)))


def test_a_token_of_another_query_is_refused_by_name() -> None:
    tokens = PageTokens(KEY)
    token = tokens.issue(TOOLS, ("a",))
    for other in (
        PageQuery.of("tools", level="safe", categories=[]),
        PageQuery.of("tools", level="", categories=["text"]),
        PageQuery.of("schemas", level="", categories=[]),  # same filters, another listing
        PageQuery.of("schemas", format="openai", level="", categories=[]),
    ):
        err = refused(lambda other=other: tokens.read(token, other, (str,)))
        assert "issued for another query" in err.message
    schemas = PageQuery.of("schemas", format="openai", level="", categories=[])
    anthropic = PageQuery.of("schemas", format="anthropic", level="", categories=[])
    refused(lambda: tokens.read(tokens.issue(schemas, ("a",)), anthropic, (str,)))


def test_length_is_capped_before_any_decoding(monkeypatch: pytest.MonkeyPatch) -> None:
    decoded: list[str] = []
    monkeypatch.setattr(
        "registry_server.domain.pages._b64decode", lambda text: decoded.append(text) or b""
    )
    err = refused(lambda: PageTokens(KEY).read("A" * (MAX_PAGE_TOKEN_CHARS + 1), TOOLS, (str,)))
    assert err.message == f"page_token: longer than {MAX_PAGE_TOKEN_CHARS} characters"
    assert decoded == []


def test_authentic_but_malformed_payloads_are_refused() -> None:
    """What only a key holder could make, checked all the same."""
    tokens = PageTokens(KEY)
    base = {"v": 1, "k": "tools", "q": TOOLS.digest, "a": ["a"]}
    for payload in (
        {**base, "v": 2},
        {**base, "a": "a"},
        {**base, "a": []},
        {**base, "a": [1]},
        {**base, "a": ["a", "b"]},
        [base],
    ):
        refused(lambda payload=payload: tokens.read(forge(payload), TOOLS, (str,)))  # type: ignore[arg-type]
    approvals = PageQuery.of("approvals", state="", viewer="x")
    good = {"v": 1, "k": "approvals", "q": approvals.digest}
    assert tokens.read(forge({**good, "a": [5, "id"]}), approvals, (float, str)) == (5, "id")
    for key in (["5", "id"], [True, "id"], [1e400, "id"], [None, "id"]):
        refused(lambda key=key: tokens.read(forge({**good, "a": key}), approvals, (float, str)))
    refused(lambda: tokens.read(forge({**good, "a": [5, "x"]})[:-1] + "=", approvals, (str,)))


def test_a_key_must_be_long_enough() -> None:
    with pytest.raises(ValueError):
        PageTokens(b"short")


@pytest.mark.parametrize(
    ("requested", "expected"), [(0, 100), (1, 1), (7, 7), (1_000, 1_000), (5_000, 1_000)]
)
def test_page_sizes(requested: int, expected: int) -> None:
    assert page_size(requested, 100, 1_000) == expected


def test_a_negative_page_size_is_named() -> None:
    with pytest.raises(InvalidArgument) as info:
        page_size(-1, 100, 1_000)
    assert [v.field for v in info.value.violations] == ["page_size"]
    with pytest.raises(InvalidArgument) as info:
        page_size(-3, 50, 500, "limit")
    assert info.value.message == "limit: must not be negative"


def test_the_store_keeps_one_key_for_every_server() -> None:
    store = MemoryStore()
    first, second = page_tokens(store), page_tokens(store)
    token = first.issue(TOOLS, ("a",))
    assert second.read(token, TOOLS, (str,)) == ("a",)  # another server, the same store
    refused(lambda: page_tokens(MemoryStore()).read(token, TOOLS, (str,)))


# ------------------------------------------------------------- tools, keyset


def registry_with(names: list[str]) -> Registry:
    """A registry loading ``names`` from its store (one unit of work for all)."""
    store = MemoryStore()
    with store.unit_of_work() as uow:
        for name in names:
            made = tool(name=name)
            manifest = strict_json.dumps(made.as_manifest())
            uow.put_tool(StoredTool(name, manifest, made.digest, "[operator]"), time.time())
    return Registry(store)


def pages_of(
    views: RegistryViews,
    size: int,
    between: Callable[[list[str]], None] = lambda names: None,
    query: PageQuery = TOOLS,
    registry: Registry | None = None,
) -> list[list[str]]:
    """Every page of the listing, names only; ``between(page)`` runs after each."""
    assert registry is not None
    out: list[list[str]] = []
    token = ""
    while True:
        names, token = views.page(
            query,
            size,
            token,
            lambda: [(t.name, t.name) for t in registry.list()],
            lambda items, next_token: (list(items), next_token),
        )
        out.append(names)
        if not token:
            return out
        between(names)


@pytest.fixture(scope="module")
def listing() -> tuple[list[str], Registry]:
    """Tools for two default pages, in a registry the tests only read."""
    names = [f"tool_{i:04d}" for i in range(DEFAULT_TOOLS_PAGE + 30)]
    return names, registry_with(names)


@pytest.mark.parametrize("size", [1, 7, 0, 100, 1_000])
def test_pages_cover_the_listing_once(listing: tuple[list[str], Registry], size: int) -> None:
    names, registry = listing
    pages = pages_of(RegistryViews(registry, PageTokens(KEY)), size, registry=registry)
    flat = [n for page in pages for n in page]
    assert flat == names
    expected = size or DEFAULT_TOOLS_PAGE
    assert all(len(p) == expected for p in pages[:-1]) and 0 < len(pages[-1]) <= expected


def test_no_size_is_the_default_page_and_large_sizes_are_cut(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    default, maximum = 10, 25  # the default and the cap, lowered: fewer tools to make
    monkeypatch.setattr("registry_server.catalog.views.DEFAULT_TOOLS_PAGE", default)
    monkeypatch.setattr("registry_server.catalog.views.MAX_TOOLS_PAGE", maximum)
    registry = registry_with([f"tool_{i:04d}" for i in range(maximum + 20)])
    views = RegistryViews(registry, PageTokens(KEY))

    def first(size: int) -> tuple[list[str], str]:
        return views.page(
            TOOLS, size, "", lambda: [(t.name, t.name) for t in registry.list()],
            lambda items, token: (list(items), token),
        )  # fmt: skip

    names, token = first(0)
    assert len(names) == default and token
    names, token = first(10 * maximum)
    assert len(names) == maximum and token
    assert (DEFAULT_TOOLS_PAGE, MAX_TOOLS_PAGE) == (100, 1_000)  # the real ones


def test_an_exact_last_page_has_no_token() -> None:
    registry = registry_with([f"tool_{i}" for i in range(10)])
    pages = pages_of(RegistryViews(registry, PageTokens(KEY)), 5, registry=registry)
    assert [len(p) for p in pages] == [5, 5]


def test_tools_present_throughout_are_listed_once_while_others_come_and_go() -> None:
    """Between every two pages, new tools are registered just before and just
    after the cursor and at both ends; every tool present from the first page
    to the last is listed exactly once, none twice."""
    original = [f"tool_{i:03d}" for i in range(0, 240, 2)]  # even numbers: room between
    registry = registry_with(original)
    after: list[str] = []  # registered after the cursor of their time
    before: list[str] = []

    def change(page: list[str]) -> None:
        last = page[-1]  # the cursor
        for name in (f"{last}_a", f"{page[0]}_b", f"a{len(before):04d}", f"z{len(after):04d}"):
            if registry.find(name) is None:
                registry.register(tool(name=name))
                (after if name > last else before).append(name)

    views = RegistryViews(registry, PageTokens(KEY))
    flat = [n for p in pages_of(views, 7, change, registry=registry) for n in p]
    assert len(flat) == len(set(flat))  # nothing twice
    assert [n for n in flat if n in set(original)] == original  # all of them, in order
    assert flat == sorted(flat)
    # AIP-158 leaves tools added meanwhile to chance; with keyset pages, those
    # after the cursor are reached and those before it are not.
    assert set(after) <= set(flat) and not set(before) & set(flat)
    assert len(after) > 30 and len(before) > 30  # both kinds, many times


def test_a_cursor_whose_tool_is_gone_still_works() -> None:
    tokens = PageTokens(KEY)
    registry = registry_with(["alpha", "delta", "gamma"])
    views = RegistryViews(registry, tokens)
    token = tokens.issue(TOOLS, ("beta",))  # as if "beta" had been the last and was removed
    names, _ = views.page(
        TOOLS, 10, token, lambda: [(t.name, t.name) for t in registry.list()],
        lambda items, next_token: (list(items), next_token),
    )  # fmt: skip
    assert names == ["delta", "gamma"]


def test_the_listing_is_built_once_for_all_its_pages() -> None:
    """Paging through 300 tools one at a time converts them once, not per page,
    and pages already answered are not built again."""
    registry = registry_with([f"tool_{i:03d}" for i in range(300)])
    views = RegistryViews(registry, PageTokens(KEY))
    built: list[int] = []
    answered: list[int] = []

    def listing() -> list[tuple[str, str]]:
        built.append(1)
        return [(t.name, t.name) for t in registry.list()]

    def page(size: int, token: str) -> tuple[list[str], str]:
        def answer(items: Any, next_token: str) -> tuple[list[str], str]:
            answered.append(1)
            return list(items), next_token

        return views.page(TOOLS, size, token, listing, answer)

    token, seen = "", 0
    while True:
        items, token = page(1, token)
        seen += len(items)
        if not token:
            break
    assert (seen, len(built), len(answered)) == (300, 1, 300)
    page(0, "")
    page(0, "")
    assert (len(built), len(answered)) == (1, 301)  # the second first page: cached
    registry.register(tool(name="tool_new"))
    assert len(page(0, "")[0]) == DEFAULT_TOOLS_PAGE and len(built) == 2  # stale at once


def test_views_refuse_bad_tokens_and_sizes() -> None:
    registry = registry_with(["a"])
    views = RegistryViews(registry, PageTokens(KEY))

    def call(size: int, token: str) -> object:
        return views.page(TOOLS, size, token, lambda: [], lambda items, t: t)

    refused(lambda: call(0, "garbage"))
    refused(lambda: call(0, PageTokens.ephemeral().issue(TOOLS, ("a",))))
    with pytest.raises(InvalidArgument) as info:
        call(-1, "")
    assert [v.field for v in info.value.violations] == ["page_size"]


# ------------------------------------------------------- approval requests


def approvals_env(tmp_path: Path) -> tuple[MemoryStore, Registry, Approvals]:
    """alice approves for ops, bob for security; tidy_files needs ops (category
    files), run_shell matches no rule (any approver)."""
    keys = {who: generate_keypair()[1] for who in ("alice", "bob")}
    path = tmp_path / "policy.yaml"
    path.write_text(f"""\
audience: toolreg-test
approvers:
  - {{id: alice, public_key: "{keys["alice"]}", groups: [ops]}}
  - {{id: bob, public_key: "{keys["bob"]}", groups: [security]}}
approval_rules:
  - match: {{category: files}}
    approvals_required: 1
    groups: [ops]
clients:
  - {{id: agent-1, token_sha256: "{sha("a1")}", roles: [execute], max_safety_level: dangerous}}
""")
    store = MemoryStore()
    registry = Registry(store)
    registry.register(tool(name="run_shell", safety_level="dangerous", categories=[]))
    registry.register(tool(name="tidy_files", safety_level="dangerous", categories=["files"]))
    return store, registry, Approvals(store, load_policy(path), registry)


def add_requests(
    store: MemoryStore,
    registry: Registry,
    count: int,
    start: int = 0,
    tool_of: Callable[[int], str] = lambda i: "tidy_files" if i % 4 == 0 else "run_shell",
    state_of: Callable[[int], str] = lambda i: APPROVED if i % 3 == 0 else PENDING,
) -> list[ApprovalRequestRecord]:
    """``count`` requests, three at a time sharing one created_at (ties go by
    id); every 5th by agent-2, the others by agent-1."""
    now = time.time()
    records = []
    for i in range(start, start + count):
        made: ToolDefinition = registry.get(tool_of(i))
        records.append(ApprovalRequestRecord(
            id=f"{i:032x}", tool_name=made.name, tool_digest=made.digest, arguments_json="{}",
            arguments_digest="0" * 64, requested_by="agent-2" if i % 5 == 0 else "agent-1",
            approvals_required=1, state=state_of(i), created_at=now - 10_000 + i // 3,
            expires_at=now + 3_600, tool_manifest=strict_json.dumps(made.as_manifest()),
            tool_owner=made.owner,
        ))  # fmt: skip
    with store.unit_of_work() as uow:
        for record in records:
            uow.add_request(record)
    return records


def newest_first(records: list[ApprovalRequestRecord]) -> list[str]:
    return [r.id for r in sorted(records, key=lambda r: (r.created_at, r.id), reverse=True)]


def all_pages(
    approvals: Approvals, viewer: Viewer, size: int, state: str = "", **kw: Any
) -> list[list[str]]:
    tokens = PageTokens(KEY)
    out, token = [], ""
    while True:
        page = approvals.page_requests(state, size, token, viewer, tokens, **kw)
        out.append([r.id for r in page.items])
        token = page.next_page_token
        if not token:
            return out


ADMIN = Viewer("admin", sees_all=True, admin=True)
Requests = tuple[Approvals, list[ApprovalRequestRecord]]


@pytest.fixture(scope="module")
def requests(tmp_path_factory: pytest.TempPathFactory) -> Requests:
    """120 requests (add_requests) that the tests using them only page through."""
    store, registry, approvals = approvals_env(tmp_path_factory.mktemp("requests"))
    return approvals, add_requests(store, registry, 120)


@pytest.mark.parametrize("size", [1, 7, 0, 50, 120, 500])
def test_approval_requests_page_newest_first_with_ties(requests: Requests, size: int) -> None:
    approvals, records = requests
    pages = all_pages(approvals, ADMIN, size)
    assert [i for p in pages for i in p] == newest_first(records)
    expected = size or DEFAULT_REQUESTS_PAGE
    assert all(len(p) == expected for p in pages[:-1])


def test_approval_requests_page_within_a_state(requests: Requests) -> None:
    approvals, records = requests
    for state in (PENDING, APPROVED):
        want = newest_first([r for r in records if r.state == state])
        assert [i for p in all_pages(approvals, ADMIN, 7, state.lower()) for i in p] == want
    assert all_pages(approvals, ADMIN, 7, CONSUMED) == [[]]
    # a token of one state is refused for another (the same viewer)
    tokens = PageTokens(KEY)
    token = approvals.page_requests(PENDING, 5, "", ADMIN, tokens).next_page_token
    assert approvals.page_requests(" pending ", 5, token, ADMIN, tokens).items  # normalised
    refused(lambda: approvals.page_requests(APPROVED, 5, token, ADMIN, tokens))
    refused(lambda: approvals.page_requests(PENDING, 5, token, Viewer("agent-1"), tokens))


def test_requests_made_between_pages_do_not_disturb_the_rest(tmp_path: Path) -> None:
    store, registry, approvals = approvals_env(tmp_path)
    records = add_requests(store, registry, 120)
    tokens = PageTokens(KEY)
    seen: list[str] = []
    token, extra = "", 1_000
    while True:
        page = approvals.page_requests("", 9, token, ADMIN, tokens)
        seen += [r.id for r in page.items]
        token = page.next_page_token
        if not token:
            break
        add_requests(store, registry, 2, start=extra)  # newer: before the cursor
        extra += 2
    assert seen == newest_first(records)


def test_expiry_between_pages_moves_a_request_out_of_pending(tmp_path: Path) -> None:
    store, registry, approvals = approvals_env(tmp_path)
    records = add_requests(store, registry, 30, state_of=lambda i: PENDING)
    tokens = PageTokens(KEY)
    first = approvals.page_requests(PENDING, 10, "", ADMIN, tokens)
    later = newest_first(records)[15]
    with store.unit_of_work() as uow:  # the sweep stores it EXPIRED meanwhile
        assert uow.expire_request(later, time.time() + 7_200)
    rest = all_pages(approvals, ADMIN, 10, PENDING)
    second = approvals.page_requests(PENDING, 100, first.next_page_token, ADMIN, tokens)
    assert [r.id for r in second.items] == [i for i in newest_first(records)[10:] if i != later]
    assert sum(map(len, rest)) == 29
    assert [r.id for r in approvals.page_requests(EXPIRED, 0, "", ADMIN, tokens).items] == [later]


def test_an_agent_pages_through_its_own_requests_only(requests: Requests) -> None:
    approvals, records = requests
    own = newest_first([r for r in records if r.requested_by == "agent-2"])
    pages = all_pages(approvals, Viewer("agent-2"), 5)
    assert [i for p in pages for i in p] == own and all(len(p) == 5 for p in pages[:-1])


def test_an_approver_pages_through_what_it_may_approve(requests: Requests) -> None:
    """bob (security) may approve run_shell (any approver) but not tidy_files
    (ops only): its pages are full pages of what it may see."""
    approvals, records = requests
    bobs = newest_first([r for r in records if r.tool_name == "run_shell"])
    pages = all_pages(approvals, Viewer("bob-cli", approver="bob"), 7)
    assert [i for p in pages for i in p] == bobs
    assert all(len(p) == 7 for p in pages[:-1])
    alice = Viewer("alice-cli", approver="alice")  # ops: both tools
    assert [i for p in all_pages(approvals, alice, 50) for i in p] == newest_first(records)


def test_an_approver_page_reads_a_bounded_number_of_rows(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """When few rows are the approver's, a page stops after the scan cap with a
    token to go on from the last row read: short (even empty) pages, none lost,
    and no page reads more than the cap."""
    store, registry, approvals = approvals_env(tmp_path)
    records = add_requests(
        store, registry, 40, tool_of=lambda i: "run_shell" if i % 10 == 0 else "tidy_files"
    )
    monkeypatch.setattr(approvals_service, "MAX_REQUESTS_SCANNED", 10)
    monkeypatch.setattr(approvals_service, "SCAN_BATCH", 4)
    rows: list[int] = []
    real = type(store.reading().__enter__()).requests

    def counted(self: Any, **kw: Any) -> list[ApprovalRequestRecord]:
        found: list[ApprovalRequestRecord] = real(self, **kw)
        rows.append(len(found))
        return found

    monkeypatch.setattr(type(store.reading().__enter__()), "requests", counted)
    tokens = PageTokens(KEY)
    bob = Viewer("bob-cli", approver="bob")  # security: run_shell only
    pages, token = [], ""
    while True:
        rows.clear()
        page = approvals.page_requests("", 50, token, bob, tokens)
        assert sum(rows) <= 10
        pages.append([r.id for r in page.items])
        token = page.next_page_token
        if not token:
            break
    wanted = newest_first([r for r in records if r.tool_name == "run_shell"])
    assert [i for p in pages for i in p] == wanted
    assert [] in pages  # a page of hidden rows only: empty, with a token to go on
    alice = Viewer("alice-cli", approver="alice")  # ops: both tools, pages of 10 at most
    assert [i for p in all_pages(approvals, alice, 50) for i in p] == newest_first(records)


def test_the_deprecated_limit_is_the_page_size(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    maximum = 150  # the cap, lowered (above the 120 first made): fewer requests to make
    monkeypatch.setattr(approvals_service, "MAX_REQUESTS_PAGE", maximum)
    store, registry, approvals = approvals_env(tmp_path)
    add_requests(store, registry, 120)
    tokens = PageTokens(KEY)
    assert len(approvals.page_requests("", 0, "", ADMIN, tokens, limit=7).items) == 7
    assert len(approvals.page_requests("", 3, "", ADMIN, tokens, limit=7).items) == 3
    assert len(approvals.page_requests("", 0, "", ADMIN, tokens, limit=9_999).items) == 120
    page = approvals.page_requests("", 10_000, "", ADMIN, tokens)
    assert len(page.items) == 120 and not page.next_page_token
    add_requests(store, registry, maximum, start=200)
    assert len(approvals.page_requests("", 10_000, "", ADMIN, tokens).items) == maximum
    assert len(approvals.page_requests("", 0, "", ADMIN, tokens, limit=9_999).items) == maximum
    assert MAX_REQUESTS_PAGE == 500  # the real one
    with pytest.raises(InvalidArgument) as info:
        approvals.page_requests("", 0, "", ADMIN, tokens, limit=-1)
    assert info.value.message == "limit: must not be negative"
    with pytest.raises(InvalidArgument) as info:
        approvals.page_requests("", -1, "", ADMIN, tokens)
    assert info.value.message == "page_size: must not be negative"
    with pytest.raises(InvalidArgument):
        approvals.page_requests("DONE", 0, "", ADMIN, tokens)


# ------------------------------------------------------------- the client side


def test_following_pages_stops_on_the_empty_token_and_on_a_repeated_one() -> None:
    answers = {"": ([1, 2], "t1"), "t1": ([], "t2"), "t2": ([3], "")}
    assert list(follow_pages(lambda token: answers[token])) == [1, 2, 3]
    with pytest.raises(RuntimeError, match="repeated a page token"):
        list(follow_pages(lambda token: ([1], "same")))


def test_schema_pages_join_into_one_array_with_their_text_unchanged() -> None:
    pages = ['[{"a":1.0}]', "[]", '[{"b":[]} , {"c":"]"}]']
    joined = join_json_arrays(pages)
    assert joined == '[{"a":1.0},{"b":[]} , {"c":"]"}]'
    assert json.loads(joined) == [{"a": 1.0}, {"b": []}, {"c": "]"}]
    assert join_json_arrays(["[]"]) == "[]" and join_json_arrays(["[]", "[]"]) == "[]"
    with pytest.raises(ValueError):
        join_json_arrays(["[]", "{}"])
