"""Fresh databases on the tests' PostgreSQL cluster (scripts/ensure_postgres.sh): made
for one test or module, dropped after it."""

from __future__ import annotations

import contextlib
import time
import uuid
from collections.abc import Iterator

import psycopg

DROP_WAIT_S = 30.0  # seconds a drop may wait for PostgreSQL's own workers to leave


@contextlib.contextmanager
def fresh_database(maintenance_url: str, prefix: str = "toolreg") -> Iterator[str]:
    """The URL of a new, empty database (a random name after ``prefix``); dropped on exit."""
    name = f"{prefix}_{uuid.uuid4().hex[:12]}"
    with psycopg.connect(maintenance_url, autocommit=True) as conn:
        conn.execute(f"CREATE DATABASE {name}")
    try:
        yield maintenance_url.rsplit("/", 1)[0] + f"/{name}"
    finally:
        drop_database(maintenance_url, name)


def drop_database(maintenance_url: str, name: str) -> None:
    """DROP DATABASE ... WITH (FORCE) ends the connections of the tests' role (its servers'),
    but PostgreSQL 15 refuses the whole drop while a process of no role is in the database:
    an autovacuum worker it started there, whose end needs pg_signal_backend, which the
    tests' role is not given (seen in a parallel make test: InsufficientPrivilege, "must be
    a member of the role whose process is being terminated"). Such a worker is done in
    moments, and the refusal ends nothing: the drop is tried again until a deadline."""
    deadline = time.monotonic() + DROP_WAIT_S
    while True:
        try:
            with psycopg.connect(maintenance_url, autocommit=True) as conn:
                conn.execute(f"DROP DATABASE IF EXISTS {name} WITH (FORCE)")
            return
        except psycopg.errors.InsufficientPrivilege:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.2)
