"""Text from clients, made safe to show to a person: on an operator's
terminal, in a chat message a webhook posts, on a page.

An approver decides from what they are shown, so a request must not be able
to rewrite it: control characters (cursor moves, colour, clearing the line)
and invisible format characters (bidi overrides that reverse what follows,
zero-width spaces) are shown as escapes, never obeyed. It lives in the
domain so that the server (webhook payloads) and the client (the CLI) share
one definition of "visible".
"""

from __future__ import annotations

import unicodedata

from registry_server.domain.errors import InvalidArgument

# Categories printed as \uXXXX: controls, format (bidi marks, zero-width),
# line/paragraph separators, surrogates, private use, unassigned.
ESCAPED_CATEGORIES = frozenset({"Cc", "Cf", "Zl", "Zp", "Cs", "Co", "Cn"})


def escape(text: str, *, keep_newlines: bool = False) -> str:
    """``text`` with every character an attacker could hide behind escaped."""
    out: list[str] = []
    for char in text:
        if keep_newlines and char == "\n":
            out.append(char)
        elif unicodedata.category(char) in ESCAPED_CATEGORIES:
            code = ord(char)
            out.append(f"\\u{code:04x}" if code <= 0xFFFF else f"\\U{code:08x}")
        else:
            out.append(char)
    return "".join(out)


MAX_REASON_CHARS = 1_000  # characters of a reason a client gives (a rejection, a kill switch)


def checked_reason(reason: str, *, required: bool = True) -> str:
    """``reason`` stripped: at most MAX_REASON_CHARS characters, none of them
    control characters (it reaches agents, logs, webhooks and pages), and not
    empty when ``required``. Raises InvalidArgument naming the field."""
    reason = reason.strip()
    if not reason and required:
        raise InvalidArgument("reason: must not be empty (say why, for the agent and the audit)")
    if len(reason) > MAX_REASON_CHARS:
        raise InvalidArgument(f"reason: longer than {MAX_REASON_CHARS} characters")
    if any(unicodedata.category(ch) == "Cc" for ch in reason):
        raise InvalidArgument("reason: must not contain control characters (newlines included)")
    return reason
