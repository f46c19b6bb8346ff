"""The fair gate for heavy request work (execution/heavy_gate.py) and what
decides a call is heavy and checks it (execution/heavy_work.py)."""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Callable

import pytest

from registry_server.domain.errors import QuotaExceeded
from registry_server.domain.models import parse_definition
from registry_server.execution.admission import Cancelled
from registry_server.execution.heavy_gate import HeavyGate
from registry_server.execution.heavy_work import HeavyWork, Workers, check_call

WAIT_S = 5.0  # seconds any step of these tests may take


class Held:
    """A turn taken on its own thread, held until ``release``."""

    def __init__(self, gate: HeavyGate, client: str, order: list[str] | None = None, **kw: object):
        self.got = threading.Event()
        self._release = threading.Event()
        self.error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, args=(gate, client, order, kw))
        self._thread.start()

    def _run(self, gate: HeavyGate, client: str, order: list[str] | None, kw: dict) -> None:
        try:
            with gate.turn(client, **kw):  # type: ignore[arg-type]
                if order is not None:
                    order.append(client)
                self.got.set()
                self._release.wait(WAIT_S)
        except BaseException as exc:
            self.error = exc
            self.got.set()

    def release(self) -> None:
        self._release.set()
        self._thread.join(WAIT_S)


def until(condition: Callable[[], bool]) -> None:
    deadline = time.monotonic() + WAIT_S
    while not condition():
        assert time.monotonic() < deadline
        time.sleep(0.005)


def gate(
    turns: int = 1, queued: int = 16, per_client: int = 4, wait_s: float = WAIT_S
) -> HeavyGate:
    return HeavyGate(turns, queued, per_client, wait_s)


def test_a_freed_turn_goes_to_the_client_served_least_recently() -> None:
    g, order = gate(), []
    first = Held(g, "a", order)
    assert first.got.wait(WAIT_S)
    a2 = Held(g, "a", order)
    until(lambda: g.waiting == 1)
    a3 = Held(g, "a", order)
    until(lambda: g.waiting == 2)
    b1 = Held(g, "b", order)  # arrives last, goes second: "a" was just served
    until(lambda: g.waiting == 3)
    first.release()
    assert b1.got.wait(WAIT_S)
    b1.release()
    a2.release()
    a3.release()
    assert order == ["a", "b", "a", "a"]


def test_one_client_holds_one_turn_however_many_are_free() -> None:
    g = gate(turns=3)
    first, second = Held(g, "a"), None
    assert first.got.wait(WAIT_S)
    second = Held(g, "a")
    until(lambda: g.waiting == 1)
    other = Held(g, "b")
    assert other.got.wait(WAIT_S) and g.working == 2
    assert not second.got.is_set()
    first.release()
    assert second.got.wait(WAIT_S)
    second.release()
    other.release()
    assert (g.working, g.waiting) == (0, 0)


def test_a_client_past_its_waiting_share_is_refused_at_once() -> None:
    g = gate(per_client=1)
    first = Held(g, "a")
    assert first.got.wait(WAIT_S)
    waiting = Held(g, "a")
    until(lambda: g.waiting == 1)
    with pytest.raises(QuotaExceeded) as info, g.turn("a"):
        pass
    assert (info.value.subject, info.value.limit) == ("client:a", "heavy_queue_per_client")
    assert info.value.retry_after_s == 1.0
    assert "already has 1 calls with large arguments waiting" in info.value.message
    assert g.refused["client_queue"] == 1
    assert g.refused_by[("a", "heavy_queue_per_client")] == 1
    other = Held(g, "b")  # another client's share is its own
    until(lambda: g.waiting == 2)
    first.release()
    waiting.release()
    assert other.got.wait(WAIT_S) and other.error is None
    other.release()


def test_the_server_wide_queue_is_bounded() -> None:
    g = gate(queued=1)
    first = Held(g, "a")
    assert first.got.wait(WAIT_S)
    waiting = Held(g, "b")
    until(lambda: g.waiting == 1)
    with pytest.raises(QuotaExceeded) as info, g.turn("c"):
        pass
    assert (info.value.subject, info.value.limit) == ("server", "heavy_max_queued")
    assert g.refused["server_queue"] == 1
    first.release()
    waiting.release()


def test_a_turn_that_does_not_come_in_time_is_refused_and_leaves_the_line() -> None:
    g = gate(wait_s=0.1)
    first = Held(g, "a")
    assert first.got.wait(WAIT_S)
    started = time.monotonic()
    with pytest.raises(QuotaExceeded) as info, g.turn("b"):
        pass
    assert 0.1 <= time.monotonic() - started < 2
    assert info.value.limit == "heavy_wait" and "within 0.1 s" in info.value.message
    assert (g.waiting, g.refused["wait"]) == (0, 1)
    first.release()


def test_a_cancelled_or_expired_wait_leaves_the_line_and_the_next_goes_on() -> None:
    g = gate()
    first = Held(g, "a")
    assert first.got.wait(WAIT_S)
    cancel = threading.Event()
    gone = Held(g, "b", cancel=cancel)
    expired = Held(g, "c", deadline=time.monotonic() + 0.05)
    until(lambda: g.waiting == 2)
    cancel.set()
    assert gone.got.wait(WAIT_S) and isinstance(gone.error, Cancelled)
    assert expired.got.wait(WAIT_S) and isinstance(expired.error, Cancelled)
    assert g.waiting == 0
    later = Held(g, "d")
    until(lambda: g.waiting == 1)
    first.release()
    assert later.got.wait(WAIT_S) and later.error is None
    later.release()
    gone.release()
    expired.release()


def test_the_wait_is_told_to_the_metrics() -> None:
    g, waits = gate(), []
    g.on_wait = waits.append
    with g.turn("a") as waited:
        pass
    assert waits == [waited] and 0 <= waited < 1


@pytest.mark.parametrize(
    ("text", "heavy"),
    [
        ("a" * 1024, False),
        ("a" * 1025, True),
        ("é" * 256, False),  # 512 bytes: four times the characters fit, not encoded
        ("é" * 512, False),  # 1,024 bytes exactly
        ("é" * 513, True),  # more characters than bytes allowed: heavy, not encoded
        ("€" * 341, False),  # 1,023 bytes
        ("€" * 342, True),  # 1,026 bytes
        ("\U0001f600" * 256, False),
        ("\U0001f600" * 257, True),
    ],
)
def test_heavy_is_the_utf8_size_above_the_threshold(text: str, heavy: bool) -> None:
    assert (len(text.encode()) > 1024) is heavy
    assert HeavyWork(gate(), Workers(1), 1024).is_heavy(text) is heavy


def test_check_call_refuses_as_the_server_does() -> None:
    tool = parse_definition({
        "name": "guarded", "description": "d",
        "parameters": {"type": "object", "properties": {"q": {"type": "string"}}},
        "guard": [{"condition": 'args.q != "no"', "message": "not no"}],
        "sandbox": {"image": "toolreg/base", "command": ["cat"]},
    })  # fmt: skip
    assert check_call(tool, "{").invalid.startswith("arguments_json: not valid JSON")
    assert "invalid arguments for tool 'guarded'" in check_call(tool, '{"q": 1}').invalid
    assert check_call(tool, '{"q": "no"}').guard_failed == "not no"
    ok = check_call(tool, json.dumps({"q": "yes"}))
    assert ok.arguments is not None and ok.guard_failed is None and not ok.invalid
    assert ok.arguments.canonical == b'{"q":"yes"}'
