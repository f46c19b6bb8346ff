"""SIEM export of the audit log (docs/how-to/audit.md, "SIEM export").

ocsf.py makes each audit entry an OCSF event (pure); sinks.py writes events
to a JSON Lines file with rotation, or to a syslog receiver over TLS
(RFC 5424 messages, RFC 5425 framing); exporter.py follows the committed
log with a cursor kept in the store, one thread per destination, so no call
ever waits for it and a restart resumes where the destination left off.
"""
