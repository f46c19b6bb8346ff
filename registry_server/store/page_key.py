"""The key that signs page tokens (domain/pages.py), kept in the store.

One key per store, not per server: servers behind a load balancer share a
store (docs/how-to/scaling.md), and the next page of a listing may be asked of
another server than the first, which must accept the token. The first server
to start on a store makes the key; every later one reads it.
"""

from __future__ import annotations

import secrets
import time

from registry_server.domain.pages import PAGE_KEY_BYTES, PageTokens
from registry_server.store.base import Store

PAGE_KEY_SECRET = "page_tokens"  # the name of the key among the store's secrets


def page_tokens(store: Store) -> PageTokens:
    """Page tokens under the store's key (made and stored on first use)."""
    with store.unit_of_work() as uow:
        value = uow.keep_secret(PAGE_KEY_SECRET, secrets.token_hex(PAGE_KEY_BYTES), time.time())
    return PageTokens(bytes.fromhex(value))
