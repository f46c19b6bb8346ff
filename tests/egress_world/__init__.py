"""A private "internet" for the egress tests, made of real containers.

`UpstreamWorld` creates a (non-internal) bridge network and starts on it, from the
`toolreg/python` image, named HTTP and HTTPS upstreams and a DNS server that knows
them (plus a few hostile names), all running `upstream.py` from this directory:

    with UpstreamWorld() as world:
        world.ip("api.world.test")          # the upstream's address on the network
        world.dns_ip                        # point the egress proxy's resolver here
        world.ca_file                       # trust this to verify the HTTPS upstreams
        world.requests("api.world.test")    # what that upstream received
        world.dns_queries()                 # what the DNS server was asked

Everything it creates is labelled `toolreg.test=1`, named `toolreg-test-world-...`,
and removed on exit, failures included.
"""

from __future__ import annotations

import contextlib
import json
import os
import secrets
import shutil
import socket
import struct
import tempfile
import time
from collections.abc import Iterable, Mapping
from pathlib import Path
from types import TracebackType
from typing import Any

import docker
import docker.errors
from docker.models.containers import Container
from docker.models.networks import Network

from sandbox_runner.ownership import OwnerIdentity, owner_gone
from tests.certs import CertificateAuthority

__all__ = [
    "DEFAULT_HTTP",
    "DEFAULT_HTTPS",
    "HOSTILE_ZONE",
    "LABELS",
    "UpstreamWorld",
    "WorldError",
    "dns_query",
]

HERE = Path(__file__).resolve().parent
IMAGE = "toolreg/python"
PREFIX = "toolreg-test-world-"
LABELS = {"toolreg.test": "1"}
NOBODY = "65534:65534"

DEFAULT_HTTPS = ("api.world.test", "other.world.test", "forbidden.world.test")
DEFAULT_HTTP = ("plain.world.test",)
# Fixed answers of the world's DNS: names that resolve to places a proxy must refuse.
HOSTILE_ZONE: dict[str, list[str]] = {
    "private.world.test": ["10.255.0.7"],
    "loopback.world.test": ["127.0.0.1"],
    "metadata.world.test": ["169.254.169.254"],
}
REBIND = "rebind.world.test"  # the api upstream first, then loopback
REBIND_FIRST_BAD = "rebind-first-bad.world.test"  # loopback first, then the api upstream

QTYPES = {"A": 1, "AAAA": 28}
RCODES = {0: "NOERROR", 1: "FORMERR", 2: "SERVFAIL", 3: "NXDOMAIN", 4: "NOTIMP", 5: "REFUSED"}


class WorldError(RuntimeError):
    """The world could not be built or did not come up in time."""


def dns_query(
    server: str, name: str, qtype: str = "A", *, port: int = 53, timeout: float = 2.0
) -> tuple[str, list[str]]:
    """Ask `server` over UDP: (rcode name, IPv4 addresses of the A answers).
    qtype: "A", "AAAA" or a number."""
    qid = secrets.randbits(16)
    question = b"".join(
        bytes([len(label)]) + label.encode("ascii") for label in name.rstrip(".").split(".")
    )
    packet = struct.pack("!HHHHHH", qid, 0x0100, 1, 0, 0, 0) + question + b"\0"
    code = int(qtype) if qtype.isdigit() else QTYPES[qtype]
    packet += struct.pack("!HH", code, 1)
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
        sock.settimeout(timeout)
        sock.sendto(packet, (server, port))
        deadline = time.monotonic() + timeout
        while True:
            sock.settimeout(max(0.01, deadline - time.monotonic()))
            reply, _ = sock.recvfrom(4096)
            if len(reply) >= 12 and struct.unpack("!H", reply[:2])[0] == qid:
                break
    _, flags, qdcount, ancount = struct.unpack("!HHHH", reply[:8])
    i = 12
    for _ in range(qdcount):
        i = _skip_name(reply, i) + 4
    addresses = []
    for _ in range(ancount):
        i = _skip_name(reply, i)
        rtype, _rclass, _ttl, rdlength = struct.unpack("!HHIH", reply[i : i + 10])
        i += 10
        if rtype == 1 and rdlength == 4:
            addresses.append(socket.inet_ntoa(reply[i : i + 4]))
        i += rdlength
    return RCODES.get(flags & 0xF, str(flags & 0xF)), addresses


def _skip_name(packet: bytes, i: int) -> int:
    while True:
        length = packet[i]
        if length == 0:
            return i + 1
        if length & 0xC0:
            return i + 2
        i += 1 + length


class UpstreamWorld:
    """Context manager: the network, the upstreams and the DNS server, up and answering.

    Attributes once entered: network_name, subnet (CIDR), gateway, dns_ip, ca (the test
    CertificateAuthority), ca_pem, ca_file, zone (what the DNS server serves), names
    (all upstream names), https_names, http_names.
    """

    def __init__(
        self,
        client: docker.DockerClient | None = None,
        *,
        https: Iterable[str] = DEFAULT_HTTPS,
        http: Iterable[str] = DEFAULT_HTTP,
        image: str = IMAGE,
        labels: Mapping[str, str] | None = None,
        ready_timeout: float = 30.0,
    ) -> None:
        self.https_names = tuple(n.lower() for n in https)
        self.http_names = tuple(n.lower() for n in http)
        self.names = self.https_names + self.http_names
        if len(set(self.names)) != len(self.names):
            raise ValueError(f"upstream names repeat: {self.names}")
        self.image = image
        # Its creator too: a later world removes this one if its test run was killed.
        self.labels = {**LABELS, **OwnerIdentity.current().labels(), **(labels or {})}
        self.ready_timeout = ready_timeout
        self._own_client = client is None
        self._client = client
        self.run = secrets.token_hex(4)
        self.network_name = f"{PREFIX}{self.run}"
        self.subnet = ""
        self.gateway = ""
        self.dns_ip = ""
        self.zone: dict[str, Any] = {}
        self.ca = CertificateAuthority("toolreg test upstream CA")
        self.ca_pem: bytes = self.ca.pem
        self._network: Network | None = None
        self._containers: dict[str, Container] = {}
        self._ips: dict[str, str] = {}
        self._dns_skip = 0
        self._dir = Path(tempfile.mkdtemp(prefix=PREFIX))
        self.log_dir = self._dir / "log"
        self.cert_dir = self._dir / "certs"
        self.zone_dir = self._dir / "zone"
        self.ca_file = self._dir / "upstream-ca.pem"

    # --- lifecycle ---------------------------------------------------------------------

    def __enter__(self) -> UpstreamWorld:
        try:
            self._start()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    @property
    def client(self) -> docker.DockerClient:
        if self._client is None:
            self._client = docker.from_env(version="auto")
        return self._client

    def _remove_dead_worlds(self) -> None:
        """Remove the containers and networks of worlds whose test run is gone
        (killed before its close): only those labelled with a provably dead owner."""
        me, client = OwnerIdentity.current(), self.client
        for c in client.api.containers(all=True, filters={"label": "toolreg.test=1"}):
            if c["Names"][0].lstrip("/").startswith(PREFIX) and owner_gone(c["Labels"], me=me):
                with contextlib.suppress(docker.errors.NotFound):
                    client.api.remove_container(c["Id"], force=True, v=True)
        for n in client.api.networks(filters={"label": "toolreg.test=1"}):
            if n["Name"].startswith(PREFIX) and owner_gone(n.get("Labels") or {}, me=me):
                with contextlib.suppress(docker.errors.NotFound):
                    client.api.remove_network(n["Id"])

    def _start(self) -> None:
        self._remove_dead_worlds()
        os.chmod(self._dir, 0o755)
        for d, mode in ((self.log_dir, 0o777), (self.cert_dir, 0o755), (self.zone_dir, 0o755)):
            d.mkdir()
            os.chmod(d, mode)  # mkdir's mode is masked by the umask
        self.ca_file.write_bytes(self.ca_pem)
        for name in self.https_names:
            issued = self.ca.issue(name, dns_names=[name])
            for suffix, data in ((".pem", issued.cert_pem), (".key", issued.key_pem)):
                path = self.cert_dir / f"{name}{suffix}"
                path.write_bytes(data)
                os.chmod(path, 0o644)  # a throwaway key, readable by uid 65534

        self._network = self.client.networks.create(
            self.network_name, driver="bridge", internal=False, labels=self.labels
        )
        self._network.reload()
        ipam = (self._network.attrs.get("IPAM") or {}).get("Config") or [{}]
        self.subnet = ipam[0].get("Subnet", "")
        self.gateway = ipam[0].get("Gateway", "")

        for name in self.https_names:
            self._run(
                name,
                [
                    *("https", "--name", name, "--port", "443"),
                    *("--cert", f"/certs/{name}.pem", "--key", f"/certs/{name}.key"),
                    *("--log", f"/log/{name}.jsonl"),
                ],
            )
        for name in self.http_names:
            self._run(name, ["http", "--name", name, "--port", "80", "--log", f"/log/{name}.jsonl"])
        for name in self.names:
            self._ips[name] = self._address(self._containers[name])

        api = self._ips.get("api.world.test")
        self.zone = {name: [self._ips[name]] for name in self.names}
        self.zone.update({k: list(v) for k, v in HOSTILE_ZONE.items()})
        if api is not None:
            self.zone[REBIND] = {"rebind": [api, "127.0.0.1"]}
            self.zone[REBIND_FIRST_BAD] = {"rebind": ["127.0.0.1", api]}
        zone_file = self.zone_dir / "zone.json"
        zone_file.write_text(json.dumps(self.zone, indent=1))
        os.chmod(zone_file, 0o644)
        dns = self._run(
            "dns",
            [
                *("dns", "--port", "53", "--zone", "/etc/world/zone.json"),
                *("--log", "/log/dns.jsonl"),
            ],
            extra_volumes={str(self.zone_dir): {"bind": "/etc/world", "mode": "ro"}},
        )
        self.dns_ip = self._address(dns)
        self._wait_ready()

    def _run(
        self,
        name: str,
        args: list[str],
        extra_volumes: dict[str, dict[str, str]] | None = None,
    ) -> Container:
        volumes = {
            str(HERE): {"bind": "/opt/world", "mode": "ro"},
            str(self.log_dir): {"bind": "/log", "mode": "rw"},
            str(self.cert_dir): {"bind": "/certs", "mode": "ro"},
            **(extra_volumes or {}),
        }
        container = self.client.containers.create(
            self.image,
            ["python3", "/opt/world/upstream.py", *args],
            name=f"{PREFIX}{self.run}-{name}",
            hostname=name[:63],
            user=NOBODY,
            cap_drop=["ALL"],
            security_opt=["no-new-privileges"],
            read_only=True,
            tmpfs={"/tmp": "rw,nosuid,nodev,size=16m"},
            volumes=volumes,
            labels=self.labels,
            network=self.network_name,
            mem_limit="128m",
            pids_limit=128,
        )
        self._containers[name] = container  # registered before start: close() removes it
        container.start()
        return container

    def _address(self, container: Container) -> str:
        container.reload()
        nets = container.attrs["NetworkSettings"]["Networks"]
        ip = str(nets.get(self.network_name, {}).get("IPAddress") or "")
        if not ip:
            logs = container.logs(stdout=True, stderr=True).decode("utf-8", "replace")
            raise WorldError(
                f"{container.name} has no address on {self.network_name} "
                f"(status {container.status}):\n{logs}"
            )
        return ip

    def _wait_ready(self) -> None:
        pending: dict[str, tuple[str, int]] = {
            name: (self._ips[name], 443 if name in self.https_names else 80) for name in self.names
        }
        dns_ok = False
        probe = self.names[0] if self.names else None
        deadline = time.monotonic() + self.ready_timeout
        while True:
            for name, (ip, port) in list(pending.items()):
                with contextlib.suppress(OSError), socket.create_connection((ip, port), 0.5):
                    del pending[name]
            if not dns_ok:
                if probe is None:
                    dns_ok = True
                else:
                    with contextlib.suppress(OSError):
                        rcode, answer = dns_query(self.dns_ip, probe, timeout=0.5)
                        dns_ok = rcode == "NOERROR" and answer == [self._ips[probe]]
            if not pending and dns_ok:
                break
            self._check_alive()
            if time.monotonic() > deadline:
                waiting = [f"{n} ({ip}:{p}/tcp)" for n, (ip, p) in pending.items()]
                if not dns_ok:
                    waiting.append(f"dns ({self.dns_ip}:53/udp)")
                raise WorldError(
                    f"the upstream world did not answer within {self.ready_timeout:.0f}s: "
                    f"still waiting for {', '.join(waiting)}\n{self._all_logs()}"
                )
            time.sleep(0.1)
        # The readiness probe is not a query of the test's: dns_queries() skips it.
        self._dns_skip = len(self._read_log("dns"))

    def _check_alive(self) -> None:
        for name, container in self._containers.items():
            container.reload()
            if container.status in ("exited", "dead"):
                raise WorldError(
                    f"upstream {name} ({container.name}) stopped: {container.status}\n"
                    f"{self.logs(name)}"
                )

    def close(self) -> None:
        """Remove the containers, the network and the temporary files (idempotent)."""
        client = self._client
        if client is not None:
            for container in self._containers.values():
                with contextlib.suppress(docker.errors.NotFound):
                    container.remove(force=True, v=True)
            self._containers.clear()
            # Anything of this world's the lines above did not know of (a failed create).
            with contextlib.suppress(docker.errors.APIError):
                for c in client.api.containers(
                    all=True, filters={"name": f"{PREFIX}{self.run}-", "label": "toolreg.test=1"}
                ):
                    with contextlib.suppress(docker.errors.NotFound):
                        client.api.remove_container(c["Id"], force=True, v=True)
            if self._network is not None:
                for attempt in range(10):
                    try:
                        self._network.remove()
                        break
                    except docker.errors.NotFound:
                        break
                    except docker.errors.APIError:
                        if attempt == 9:
                            raise
                        time.sleep(0.2)
                self._network = None
            if self._own_client:
                client.close()
                self._client = None
        shutil.rmtree(self._dir, ignore_errors=True)

    # --- what the tests use ------------------------------------------------------------

    def ip(self, name: str) -> str:
        """The address of upstream `name` (or "dns") on the world network."""
        if name == "dns":
            return self.dns_ip
        return self._ips[name.lower()]

    def port(self, name: str) -> int:
        """443 for an HTTPS upstream, 80 for an HTTP one."""
        name = name.lower()
        if name in self.https_names:
            return 443
        if name in self.http_names:
            return 80
        raise KeyError(name)

    def requests(self, name: str) -> list[dict[str, Any]]:
        """The requests upstream `name` received, oldest first: dicts with method, path,
        headers, body_len (and sni for HTTPS)."""
        name = name.lower()
        if name not in self._ips:
            raise KeyError(name)
        return self._read_log(name)

    def dns_queries(self) -> list[dict[str, Any]]:
        """The queries the DNS server answered since the world came up, oldest first:
        dicts with name, type ("A", "AAAA", ...), answer (list of IPs) and rcode."""
        return self._read_log("dns")[self._dns_skip :]

    def resolve(self, name: str, qtype: str = "A") -> tuple[str, list[str]]:
        """Ask the world's DNS from the host (counts as a query: rebind names advance)."""
        return dns_query(self.dns_ip, name, qtype)

    def logs(self, name: str) -> str:
        """stdout+stderr of the container serving `name` (or "dns")."""
        container = self._containers.get(name.lower())
        if container is None:
            return ""
        try:
            return str(container.logs(stdout=True, stderr=True).decode("utf-8", "replace"))
        except docker.errors.APIError as e:
            return f"<no logs: {e}>"

    def _all_logs(self) -> str:
        return "\n".join(f"--- {name}:\n{self.logs(name)}" for name in self._containers)

    def _read_log(self, name: str) -> list[dict[str, Any]]:
        path = self.log_dir / f"{name}.jsonl"
        try:
            text = path.read_text(encoding="utf-8")
        except FileNotFoundError:
            return []
        # A line still being written has no newline yet: leave it for the next read.
        return [json.loads(line) for line in text.split("\n")[:-1] if line.strip()]
