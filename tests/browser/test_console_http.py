"""The approval console at the HTTP level, as `tests/integration/test_mcp_http.py`
checks the MCP bridge: headers, who may sign in, the session cookie and CSRF
token, Host and Origin, body and session caps, the event stream, and the
refusals at start. Real processes; plain HTTP (httpx) where a test needs the
status line and headers."""

from __future__ import annotations

import contextlib
import json
import re
import ssl
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from registry_server.console.guard import CONTENT_SECURITY_POLICY
from registry_server.console.settings import DEFAULT_MAX_BODY_BYTES
from tests.browser.conftest import (
    TOKENS,
    Api,
    ConsoleProcess,
    Deployment,
    run_cli,
    spawn_console,
    wait_for,
)
from tests.certs import CertificateAuthority

EXPECTED_CSP = (
    "default-src 'none'; script-src 'self'; style-src 'self'; connect-src 'self';"
    " img-src 'self'; form-action 'self'; frame-ancestors 'none'; base-uri 'none';"
    " require-trusted-types-for 'script'; trusted-types 'none'"
)
ASSETS = {"/": "text/html", "/console.js": "text/javascript", "/console.css": "text/css"}


def get(console: ConsoleProcess, path: str, **headers: str) -> httpx.Response:
    with httpx.Client(base_url=console.origin, timeout=30) as http:
        return http.get(path, headers=headers)


def sign_in(console: ConsoleProcess, token: str | None, **headers: str) -> httpx.Response:
    sent = {"Origin": console.origin, **headers}
    if token is not None:
        sent["Authorization"] = f"Bearer {token}"
    with httpx.Client(base_url=console.origin, timeout=30) as http:
        return http.post("/api/session", headers=sent)


def events(api: Api, until: str = "synced", limit: int = 200) -> Iterator[dict[str, Any]]:
    """The messages of one event stream, up to the first of kind ``until``."""
    with api.http.stream("GET", "/api/events") as stream:
        assert stream.status_code == 200, stream.read()
        assert stream.headers["content-type"].startswith("text/event-stream")
        for line in stream.iter_lines():
            if line.startswith("data: "):
                message = json.loads(line[len("data: ") :])
                assert message["kind"] != "reset", f"the console lost its watch: {message}"
                yield message
                limit -= 1
                if message["kind"] == until or limit == 0:
                    return


# ------------------------------------------------------------- the page


def test_the_page_and_its_assets_are_local_and_locked_down(deployment: Deployment) -> None:
    assert CONTENT_SECURITY_POLICY == EXPECTED_CSP
    for path, kind in ASSETS.items():
        answer = get(deployment.console, path)
        assert answer.status_code == 200, path
        assert answer.headers["content-type"].startswith(kind), path
        assert answer.headers["content-security-policy"] == EXPECTED_CSP
        assert answer.headers["x-content-type-options"] == "nosniff"
        assert answer.headers["referrer-policy"] == "no-referrer"
        assert "set-cookie" not in answer.headers
        # Nothing is loaded from elsewhere: no absolute URLs, nothing protocol-relative.
        assert "http:" not in answer.text and "https:" not in answer.text, path
        assert not re.search(r"//[\w-]+\.[a-z]{2,}", answer.text), path
    script = get(deployment.console, "/console.js").text
    for sink in ("innerHTML", "outerHTML", "insertAdjacentHTML", "document.write", "eval(",
                 "localStorage", "sessionStorage", "indexedDB", "extractable: true"):  # fmt: skip
        assert sink not in script, sink
    html = get(deployment.console, "/").text
    assert "<script>" not in html and " style=" not in html  # no inline script or style
    assert not re.search(r"\son[a-z]+=", html)  # no inline event handlers
    # Errors carry the same headers.
    missing = get(deployment.console, "/nothing-here")
    assert missing.status_code == 404
    assert missing.headers["content-security-policy"] == EXPECTED_CSP


# ----------------------------------------------------------- signing in


def test_only_approvers_sign_in_and_the_cookie_is_locked(deployment: Deployment) -> None:
    console = deployment.console
    for token in (None, "not-a-token", TOKENS["alice"] + "x"):
        answer = sign_in(console, token)
        assert answer.status_code == 401, token
        assert answer.headers["www-authenticate"] == "Bearer"
        assert "set-cookie" not in answer.headers
    for who in ("agent", "viewer"):  # known clients without the approve role
        answer = sign_in(console, TOKENS[who])
        assert answer.status_code == 403 and "no approver" in answer.json()["error"], who
    answer = sign_in(console, TOKENS["alice"])
    assert answer.status_code == 200
    assert answer.json()["client"] == "alice" and answer.json()["approver"] == "alice"
    cookie = answer.headers["set-cookie"]
    name, _, rest = cookie.partition("=")
    assert name == "toolreg_console"
    attributes = {a.strip() for a in rest.split(";")[1:]}
    assert attributes == {"Path=/", "HttpOnly", "SameSite=Strict"}  # Secure: see the TLS test
    with httpx.Client(base_url=console.origin, timeout=30) as http:
        session = cookie.split(";")[0].split("=", 1)[1]
        http.cookies.set("toolreg_console", session)
        me = http.get("/api/session")
        assert me.status_code == 200 and me.json()["csrf"] == answer.json()["csrf"]
    assert get(console, "/api/session").status_code == 401  # no cookie, no session


def test_changes_need_the_csrf_token_and_the_consoles_origin(deployment: Deployment) -> None:
    console = deployment.console
    api = Api(console, TOKENS["bob"])
    request_id = deployment.ask("deploy_note", "csrf checks")
    try:
        path = f"/api/requests/{request_id}/reject"
        body = {"reason": "should never land"}
        without = api.http.post(path, json=body, headers={"Origin": console.origin})
        assert without.status_code == 403 and "CSRF" in without.json()["error"]
        wrong = api.post(path, body, **{"X-Toolreg-Csrf": "forged"})
        assert wrong.status_code == 403
        no_origin = api.http.post(path, json=body, headers={"X-Toolreg-Csrf": api.csrf})
        assert no_origin.status_code == 403 and "Origin" in no_origin.json()["error"]
        foreign = api.post(path, body, Origin="http://evil.example")
        assert foreign.status_code == 403
        cross_site = api.post(path, body, **{"Sec-Fetch-Site": "cross-site"})
        assert cross_site.status_code == 403
        assert (
            api.http.get("/api/session", headers={"Sec-Fetch-Site": "cross-site"}).status_code
            == 403
        )
        registry = deployment.as_client("bob")
        assert registry.approval_request(request_id).state == "PENDING"
        # With all of it, the change goes through, and the registry's answer comes back.
        done = api.post(path, {"reason": "checked the CSRF guard"})
        assert done.status_code == 200, done.text
        assert done.json()["request"]["state"] == "REJECTED"
        again = api.post(path, {"reason": "twice"})
        assert again.status_code == 409 and "FAILED_PRECONDITION" in again.json()["error"]
        unsigned = api.post(f"/api/requests/{request_id}/approve", {"token": "a.b.c"})
        assert unsigned.status_code == 403, unsigned.text  # not signed as bob
        registry.close()
        out = api.post("/api/session/end", {})
        assert out.status_code == 200 and "Max-Age=0" in out.headers["set-cookie"]
        assert api.http.get("/api/session").status_code == 401
    finally:
        api.close()


# ------------------------------------------------------ DNS rebinding


def test_host_and_origin_are_checked(deployment: Deployment) -> None:
    console = deployment.console
    port = console.origin.rsplit(":", 1)[1]
    assert get(console, "/", Host="evil.example").status_code == 421
    assert get(console, "/", Host=f"evil.example:{port}").status_code == 421
    assert sign_in(console, TOKENS["alice"], Host="evil.example").status_code == 421
    for name in ("127.0.0.1", "localhost"):
        assert get(console, "/", Host=f"{name}:{port}").status_code == 200
    assert get(console, "/", Origin="http://evil.example").status_code == 403
    refused = sign_in(console, TOKENS["alice"], Origin="http://evil.example")
    assert refused.status_code == 403 and "set-cookie" not in refused.headers
    with httpx.Client(base_url=console.origin, timeout=30) as http:
        headless = http.post("/api/session", headers={"Authorization": f"Bearer {TOKENS['alice']}"})
    assert headless.status_code == 403  # a change without Origin


# ----------------------------------------------------------------- caps


def test_bodies_are_capped_and_checked(deployment: Deployment) -> None:
    api = Api(deployment.console, TOKENS["alice"])
    path = "/api/requests/" + "0" * 32 + "/reject"
    try:
        declared = api.post(path, {"reason": "x" * DEFAULT_MAX_BODY_BYTES})
        assert declared.status_code == 413, declared.text

        def chunks() -> Iterator[bytes]:
            yield b'{"reason": "'
            for _ in range(DEFAULT_MAX_BODY_BYTES // 4096 + 1):
                yield b"x" * 4096
            yield b'"}'

        streamed = api.http.post(path, content=chunks(), headers={
            "Origin": api.console.origin, "X-Toolreg-Csrf": api.csrf,
            "Content-Type": "application/json",
        })  # fmt: skip
        assert streamed.status_code == 413, streamed.text
        form = api.http.post(path, data={"reason": "x"}, headers={
            "Origin": api.console.origin, "X-Toolreg-Csrf": api.csrf,
        })  # fmt: skip
        assert form.status_code == 415
        broken = api.http.post(path, content=b"{not json", headers={
            "Origin": api.console.origin, "X-Toolreg-Csrf": api.csrf,
            "Content-Type": "application/json",
        })  # fmt: skip
        assert broken.status_code == 400
        assert api.post(path, ["reason"]).status_code == 400
        assert api.post(path, {"reason": 7}).status_code == 400
        assert api.post("/api/requests/..%2F..%2Fetc/reject", {"reason": "x"}).status_code == 404
        # The console keeps serving.
        assert api.http.get("/api/session").status_code == 200
    finally:
        api.close()


def test_sessions_are_capped_and_end_when_idle(deployment: Deployment) -> None:
    limited = spawn_console(
        deployment.server.address, "--policy", str(deployment.policy),
        "--max-sessions", "2", "--session-idle-s", "1",
    )  # fmt: skip
    try:
        first, second = Api(limited, TOKENS["alice"]), Api(limited, TOKENS["bob"])
        third = sign_in(limited, TOKENS["carol"])
        assert third.status_code == 503 and "sessions" in third.json()["error"]
        # An open page hears that its session ended; its cookie is then worthless.
        with first.http.stream("GET", "/api/events") as stream:
            kinds = []
            for line in stream.iter_lines():
                if line.startswith("data: "):
                    kinds.append(json.loads(line[6:])["kind"])
                    if kinds[-1] == "signed-out":
                        break
        assert kinds[0] == "start" and kinds[-1] == "signed-out", kinds
        assert first.http.get("/api/session").status_code == 401
        # Bob's session, unused since its sign-in, ended by then as well.
        assert second.http.get("/api/session").status_code == 401
        assert sign_in(limited, TOKENS["carol"]).status_code == 200
        first.close()
        second.close()
    finally:
        assert limited.stop() == 0


def test_event_streams_per_session_are_capped(deployment: Deployment) -> None:
    api = Api(deployment.console, TOKENS["carol"])
    try:
        with contextlib.ExitStack() as pages:
            opened = [pages.enter_context(api.http.stream("GET", "/api/events")) for _ in range(4)]
            assert [r.status_code for r in opened] == [200] * 4
            with api.http.stream("GET", "/api/events") as fifth:
                assert fifth.status_code == 429
        # Closed pages free their places.
        wait_for("the streams to close", lambda: _stream_opens(api))
    finally:
        api.close()


def _stream_opens(api: Api) -> bool:
    with api.http.stream("GET", "/api/events") as stream:
        return stream.status_code == 200


def test_the_stream_starts_from_what_is_open_then_follows(deployment: Deployment) -> None:
    request_id = deployment.ask("restart_service", "the stream's own request")
    api = Api(deployment.console, TOKENS["carol"])
    try:
        messages = list(events(api))
        assert messages[0] == {"kind": "start"} and messages[-1] == {"kind": "synced"}
        current = {m["request"]["id"]: m for m in messages if m["kind"] == "request"}
        assert current[request_id]["event"] == "CURRENT"
        summary = current[request_id]["request"]
        assert summary["tool_name"] == "restart_service" and summary["state"] == "PENDING"
        assert "arguments_json" not in summary  # the list carries no arguments; the detail does
        detail = api.http.get(f"/api/requests/{request_id}").json()
        assert json.loads(detail["arguments"]) == {"note": "the stream's own request"}
        assert detail["signable"] and detail["claims"]["iss"] == "carol"
        assert detail["claims"]["req"] == request_id and detail["claims"]["ttl_s"] == 600
    finally:
        api.close()


def test_the_log_names_no_token(deployment: Deployment) -> None:
    # A thread reads the console's stderr: the last sign-in's line arrives a moment later.
    wait_for(
        "a sign-in in the console's log",
        lambda: "signed in to the console" in "".join(deployment.console.log),
    )
    log = "".join(deployment.console.log)
    assert "signed in to the console" in log
    for token in TOKENS.values():
        assert token not in log


# ------------------------------------------------------------ at start


def test_https_with_the_operators_certificate(deployment: Deployment, tmp_path: Path) -> None:
    ca = CertificateAuthority("console-test-ca")
    issued = ca.issue("localhost", server=True)
    cert, key = tmp_path / "console.pem", tmp_path / "console.key"
    cert.write_bytes(issued.cert_pem)
    key.write_bytes(issued.key_pem)
    secure = spawn_console(
        deployment.server.address, "--policy", str(deployment.policy),
        "--http-tls-cert", str(cert), "--http-tls-key", str(key),
    )  # fmt: skip
    try:
        assert secure.url.startswith("https://")
        port = secure.origin.rsplit(":", 1)[1]
        origin = f"https://localhost:{port}"
        trust = ssl.create_default_context(cadata=ca.pem.decode())
        with httpx.Client(base_url=origin, verify=trust, timeout=30) as http:
            answer = http.post("/api/session", headers={
                "Authorization": f"Bearer {TOKENS['alice']}", "Origin": origin,
            })  # fmt: skip
        assert answer.status_code == 200, answer.text
        cookie = answer.headers["set-cookie"]
        assert cookie.startswith("__Host-toolreg_console=") and cookie.endswith("; Secure")
        with pytest.raises(httpx.HTTPError):
            httpx.get(f"http://localhost:{port}/", timeout=10)
    finally:
        assert secure.stop() == 0


@pytest.mark.parametrize(
    ("args", "says"),
    [
        ([], "needs --policy FILE"),
        (["--http", "192.0.2.10:8780"], "without TLS"),
        (["--http", "0.0.0.0:8780", "--http-tls-cert", "c.pem", "--http-tls-key", "k.pem"],
         "needs --allow-host"),
        (["--http-tls-cert", "c.pem"], "go together"),
        (["--max-sessions", "0"], "must be positive"),
        (["--http", "nonsense"], "expected HOST:PORT"),
    ],
)  # fmt: skip
def test_refuses_to_start_unsafely(deployment: Deployment, args: list[str], says: str) -> None:
    policy = [] if not args else ["--policy", str(deployment.policy)]
    done = run_cli("console", "--address", deployment.server.address, *policy, *args)
    assert done.returncode == 2, done.stderr
    assert says in done.stderr and len(done.stderr.strip().splitlines()) == 1, done.stderr


def test_refuses_a_fixed_token_and_a_policy_without_approvers(
    deployment: Deployment, tmp_path: Path
) -> None:
    done = run_cli("--token", TOKENS["alice"], "console", "--policy", str(deployment.policy))
    assert done.returncode == 2 and "does not apply to the console" in done.stderr
    nobody = tmp_path / "nobody.yaml"
    nobody.write_text("audience: x\nclients:\n  - {id: a, token_sha256: '"
                      + "0" * 64 + "', roles: [execute]}\n")  # fmt: skip
    done = run_cli("console", "--policy", str(nobody))
    assert done.returncode == 2 and "no client could sign in" in done.stderr, done.stderr
