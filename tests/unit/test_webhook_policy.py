"""Webhook endpoints in the policy: what the loader accepts, and every
refusal naming the file, the line and the field."""

from __future__ import annotations

from pathlib import Path

import pytest

from registry_server.policy.loader import load_policy
from registry_server.policy.model import PolicyError
from registry_server.policy.webhooks import MAX_WEBHOOKS, is_loopback

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "policy.yaml"

BASE = """\
audience: toolreg-test
console_url: https://console.example/toolreg/
webhooks:
  - id: chat
    url: https://hooks.example/x
    events: [opened, approved, rejected, expired]
    secret_env: TOOLREG_WEBHOOK_CHAT
    format: slack
    timeout_s: 3
  - id: local
    url: http://127.0.0.1:9000/hook
    events: [consumed]
    secret_file: /etc/toolreg/local.whsec
"""


def refusal(tmp_path: Path, text: str) -> str:
    path = tmp_path / "policy.yaml"
    path.write_text(text)
    with pytest.raises(PolicyError) as info:
        load_policy(path)
    message = str(info.value)
    assert str(path) in message
    return message


def with_webhook(**fields: str) -> str:
    """BASE's first endpoint with ``fields`` replacing (or, valued "", removing) its keys."""
    entry = {
        "id": "chat",
        "url": "https://hooks.example/x",
        "events": "[opened]",
        "secret_env": "TOOLREG_WEBHOOK_CHAT",
    }
    entry.update(fields)
    lines = [f"    {k}: {v}" for k, v in entry.items() if v != ""]
    lines[0] = "  - " + lines[0].lstrip()
    return "audience: x\nwebhooks:\n" + "\n".join(lines) + "\n"


def test_endpoints_and_console_url_load(tmp_path: Path) -> None:
    path = tmp_path / "p.yaml"
    path.write_text(BASE)
    policy = load_policy(path)
    chat, local = policy.webhooks
    assert policy.console_url == "https://console.example/toolreg"  # trailing slash dropped
    assert (chat.id, chat.format, chat.timeout_s, chat.secret_env) == (
        "chat", "slack", 3.0, "TOOLREG_WEBHOOK_CHAT",
    )  # fmt: skip
    assert chat.wants("OPENED") and not chat.wants("CONSUMED")
    assert (local.format, local.timeout_s, local.secret_file) == (
        "standard", 5.0, "/etc/toolreg/local.whsec",
    )  # fmt: skip
    assert local.where.endswith("p.yaml line 10: webhooks[1]")
    assert "hooks.example" not in repr(chat)  # a URL may hold a credential (Slack's do)


def test_the_example_policys_webhook_loads_once_uncommented(tmp_path: Path) -> None:
    """The example keeps its webhook commented out (servers started with it
    have no secret file); uncommented, it is a valid endpoint."""
    text = EXAMPLE.read_text()
    start = text.index("\n# webhooks:\n") + 1
    end = text.find("\n\n", start)
    block = text[start : len(text) if end < 0 else end].splitlines()
    uncommented = "\n".join(line.removeprefix("# ") for line in block)
    path = tmp_path / "policy.yaml"
    path.write_text(text[:start] + uncommented + "\n")
    policy = load_policy(path)
    assert [(w.id, w.format, w.secret_file) for w in policy.webhooks] == [
        ("chat", "slack", "/etc/toolreg/chat.whsec")
    ]
    assert policy.console_url == "https://toolreg.example/console"
    assert load_policy(EXAMPLE).webhooks == ()


@pytest.mark.parametrize(
    ("fields", "expected"),
    [
        ({"url": "http://hooks.example/x"}, "line 4: webhooks[0].url: must use https"),
        ({"url": "ftp://hooks.example/x"}, "url: must be an https:// URL with a host"),
        ({"url": "https://user:pw@hooks.example/x"}, "url: must not carry a user or password"),
        ({"url": "https://hooks.example/x#frag"}, "url: must not have a #fragment"),
        ({"url": "https://hooks.example:99999/x"}, "url: is not a valid URL"),
        ({"url": "https://" + "a" * 2100}, "url: at most 2048 characters"),
        ({"events": "[]"}, "line 5: webhooks[0].events: List should have at least 1 item"),
        ({"events": "[opened, bogus]"}, "events: unknown event 'bogus'"),
        ({"events": "[opened, opened]"}, "events: repeats an event"),
        ({"secret_env": ""}, "webhooks[0]: needs exactly one of secret_file or secret_env"),
        ({"secret_file": "/etc/x.whsec"}, "needs exactly one of secret_file or secret_env"),
        ({"secret_env": "lower_case"}, "secret_env: must be an environment variable name"),
        ({"secret_env": "", "secret_file": "relative.whsec"}, "secret_file: must be an absolute"),
        ({"format": "teams"}, "webhooks[0].format: "),
        ({"timeout_s": "0"}, "timeout_s: must be greater than 0"),
        ({"timeout_s": "31"}, "timeout_s: must be less than or equal to 30"),
        ({"ca_file": "ca.pem"}, "ca_file: must be an absolute path"),
        ({"url": "http://127.0.0.1:1/x", "ca_file": "/ca.pem"}, "ca_file is for https URLs only"),
        ({"id": "Chat Room"}, "webhooks[0].id: 'Chat Room' is not a valid webhook id"),
        ({"retries": "3"}, "line 7: webhooks[0].retries: unknown key"),
    ],
)
def test_bad_endpoints_are_refused_with_file_line_and_field(
    tmp_path: Path, fields: dict[str, str], expected: str
) -> None:
    assert expected in refusal(tmp_path, with_webhook(**fields))


def test_loopback_http_is_allowed_for_local_receivers(tmp_path: Path) -> None:
    for url in ("http://127.0.0.1:8080/x", "http://localhost/x", "http://[::1]:9/x"):
        path = tmp_path / "p.yaml"
        path.write_text(with_webhook(url=url))
        assert load_policy(path).webhooks[0].url == url
    assert is_loopback("127.9.9.9") and not is_loopback("10.0.0.1")
    assert not is_loopback("localhost.example")


def test_duplicate_ids_too_many_endpoints_and_a_bad_console_url(tmp_path: Path) -> None:
    entry = with_webhook().split("webhooks:\n")[1]
    twice = "audience: x\nwebhooks:\n" + entry + entry
    assert "line 7: webhooks[1].id: duplicate webhook id 'chat' (also webhooks[0])" in refusal(
        tmp_path, twice
    )
    many = "audience: x\nwebhooks:\n" + entry * (MAX_WEBHOOKS + 1)
    assert f"at most {MAX_WEBHOOKS} items" in refusal(tmp_path, many)
    assert "console_url: must use https" in refusal(
        tmp_path, "audience: x\nconsole_url: http://console.example\n"
    )
    assert "console_url: must not have a ?query" in refusal(
        tmp_path, "audience: x\nconsole_url: https://console.example/?a=1\n"
    )
