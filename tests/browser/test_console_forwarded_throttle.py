"""The console's sign-in throttle behind a reverse proxy, against a real
`toolreg console` process over real HTTP on loopback. In the first two tests
the "proxy" is a client on 127.0.0.3 (all of 127/8 is loopback) that sends
X-Forwarded-For as a proxy appends it: the client's words, then the address
it heard from. The last puts a real HAProxy (`option forwardfor`, connecting
to the console from 127.0.0.3) in front of it.

Without --trusted-proxy the header is nobody's word: a client that sends a
new spoofed address with each guess is still one source. With the proxy
trusted, two clients behind it are throttled apart, and a client that forges
the left-most hop is still counted under its own address."""

from __future__ import annotations

import shutil
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from registry_server.cli.launcher import spawn_until
from registry_server.console.settings import SIGNIN_WINDOW_ENV
from registry_server.console.throttle import MAX_FAILURES_PER_SOURCE
from registry_server.signing.keys import generate_keypair
from tests.browser.conftest import (
    APPROVERS,
    CONSOLE_SERVING,
    ROOT,
    TOKENS,
    ConsoleProcess,
    console_env,
    wait_for,
    write_policy,
)
from tests.browser.test_console_signin_throttle import client_from, wrong_token

PROXY = "127.0.0.3"  # the reverse proxy's address
WINDOW_S = 60  # seconds: no window ends during a test


@pytest.fixture(scope="module")
def policy(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("forwarded") / "policy.yaml"
    write_policy(path, {who: generate_keypair()[1] for who in APPROVERS})
    return path


def start_console(policy: Path, *args: str) -> ConsoleProcess:
    with socket.socket() as s:  # a registry address nothing listens on: none is needed
        s.bind(("127.0.0.1", 0))
        nowhere = f"127.0.0.1:{s.getsockname()[1]}"
    argv = [sys.executable, "-m", "registry_server.cli", "console", "--address", nowhere,
            "--http", "127.0.0.1:0", "--policy", str(policy), *args]  # fmt: skip
    env = console_env() | {SIGNIN_WINDOW_ENV: str(WINDOW_S)}
    proc, url, log = spawn_until(argv, CONSOLE_SERVING, what="toolreg console", cwd=ROOT, env=env)
    return ConsoleProcess(proc, url, log)


@pytest.fixture
def direct(policy: Path) -> Iterator[ConsoleProcess]:
    console = start_console(policy)
    yield console
    assert console.stop() == 0


@pytest.fixture
def proxied(policy: Path) -> Iterator[ConsoleProcess]:
    console = start_console(policy, "--trusted-proxy", f"{PROXY}/32")
    yield console
    assert console.stop() == 0


def log_with(console: ConsoleProcess, *lines: str) -> str:
    """The console's log once it holds every one of ``lines``: a thread reads its
    stderr, so a line reaches ``console.log`` a moment after it is written (after
    the process exited, for its last ones)."""
    wait_for(
        f"{lines} in the console's log",
        lambda: all(line in "".join(console.log) for line in lines),
    )
    return "".join(console.log)


def via(http: httpx.Client, token: str, forwarded: str) -> httpx.Response:
    return http.post(
        "/api/session",
        headers={"Authorization": f"Bearer {token}", "X-Forwarded-For": forwarded},
    )


def test_without_a_trusted_proxy_a_spoofed_header_does_not_escape_the_throttle(
    direct: ConsoleProcess,
) -> None:
    with client_from(direct, PROXY) as attacker:
        answers = [
            via(attacker, wrong_token(), f"198.51.100.{i}")
            for i in range(1, MAX_FAILURES_PER_SOURCE + 2)
        ]
        statuses = [a.status_code for a in answers]
        assert statuses == [401] * MAX_FAILURES_PER_SOURCE + [429], statuses
        # The right token, "from" yet another address: the same source, refused.
        assert via(attacker, TOKENS["alice"], "203.0.113.5").status_code == 429
    text = log_with(direct, f"sign-in refused from {PROXY}: unknown token")
    assert f"sign-in refused from {PROXY}: unknown token" in text
    assert "198.51.100." not in text and "203.0.113.5" not in text  # the header, never read


def test_behind_a_trusted_proxy_clients_are_throttled_apart_and_a_forged_hop_buys_nothing(
    proxied: ConsoleProcess,
) -> None:
    attacker_ip, colleague_ip = "198.51.100.7", "198.51.100.8"
    with client_from(proxied, PROXY) as proxy, client_from(proxied, "127.0.0.1") as stranger:
        statuses = [
            via(proxy, wrong_token(), attacker_ip).status_code
            for _ in range(MAX_FAILURES_PER_SOURCE + 1)
        ]
        assert statuses == [401] * MAX_FAILURES_PER_SOURCE + [429], statuses
        # The attacker forges a left-most hop; the proxy appends its real address.
        for forged in ("203.0.113.99", "127.0.0.1", colleague_ip):
            answer = via(proxy, wrong_token(), f"{forged}, {attacker_ip}")
            assert answer.status_code == 429, forged
            assert "your address" in answer.json()["error"]
        # Another client behind the same proxy is not locked out by the attacker...
        colleague = via(proxy, TOKENS["bob"], colleague_ip)
        assert colleague.status_code == 200, colleague.text
        assert colleague.json()["approver"] == "bob"
        # ...and a peer that is no trusted proxy is itself, whatever it forwards.
        assert via(stranger, wrong_token(), colleague_ip).status_code == 401
        assert via(stranger, TOKENS["alice"], attacker_ip).status_code == 200
    assert proxied.stop() == 0
    text = log_with(
        proxied,
        f"sign-in refused from {attacker_ip}: unknown token",
        f"sign-in refused from {attacker_ip}: throttled (source)",
        "sign-in refused from 127.0.0.1: unknown token",
    )
    assert f"sign-in refused from {attacker_ip}: unknown token" in text, text
    assert f"sign-in refused from {attacker_ip}: throttled (source)" in text, text
    assert "sign-in refused from 127.0.0.1: unknown token" in text, text
    assert f"sign-in refused from {PROXY}" not in text  # the proxy is nobody's source
    assert "203.0.113.99" not in text  # a forged hop never reaches the log


HAPROXY_CONFIG = """\
global
    maxconn 64
defaults
    mode http
    timeout connect 5s
    timeout client 30s
    timeout server 30s
frontend approvals
    bind 127.0.0.1:{port}
    option forwardfor
    default_backend console
backend console
    server console {console} source {proxy}
"""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.fixture
def haproxy(proxied: ConsoleProcess, tmp_path: Path) -> Iterator[str]:
    """A real HAProxy in front of the console; its URL."""
    binary = shutil.which("haproxy") or "/usr/sbin/haproxy"
    if not Path(binary).exists():
        pytest.fail("haproxy is not installed: run `make test` (it installs it)")
    port = free_port()
    console = proxied.origin.removeprefix("http://")
    config = tmp_path / "haproxy.cfg"
    config.write_text(HAPROXY_CONFIG.format(port=port, console=console, proxy=PROXY))
    proc = subprocess.Popen(
        [binary, "-f", str(config), "-db"], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE
    )
    try:
        deadline = time.monotonic() + 15
        while True:
            try:
                socket.create_connection(("127.0.0.1", port), timeout=1).close()
                break
            except OSError:
                if time.monotonic() > deadline or proc.poll() is not None:
                    pytest.fail("HAProxy did not listen")
                time.sleep(0.1)
        yield f"http://127.0.0.1:{port}"
    finally:
        proc.terminate()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()


def test_through_a_real_haproxy_each_client_is_its_own_source(
    proxied: ConsoleProcess, haproxy: str
) -> None:
    def through(source: str) -> httpx.Client:
        # The console checks Host and Origin against its own listener's.
        host = proxied.origin.removeprefix("http://")
        return httpx.Client(
            base_url=haproxy, transport=httpx.HTTPTransport(local_address=source),
            headers={"Host": host, "Origin": proxied.origin}, timeout=30,
        )  # fmt: skip

    with through("127.0.0.1") as attacker, through("127.0.0.2") as colleague:
        # The attacker claims a new address each time; HAProxy adds its real one.
        statuses = [
            via(attacker, wrong_token(), f"198.51.100.{i}").status_code
            for i in range(1, MAX_FAILURES_PER_SOURCE + 2)
        ]
        assert statuses == [401] * MAX_FAILURES_PER_SOURCE + [429], statuses
        assert attacker.post(
            "/api/session", headers={"Authorization": f"Bearer {TOKENS['alice']}"}
        ).status_code == 429  # fmt: skip
        signed_in = colleague.post(
            "/api/session", headers={"Authorization": f"Bearer {TOKENS['bob']}"}
        )
        assert signed_in.status_code == 200, signed_in.text
    assert proxied.stop() == 0
    text = log_with(
        proxied,
        "sign-in refused from 127.0.0.1: unknown token",
        "sign-in refused from 127.0.0.1: throttled (source)",
    )
    assert "sign-in refused from 127.0.0.1: unknown token" in text, text
    assert "sign-in refused from 127.0.0.1: throttled (source)" in text, text
    assert "198.51.100." not in text and f"refused from {PROXY}" not in text
