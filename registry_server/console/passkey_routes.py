"""The console's passkey routes (docs/how-to/approvals.md, "Passkeys").

- ``GET /api/passkeys``: whether passkeys are set up (the policy's
  ``webauthn``), the relying party id, and the signed-in approver's passkeys.
- ``POST /api/passkeys/enrol/options`` and ``POST /api/passkeys/enrol``: the
  options for ``navigator.credentials.create`` (user verification required,
  resident key preferred, no attestation), then the created credential,
  verified with py_webauthn against the challenge given, answered with the
  policy lines to add. Nothing is stored: a passkey approves only once the
  operator has put those lines in the policy.
- ``GET /api/requests/{id}/passkey-claims``: the claims a passkey approval of
  the request signs, built from the request as the registry says it is now
  (a fresh jti every time), in RFC 8785 form: the page's challenge is their
  SHA-256, computed by the page with WebCrypto over these very bytes.
- ``POST /api/requests/{id}/approve-passkey``: the assertion; the console
  wraps it with the claims in a ``toolreg-passkey.v1`` envelope and submits it
  (SubmitApproval), where the registry verifies everything.

A passkey approval is the approver's own: only a credential the policy lists
for the signed-in approver is taken.
"""

from __future__ import annotations

import hashlib
import secrets
import time
from collections.abc import Callable
from typing import Any

import grpc
from starlette.concurrency import run_in_threadpool
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route
from webauthn import verify_registration_response
from webauthn.helpers.cose import COSEAlgorithmIdentifier
from webauthn.helpers.exceptions import InvalidRegistrationResponse
from webauthn.helpers.structs import (
    AuthenticatorAttestationResponse,
    PublicKeyCredentialType,
    RegistrationCredential,
)

from registry_server.client.terminal import escape
from registry_server.console import views
from registry_server.console.guard import error
from registry_server.domain import strict_json
from registry_server.domain.errors import InvalidArgument
from registry_server.policy.model import Policy
from registry_server.signing import passkeys
from registry_server.signing.tokens import TokenRejected, peek_issuer

ENROL_TTL_S = 300  # seconds an enrolment challenge stays usable
MAX_ENROLMENTS = 1_000  # enrolment challenges held at once (one per approver)
ATTESTATION_MAX_BYTES = 16 * 1024
TIMEOUT_MS = 120_000  # what the page gives the authenticator
ASSERTION_FIELDS = ("credential_id", "authenticator_data", "client_data_json", "signature")


def signer_of(policy: Policy, token: str) -> str | None:
    """Whose approval ``token`` says it is, unverified (the registry verifies):
    a passkey envelope's credential's approver, else a token's ``iss``."""
    if not passkeys.is_envelope(token):
        return peek_issuer(token)
    try:
        envelope = passkeys.parse(token)
    except TokenRejected:
        return None
    credential = policy.passkey_credentials().get(envelope.credential_id)
    return None if credential is None else credential.approver


class PasskeyRoutes:
    def __init__(self, console: Any, refusal: Callable[[grpc.RpcError], Response]) -> None:
        # console: the app's Console (its session, CSRF, body and submission
        # steps); refusal: how it answers a registry refusal
        self.console = console
        self._refusal = refusal
        self._enrolments: dict[str, tuple[bytes, float]] = {}  # client id -> challenge, until

    @property
    def policy(self) -> Policy:
        policy: Policy = self.console.policy
        return policy

    def routes(self) -> list[Route]:
        return [
            Route("/api/passkeys", self.status, methods=["GET"]),
            Route("/api/passkeys/enrol/options", self.enrol_options, methods=["POST"]),
            Route("/api/passkeys/enrol", self.enrol, methods=["POST"]),
            Route("/api/requests/{request_id}/passkey-claims", self.claims, methods=["GET"]),
            Route("/api/requests/{request_id}/approve-passkey", self.approve, methods=["POST"]),
        ]

    def _own_credentials(self, approver: str) -> list[str]:
        approver_entry = self.policy.approver(approver)
        return [] if approver_entry is None else [p.credential_id for p in approver_entry.passkeys]

    async def status(self, request: Request) -> Response:
        session = self.console._session(request)
        if session is None:
            return error(401, "not signed in")
        webauthn = self.policy.webauthn
        return JSONResponse({
            "enabled": webauthn is not None,
            "rp_id": webauthn.rp_id if webauthn else "",
            "credentials": self._own_credentials(session.approver),
        })  # fmt: skip

    # ------------------------------------------------------------ enrolment

    async def enrol_options(self, request: Request) -> Response:
        session = self.console._changing(request)
        if isinstance(session, Response):
            return session
        webauthn = self.policy.webauthn
        if webauthn is None:
            return error(
                409, "passkeys are not set up: the policy has no webauthn (rp_id, origins)"
            )
        now = time.monotonic()
        for client_id, (_, until) in list(self._enrolments.items()):
            if until <= now:
                del self._enrolments[client_id]
        if len(self._enrolments) >= MAX_ENROLMENTS and session.client_id not in self._enrolments:
            return error(429, "too many enrolments under way; try again in a few minutes")
        challenge = secrets.token_bytes(32)
        self._enrolments[session.client_id] = (challenge, now + ENROL_TTL_S)
        return JSONResponse({
            "challenge": passkeys.b64url(challenge),
            "rp": {"id": webauthn.rp_id, "name": "toolreg approvals"},
            "user": {
                # Not secret, not stored: the approver id, so that one
                # authenticator keeps one toolreg passkey per approver.
                "id": passkeys.b64url(hashlib.sha256(session.approver.encode()).digest()[:16]),
                "name": escape(session.approver),
                "displayName": escape(session.approver),
            },
            "algorithms": [int(a) for a in passkeys.ALGORITHMS],
            "exclude": self._own_credentials(session.approver),
            "timeout_ms": TIMEOUT_MS,
        })  # fmt: skip

    async def enrol(self, request: Request) -> Response:
        session = self.console._changing(request)
        if isinstance(session, Response):
            return session
        body = await self.console._json_body(request)
        if isinstance(body, Response):
            return body
        webauthn = self.policy.webauthn
        pending = self._enrolments.pop(session.client_id, None)
        if webauthn is None or pending is None or pending[1] <= time.monotonic():
            return error(409, "no enrolment under way (or it timed out); start again")
        try:
            raw_id = _bytes(body, "credential_id", passkeys.MAX_CREDENTIAL_ID_BYTES)
            credential = RegistrationCredential(
                id=passkeys.b64url(raw_id),
                raw_id=raw_id,
                response=AuthenticatorAttestationResponse(
                    client_data_json=_bytes(
                        body, "client_data_json", passkeys.MAX_CLIENT_DATA_BYTES
                    ),
                    attestation_object=_bytes(body, "attestation_object", ATTESTATION_MAX_BYTES),
                ),
                type=PublicKeyCredentialType.PUBLIC_KEY,
            )
            verified = verify_registration_response(
                credential=credential,
                expected_challenge=pending[0],
                expected_rp_id=webauthn.rp_id,
                expected_origin=list(webauthn.origins),
                require_user_verification=True,
                supported_pub_key_algs=[COSEAlgorithmIdentifier(a) for a in passkeys.ALGORITHMS],
            )
            credential_id = passkeys.canonical_credential_id(passkeys.b64url(raw_id))
            public_key = passkeys.b64url(verified.credential_public_key)
            passkeys.public_key_from_text(public_key)
        except (ValueError, InvalidRegistrationResponse) as exc:
            return error(400, f"the passkey was not created as required: {escape(str(exc)[:200])}")
        approver = escape(session.approver)
        entry = f'{{id: "{credential_id}", public_key: "{public_key}"}}'
        lines = [
            f"# approvers[] entry of {approver}: add this passkey to its passkeys list",
            f"  - id: {approver}",
            "    passkeys:",
            f"      - {entry}",
        ]
        return JSONResponse({
            "credential_id": credential_id, "public_key": public_key, "entry": entry,
            "policy_lines": "\n".join(lines), "rp_id": webauthn.rp_id,
            "user_verified": verified.user_verified,
            "backed_up": verified.credential_backed_up,
        })  # fmt: skip

    # ------------------------------------------------------------- approving

    async def claims(self, request: Request) -> Response:
        session = self.console._session(request)
        if session is None:
            return error(401, "not signed in")
        webauthn = self.policy.webauthn
        if webauthn is None:
            return error(409, "passkeys are not set up: the policy has no webauthn")
        if not self._own_credentials(session.approver):
            return error(409, f"the policy lists no passkey of {escape(session.approver)}")
        request_id = request.path_params["request_id"]
        client = self.console.connections(session.client_id)
        try:
            req = await run_in_threadpool(client.approval_request, request_id)
        except grpc.RpcError as err:
            return self._refusal(err)
        refusal = views.why_not_signable(req, session.approver, views.checks_of(req))
        if refusal is not None:
            return error(409, refusal)
        claims = passkeys.claims_for(req)
        return JSONResponse({
            "claims": passkeys.canonical(claims).decode("utf-8"),
            "rp_id": webauthn.rp_id,
            "credentials": self._own_credentials(session.approver),
            "timeout_ms": TIMEOUT_MS,
        })  # fmt: skip

    async def approve(self, request: Request) -> Response:
        console = self.console
        session = console._changing(request)
        if isinstance(session, Response):
            return session
        request_id = request.path_params["request_id"]
        body = await console._json_body(request)
        if isinstance(body, Response):
            return body
        try:
            claims = strict_json.loads_object(str(body.get("claims", "")), "claims")
            parts = {name: body.get(name) for name in ASSERTION_FIELDS}
            if not all(isinstance(v, str) and v for v in parts.values()):
                raise ValueError(f"the body needs {', '.join(ASSERTION_FIELDS)}: strings")
            credential_id = passkeys.canonical_credential_id(str(parts["credential_id"]))
            envelope = passkeys.wrap(
                claims, credential_id=credential_id,
                authenticator_data=_bytes(
                    parts, "authenticator_data", passkeys.MAX_AUTHENTICATOR_DATA_BYTES
                ),
                client_data_json=_bytes(parts, "client_data_json", passkeys.MAX_CLIENT_DATA_BYTES),
                signature=_bytes(parts, "signature", passkeys.MAX_SIGNATURE_BYTES),
            )  # fmt: skip
        except (ValueError, InvalidArgument) as exc:
            return error(400, escape(str(exc)[:200]))
        if claims.get("req") != request_id:
            return error(400, "the claims are not this request's (req)")
        if credential_id not in self._own_credentials(session.approver):
            return error(403, f"that passkey is not one the policy lists for"
                              f" {escape(session.approver)}")  # fmt: skip
        try:
            answer: Response = await console._submit(
                session, console.connections(session.client_id), request_id, envelope
            )
            return answer
        except grpc.RpcError as err:
            return self._refusal(err)


def _bytes(body: dict[str, Any], name: str, max_bytes: int) -> bytes:
    value = body.get(name)
    if not isinstance(value, str) or not value:
        raise ValueError(f"the body needs {name!r}: base64url")
    return passkeys.from_b64url(value, name, max_bytes=max_bytes)
