"""The cleartext health port (TOOLREG_HEALTH_PORT): what the server image's health
check and Kubernetes' gRPC probes ask, beside a main port that serves only mTLS."""

from __future__ import annotations

from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from registry_server.api.server import LIVENESS_SERVICE
from registry_server.client.health_probe import check, probe
from tests.certs import CertificateAuthority
from tests.integration.conftest import StartServer


def test_the_health_port_answers_in_cleartext_beside_an_mtls_port(
    start_server: StartServer, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    ca = CertificateAuthority("health-port-test-ca")
    leaf = ca.issue("localhost", server=True)
    for name, data in (("ca.pem", ca.pem), ("cert.pem", leaf.cert_pem), ("key.pem", leaf.key_pem)):
        (tmp_path / name).write_bytes(data)
    (tmp_path / "key.pem").chmod(0o600)
    running = start_server(
        tls_cert=tmp_path / "cert.pem", tls_key=tmp_path / "key.pem",
        tls_client_ca=tmp_path / "ca.pem", health_port=0,
    )  # fmt: skip
    port = running.app.health_port
    assert port
    address = f"127.0.0.1:{port}"
    assert check(address) == "SERVING"
    assert check(address, "toolregistry.v1.ToolRegistry") == "SERVING"
    assert probe(address) == 0 and capsys.readouterr().out.strip() == "SERVING"
    # Only health is served there: the registry is not reachable without mTLS.
    with grpc.insecure_channel(address) as channel:
        reflect = channel.unary_unary(
            "/toolregistry.v1.ToolRegistry/ListTools",
            request_serializer=lambda b: b,
            response_deserializer=lambda b: b,
        )
        with pytest.raises(grpc.RpcError) as caught:
            reflect(b"", timeout=5)
        assert caught.value.code() is grpc.StatusCode.UNIMPLEMENTED
    # Liveness stays SERVING while the engine or the store is down (readiness does not).
    running.app.health.set("", health_pb2.HealthCheckResponse.NOT_SERVING)
    assert check(address) == "NOT_SERVING" and check(address, LIVENESS_SERVICE) == "SERVING"
    # A shutting-down server says so on the health port too (one HealthServicer).
    running.app.health.enter_graceful_shutdown()
    assert check(address) == "NOT_SERVING"
    assert probe(address) == 1


def test_the_health_port_is_off_by_default(start_server: StartServer) -> None:
    running = start_server()
    assert running.app.health_port is None
    with grpc.insecure_channel(running.address) as channel:
        answer = health_pb2_grpc.HealthStub(channel).Check(
            health_pb2.HealthCheckRequest(), timeout=5
        )
    assert answer.status == health_pb2.HealthCheckResponse.SERVING


def test_no_answer_is_a_failed_probe(capsys: pytest.CaptureFixture[str]) -> None:
    assert probe("127.0.0.1:1", timeout_s=2) == 1
    assert "no answer" in capsys.readouterr().err
