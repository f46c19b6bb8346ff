"""Where SIEM events go: a JSON Lines file with size-based rotation, or a
syslog receiver over TLS (RFC 5424 messages in RFC 5425's octet-counted
framing). ``write`` returns only once the destination has the events:

* the file: written and fsync'ed (and the directory too, after a rotation
  or the file's creation), so they survive a crash of the machine;
* syslog: every byte acknowledged by the receiver's TCP (the socket's send
  queue is empty, Linux's SIOCOUTQ) and the connection still up. That is as
  far as RFC 5425 goes: it has no acknowledgement of its own, so a receiver
  that dies before writing what its kernel acknowledged loses it (RELP
  exists for that; it is not RFC 5425).

The file also says how far it goes (``last_written``): the exporter resumes
after its last complete line, so a crash between a write and the cursor's
update never writes a record twice to it. A syslog receiver cannot be
asked; there the records since the last confirmed batch are sent again,
with the same event uid and hash (docs/how-to/audit.md, "Delivery guarantee").

Errors (SinkError) say what failed in words safe to log: a destination's
name, path or address, never a key or an event's content.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import os
import socket
import ssl
import struct
import termios
import time
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Protocol

DEFAULT_JSONL_MAX_BYTES = 64 * 1024 * 1024  # bytes: the file is rotated before it grows past this
DEFAULT_JSONL_KEEP = 5  # rotated files kept (path.1 ... path.N); older ones are deleted
JSONL_MODE = 0o640  # the file holds the audit log: not for every user of the machine
TAIL_CHUNK = 64 * 1024  # bytes read at a time while looking for a file's last line
SYSLOG_FACILITY = 13  # RFC 5424 "log audit"
SYSLOG_APP_NAME = "toolreg"
DEFAULT_SYSLOG_TIMEOUT_S = 10.0  # seconds to connect, and for a batch to be acknowledged
ACK_POLL_S = (0.0005, 0.01)  # seconds between looks at the send queue: first, at most
# OCSF severity_id -> RFC 5424 severity (6 informational, 5 notice, 4 warning, 3 error, 2 critical)
SYSLOG_SEVERITY = {0: 6, 1: 6, 2: 5, 3: 4, 4: 3, 5: 2, 6: 2, 99: 6}
# Linux's ioctl for the bytes in a socket's send queue not yet acknowledged (termios.TIOCOUTQ).
_OUTQ = getattr(termios, "TIOCOUTQ", None)


class SinkError(Exception):
    """The destination did not take the events; the message is safe to log."""


@dataclass(frozen=True)
class Line:
    """One event, ready for any sink."""

    seq: int
    at: float  # the audit entry's time (the syslog TIMESTAMP)
    kind: str  # the audit entry's kind (the syslog MSGID)
    severity_id: int  # OCSF's
    hash: str  # the audit entry's hash
    text: str  # the event as one line of ASCII JSON (ocsf.dumps)


@dataclass(frozen=True)
class Written:
    """The last event a destination holds by its own account."""

    seq: int
    hash: str
    log_name: str


class Sink(Protocol):
    @property
    def id(self) -> str:
        """The destination, as its cursor in the store is keyed: a new
        destination gets the whole log."""
        ...

    @property
    def label(self) -> str:
        """Its metric label (one per kind of sink: a bounded set)."""
        ...

    def last_written(self) -> Written | None:
        """The last event the destination holds, when it can tell."""
        ...

    def write(self, lines: Sequence[Line]) -> None:
        """Deliver ``lines`` in order; returns once the destination has them
        all (see the module's docstring), else raises SinkError."""
        ...

    def close(self) -> None: ...


class JsonlSink:
    """One event per line, appended to ``path``; before a write would take
    the file past ``max_bytes`` it becomes ``path.1`` (``path.1`` becomes
    ``path.2`` ..., ``path.<keep>`` is deleted) and a new file starts. A file
    never ends inside a line: a line cut short by a crash is cut off at
    start and written again whole."""

    label = "jsonl"

    def __init__(
        self, path: Path, *, max_bytes: int = DEFAULT_JSONL_MAX_BYTES,
        keep: int = DEFAULT_JSONL_KEEP,
    ) -> None:  # fmt: skip
        self.path = path.absolute()
        self._max_bytes = max_bytes
        self._keep = keep
        self._fd: int | None = None
        self._size = 0

    @property
    def id(self) -> str:
        return f"jsonl:{self.path}"

    def rotated(self, n: int) -> Path:
        return self.path.with_name(f"{self.path.name}.{n}")

    def last_written(self) -> Written | None:
        try:
            self._repair()
            for path in (self.path, *(self.rotated(n) for n in range(1, self._keep + 1))):
                line = _last_line(path)
                if line is not None:
                    return _written(line)
        except OSError as exc:
            raise SinkError(f"{self.path}: {_reason(exc)}") from None
        return None

    def write(self, lines: Sequence[Line]) -> None:
        try:
            fd = self._open()
            chunk: list[bytes] = []
            pending = 0
            for line in lines:
                data = line.text.encode("ascii") + b"\n"
                if self._size + pending + len(data) > self._max_bytes and self._size + pending:
                    _write_all(fd, b"".join(chunk))
                    self._size += pending
                    chunk, pending = [], 0
                    fd = self._rotate()
                chunk.append(data)
                pending += len(data)
            _write_all(fd, b"".join(chunk))
            self._size += pending
            os.fsync(fd)
        except OSError as exc:
            self._drop()
            raise SinkError(f"{self.path}: {_reason(exc)}") from None

    def _open(self) -> int:
        if self._fd is None:
            self._repair()
            created = not self.path.exists()
            self.path.parent.mkdir(parents=True, exist_ok=True)
            fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_CLOEXEC,
                         JSONL_MODE)  # fmt: skip
            self._fd, self._size = fd, os.fstat(fd).st_size
            if created:
                _fsync_dir(self.path.parent)
        return self._fd

    def _rotate(self) -> int:
        """path -> path.1 -> ... -> path.<keep> (deleted); a new, empty path."""
        assert self._fd is not None
        os.fsync(self._fd)
        self._drop()
        with contextlib.suppress(FileNotFoundError):
            self.rotated(self._keep).unlink()
        for n in range(self._keep - 1, 0, -1):
            with contextlib.suppress(FileNotFoundError):
                os.replace(self.rotated(n), self.rotated(n + 1))
        os.replace(self.path, self.rotated(1))
        _fsync_dir(self.path.parent)
        return self._open()

    def _repair(self) -> None:
        """Cut off a last line left unfinished by a crash."""
        try:
            fd = os.open(self.path, os.O_RDWR | os.O_CLOEXEC)
        except FileNotFoundError:
            return
        try:
            size = os.fstat(fd).st_size
            if size == 0 or os.pread(fd, 1, size - 1) == b"\n":
                return
            end = _after_last_newline(fd, size)
            os.ftruncate(fd, end)
            os.fsync(fd)
        finally:
            os.close(fd)

    def _drop(self) -> None:
        if self._fd is not None:
            with contextlib.suppress(OSError):
                os.close(self._fd)
            self._fd = None

    def close(self) -> None:
        self._drop()


def _write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view) :]


def _fsync_dir(directory: Path) -> None:
    fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _after_last_newline(fd: int, size: int) -> int:
    """The offset just after the last newline before ``size`` (0: none)."""
    end = size
    while end > 0:
        start = max(0, end - TAIL_CHUNK)
        chunk = os.pread(fd, end - start, start)
        found = chunk.rfind(b"\n")
        if found >= 0:
            return start + found + 1
        end = start
    return 0


def _last_line(path: Path) -> bytes | None:
    """The last complete line of ``path`` (None: no file, or no line)."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    except FileNotFoundError:
        return None
    try:
        end = _after_last_newline(fd, os.fstat(fd).st_size)
        if end == 0:
            return None
        start = _after_last_newline(fd, end - 1)
        return os.pread(fd, end - 1 - start, start)
    finally:
        os.close(fd)


def _written(line: bytes) -> Written | None:
    try:
        event = json.loads(line)
        audit = event["unmapped"]["audit"]
        return Written(int(audit["seq"]), str(audit["hash"]), str(event["metadata"]["log_name"]))
    except (ValueError, KeyError, TypeError):
        return None  # not one of ours: the store's cursor decides


def _reason(exc: OSError) -> str:
    return exc.strerror or type(exc).__name__


# -- syslog over TLS -----------------------------------------------------------------------


@dataclass(frozen=True)
class SyslogTls:
    """A syslog receiver over TLS and how to trust it: its certificate is
    verified against ``ca_file`` for ``server_name`` (default: ``host``);
    ``cert_file``/``key_file``: this server's client certificate, for a
    receiver that asks for one (rsyslog's x509/certvalid and x509/name)."""

    host: str
    port: int
    ca_file: Path
    cert_file: Path | None = None
    key_file: Path | None = None
    server_name: str | None = None
    timeout_s: float = DEFAULT_SYSLOG_TIMEOUT_S


def rfc5424(line: Line, hostname: str) -> bytes:
    """One RFC 5424 message: PRI VERSION TIMESTAMP HOSTNAME APP-NAME PROCID
    MSGID STRUCTURED-DATA MSG. PROCID is "-", so a record sent again after a
    restart is the same message byte for byte; MSG is ASCII JSON (no BOM)."""
    pri = SYSLOG_FACILITY * 8 + SYSLOG_SEVERITY.get(line.severity_id, 6)
    stamp = datetime.fromtimestamp(line.at, UTC).isoformat(timespec="microseconds")
    stamp = stamp.replace("+00:00", "Z")
    msgid = _printable(line.kind, 32) or "-"
    header = f"<{pri}>1 {stamp} {hostname} {SYSLOG_APP_NAME} - {msgid} - "
    return header.encode("ascii") + line.text.encode("ascii")


def octet_counted(message: bytes) -> bytes:
    """RFC 5425 4.3: MSG-LEN SP SYSLOG-MSG."""
    return str(len(message)).encode("ascii") + b" " + message


def _printable(text: str, limit: int) -> str:
    """RFC 5424's PRINTUSASCII (33-126), at most ``limit`` characters."""
    return "".join(c for c in text if 33 <= ord(c) <= 126)[:limit]


def local_hostname() -> str:
    return _printable(socket.gethostname(), 255) or "-"


class SyslogTlsSink:
    """One TLS connection, kept open across batches and made again after a
    failure. A batch is confirmed once its bytes are acknowledged and the
    receiver has not closed or refused the connection."""

    label = "syslog"

    def __init__(self, target: SyslogTls, *, hostname: str | None = None) -> None:
        self.target = target
        self._hostname = hostname or local_hostname()
        self._context = self._tls_context()
        self._conn: ssl.SSLSocket | None = None

    @property
    def id(self) -> str:
        return f"syslog:{self.address}"

    @property
    def address(self) -> str:
        host = self.target.host
        return f"[{host}]:{self.target.port}" if ":" in host else f"{host}:{self.target.port}"

    def _tls_context(self) -> ssl.SSLContext:
        t = self.target
        try:
            context = ssl.create_default_context(cafile=str(t.ca_file))
            if t.cert_file is not None:
                context.load_cert_chain(str(t.cert_file), str(t.key_file) if t.key_file else None)
        except (OSError, ssl.SSLError) as exc:
            what = "client certificate or key" if t.cert_file else "CA file"
            raise SinkError(f"syslog {self.address}: cannot read the {what}: {exc}") from None
        context.minimum_version = ssl.TLSVersion.TLSv1_2  # RFC 5425 as updated by RFC 9662
        return context

    def last_written(self) -> Written | None:
        return None  # RFC 5425 has no way to ask

    def write(self, lines: Sequence[Line]) -> None:
        data = b"".join(octet_counted(rfc5424(line, self._hostname)) for line in lines)
        conn = self._connection()
        try:
            conn.sendall(data)
            self._await_acknowledgement(conn)
        except (OSError, ssl.SSLError) as exc:
            self._drop()
            raise SinkError(f"syslog {self.address}: {_tls_reason(exc)}") from None
        except SinkError:
            self._drop()
            raise

    def _connection(self) -> ssl.SSLSocket:
        if self._conn is not None and _alive(self._conn):
            return self._conn
        self._drop()
        t = self.target
        try:
            raw = socket.create_connection((t.host, t.port), timeout=t.timeout_s)
        except OSError as exc:
            raise SinkError(f"syslog {self.address}: cannot connect: {_reason(exc)}") from None
        try:
            conn = self._context.wrap_socket(raw, server_hostname=t.server_name or t.host)
        except (OSError, ssl.SSLError) as exc:
            raw.close()
            raise SinkError(f"syslog {self.address}: TLS handshake: {_tls_reason(exc)}") from None
        conn.settimeout(t.timeout_s)
        self._conn = conn
        return conn

    def _await_acknowledgement(self, conn: ssl.SSLSocket) -> None:
        closed = SinkError(f"syslog {self.address}: the receiver closed the connection")
        if _OUTQ is not None:
            deadline = time.monotonic() + self.target.timeout_s
            pause = ACK_POLL_S[0]
            buffer = bytearray(4)
            while True:
                fcntl.ioctl(conn.fileno(), _OUTQ, buffer)
                if struct.unpack("i", buffer)[0] == 0:
                    break
                if not _alive(conn):  # a refused client certificate, say
                    raise closed
                if time.monotonic() > deadline:
                    waited = self.target.timeout_s
                    raise SinkError(f"syslog {self.address}: not acknowledged in {waited:g} s")
                time.sleep(pause)
                pause = min(ACK_POLL_S[1], pause * 2)
        # An empty queue is also what a reset connection shows: only a live one confirms.
        if not _alive(conn):
            raise closed

    def _drop(self) -> None:
        conn, self._conn = self._conn, None
        if conn is None:
            return
        with contextlib.suppress(OSError, ssl.SSLError, ValueError):
            conn.settimeout(1.0)
            conn.unwrap()  # close_notify: the receiver sees an orderly end
        with contextlib.suppress(OSError):
            conn.close()

    def close(self) -> None:
        self._drop()


def _alive(conn: ssl.SSLSocket) -> bool:
    """No error pending, no end of stream, no TLS alert: the receiver sends
    nothing on a healthy RFC 5425 connection, so anything readable is one of those."""
    try:
        if conn.getsockopt(socket.SOL_SOCKET, socket.SO_ERROR) != 0:
            return False
        timeout = conn.gettimeout()
        conn.setblocking(False)
        try:
            data = conn.recv(1)
        finally:
            conn.settimeout(timeout)
    except ssl.SSLWantReadError:
        return True
    except (OSError, ssl.SSLError, ValueError):
        return False
    return bool(data)  # b"": the receiver ended the connection


def _tls_reason(exc: BaseException) -> str:
    if isinstance(exc, ssl.SSLCertVerificationError):
        return f"its certificate does not verify: {exc.verify_message}"
    if isinstance(exc, ssl.SSLError):
        return exc.reason or type(exc).__name__
    if isinstance(exc, OSError):
        if exc.errno in (errno.EPIPE, errno.ECONNRESET):
            return "the receiver closed the connection"
        return _reason(exc)
    return type(exc).__name__
