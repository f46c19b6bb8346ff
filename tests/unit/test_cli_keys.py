"""`toolreg keys generate --encrypt` and the verbs that sign with a key file,
when the key is encrypted: where the passphrase comes from, and the one-line
errors (exit 2) when it is missing or wrong. No server: a verb that gets past
its key reaches for one that is not there."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from typer.testing import CliRunner, Result

from registry_server.cli import app
from registry_server.cli import keys as cli_keys
from registry_server.signing.keys import generate_keypair, load_private_key, public_key_text

ENV = "TOOLREG_KEY_PASSPHRASE"
PASSPHRASE = "approver's long passphrase"
NOWHERE = "127.0.0.1:1"  # no server: a verb that loaded its key fails to connect


def run(*args: str, passphrase: str | None = None) -> Result:
    return CliRunner().invoke(app, list(args), env={ENV: passphrase, "TOOLREG_TOKEN": None})


@pytest.fixture
def terminal(monkeypatch: pytest.MonkeyPatch) -> Iterator[Callable[..., list[str]]]:
    """Makes the CLI believe it runs on a terminal; each getpass answers the next
    of the given replies. Yields a setter that returns the prompts shown."""
    prompts: list[str] = []

    def answer(*replies: str) -> list[str]:
        queue = list(replies)

        def fake_getpass(prompt: str = "") -> str:
            prompts.append(prompt)
            return queue.pop(0)

        monkeypatch.setattr(cli_keys.getpass, "getpass", fake_getpass)
        return prompts

    monkeypatch.setattr(cli_keys, "_on_terminal", lambda: True)
    yield answer


def one_line(result: Result) -> str:
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    return lines[0]


# ------------------------------------------------------------- generate


def test_generate_encrypts_with_the_passphrase_from_the_environment(tmp_path: Path) -> None:
    out = tmp_path / "alice.key"
    done = run("keys", "generate", "--out", str(out), "--encrypt", passphrase=PASSPHRASE)
    assert done.exit_code == 0, done.output
    assert "encrypted with your passphrase" in done.stdout and PASSPHRASE not in done.output
    pem = out.read_bytes()
    assert pem.startswith(b"-----BEGIN ENCRYPTED PRIVATE KEY-----")
    assert out.stat().st_mode & 0o777 == 0o600
    public = (tmp_path / "alice.pub").read_text().strip()
    assert public_key_text(load_private_key(pem, PASSPHRASE.encode()).public_key()) == public


def test_generate_without_encrypt_ignores_the_passphrase(tmp_path: Path) -> None:
    out = tmp_path / "bob.key"
    done = run("keys", "generate", "--out", str(out), passphrase=PASSPHRASE)
    assert done.exit_code == 0 and "(keep it secret;" in done.stdout
    assert out.read_bytes().startswith(b"-----BEGIN PRIVATE KEY-----")


def test_generate_encrypt_needs_a_passphrase(tmp_path: Path) -> None:
    out = tmp_path / "alice.key"
    done = run("keys", "generate", "--out", str(out), "--encrypt")
    assert done.exit_code == 2
    assert ENV in one_line(done) and "on a terminal" in one_line(done)
    assert not out.exists() and not (tmp_path / "alice.pub").exists()


def test_generate_asks_twice_on_a_terminal(
    tmp_path: Path, terminal: Callable[..., list[str]]
) -> None:
    out = tmp_path / "alice.key"
    prompts = terminal(PASSPHRASE, PASSPHRASE)
    done = run("keys", "generate", "--out", str(out), "--encrypt")
    assert done.exit_code == 0, done.output
    assert len(prompts) == 2 and PASSPHRASE not in done.output
    load_private_key(out.read_bytes(), PASSPHRASE.encode())


@pytest.mark.parametrize(
    ("replies", "says"),
    [
        ((PASSPHRASE, PASSPHRASE + "!"), "the passphrases differ"),
        (("x7q", "x7q"), "shorter than 8 characters"),
        (("", ""), "shorter than 8 characters"),
    ],
)
def test_generate_refuses_a_mistyped_or_short_passphrase(
    tmp_path: Path, terminal: Callable[..., list[str]], replies: tuple[str, str], says: str
) -> None:
    out = tmp_path / "alice.key"
    terminal(*replies)
    done = run("keys", "generate", "--out", str(out), "--encrypt")
    assert done.exit_code == 2 and says in one_line(done) and "was not written" in one_line(done)
    assert not replies[0] or replies[0] not in done.output
    assert not out.exists()


# -------------------------------------------------------- approvals approve


@pytest.fixture
def encrypted_key(tmp_path: Path) -> Path:
    key = tmp_path / "alice.key"
    key.write_bytes(generate_keypair(PASSPHRASE.encode())[0])
    return key


def approve(key: Path, passphrase: str | None = None) -> Result:
    return run(
        "approvals", "approve", "0" * 32, "--key", str(key), "--address", NOWHERE,
        passphrase=passphrase,
    )  # fmt: skip


def test_approve_with_an_encrypted_key_and_no_passphrase_says_what_to_set(
    encrypted_key: Path,
) -> None:
    done = approve(encrypted_key)
    assert done.exit_code == 2
    line = one_line(done)
    assert str(encrypted_key) in line and ENV in line and "encrypted" in line


def test_approve_with_the_passphrase_from_the_environment_gets_past_the_key(
    encrypted_key: Path,
) -> None:
    done = approve(encrypted_key, PASSPHRASE)
    assert done.exit_code == 1 and "cannot reach the toolreg server" in one_line(done)


def test_approve_with_a_wrong_passphrase_fails_without_echoing_it(encrypted_key: Path) -> None:
    wrong = "not the passphrase at all"
    done = approve(encrypted_key, wrong)
    assert done.exit_code == 2
    assert one_line(done) == f"toolreg: {encrypted_key}: wrong passphrase (or a damaged key file)"
    assert wrong not in done.output


def test_approve_asks_on_a_terminal(
    encrypted_key: Path, terminal: Callable[..., list[str]]
) -> None:
    prompts = terminal(PASSPHRASE)
    done = approve(encrypted_key)
    assert prompts == [f"Passphrase for {encrypted_key}: "]
    assert done.exit_code == 1 and "cannot reach the toolreg server" in one_line(done)
    terminal("wrong passphrase typed")
    done = approve(encrypted_key)
    assert done.exit_code == 2 and "wrong passphrase" in one_line(done)
    assert "typed" not in done.output


def test_approve_with_an_unencrypted_key_needs_no_passphrase(tmp_path: Path) -> None:
    key = tmp_path / "bob.key"
    key.write_bytes(generate_keypair()[0])
    done = approve(key)
    assert done.exit_code == 1 and "cannot reach the toolreg server" in one_line(done)
