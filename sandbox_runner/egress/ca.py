"""The server's own certificate authority for header-delivered secrets.

The egress proxy terminates TLS for the hosts a secret is injected into, so
it shows the sandbox a certificate for that host. This CA signs those
certificates; only the sandboxes of tools with header-delivered secrets are
told to trust it (SSL_CERT_FILE and friends), nothing else on the machine.
Its key stays in the server's state directory (mode 0600); the proxy gets
only short-lived leaf keys.
"""

from __future__ import annotations

import datetime as dt
import os
import threading
import time
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID

CA_VALIDITY_DAYS = 3_650  # days; the CA is local to one data directory
LEAF_VALIDITY_S = 24 * 3600  # seconds a host certificate is valid
LEAF_REISSUE_S = 12 * 3600  # seconds after which a cached host certificate is replaced
CA_CERT_FILE = "egress-ca.pem"
CA_KEY_FILE = "egress-ca.key"


class EgressCA:
    def __init__(self, state_dir: Path) -> None:
        self.state_dir = state_dir
        self._lock = threading.Lock()
        self._key: ec.EllipticCurvePrivateKey | None = None
        self._cert: x509.Certificate | None = None
        self._leaves: dict[str, tuple[float, str, str]] = {}  # host -> (made, cert, key)

    @property
    def cert_path(self) -> Path:
        return self.state_dir / CA_CERT_FILE

    def load_or_create(self) -> None:
        with self._lock:
            if self._key is not None:
                return
            key_path = self.state_dir / CA_KEY_FILE
            self.state_dir.mkdir(parents=True, exist_ok=True, mode=0o700)
            if key_path.exists() and self.cert_path.exists():
                key = serialization.load_pem_private_key(key_path.read_bytes(), None)
                assert isinstance(key, ec.EllipticCurvePrivateKey)
                self._key = key
                self._cert = x509.load_pem_x509_certificate(self.cert_path.read_bytes())
                return
            key = ec.generate_private_key(ec.SECP256R1())
            name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "toolreg egress CA")])
            now = dt.datetime.now(dt.UTC)
            cert = (
                x509.CertificateBuilder()
                .subject_name(name)
                .issuer_name(name)
                .public_key(key.public_key())
                .serial_number(x509.random_serial_number())
                .not_valid_before(now - dt.timedelta(minutes=5))
                .not_valid_after(now + dt.timedelta(days=CA_VALIDITY_DAYS))
                .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
                .add_extension(
                    x509.KeyUsage(
                        digital_signature=True,
                        key_cert_sign=True,
                        crl_sign=True,
                        content_commitment=False,
                        key_encipherment=False,
                        data_encipherment=False,
                        key_agreement=False,
                        encipher_only=False,
                        decipher_only=False,
                    ),
                    critical=True,
                )
                .sign(key, hashes.SHA256())
            )
            pem_key = key.private_bytes(
                serialization.Encoding.PEM,
                serialization.PrivateFormat.PKCS8,
                serialization.NoEncryption(),
            )
            fd = os.open(key_path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
            with os.fdopen(fd, "wb") as f:
                f.write(pem_key)
            self.cert_path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
            self.cert_path.chmod(0o644)  # public: mounted into the sandboxes that trust it
            self._key, self._cert = key, cert

    def leaf(self, host: str) -> tuple[str, str]:
        """(certificate PEM, key PEM) for ``host``, signed by this CA."""
        self.load_or_create()
        with self._lock:
            cached = self._leaves.get(host)
            if cached is not None and time.time() - cached[0] < LEAF_REISSUE_S:
                return cached[1], cached[2]
            assert self._key is not None and self._cert is not None
            key = ec.generate_private_key(ec.SECP256R1())
            now = dt.datetime.now(dt.UTC)
            cert = (
                x509.CertificateBuilder()
                .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, host)]))
                .issuer_name(self._cert.subject)
                .public_key(key.public_key())
                .serial_number(x509.random_serial_number())
                .not_valid_before(now - dt.timedelta(minutes=5))
                .not_valid_after(now + dt.timedelta(seconds=LEAF_VALIDITY_S))
                .add_extension(x509.SubjectAlternativeName([x509.DNSName(host)]), critical=False)
                .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
                .add_extension(
                    x509.ExtendedKeyUsage([x509.oid.ExtendedKeyUsageOID.SERVER_AUTH]),
                    critical=False,
                )
                .sign(self._key, hashes.SHA256())
            )
            cert_pem = cert.public_bytes(serialization.Encoding.PEM).decode()
            key_pem = key.private_bytes(
                serialization.Encoding.PEM,
                serialization.PrivateFormat.PKCS8,
                serialization.NoEncryption(),
            ).decode()
            self._leaves[host] = (time.time(), cert_pem, key_pem)
            return cert_pem, key_pem
