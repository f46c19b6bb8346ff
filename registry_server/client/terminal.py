"""Text from clients, made safe to print on an operator's terminal.

An approver decides from what `toolreg approvals show` prints, so a request
must not be able to rewrite it: control characters and invisible format
characters are shown as escapes, never obeyed. The rule is the domain's
(domain/text.py), shared with the server's webhook payloads.
"""

from __future__ import annotations

from registry_server.domain.text import ESCAPED_CATEGORIES, escape

__all__ = ["ESCAPED_CATEGORIES", "escape"]
