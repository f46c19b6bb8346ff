"""What remembering group-mapped IdP clients in the store costs a call
(policy/seen.py, store/remembered.py), in process, on a real SQLite store:

- steady: a known client's token seen again and its client looked up (what
  every call of a group-mapped client does), with the store attached, against
  the same without a store (the baseline, measured interleaved in this run);
- first sighting: a client this server has not seen (one write, SQLite
  synchronous=FULL);
- cold lookup: a client another server remembered, read from the store once
  (then kept for RECHECK_S).

`python -m bench.remembered_clients [--runs N]`: medians in microseconds and
the steady ratio. Not part of `make bench`'s report (yet).
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

from registry_server.policy.seen import SeenIdentities, Sighting
from registry_server.store.remembered import StoredIdentities
from registry_server.store.sqlite import SqliteStore

CALLS = 2_000  # steady calls per run
NEW_CLIENTS = 50  # first sightings and cold lookups per run
GROUPS = frozenset({"toolreg-agents", "toolreg-builders", "staff", "eu"})


def _sighting(i: int) -> Sighting:
    return Sighting("corp", f"user{i}", GROUPS, 1_000.0, 2_000.0)


def _steady(seen: SeenIdentities) -> float:
    """Microseconds per call: the token seen again, then the client looked up."""
    sighting = _sighting(0)
    seen.saw("corp.user0", sighting, remember=True)
    started = time.perf_counter()
    for _ in range(CALLS):
        seen.saw("corp.user0", sighting, remember=True)
        seen.get("corp.user0")
    return (time.perf_counter() - started) / CALLS * 1e6


def _firsts(seen: SeenIdentities, base: int) -> list[float]:
    times = []
    for i in range(base, base + NEW_CLIENTS):
        started = time.perf_counter()
        seen.saw(f"corp.user{i}", _sighting(i), remember=True)
        times.append((time.perf_counter() - started) * 1e6)
    return times


def _colds(seen: SeenIdentities, base: int) -> list[float]:
    times = []
    for i in range(base, base + NEW_CLIENTS):
        started = time.perf_counter()
        assert seen.get(f"corp.user{i}") is not None
        times.append((time.perf_counter() - started) * 1e6)
    return times


def run(runs: int) -> dict[str, float]:
    with tempfile.TemporaryDirectory() as tmp:
        store = SqliteStore(Path(tmp) / "toolreg.db")
        try:
            base_us, stored_us, first_us, cold_us = [], [], [], []
            for r in range(runs):  # interleaved: baseline and store under the same load
                base_us.append(_steady(SeenIdentities()))
                here = SeenIdentities()
                here.remember_in(StoredIdentities(store))
                stored_us.append(_steady(here))
                first_us.extend(_firsts(here, 1 + r * NEW_CLIENTS))
                there = SeenIdentities()  # another server (or this one, restarted)
                there.remember_in(StoredIdentities(store))
                cold_us.extend(_colds(there, 1 + r * NEW_CLIENTS))
        finally:
            store.close()
    base, stored = statistics.median(base_us), statistics.median(stored_us)
    return {
        "steady_no_store_us": base,
        "steady_with_store_us": stored,
        "steady_ratio": stored / base,
        "first_sighting_us": statistics.median(first_us),
        "cold_lookup_us": statistics.median(cold_us),
    }


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.remembered_clients")
    parser.add_argument("--runs", type=int, default=9)
    result = run(parser.parse_args().runs)
    print("| measure | median |")
    print("|---|---:|")
    for key, value in result.items():
        shown = f"{value:.2f}x" if key.endswith("ratio") else f"{value:.1f} us"
        print(f"| {key} | {shown} |")


if __name__ == "__main__":
    main()
