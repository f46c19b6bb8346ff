"""SIEM export with two real servers on one real PostgreSQL, both told to
export to the same real rsyslogd over TLS (tests/rsyslog_receiver.py): one
exports at a time (the cursor's lease), so every record of the one log
arrives once; the holder SIGKILLed, the other takes the destination over
once the lease lapses and every record arrives, the batch in flight at the
kill at most twice, byte for byte the same (docs/how-to/audit.md, "Delivery
guarantee"; tests/cluster/test_export_cursors_store.py holds the store to
the lease)."""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterator

import pytest

from registry_server._proto.toolregistry.v1 import registry_pb2 as pb
from registry_server.store.postgres import PostgresStore
from tests.cluster.conftest import Cluster, StartCluster, wait_for
from tests.rsyslog_receiver import Rsyslog

LOG_NAME = "toolreg/siem-cluster"
BATCH = 20  # events per confirmed batch
CALLS = 150  # refused calls (no engine needed) through each server, each an audit record


@pytest.fixture(scope="module")
def rsyslog(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Rsyslog]:
    receiver = Rsyslog(tmp_path_factory.mktemp("rsyslog-cluster")).start()
    yield receiver
    receiver.stop()


def head(cluster: Cluster) -> int:
    store = PostgresStore(cluster.store_url)
    try:
        with store.reading() as reads:
            tail = reads.audit_tail(1)
    finally:
        store.close()
    return tail[-1].seq if tail else 0


def calls(cluster: Cluster, index: int, count: int, tag: str) -> None:
    stub = cluster.stub(index, "agent")
    for n in range(count):
        result = stub.ExecuteTool(
            pb.ExecuteToolRequest(name=f"no_such_tool_{tag}_{n}", arguments_json="{}"), timeout=30
        )
        assert result.status == pb.EXECUTION_STATUS_TOOL_NOT_FOUND


def exporting(cluster: Cluster, sink: str) -> list[int]:
    """The servers that logged taking the destination."""
    return [i for i, s in enumerate(cluster.servers)
            if any(f"SIEM export to {sink}: from record" in line for line in s.log)]  # fmt: skip


def test_two_servers_export_one_log_once_and_one_takes_over_from_the_other(
    start_cluster: StartCluster, rsyslog: Rsyslog, monkeypatch: pytest.MonkeyPatch
) -> None:
    for name, value in {
        "TOOLREG_LOG_ORIGIN": LOG_NAME, "TOOLREG_EXPORT_SYSLOG": rsyslog.address,
        "TOOLREG_EXPORT_SYSLOG_CA": str(rsyslog.ca_file),
        "TOOLREG_EXPORT_SYSLOG_CERT": str(rsyslog.client_cert),
        "TOOLREG_EXPORT_SYSLOG_KEY": str(rsyslog.client_key),
        "TOOLREG_EXPORT_BATCH": str(BATCH), "TOOLREG_EXPORT_LEASE_S": "3",
    }.items():  # fmt: skip
        monkeypatch.setenv(name, value)
    cluster = start_cluster(2)
    sink = f"syslog:{rsyslog.address}"

    def arrived() -> Counter[int]:
        return Counter(m.seq for m in rsyslog.messages(LOG_NAME))

    calls(cluster, 0, CALLS, "a")
    calls(cluster, 1, CALLS, "b")
    first = head(cluster)
    wait_for("every record at rsyslog", lambda: len(arrived()) >= first, timeout_s=60)
    # The holder's line reaches its log through a thread reading its stderr.
    wait_for("a server to log taking the destination", lambda: exporting(cluster, sink) != [])
    assert exporting(cluster, sink) in ([0], [1])  # one of them, not both
    got = arrived()
    assert set(got) == set(range(1, first + 1)) and max(got.values()) == 1  # each once
    holder = exporting(cluster, sink)[0]
    other = 1 - holder
    cluster.servers[holder].kill()  # SIGKILL: its lease is left to lapse
    calls(cluster, other, CALLS, "c")
    total = head(cluster)
    wait_for("the other server to take the destination over",
             lambda: other in exporting(cluster, sink), timeout_s=30)  # fmt: skip
    wait_for("every record at rsyslog", lambda: len(arrived()) >= total, timeout_s=60)
    got = arrived()
    assert set(got) == set(range(1, total + 1))
    twice = sorted(seq for seq, n in got.items() if n > 1)
    assert max(got.values()) <= 2 and len(twice) <= BATCH, twice
    copies: dict[int, set[bytes]] = {}
    for m in rsyslog.messages(LOG_NAME):
        copies.setdefault(m.seq, set()).add(m.raw)
    assert all(len(c) == 1 for c in copies.values())  # a record sent twice is the same bytes
