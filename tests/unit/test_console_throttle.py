"""The console's sign-in throttle and refusal log budget (console/throttle.py),
on a fake clock: limits per source and overall, windows, eviction, and the
settings that bound the window."""

from __future__ import annotations

from pathlib import Path

import pytest

from registry_server.console import throttle as t
from registry_server.console.guard import shown
from registry_server.console.settings import SIGNIN_WINDOW_ENV, ConsoleSettings
from registry_server.domain.errors import ConfigError
from registry_server.signing.keys import generate_keypair


class Clock:
    def __init__(self) -> None:
        self.now = 1_000.0

    def __call__(self) -> float:
        return self.now


def fail(throttle: t.SignInThrottle, source: str, times: int) -> None:
    for _ in range(times):
        assert throttle.check(source) is None
        throttle.failed(source)


def test_a_source_is_refused_after_its_failures_until_its_window_ends() -> None:
    clock = Clock()
    throttle = t.SignInThrottle(window_s=300, clock=clock)
    fail(throttle, "10.0.0.1", t.MAX_FAILURES_PER_SOURCE - 1)
    clock.now += 100
    fail(throttle, "10.0.0.1", 1)  # the last failure the window allows
    assert throttle.check("10.0.0.1") == t.Throttled(t.PER_SOURCE, 200)
    clock.now += 199.5
    assert throttle.check("10.0.0.1") == t.Throttled(t.PER_SOURCE, 1)  # rounded up, never 0
    assert throttle.check("10.0.0.2") is None  # another source is not locked out
    clock.now += 0.5  # the window, from its first failure, has ended
    assert throttle.check("10.0.0.1") is None
    fail(throttle, "10.0.0.1", t.MAX_FAILURES_PER_SOURCE)  # a new window, a new allowance
    assert throttle.check("10.0.0.1") is not None


def test_refused_attempts_are_no_failures_so_a_flood_locks_out_only_its_source() -> None:
    clock = Clock()
    throttle = t.SignInThrottle(clock=clock)
    fail(throttle, "10.0.0.1", t.MAX_FAILURES_PER_SOURCE)
    for _ in range(10_000):  # refused before any token is looked at: never failed()
        assert throttle.check("10.0.0.1") is not None
    assert throttle.check("10.0.0.9") is None


def test_failures_from_many_sources_refuse_everyone_until_the_overall_window_ends() -> None:
    clock = Clock()
    throttle = t.SignInThrottle(window_s=60, per_source=3, overall=10, clock=clock)
    for n in range(3):
        fail(throttle, f"10.0.0.{n}", 3)  # 9 failures, each source at its own limit
    fail(throttle, "10.0.1.1", 1)  # the 10th overall
    assert throttle.check("10.0.9.9") == t.Throttled(t.OVERALL, 60)
    assert throttle.check("10.0.1.1") == t.Throttled(t.OVERALL, 60)
    assert throttle.check("10.0.0.0") == t.Throttled(t.PER_SOURCE, 60)  # its own limit first
    clock.now += 60
    assert throttle.check("10.0.9.9") is None


def test_the_source_table_is_capped_and_forgets_ended_windows_then_the_oldest() -> None:
    clock = Clock()
    throttle = t.SignInThrottle(
        window_s=60, per_source=2, overall=1_000_000, max_sources=4, clock=clock
    )
    fail(throttle, "10.0.0.1", 2)  # locked out
    for n in range(2, 5):
        fail(throttle, f"10.0.0.{n}", 1)
    assert len(throttle) == 4
    fail(throttle, "10.0.0.5", 1)  # full: the oldest window (10.0.0.1's) is forgotten
    assert len(throttle) == 4 and throttle.check("10.0.0.1") is None
    clock.now += 61  # every window ended: a new source's failure clears them all
    fail(throttle, "10.0.0.6", 1)
    assert len(throttle) == 1
    for n in range(1_000):
        throttle.failed(f"10.1.{n // 256}.{n % 256}")
    assert len(throttle) == 4  # never more than the cap


def test_sources_are_addresses_and_ipv6_counts_by_its_64() -> None:
    assert t.source_key("192.0.2.7") == "192.0.2.7"
    assert t.source_key("2001:db8:1:2:aaaa::1") == t.source_key("2001:db8:1:2:bbbb::2")
    assert t.source_key("2001:db8:1:2::1") == "2001:db8:1:2::/64"
    assert t.source_key("2001:db8:1:3::1") != t.source_key("2001:db8:1:2::1")
    assert t.source_key("::ffff:192.0.2.7") == "192.0.2.7"
    assert t.source_key("unknown") == "unknown" and len(t.source_key("x" * 500)) == 64
    clock = Clock()
    throttle = t.SignInThrottle(per_source=2, clock=clock)
    fail(throttle, "2001:db8::1", 1)
    fail(throttle, "2001:db8::2", 1)
    assert throttle.check("2001:db8::ffff") is not None


def test_bad_limits_are_refused() -> None:
    for bad in ({"window_s": 0}, {"per_source": 0}, {"overall": 0}, {"max_sources": 0}):
        with pytest.raises(ValueError):
            t.SignInThrottle(**bad)  # type: ignore[arg-type]


def test_the_log_budget_logs_some_one_by_one_and_sums_up_the_rest() -> None:
    clock = Clock()
    budget = t.LogBudget(lines=3, window_s=60, clock=clock)
    verdicts = [budget.note("sign-in", f"10.0.0.{n % 8}", "unknown token") for n in range(300)]
    assert [v for v, _ in verdicts].count(True) == 3 and all(s is None for _, s in verdicts)
    assert budget.note("CSRF", "10.0.0.1", "no CSRF token") == (True, None)  # its own budget
    assert budget.summaries() == []  # the window has not ended
    clock.now += 60
    (summary,) = budget.summaries()
    assert summary.startswith("297 more sign-in refusals in 60 s not logged one by one:")
    assert "unknown token 297" in summary and "others" in summary
    assert summary.count("10.0.0.") == t.MAX_SUMMARY_SOURCES  # sources named: capped
    assert budget.summaries() == []  # said once


def test_a_window_that_ended_is_summed_up_with_the_next_refusal() -> None:
    clock = Clock()
    budget = t.LogBudget(lines=1, window_s=60, clock=clock)
    budget.note("sign-in", "a", "unknown token")
    assert budget.note("sign-in", "a", "throttled (source)") == (False, None)
    clock.now += 61
    log_it, summary = budget.note("sign-in", "a", "unknown token")
    assert log_it and summary is not None and "1 more sign-in refusals" in summary
    assert budget.note("sign-in", "b", "unknown token") == (False, None)
    (last,) = budget.summaries(all_now=True)  # at shutdown
    assert "b 1" in last


def test_a_clients_text_is_capped_and_escaped_for_the_log() -> None:
    assert shown("evil.example\r\nX-Injected: 1") == "'evil.example\\r\\nX-Injected: 1'"
    assert shown("\u202eevil") == "'\\u202eevil'" and shown(None) == "(none)"
    long = shown("h" * 10_000)
    assert len(long) < 150 and long.endswith("... (10000 characters)")


def test_the_window_setting_is_bounded_both_ways(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    policy = tmp_path / "policy.yaml"
    public = generate_keypair()[1]
    policy.write_text(
        f"audience: a\napprovers: [{{id: alice, public_key: '{public}'}}]\n"
        f"clients: [{{id: alice, token_sha256: '{'a' * 64}', roles: [approve]}}]\n"
    )

    def settings(**kw: float) -> ConsoleSettings:
        return ConsoleSettings.from_options("127.0.0.1:0", policy_file=policy, **kw)  # type: ignore[arg-type]

    assert settings().signin_window_s == t.DEFAULT_WINDOW_S
    assert settings(signin_window_s=2).signin_window_s == 2
    for bad in (0, 0.5, t.MAX_WINDOW_S + 1, float("nan")):
        with pytest.raises(ConfigError, match="window"):
            settings(signin_window_s=bad)
    monkeypatch.setenv(SIGNIN_WINDOW_ENV, "3")
    assert settings().signin_window_s == 3
    for bad_text in ("soon", "inf", "1" * 40, "7200"):
        monkeypatch.setenv(SIGNIN_WINDOW_ENV, bad_text)
        with pytest.raises(ConfigError):
            settings()
