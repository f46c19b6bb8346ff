"""The console's sign-in throttle and refusal log, against a real `toolreg
console` process over real HTTP on loopback: a flood of wrong sign-ins is
answered 429 after the allowed number, the right token is refused too until
the window ends, another source address (127.0.0.2: all of 127/8 is loopback)
is not locked out by the first one's failures, but is once failures from many
sources pass the overall limit. The console's log is read back: every kind of
refusal is there (the flood summed up, not line by line), what a client sent
is capped and escaped, and no token, wrong or right, appears in it.

The window is short (TOOLREG_CONSOLE_SIGNIN_WINDOW_S), so the tests wait it
out rather than the default five minutes. The registry behind the console is
never called: signing in needs only the policy."""

from __future__ import annotations

import re
import secrets
import socket
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from registry_server.cli.launcher import spawn_until
from registry_server.console.settings import SIGNIN_WINDOW_ENV
from registry_server.console.throttle import (
    LOG_LINES_PER_WINDOW,
    MAX_FAILURES_OVERALL,
    MAX_FAILURES_PER_SOURCE,
)
from registry_server.signing.keys import generate_keypair
from tests.browser.conftest import (
    APPROVERS,
    CONSOLE_SERVING,
    ROOT,
    TOKENS,
    Api,
    ConsoleProcess,
    console_env,
    wait_for,
    write_policy,
)

WINDOW_S = 4  # seconds of the console's throttle window in these tests
FLOOD = 300  # wrong sign-ins in a row from one source


@pytest.fixture(scope="module")
def policy(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("throttle") / "policy.yaml"
    write_policy(path, {who: generate_keypair()[1] for who in APPROVERS})
    return path


@pytest.fixture
def console(policy: Path) -> Iterator[ConsoleProcess]:
    """A console of its own (a fresh throttle) in front of no registry at all."""
    with socket.socket() as s:  # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        nowhere = f"127.0.0.1:{s.getsockname()[1]}"
    argv = ["-m", "registry_server.cli", "console", "--address", nowhere,
            "--http", "127.0.0.1:0", "--policy", str(policy)]  # fmt: skip
    env = console_env() | {SIGNIN_WINDOW_ENV: str(WINDOW_S)}
    proc, url, log = spawn_until(
        [sys.executable, *argv], CONSOLE_SERVING, what="toolreg console", cwd=ROOT, env=env
    )
    process = ConsoleProcess(proc, url, log)
    yield process
    assert process.stop() == 0, "".join(log[-20:])


def client_from(console: ConsoleProcess, source: str) -> httpx.Client:
    """HTTP from the loopback address ``source``, naming the console as its page does."""
    return httpx.Client(
        base_url=console.origin,
        transport=httpx.HTTPTransport(local_address=source),
        headers={"Origin": console.origin},
        timeout=30,
    )


def sign_in(http: httpx.Client, token: str) -> httpx.Response:
    return http.post("/api/session", headers={"Authorization": f"Bearer {token}"})


def wrong_token() -> str:
    return f"guess-{secrets.token_hex(16)}"


def log_of(console: ConsoleProcess, *lines: str) -> str:
    """Its whole log once stopped, holding every one of ``lines``: a thread reads
    its stderr, and the last lines it wrote (the summaries, at shutdown) can reach
    ``console.log`` after the process exited."""
    assert console.stop() == 0
    wait_for(
        f"{lines} in the console's log",
        lambda: all(line in "".join(console.log) for line in lines),
    )
    return "".join(console.log)


def refusal_lines(text: str, kind: str) -> list[str]:
    return [line for line in text.splitlines() if f"console: {kind} refused from" in line]


def wait_out(answer: httpx.Response) -> None:
    time.sleep(int(answer.headers["retry-after"]) + 0.2)


@pytest.mark.serial  # timed: the flood must fit in the 4 s window (WINDOW_S)
def test_a_flood_of_wrong_sign_ins_is_throttled_and_the_right_token_waits_too(
    console: ConsoleProcess,
) -> None:
    guesses = [wrong_token() for _ in range(FLOOD)]
    with client_from(console, "127.0.0.1") as attacker, client_from(console, "127.0.0.2") as other:
        started = time.monotonic()
        answers = [sign_in(attacker, guess) for guess in guesses]
        flood_s = time.monotonic() - started
        assert flood_s < WINDOW_S, f"the flood took {flood_s:.1f} s: longer than a window"
        statuses = [a.status_code for a in answers]
        allowed = MAX_FAILURES_PER_SOURCE
        assert statuses == [401] * allowed + [429] * (FLOOD - allowed), statuses
        for answer in answers[allowed:]:
            assert 1 <= int(answer.headers["retry-after"]) <= WINDOW_S
            assert "your address" in answer.json()["error"]
            assert "set-cookie" not in answer.headers
        print(f"\n{FLOOD} wrong sign-ins in {flood_s:.2f} s: {allowed} answered 401, the rest 429")

        # The right token, during the window: refused, before it is even looked at.
        refused = sign_in(attacker, TOKENS["alice"])
        assert refused.status_code == 429 and "set-cookie" not in refused.headers
        # Another address is not locked out by the first one's failures.
        assert sign_in(other, TOKENS["bob"]).status_code == 200
        wait_out(refused)
        signed_in = sign_in(attacker, TOKENS["alice"])
        assert signed_in.status_code == 200, signed_in.text
        assert signed_in.json()["approver"] == "alice"

    text = log_of(console, "more sign-in refusals in", "alice signed in", "bob signed in")
    lines = refusal_lines(text, "sign-in")
    assert any("from 127.0.0.1: unknown token" in line for line in lines), text
    assert any("from 127.0.0.1: throttled (source)" in line for line in lines), text
    assert len(lines) == LOG_LINES_PER_WINDOW, lines  # one by one up to the budget...
    held_back = FLOOD + 1 - LOG_LINES_PER_WINDOW  # ...the wrong ones and the right one
    summary = re.search(rf"console: {held_back} more sign-in refusals in \d+ s not logged", text)
    assert summary, text  # ...the rest summed up
    assert f"from 127.0.0.1 {held_back}" in text
    assert "alice signed in" in text and "bob signed in" in text
    for token in [*guesses, TOKENS["alice"], TOKENS["bob"]]:
        assert token not in text
    assert "guess-" not in text and "Bearer" not in text  # no part of a token either


@pytest.mark.serial  # timed: every failure and the newcomer must fit in one window (WINDOW_S)
def test_failures_from_many_sources_past_the_overall_limit_refuse_every_source(
    console: ConsoleProcess,
) -> None:
    sources = MAX_FAILURES_OVERALL // MAX_FAILURES_PER_SOURCE
    started = time.monotonic()
    for n in range(sources):
        with client_from(console, f"127.0.0.{10 + n}") as http:
            statuses = {sign_in(http, wrong_token()).status_code
                        for _ in range(MAX_FAILURES_PER_SOURCE)}  # fmt: skip
            assert statuses == {401}, (n, statuses)
    with client_from(console, "127.0.0.99") as newcomer:
        refused = sign_in(newcomer, TOKENS["carol"])
        took_s = time.monotonic() - started
        assert took_s < WINDOW_S, f"the failures took {took_s:.1f} s: longer than a window"
        assert refused.status_code == 429, refused.text
        assert "all sources" in refused.json()["error"]
        wait_out(refused)
        assert sign_in(newcomer, TOKENS["carol"]).status_code == 200
    text = log_of(console, "more sign-in refusals in")
    # The 100 failures used the log's budget; the refusal is in the summary, by reason.
    assert len(refusal_lines(text, "sign-in")) == LOG_LINES_PER_WINDOW
    assert re.search(r"more sign-in refusals in \d+ s not logged one by one: .*throttled"
                     r" \(overall\) 1", text), text  # fmt: skip
    assert TOKENS["carol"] not in text and "guess-" not in text


def test_host_origin_and_csrf_refusals_are_logged_capped_escaped_and_bounded(
    console: ConsoleProcess,
) -> None:
    long_host = "h" * 5_000
    flood = 200
    with httpx.Client(base_url=console.origin, timeout=30) as http:
        # Bytes a header may carry (latin-1) that are not printable: C1 controls.
        assert http.get("/", headers={b"Host": b"evil.example\x85\x9b2J"}).status_code == 421
        origin = http.post("/api/session", headers={"Origin": "https://evil.example"})
        assert origin.status_code == 403
        site = http.get(
            "/api/session", headers={"Sec-Fetch-Site": "cross-site", "Origin": console.origin}
        )
        assert site.status_code == 403
        for _ in range(flood):
            assert http.get("/", headers={"Host": long_host}).status_code == 421
    api = Api(console, TOKENS["alice"])
    try:
        no_csrf = api.http.post("/api/session/end", headers={"Origin": console.origin})
        assert no_csrf.status_code == 403
        wrong_csrf = api.post("/api/session/end", {}, **{"X-Toolreg-Csrf": "forged-csrf"})
        assert wrong_csrf.status_code == 403
    finally:
        api.close()

    text = log_of(console, "more Host/Origin refusals in", "wrong CSRF token")
    guard = [line.split("refused from ")[1] for line in refusal_lines(text, "Host/Origin")]
    assert guard[:3] == [
        "127.0.0.1: Host not this console's (GET '/', Host 'evil.example\\x85\\x9b2J')",
        "127.0.0.1: Origin not this console's (POST '/api/session', Origin 'https://evil.example')",
        "127.0.0.1: API request not same-origin (GET '/api/session', Sec-Fetch-Site 'cross-site')",
    ]
    assert "\x85" not in text and "\x9b" not in text  # the raw bytes: escaped
    assert len(guard) == LOG_LINES_PER_WINDOW, guard  # the budget, then summed up
    assert guard[3].endswith("'... (5000 characters))") and len(guard[3]) < 300  # capped
    assert long_host not in text
    held_back = flood + 3 - LOG_LINES_PER_WINDOW
    assert f"console: {held_back} more Host/Origin refusals in" in text, text
    assert f"not logged one by one: Host not this console's {held_back};" in text
    csrf = [line.split("refused from ")[1] for line in refusal_lines(text, "CSRF")]
    assert csrf == [
        "127.0.0.1: no CSRF token (client alice, POST '/api/session/end')",
        "127.0.0.1: wrong CSRF token (client alice, POST '/api/session/end')",
    ]
    assert "forged-csrf" not in text and TOKENS["alice"] not in text
