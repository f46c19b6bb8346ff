"""The identity tests' OpenID Provider: `oidc-provider` (tests/identity/idp),
started on loopback over TLS with a CA made for the run, one per test session.

The test holds the provider's signing keys (private JWKs it made), so it can
both ask the provider for real tokens (client credentials, with a resource
indicator, as an agent would) and forge tokens that only differ from real ones
in the one way a test attacks (expired, another audience, ...). A key rotation
is a restart with [new, old]; the groups of each subject live in a file the
provider reads for every token.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import ssl
import subprocess
import time
import uuid
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import httpx
import jwt
from cryptography.hazmat.primitives.asymmetric import ec, rsa
from jwt.algorithms import ECAlgorithm, RSAAlgorithm

from tests.certs import CertificateAuthority

HERE = Path(__file__).resolve().parent
PROVIDER_DIR = HERE / "idp"
START_TIMEOUT_S = 20.0  # seconds for the provider to listen
RESOURCE = "https://registry.toolreg.test"  # the registry's audience (RFC 8707 resource)
OTHER_RESOURCE = "https://other.toolreg.test"  # a resource server that is not the registry
SCOPE = "toolreg"
TOKEN_EXCHANGE = "urn:ietf:params:oauth:grant-type:token-exchange"
ACCESS_TOKEN_TYPE = "urn:ietf:params:oauth:token-type:access_token"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class SigningKey:
    """One of the provider's signing keys, private part included (the test's)."""

    def __init__(self, alg: str = "ES256") -> None:
        self.alg = alg
        self.kid = uuid.uuid4().hex[:16]
        if alg == "ES256":
            self.key: Any = ec.generate_private_key(ec.SECP256R1())
            jwk = ECAlgorithm.to_jwk(self.key, as_dict=True)
        else:
            self.key = rsa.generate_private_key(public_exponent=65537, key_size=2048)
            jwk = RSAAlgorithm.to_jwk(self.key, as_dict=True)
        self.private_jwk = {**jwk, "kid": self.kid, "use": "sig", "alg": alg}

    def sign(self, claims: Mapping[str, Any], **header: Any) -> str:
        headers = {"kid": self.kid, "typ": "at+jwt", **header}
        return jwt.encode(dict(claims), self.key, algorithm=self.alg, headers=headers)


class IdP:
    """The provider process and what a test needs of it."""

    def __init__(self, workdir: Path, ca: CertificateAuthority) -> None:
        self.workdir = workdir
        self.ca = ca
        self.port = free_port()
        self.issuer = f"https://127.0.0.1:{self.port}"
        self.ca_file = workdir / "idp-ca.pem"
        self.ca_file.write_bytes(ca.pem)
        issued = ca.issue("test-idp", server=True, ip_addresses=["127.0.0.1"])
        (workdir / "idp-cert.pem").write_bytes(issued.cert_pem)
        (workdir / "idp-key.pem").write_bytes(issued.key_pem)
        self.claims_file = workdir / "idp-claims.json"
        self.log_file = workdir / "idp.log"
        self.keys: list[SigningKey] = [SigningKey("ES256"), SigningKey("RS256")]
        self.clients: dict[str, str] = {}  # client_id -> secret ("" for a public client)
        self.metadata: dict[str, dict[str, Any]] = {}  # client_id -> its OIDC client metadata
        self.claims: dict[str, dict[str, dict[str, Any]]] = {"clients": {}, "accounts": {}}
        self.resources: dict[str, str] = {RESOURCE: SCOPE, OTHER_RESOURCE: SCOPE}  # url -> scope
        self.exchangers: dict[str, dict[str, Any]] = {}  # client_id -> what it may exchange
        self._process: subprocess.Popen[bytes] | None = None
        self._log: Any = None

    # -- set-up ---------------------------------------------------------------

    def add_client(self, client_id: str, groups: Sequence[str] = (), **claims: Any) -> str:
        """A confidential client for the client-credentials grant; its secret."""
        secret = uuid.uuid4().hex
        self.clients[client_id] = secret
        self.metadata[client_id] = {
            "client_id": client_id, "client_secret": secret,
            "grant_types": ["client_credentials"], "response_types": [], "redirect_uris": [],
            "token_endpoint_auth_method": "client_secret_basic",
        }  # fmt: skip
        self.set_claims("clients", client_id, groups=list(groups), **claims)
        self._read_clients_again()
        return secret

    def add_login_client(
        self,
        client_id: str,
        redirect_uris: Sequence[str],
        *,
        public: bool = True,
        native: bool = False,
    ) -> str:
        """A client that signs people in (authorization code with PKCE, refresh
        tokens): public (no secret: a CLI, a browser) or confidential; native
        (RFC 8252 section 7.3: any port on a registered loopback redirect, as a
        CLI's one-shot listener needs) or web. Its secret, "" for a public one."""
        secret = "" if public else uuid.uuid4().hex
        self.clients[client_id] = secret
        self.metadata[client_id] = {
            "client_id": client_id,
            "grant_types": ["authorization_code", "refresh_token"],
            "response_types": ["code"], "redirect_uris": list(redirect_uris),
            "token_endpoint_auth_method": "none" if public else "client_secret_basic",
            **({} if public else {"client_secret": secret}),
            **({"application_type": "native"} if native else {}),
        }  # fmt: skip
        self._read_clients_again()
        return secret

    def add_resource(self, url: str, scope: str) -> None:
        """Another resource server the provider issues JWT access tokens for."""
        self.resources[url] = scope
        self._read_clients_again()

    def add_exchanger(self, client_id: str, subject_audience: str, resources: Sequence[str]) -> str:
        """A confidential client that may exchange (RFC 8693) tokens issued for
        ``subject_audience`` (its own resource) for tokens of ``resources``; its secret."""
        secret = uuid.uuid4().hex
        self.clients[client_id] = secret
        self.metadata[client_id] = {
            "client_id": client_id, "client_secret": secret,
            "grant_types": [TOKEN_EXCHANGE], "response_types": [], "redirect_uris": [],
            "token_endpoint_auth_method": "client_secret_basic",
        }  # fmt: skip
        self.exchangers[client_id] = {
            "subject_audience": subject_audience,
            "resources": list(resources),
        }
        self._read_clients_again()
        return secret

    def add_person(self, login: str, groups: Sequence[str] = (), **claims: Any) -> None:
        """An account: the provider's login page signs it in by this name
        (oidc-provider's development login takes any password)."""
        self.set_claims("accounts", login, groups=list(groups), preferred_username=login, **claims)

    def _read_clients_again(self) -> None:
        if self._process is not None:
            self.restart()  # oidc-provider's static clients are read at start

    def set_claims(self, kind: str, subject: str, **claims: Any) -> None:
        """What the provider puts in the next tokens of a subject (read per token)."""
        self.claims[kind][subject] = claims
        tmp = self.claims_file.with_suffix(".tmp")
        tmp.write_text(json.dumps(self.claims))
        os.replace(tmp, self.claims_file)

    def _config(self) -> dict[str, Any]:
        return {
            "issuer": self.issuer,
            "host": "127.0.0.1",
            "port": self.port,
            "tls": {"cert": str(self.workdir / "idp-cert.pem"),
                    "key": str(self.workdir / "idp-key.pem")},
            "jwks": {"keys": [k.private_jwk for k in self.keys]},
            "claims_file": str(self.claims_file),
            "default_resource": RESOURCE,
            "scopes": sorted(set(self.resources.values())),
            "resources": {
                url: {"scope": scope, "alg": self.keys[0].alg}
                for url, scope in self.resources.items()
            },
            "token_exchange": self.exchangers,
            "clients": list(self.metadata.values()),
        }  # fmt: skip

    # -- the process ----------------------------------------------------------

    def start(self) -> None:
        if not (PROVIDER_DIR / "node_modules" / "oidc-provider").is_dir():
            raise RuntimeError("tests/identity/idp is not installed: run `make identity-deps`")
        node = shutil.which("node", path=str(PROVIDER_DIR / "node_modules" / ".bin"))
        if node is None:
            raise RuntimeError("tests/identity/idp has no node: run `make identity-deps`")
        config = self.workdir / "idp-config.json"
        config.write_text(json.dumps(self._config()))
        if not self.claims_file.exists():
            self.set_claims("clients", "-", groups=[])
        self._log = self.log_file.open("ab")
        self._process = subprocess.Popen(
            [node, str(PROVIDER_DIR / "provider.mjs"), str(config)],
            cwd=PROVIDER_DIR, stdout=self._log, stderr=self._log, stdin=subprocess.DEVNULL,
        )  # fmt: skip
        deadline = time.monotonic() + START_TIMEOUT_S
        while time.monotonic() < deadline:
            if self._process.poll() is not None:
                raise RuntimeError(f"the test IdP exited: {self.log_file.read_text()[-2000:]}")
            try:
                self.http().get("/.well-known/openid-configuration").raise_for_status()
                return
            except httpx.HTTPError:
                time.sleep(0.1)
        raise RuntimeError(f"the test IdP did not answer in {START_TIMEOUT_S} s")

    def stop(self) -> None:
        if self._process is not None and self._process.poll() is None:
            self._process.send_signal(signal.SIGTERM)
            try:
                self._process.wait(5)
            except subprocess.TimeoutExpired:
                self._process.kill()
                self._process.wait(5)
        self._process = None
        if self._log is not None:
            self._log.close()
            self._log = None

    def restart(self) -> None:
        self.stop()
        self.start()

    def rotate(self) -> SigningKey:
        """A new signing key first (it signs from now on), the old ones still
        published, as a provider rotates; returns the new key."""
        new = SigningKey(self.keys[0].alg)
        self.keys.insert(0, new)
        self.restart()
        return new

    # -- what a test asks -----------------------------------------------------

    def http(self) -> httpx.Client:
        tls = ssl.create_default_context(cafile=str(self.ca_file))
        return httpx.Client(base_url=self.issuer, verify=tls, timeout=10)

    def client_credentials(self, client_id: str, resource: str = RESOURCE) -> str:
        """An access token for the client, as an agent gets one."""
        with self.http() as http:
            answer = http.post(
                "/token",
                data={"grant_type": "client_credentials", "resource": resource, "scope": SCOPE},
                auth=(client_id, self.clients[client_id]),
            )
        answer.raise_for_status()
        return str(answer.json()["access_token"])

    def requests_to(self, path: str) -> int:
        """How many requests the provider has served for ``path`` so far."""
        lines = self.log_file.read_text(errors="replace").splitlines()
        return sum(1 for line in lines if line.split(" ", 1)[-1] == path)

    def forge(self, key: SigningKey | None = None, **overrides: Any) -> str:
        """A token as the provider would sign it, with claims overridden
        (None removes a claim)."""
        now = int(time.time())
        claims: dict[str, Any] = {
            "iss": self.issuer, "aud": RESOURCE, "sub": "forged-agent",
            "client_id": "forged-agent", "iat": now, "exp": now + 300,
            "jti": uuid.uuid4().hex, "scope": SCOPE, "groups": [],
        }  # fmt: skip
        claims.update(overrides)
        return (key or self.keys[0]).sign({k: v for k, v in claims.items() if v is not None})
