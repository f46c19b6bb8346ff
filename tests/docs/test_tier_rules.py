"""The tier's own rules, without a server: each row of the normalisation table,
the reading of a console block, and the marks that leave a block out."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.docs.blocks import commands, fenced_blocks
from tests.docs.test_console_examples import matches, normalise, server_argv

PATHS = {"workdir": Path("/tmp/toolreg-docs-x/work"), "home": Path("/tmp/toolreg-docs-x/home")}


@pytest.mark.parametrize(
    ("given", "becomes"),
    [
        ("cd /tmp/toolreg-docs-x/work/sub", "cd <workdir>/sub"),
        ("kept in /tmp/toolreg-docs-x/home/.config", "kept in <home>/.config"),
        ("wrote /tmp/tmp.kvr1AgDgTu/out", "wrote <tmp>"),
        ("asked at 2026-11-29 05:35:38 UTC; expires", "asked at <time>; expires"),
        ('"ts": "2026-11-29T05:35:06.513+00:00"', '"ts": "<time>"'),
        ('"at": 1795930545.022596,', '"at": <time>,'),
        ("id 0f8fad5b-d9cb-469f-a165-70867728950e.", "id <id>."),
        (
            "digest 8ef002fe95559edfa6b5d07e6579855ae13dcfb9889160d041620ae124370eeb)",
            "digest <digest>)",
        ),
        (
            "approval request 3b7c854b4afc46b9b569bacb22635087: 0 of 2",
            "approval request <id>: 0 of 2",
        ),
        ("registered greet (6ab2f218f376)", "registered greet (<digest>)"),
        ("head 442d57999b3beb4d", "head <digest>"),
        ("public key:  zokV8GJz2xi+8CsyM4162eLtt+b4M4LBJ/UBJJ1COT0=", "public key:  <key>"),
        ("serving on 127.0.0.1:41479 and [::1]:50051", "serving on <address> and <address>"),
        (
            '"duration_ms": 80, took 12 ms, 0.52 s',
            '"duration_ms": <duration>, took <duration>, <duration>',
        ),
        # what must stay: counts, small numbers, words that look like hex
        ("12 records, 2 of 2 approvals, exit 1", "12 records, 2 of 2 approvals, exit 1"),
        ("deadbeef and a 13-digit 1234567890123", "deadbeef and a 13-digit 1234567890123"),
    ],
)
def test_normalise(given: str, becomes: str) -> None:
    assert normalise(given, PATHS) == becomes


def test_ellipsis_takes_any_lines() -> None:
    assert matches(["a", "...", "z"], ["a", "z"])
    assert matches(["a", "...", "z"], ["a", "b", "c", "z"])
    assert not matches(["a", "...", "z"], ["a", "b"])
    assert not matches(["a"], ["a", "b"])  # no ellipsis: exactly
    assert not matches([], ["printed"])  # nothing shown: nothing printed


def test_console_block_reading(tmp_path: Path) -> None:
    page = tmp_path / "page.md"
    page.write_text(
        "text\n"
        "```console\n"
        "# commentary before the first command\n"
        "$ toolreg exec echo \\\n"
        "    --args '{}'\n"
        "out 1\n"
        "\n"
        "out 2\n"
        "\n"
        "# commentary after\n"
        "$ cat > p.yaml <<EOF\n"
        "$ not a command: in the here-document\n"
        "EOF\n"
        "$ true\n"
        "```\n"
        "<!-- not run: needs an IdP -->\n"
        "```console\n"
        "$ toolreg login\n"
        "```\n"
        "```console skip\n"
        "$ x\n"
        "```\n"
        "```yaml\n"
        "# fragment: values elided\n"
        "a: 1\n"
        "```\n"
    )
    first, idp, skip, yaml = fenced_blocks(page)
    found = commands(first)
    assert [c.text for c in found] == [
        "toolreg exec echo \\\n    --args '{}'",
        "cat > p.yaml <<EOF\n$ not a command: in the here-document\nEOF",
        "true",
    ]
    assert [c.expected for c in found] == [["out 1", "", "out 2"], [], []]
    assert [c.line for c in found] == [4, 11, 14]
    assert (first.mark, idp.mark, idp.reason) == ("", "not run", "needs an IdP")
    assert skip.mark == "not run"
    assert (yaml.mark, yaml.reason) == ("fragment", "values elided")


def test_the_pages_server() -> None:
    argv = server_argv(
        "toolreg serve --port 50061 --policy policy.yaml --tools examples/tools 2> log &"
    )
    assert argv is not None
    assert argv[1:] == ["serve", "--port", "0", "--policy", "policy.yaml", "--tools", argv[-1]]
    assert argv[-1].endswith("/examples/tools") and argv[-1].startswith("/")
    assert server_argv("make run    # serve the example tools")[-2:] == [
        "--data-dir",
        ".toolreg/data",
    ]  # type: ignore[index]
    assert server_argv("toolreg tools list") is None
    assert server_argv("make test") is None
