"""Who the egress proxy runs as, and how file secrets are handed to sandboxes, by the
server's own user (sandbox_runner/egress/gateway.py, EgressUsers): a root server keeps
handing them to the sandboxes' user; a server that is not root (the server image's
uid 10001) runs the proxy as itself and lets the sandbox read a secret by its mode."""

from __future__ import annotations

import os
import stat
from collections.abc import Iterator
from pathlib import Path

import pytest

from sandbox_runner.egress.gateway import (
    PROXY_USER,
    SANDBOX_UID,
    SECRETS_TARGET,
    EgressConfig,
    EgressGateway,
    egress_users,
)


def test_a_root_server_hands_the_proxy_and_secrets_to_the_sandboxes_user() -> None:
    users = egress_users(0, 0)
    assert users.proxy_user == PROXY_USER == "65534:65534"
    assert users.hand_to == (SANDBOX_UID, SANDBOX_UID)
    assert users.secret_mode == 0o400


@pytest.mark.parametrize(("uid", "gid"), [(10001, 10001), (1000, 50)])
def test_a_server_that_is_not_root_runs_its_proxy_as_itself(uid: int, gid: int) -> None:
    users = egress_users(uid, gid)
    assert users.proxy_user == f"{uid}:{gid}"  # never root, never the sandboxes' user
    assert users.hand_to is None  # it could not chown
    # Owner and others may read; the group may not (nor may anyone write).
    assert users.secret_mode == 0o404


def test_a_server_running_as_the_sandboxes_user_owns_what_they_read() -> None:
    users = egress_users(SANDBOX_UID, SANDBOX_UID)
    assert users.proxy_user == "65534:65534"
    assert users.hand_to is None and users.secret_mode == 0o400


@pytest.fixture
def strict_umask() -> Iterator[None]:
    old = os.umask(0o077)  # an operator's umask must not take the sandbox's read bit
    try:
        yield
    finally:
        os.umask(old)


def _gateway(tmp_path: Path, uid: int, gid: int) -> EgressGateway:
    gateway = EgressGateway(
        EgressConfig(state_dir=tmp_path / "egress"), name_prefix="t-", labels={}
    )
    gateway.users = egress_users(uid, gid)
    return gateway


@pytest.mark.usefixtures("strict_umask")
def test_a_non_root_servers_file_secret_is_readable_by_others_only_behind_its_0700_dir(
    tmp_path: Path,
) -> None:
    gateway = _gateway(tmp_path, 10001, 10001)
    call_dir, mounts = gateway._write_secret_files("exec-1", {"TOKEN": b"value"})
    path = call_dir / "TOKEN"
    assert stat.S_IMODE(path.stat().st_mode) == 0o404
    assert path.read_bytes() == b"value"
    assert path.stat().st_uid == os.geteuid()  # not handed to anyone
    # Only the server's user may walk to it on the host.
    for folder in (call_dir, call_dir.parent):
        assert stat.S_IMODE(folder.stat().st_mode) == 0o700
        assert folder.stat().st_uid == os.geteuid()
    assert [(m.source, m.target, m.read_only) for m in mounts] == [
        (str(path), f"{SECRETS_TARGET}/TOKEN", True)
    ]


@pytest.mark.skipif(os.geteuid() != 0, reason="the root server's hand-over needs root")
@pytest.mark.usefixtures("strict_umask")
def test_a_root_servers_file_secret_is_the_sandboxes_user_s_alone(tmp_path: Path) -> None:
    gateway = _gateway(tmp_path, 0, 0)
    call_dir, _ = gateway._write_secret_files("exec-2", {"TOKEN": b"value"})
    info = (call_dir / "TOKEN").stat()
    assert stat.S_IMODE(info.st_mode) == 0o400
    assert (info.st_uid, info.st_gid) == (SANDBOX_UID, SANDBOX_UID)
