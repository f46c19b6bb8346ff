"""The identity tier: a real OpenID Provider (oidc-provider, tests/identity/idp)
on loopback over TLS, one per test run, and real toolreg servers that trust it."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests.certs import CertificateAuthority
from tests.identity.idp_world import IdP


@pytest.fixture(scope="session")
def idp(tmp_path_factory: pytest.TempPathFactory) -> Iterator[IdP]:
    provider = IdP(tmp_path_factory.mktemp("idp"), CertificateAuthority("toolreg test IdP CA"))
    provider.start()
    yield provider
    provider.stop()
