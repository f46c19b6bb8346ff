"""A real syslog receiver for the SIEM export's tests and bench: Debian's
rsyslogd (installed by scripts/ensure_rsyslog.sh, `make rsyslog`), started
here in the foreground on a free loopback port with its own configuration:
imtcp over TLS (the gtls stream driver, RFC 5425), a server certificate from
a CA made for the run, client certificates required (x509/certvalid), and
every message written raw, one per line, to a file the tests read.

Never the machine's syslog: its own config file, work directory, pid file
and output; stopped (SIGTERM, then SIGKILL) by whoever started it."""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import socket
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tests.certs import CertificateAuthority

ROOT = Path(__file__).resolve().parents[1]
ENSURE = ROOT / "scripts" / "ensure_rsyslog.sh"
START_TIMEOUT_S = 15.0  # seconds for rsyslogd to listen
MAX_MESSAGE = "512k"  # rsyslog truncates longer messages; events are far shorter
# PRI VERSION TIMESTAMP HOSTNAME APP-NAME PROCID MSGID SD, then MSG
HEADER = re.compile(rb"^<(\d{1,3})>1 (\S+) (\S+) (\S+) (\S+) (\S+) (-|\[.*?\]) ")

CONFIG = """\
global(
  workDirectory="{work}"
  maxMessageSize="{max_message}"
  defaultNetstreamDriver="gtls"
  defaultNetstreamDriverCAFile="{ca}"
  defaultNetstreamDriverCertFile="{cert}"
  defaultNetstreamDriverKeyFile="{key}"
)
module(load="imtcp" streamDriver.name="gtls" streamDriver.mode="1"
       streamDriver.authMode="x509/certvalid")
input(type="imtcp" address="127.0.0.1" port="{port}")
template(name="raw" type="string" string="%rawmsg%\\n")
action(type="omfile" file="{out}" template="raw" flushOnTXEnd="on")
"""


def rsyslogd() -> str:
    """The daemon's path, installing it first when this machine can."""
    done = subprocess.run(["bash", str(ENSURE)], capture_output=True, text=True, timeout=600)
    if done.returncode != 0:
        raise RuntimeError(f"scripts/ensure_rsyslog.sh failed:\n{done.stderr[-2000:]}")
    return done.stdout.strip()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@dataclass(frozen=True)
class Received:
    """One message as rsyslog wrote it."""

    raw: bytes  # the RFC 5424 message, header and all
    pri: int
    timestamp: str
    hostname: str
    app_name: str
    procid: str
    msgid: str
    event: dict[str, Any]  # MSG, parsed

    @property
    def seq(self) -> int:
        return int(self.event["unmapped"]["audit"]["seq"])


class Rsyslog:
    def __init__(self, base: Path) -> None:
        base.mkdir(parents=True, exist_ok=True)
        self.base = base
        self.ca = CertificateAuthority("toolreg-test-syslog-ca")
        server = self.ca.issue("localhost", server=True, ip_addresses=["127.0.0.1"])
        client = self.ca.issue("toolreg-exporter")
        self.ca_file = self._write("ca.pem", self.ca.pem)
        self.server_cert = self._write("server.pem", server.cert_pem)
        self.server_key = self._write("server.key", server.key_pem)
        self.client_cert = self._write("client.pem", client.cert_pem)
        self.client_key = self._write("client.key", client.key_pem)
        self.out = base / "received.log"
        self.log = base / "rsyslogd.log"
        self.port = 0
        self._proc: subprocess.Popen[bytes] | None = None

    def _write(self, name: str, data: bytes) -> Path:
        path = self.base / name
        path.write_bytes(data)
        path.chmod(0o600)
        return path

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    def start(self) -> Rsyslog:
        binary = rsyslogd()
        work = self.base / "work"
        work.mkdir(exist_ok=True)
        for _attempt in range(3):  # the free port may be taken in between
            self.port = free_port()
            conf = self.base / "rsyslog.conf"
            conf.write_text(CONFIG.format(
                work=work, max_message=MAX_MESSAGE, ca=self.ca_file, cert=self.server_cert,
                key=self.server_key, port=self.port, out=self.out,
            ))  # fmt: skip
            with self.log.open("ab") as log:
                self._proc = subprocess.Popen(
                    [binary, "-n", "-f", str(conf), "-i", str(self.base / "rsyslogd.pid")],
                    stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
                )  # fmt: skip
            if self._wait_listening():
                return self
            self.stop()
        raise RuntimeError(f"rsyslogd did not listen:\n{self.log.read_text()[-2000:]}")

    def _wait_listening(self) -> bool:
        deadline = time.monotonic() + START_TIMEOUT_S
        while time.monotonic() < deadline:
            assert self._proc is not None
            if self._proc.poll() is not None:
                return False
            with (
                contextlib.suppress(OSError),
                socket.create_connection(("127.0.0.1", self.port), timeout=0.5),
            ):
                return True
            time.sleep(0.05)
        return False

    def stop(self) -> None:
        proc, self._proc = self._proc, None
        if proc is None or proc.poll() is not None:
            return
        os.kill(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            os.kill(proc.pid, signal.SIGKILL)
            proc.wait(timeout=10)

    def daemon_log(self) -> str:
        return self.log.read_text(errors="replace") if self.log.exists() else ""

    def messages(self, log_name: str | None = None) -> list[Received]:
        """Every whole message received so far (of the log ``log_name``, when
        given); ``cut_short`` has the others."""
        found: list[Received] = []
        for raw in self._lines():
            header = HEADER.match(raw)
            try:
                event = json.loads(raw[header.end() :]) if header else None
            except ValueError:
                event = None
            if header is None or not isinstance(event, dict):
                continue
            if log_name is not None and event.get("metadata", {}).get("log_name") != log_name:
                continue
            pri, stamp, host, app, procid, msgid, _sd = header.groups()
            found.append(Received(raw, int(pri), stamp.decode(), host.decode(), app.decode(),
                                  procid.decode(), msgid.decode(), event))  # fmt: skip
        return found

    def cut_short(self) -> list[bytes]:
        """Lines that are not a whole message: a frame cut by a sender's death,
        should the receiver write what it had of it."""
        cut = []
        for raw in self._lines():
            header = HEADER.match(raw)
            try:
                json.loads(raw[header.end() :]) if header else None
            except ValueError:
                header = None
            if header is None:
                cut.append(raw)
        return cut

    def _lines(self) -> list[bytes]:
        return self.out.read_bytes().splitlines() if self.out.exists() else []

    def raw_text(self) -> str:
        return self.out.read_text(errors="replace") if self.out.exists() else ""
