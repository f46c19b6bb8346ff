"""HTTP client libraries' loggers never show a request's URL once logging is
set up (``logs.configure``), at any level the operator sets: their INFO and
DEBUG lines are never made, and what they still log has its text withheld.
Real httpx requests to a receiver on loopback, the log read back."""

from __future__ import annotations

import json
import logging
import secrets
import sys
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import httpx
import pytest

from registry_server.api import logs


class Stderr:
    """What the process writes on stderr (where its log handler writes)."""

    def __init__(self, capsys: pytest.CaptureFixture[str]) -> None:
        self._capsys = capsys
        self._text = ""

    def getvalue(self) -> str:
        self._text += self._capsys.readouterr().err
        return self._text


@pytest.fixture
def stderr(capsys: pytest.CaptureFixture[str]) -> Iterator[Stderr]:
    """stderr; logging's global state put back after the test."""
    root = logging.getLogger()
    saved_handlers, saved_level = root.handlers[:], root.level
    saved_factory = logging.getLogRecordFactory()
    names = [*logs.HTTP_CLIENT_LOGGERS, "httpcore.http11", "urllib3.connectionpool"]
    saved_levels = {name: logging.getLogger(name).level for name in names}
    yield Stderr(capsys)
    root.handlers[:] = saved_handlers
    root.setLevel(saved_level)
    logging.setLogRecordFactory(saved_factory)
    for name, level in saved_levels.items():
        logging.getLogger(name).setLevel(level)


@pytest.fixture(scope="module")
def receiver() -> Iterator[str]:
    """An HTTP server on loopback answering every POST 500; its base URL.
    One for the module: it keeps no state, and each shutdown waits out a poll."""

    class Handler(BaseHTTPRequestHandler):
        def do_POST(self) -> None:
            self.rfile.read(int(self.headers.get("content-length", "0")))
            self.send_response(500)
            self.send_header("content-length", "0")
            self.end_headers()

        def log_message(self, *args: Any) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, args=(0.01,), daemon=True).start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()
    server.server_close()


def lines(stream: Stderr) -> list[dict[str, Any]]:
    return [json.loads(line) for line in stream.getvalue().splitlines()]


def test_without_it_httpx_logs_the_url(stderr: Stderr, receiver: str) -> None:
    """What the set-up is for: httpx's own INFO line names the full URL."""
    token = secrets.token_hex(12)
    logging.getLogger().handlers[:] = [logging.StreamHandler(sys.stderr)]
    logging.getLogger().setLevel("INFO")
    httpx.post(f"{receiver}/services/T0/B0/{token}", content=b"{}")
    assert token in stderr.getvalue()


@pytest.mark.parametrize("level", ["DEBUG", "INFO", "WARNING"])
def test_a_request_url_reaches_no_log_line_at_any_level(
    stderr: Stderr, receiver: str, level: str
) -> None:
    token = secrets.token_hex(12)
    logs.configure(level, "json")
    mine = logging.getLogger("registry_server.notify.dispatcher")
    with httpx.Client() as client:
        answer = client.post(f"{receiver}/services/T0/B0/{token}", content=b"{}")
    mine.warning("webhook to endpoint %s: HTTP %d", "chat", answer.status_code)
    mine.debug("a debug line of our own")
    text = stderr.getvalue()
    assert token not in text and "/services/T0" not in text
    assert "webhook to endpoint chat: HTTP 500" in text  # our own lines still go out
    assert ("a debug line of our own" in text) == (level == "DEBUG")
    assert not [x for x in lines(stderr) if logs.from_http_client(x["logger"])]
    for name in logs.HTTP_CLIENT_LOGGERS:
        assert logging.getLogger(name).getEffectiveLevel() == logging.WARNING, name


def test_what_the_libraries_still_log_has_its_text_withheld(stderr: Stderr) -> None:
    """A child logger set lower later, a warning, an exception quoting a URL:
    the record keeps its logger, level and exception type, nothing else."""
    url = f"https://hooks.slack.com/services/T0/B0/{secrets.token_hex(12)}"
    logs.configure("DEBUG", "json")
    logs.configure("DEBUG", "json")  # twice: one factory, not two wrapped
    logging.getLogger("httpcore.http11").setLevel(logging.DEBUG)
    logging.getLogger("httpcore.http11").debug("send_request_headers.started url=%s", url)
    logging.getLogger("urllib3.connectionpool").warning(f"Retrying after {url}")
    try:
        raise httpx.ConnectError(f"cannot reach {url}")
    except httpx.ConnectError:
        logging.getLogger("httpx").exception("failed: %s", url)
    logging.getLogger("httpxy.elsewhere").warning("not an HTTP client of ours: %s", "kept")
    text = stderr.getvalue()
    assert url not in text and "hooks.slack.com" not in text
    got = lines(stderr)
    assert [(x["logger"], x["level"]) for x in got[:3]] == [
        ("httpcore.http11", "debug"), ("urllib3.connectionpool", "warning"), ("httpx", "error"),
    ]  # fmt: skip
    assert all(x["event"].startswith(logs.WITHHELD) for x in got[:3])
    assert got[2]["event"].endswith("exception ConnectError") and "exception" not in got[2]
    assert got[3]["event"] == "not an HTTP client of ours: kept"
    assert len(got) == 4


def test_the_text_format_and_a_handler_set_up_elsewhere_are_covered(
    stderr: Stderr,
) -> None:
    """``quiet_http_clients`` alone (as ``toolreg console`` calls it after
    ``basicConfig``) holds for whatever handler the process has."""
    url = f"https://idp.example/jwks?key={secrets.token_hex(12)}"
    logging.getLogger().handlers[:] = [logging.StreamHandler(sys.stderr)]
    logging.getLogger().setLevel("DEBUG")
    logs.quiet_http_clients()
    logging.getLogger("httpx").info("HTTP Request: GET %s", url)
    logging.getLogger("httpx").error("HTTP Request: GET %s", url)
    assert stderr.getvalue() == logs.WITHHELD + "\n"
