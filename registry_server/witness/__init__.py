"""A witness of the audit log (`toolreg witness`, docs/how-to/audit.md "Witnesses"):
its own process, with its own key, that cosigns a log's checkpoint only when
a consistency proof shows it extends the last one it cosigned, and refuses
(and reports) a fork. The protocol is c2sp.org/tlog-witness, the
cosignatures c2sp.org/tlog-cosignature.

core.py decides; state.py remembers, durably; web.py serves it over HTTP.
"""
