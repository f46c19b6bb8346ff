"""A webhook delivery's claim names its process (notify/claimant.py), so a
server takes back at once what a dead process of this host claimed, and
leaves a live process's claims, another host's and unreadable ones to their
lease. The dead process here is a real one that has exited."""

from __future__ import annotations

import os
import subprocess
import sys
from dataclasses import replace

import pytest

from registry_server.notify.claimant import claimant, claimant_gone
from registry_server.notify.dispatcher import CLAIM_LEASE_S, Dispatcher
from registry_server.store.base import DELIVERED, WebhookDeliveryRecord
from registry_server.store.memory import MemoryStore
from sandbox_runner.ownership import OwnerIdentity, process_start_ticks

ME = OwnerIdentity.current()
NOW = 1_000_000.0


@pytest.fixture(scope="module")
def dead() -> OwnerIdentity:
    """This host's identity with the pid and start time of a process that ended."""
    proc = subprocess.Popen([sys.executable, "-c", "import sys; sys.stdin.read()"],
                            stdin=subprocess.PIPE)  # fmt: skip
    start = process_start_ticks(proc.pid)
    proc.communicate(b"")
    assert start is not None
    return replace(ME, pid=proc.pid, start_ticks=start)


def test_the_claim_round_trips_the_identity_after_a_readable_head() -> None:
    text = claimant(ME, hostname="box-1", nonce="abc123")
    assert text.startswith("box-1/abc123;pid=")
    assert claimant_gone(claimant(ME), me=ME) is None  # this very process
    assert claimant(ME) != claimant(ME)  # unique per dispatcher
    assert ME.host_id not in text and ME.boot_id not in text  # only their hashes


def test_a_dead_process_of_this_host_is_gone(dead: OwnerIdentity) -> None:
    reason = claimant_gone(claimant(dead), me=ME)
    assert reason == f"its owner (pid {dead.pid}) is gone"


def test_a_live_process_keeps_its_claim() -> None:
    ppid = os.getppid()  # pytest's parent: alive, and not this process
    start = process_start_ticks(ppid)
    assert start is not None
    alive = replace(ME, pid=ppid, start_ticks=start)
    assert claimant_gone(claimant(alive), me=ME) is None


def test_a_reused_pid_is_not_the_claimant(dead: OwnerIdentity) -> None:
    # The pid runs again, but started at another time: the claimant is gone.
    assert claimant_gone(claimant(dead), me=ME, owner_alive=lambda pid, start: False)
    assert claimant_gone(claimant(dead), me=ME, owner_alive=lambda pid, start: True) is None


@pytest.mark.parametrize(
    "elsewhere",
    [{"host_id": "another-machine"}, {"pid_ns": "pid:[1]"}],
    ids=["another host", "another pid namespace"],
)
def test_a_process_it_cannot_see_keeps_its_claim(
    dead: OwnerIdentity, elsewhere: dict[str, str]
) -> None:
    assert claimant_gone(claimant(replace(dead, **elsewhere)), me=ME) is None


def test_a_host_cloned_with_this_machine_id_keeps_its_claim(dead: OwnerIdentity) -> None:
    """Another boot id is another machine as likely as a reboot: containers on
    two hosts may share a hostname and a machine id baked into their image, so
    even on the same hostname the claim waits for its lease."""
    clone = claimant(replace(dead, boot_id="its-own-boot"), hostname="clone-2")
    assert claimant_gone(clone, me=ME, hostname="clone-1") is None
    assert claimant_gone(clone, me=ME, hostname="clone-2") is None


def test_a_process_from_before_a_reboot_waits_for_its_lease(dead: OwnerIdentity) -> None:
    assert claimant_gone(claimant(replace(dead, boot_id="an-earlier-boot")), me=ME) is None


@pytest.mark.parametrize(
    "text",
    ["box-1/0123456789ab", "", "box/1;pid=x;start=1", "box/1;pid=5", "a;b;c=d;;="],
)
def test_a_claim_that_does_not_say_keeps_it(text: str) -> None:
    assert claimant_gone(text, me=ME) is None


# ------------------------------------------------------------------ the dispatcher


class Transport:
    def __init__(self) -> None:
        self.sent: list[str] = []

    def post(self, endpoint: object, body: bytes, headers: dict[str, str]) -> int:
        self.sent.append(headers["webhook-id"])
        return 200

    def close(self) -> None:
        pass


def _claimed_by(store: MemoryStore, holder: str) -> None:
    with store.unit_of_work() as uow:
        uow.add_webhook_delivery(WebhookDeliveryRecord(1, "chat", "msg_1", "{}", NOW, NOW))
        assert len(uow.claim_webhook_deliveries(holder, NOW, NOW + CLAIM_LEASE_S, 9)) == 1


def _dispatcher(store: MemoryStore, transport: Transport, clock: list[float]) -> Dispatcher:
    endpoint = type("E", (), {"id": "chat", "signer": None})()  # attempt() is replaced
    dispatcher = Dispatcher(store, {"chat": endpoint}, transport, clock=lambda: clock[0])

    def attempt(delivery: WebhookDeliveryRecord) -> str:
        transport.sent.append(delivery.webhook_id)
        with store.unit_of_work() as uow:
            assert uow.finish_webhook_delivery(replace(delivery, state=DELIVERED), dispatcher.owner)
        return "delivered"

    dispatcher.attempt = attempt  # type: ignore[method-assign]
    return dispatcher


@pytest.mark.parametrize(
    ("holder", "sent_at_once"),
    [("dead", True), ("alive", False), ("other host", False), ("old format", False)],
)
def test_the_dispatcher_takes_back_only_what_a_dead_process_claimed(
    dead: OwnerIdentity, holder: str, sent_at_once: bool
) -> None:
    holders = {
        "dead": claimant(dead),
        "alive": claimant(ME),  # another dispatcher of this live process
        "other host": claimant(replace(dead, host_id="another-machine")),
        "old format": "box-1/0123456789ab",
    }
    store, transport, clock = MemoryStore(), Transport(), [NOW + 1]
    _claimed_by(store, holders[holder])
    dispatcher = _dispatcher(store, transport, clock)
    assert dispatcher.pump() == int(sent_at_once)
    assert transport.sent == (["msg_1"] if sent_at_once else [])
    clock[0] = NOW + CLAIM_LEASE_S  # the lease ran out: whoever held it, it is sent
    if not sent_at_once:
        assert dispatcher.pump() == 1
    assert transport.sent == ["msg_1"]
    with store.reading() as reads:
        assert reads.webhook_backlog().pending == 0
